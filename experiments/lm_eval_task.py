"""The accuracy suite's recall task as an lm-evaluation-harness task over a local JSON file,
to run through the server with `local-completions` (log-likelihood by echo + logprobs).

    python -m experiments.lm_eval_task --out /tmp/recall-task [--quick]
    python -m impress_flexgen.serve --model smollm2-135m --port 8123 &
    lm_eval --model local-completions --tasks impress_recall --include_path /tmp/recall-task \\
        --model_args model=smollm2-135m,base_url=http://127.0.0.1:8123/v1/completions,\\
tokenizer_backend=huggingface,tokenizer=<the tokenizer folder printed>,tokenized_requests=True \\
        --batch_size 1

The items are experiments.accuracy's (the same settings and seed): the context is the
1,024-token prefix and the query (a quoted fragment), the choices the four 16-token
continuations, decoded to text. --score also scores them here, as the accuracy suite does
(the whole context computed, the sum of the candidate's log-probabilities), for comparison.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

YAML = """task: impress_recall
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: gold
target_delimiter: ""
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.lm_eval_task")
    p.add_argument("--out", required=True, help="folder for the task YAML and its data")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--quick", action="store_true", help="the accuracy suite's quick items")
    p.add_argument("--score", action="store_true", help="also score the items here")
    args = p.parse_args(argv)

    from experiments.accuracy import FULL, QUICK, build_tasks
    from impress_flexgen.models.runtime import Runtime, RuntimeConfig

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with Runtime(RuntimeConfig(model=args.model)) as rt:
        tok = rt.tokenizer
        tasks = build_tasks(tok, QUICK if args.quick else FULL)
        rows = [{"context": tok.decode(tasks.prefixes[item.prefix] + item.query),
                 "choices": [tok.decode(c) for c in item.candidates], "gold": item.answer}
                for item in tasks.recall]
        data = out / "recall.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in rows))
        (out / "impress_recall.yaml").write_text(YAML.format(data=data.resolve()))
        print(f"{len(rows)} items in {data}; tokenizer folder: "
              f"{getattr(tok.hf, 'name_or_path', '')}")
        if args.score:
            print(f"recall here: {score(rt, tasks):.3f}")
    return 0


def score(rt, tasks) -> float:
    """The accuracy suite's recall on these items: each candidate after prefix + query, the
    whole computed (no store), the sum of the candidate's log-probabilities."""
    import numpy as np
    import torch

    from impress_flexgen.engine import Request, assemble
    from policies import make_policy

    engine = assemble(rt, make_policy("recomp")).engine     # no store: all computed
    correct = []
    for item in tasks.recall:
        context = tasks.prefixes[item.prefix] + item.query
        lls = []
        for cand in item.candidates:
            logits = engine.serve(Request([], context + cand, 1), query_logits=True).query_logits
            lp = torch.log_softmax(logits.double(), -1)
            rows = torch.arange(len(context) - 1, len(context) - 1 + len(cand))
            lls.append(float(lp[rows, torch.tensor(cand)].sum()))
        correct.append(int(np.argmax(lls) == item.answer))
    return float(np.mean(correct))


if __name__ == "__main__":
    sys.exit(main())
