"""Multi-turn chat through the HTTP server: TTFT and throughput, impress vs full vs recomp.

    python -m experiments.bench_serve [--model smollm2-135m] [--quick] [--json PATH]

Then continuous batching (experiments.batching_load): 1, 2, 4, 8 and 16 concurrent clients,
with a shared prefix and with distinct prefixes, batched (--max-batch-size) against one
request at a time (max batch size 1), in the same run; the JSON's `batching` list holds a
row per prefix kind x clients x batch size.

The workload is what a chat deployment sees: one long shared system prompt (a passage of a
public-domain book to answer questions about), several conversations on it, each growing by
a user question and the model's answer per turn; every request sends the whole history.
Conversations run side by side from concurrent clients, turn after turn. Each policy gets its
own server (in this process, on loopback) over its own new store, the same model, workload
and tier sizes, one after the other in one run. TTFT is measured by the client: from sending
the request to the first streamed text; the server's own figure (arrival to first token) and
how much of each prompt came from the store are reported beside it.
"""
from __future__ import annotations

import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from impress_flexgen.bench.corpus import passages
from impress_flexgen.entrypoints.args import ArgumentParser, finite_float, int_range, write_json
from impress_flexgen.entrypoints.process import run_main

POLICIES = ("impress", "full", "recomp")
SYSTEM = ("You are a careful reader. Answer questions about the following text, quoting it "
          "where you can.\n\n")


def build_conversations(system_chars: int, conversations: int, turns: int,
                        seed: int = 0) -> tuple[str, list[list[str]]]:
    """(system prompt, per conversation its user messages), from the offline corpus."""
    system = SYSTEM + passages("austen_pride_and_prejudice", system_chars, 1, seed)[0]
    lines = passages("austen_emma", 160, conversations * turns, seed)
    asks = ("What does this remind you of in the text: ", "Explain, using the text: ",
            "Who in the text would say this: ", "Compare with the text: ")
    users = [[asks[(c + t) % len(asks)] + lines[c * turns + t].replace("\n", " ")
              for t in range(turns)] for c in range(conversations)]
    return system, users


def run_policy(url: str, model: str, system: str, users: list[list[str]], clients: int,
               max_tokens: int) -> dict:
    """Serve every conversation through `url` from `clients` threads; per-request rows."""
    import openai

    rows, errors = [], []
    lock = threading.Lock()
    todo = list(range(len(users)))

    def client() -> None:
        api = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
        while True:
            with lock:
                if not todo:
                    return
                c = todo.pop(0)
            history = [{"role": "system", "content": system}]
            for t, text in enumerate(users[c]):
                history.append({"role": "user", "content": text})
                sent = time.perf_counter()
                first, answer, server, usage = None, [], {}, None
                try:
                    for chunk in api.chat.completions.create(
                            model=model, messages=history, max_tokens=max_tokens,
                            temperature=0, stream=True,
                            stream_options={"include_usage": True}):
                        delta = chunk.choices[0].delta.content if chunk.choices else None
                        if delta:
                            first = first or time.perf_counter()
                            answer.append(delta)
                        extra = getattr(chunk, "model_extra", None) or {}
                        server = extra.get("impress_flexgen", server)
                        usage = chunk.usage or usage
                except openai.APIError as exc:
                    with lock:
                        errors.append(f"conversation {c} turn {t}: {exc}")
                    return
                done = time.perf_counter()
                history.append({"role": "assistant", "content": "".join(answer)})
                with lock:
                    rows.append({"conversation": c, "turn": t,
                                 "ttft_s": (first or done) - sent, "latency_s": done - sent,
                                 "prompt_tokens": usage.prompt_tokens if usage else 0,
                                 "completion_tokens": usage.completion_tokens if usage else 0,
                                 "server": server})

    threads = [threading.Thread(target=client) for _ in range(clients)]
    t0 = time.perf_counter()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    wall = time.perf_counter() - t0
    if errors:
        raise RuntimeError(errors[0])
    return {"rows": rows, "wall_s": wall}


def summarize(policy: str, got: dict) -> dict:
    rows = got["rows"]
    ttft = np.array([r["ttft_s"] for r in rows])
    server = [r["server"] for r in rows]
    prompt = sum(r["prompt_tokens"] for r in rows)
    matched = sum(s.get("matched_tokens", 0) for s in server)
    generated = sum(r["completion_tokens"] for r in rows)
    later = np.array([r["ttft_s"] for r in rows if r["turn"] > 0]) if any(
        r["turn"] > 0 for r in rows) else ttft
    return {
        "policy": policy, "requests": len(rows), "wall_s": got["wall_s"],
        "ttft_mean_s": float(ttft.mean()), "ttft_p99_s": float(np.percentile(ttft, 99)),
        "ttft_later_turns_mean_s": float(later.mean()),
        "server_ttft_mean_s": float(np.mean([s.get("ttft_s", 0.0) for s in server])),
        "engine_ttft_mean_s": float(np.mean([s.get("engine_ttft_s", 0.0) for s in server])),
        "latency_mean_s": float(np.mean([r["latency_s"] for r in rows])),
        "requests_per_s": len(rows) / got["wall_s"],
        "tokens_per_s": generated / got["wall_s"],
        "matched_fraction": matched / prompt if prompt else 0.0,
        "bytes_read": {t: int(sum(s.get("bytes_read", {}).get(t, 0) for s in server))
                       for t in ("gpu", "cpu", "disk")},
        "rows": rows,
    }


def parse_args(argv):
    p = ArgumentParser(prog="python -m experiments.bench_serve",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m", help="model name (smollm2-135m)")
    p.add_argument("--quick", action="store_true",
                   help="a small run for CI: 2 conversations x 2 turns, short system prompt")
    p.add_argument("--system-chars", type=int_range(100), default=4000,
                   help="characters of book text in the shared system prompt (4000)")
    p.add_argument("--conversations", type=int_range(1), default=8, help="(8)")
    p.add_argument("--turns", type=int_range(1), default=4, help="user turns each (4)")
    p.add_argument("--clients", type=int_range(1), default=4,
                   help="concurrent client threads (4)")
    p.add_argument("--max-tokens", type=int_range(1), default=32,
                   help="tokens generated per answer (32)")
    p.add_argument("--policies", default=",".join(POLICIES),
                   help=f"comma-separated ({','.join(POLICIES)})")
    p.add_argument("--gpu-cache-fraction", type=finite_float(0), default=0.1,
                   help="GPU tier capacity as a fraction of the workload's KV bytes (0.1)")
    p.add_argument("--cpu-cache-fraction", type=finite_float(0), default=0.25,
                   help="CPU tier capacity as a fraction of the workload's KV bytes (0.25)")
    p.add_argument("--store-root", help="where the temporary stores go (default: temp dir)")
    p.add_argument("--json", metavar="PATH")
    b = p.add_argument_group("batching")
    b.add_argument("--batching-clients", default="1,2,4,8,16",
                   help="concurrent client counts (1,2,4,8,16; --quick: 1,4; empty: skip)")
    b.add_argument("--batching-prefixes", default="shared,distinct",
                   help="prefix kinds: shared (one passage, then a question each) and/or "
                        "distinct (a passage each) (shared,distinct)")
    b.add_argument("--max-batch-size", type=int_range(1), default=8, help="(8)")
    b.add_argument("--requests-per-client", type=int_range(1), default=3, help="(3)")
    b.add_argument("--batch-max-tokens", type=int_range(2), default=32,
                   help="tokens generated per request (32)")
    b.add_argument("--batch-prompt-chars", type=int_range(50), default=2000,
                   help="characters of book text in each prompt (2000)")
    args = p.parse_args(argv)
    if args.quick:
        args.system_chars, args.conversations, args.turns = 600, 2, 2
        args.clients, args.max_tokens = 2, 4
        args.requests_per_client, args.batch_max_tokens, args.batch_prompt_chars = 2, 16, 600
        if args.batching_clients == "1,2,4,8,16":
            args.batching_clients = "1,4"
    try:
        args.client_counts = [int(x) for x in args.batching_clients.split(",") if x]
    except ValueError:
        p.error(f"--batching-clients: comma-separated integers (got {args.batching_clients!r})")
    if any(n < 1 for n in args.client_counts):
        p.error("--batching-clients: every count must be at least 1")
    args.prefix_kinds = [x for x in args.batching_prefixes.split(",") if x]
    if not args.prefix_kinds or any(k not in ("shared", "distinct") for k in args.prefix_kinds):
        p.error(f"--batching-prefixes: shared and/or distinct (got {args.batching_prefixes!r})")
    from experiments.batching_load import prompts
    from impress_flexgen.errors import UserError

    for kind in args.prefix_kinds:     # refused now, not after the rows before it
        for n in args.client_counts:
            try:
                prompts(kind, n * args.requests_per_client, args.batch_prompt_chars, 10 * n)
            except UserError as exc:
                p.error(f"{n} clients x {args.requests_per_client} requests, {kind} "
                        f"prefixes: {exc}")
    from policies import POLICY_NAMES

    args.policy_list = [x for x in args.policies.split(",") if x]
    for name in args.policy_list:
        if name.partition(":")[0] not in POLICY_NAMES:
            p.error(f"unknown policy '{name}'; choose from {', '.join(POLICY_NAMES)}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    from impress_flexgen.bench.runner import RunConfig, kv_bytes_per_token
    from impress_flexgen.entrypoints.openai.guard import ServerOptions
    from impress_flexgen.entrypoints.openai.server import background_server
    from impress_flexgen.models.runtime import Runtime, RuntimeConfig
    from impress_flexgen.service import Service, ServiceConfig
    from impress_flexgen.store import scratch

    system, users = build_conversations(args.system_chars, args.conversations, args.turns)
    root = Path(args.store_root) if args.store_root else Path(tempfile.gettempdir())
    results = []
    with Runtime(RuntimeConfig(model=args.model)) as rt:
        tok = rt.tokenizer
        # KV of what the store can hold: the system prompt and every question and answer.
        tokens = len(tok.encode(system)) + sum(
            len(tok.encode(u)) + args.max_tokens + 16 for conv in users for u in conv)
        pool = tokens * kv_bytes_per_token(rt)
        gpu, cpu = int(pool * args.gpu_cache_fraction), int(pool * args.cpu_cache_fraction)
        print(f"model {rt.spec.name}; system prompt {len(tok.encode(system))} tokens; "
              f"{args.conversations} conversations x {args.turns} turns from {args.clients} "
              f"clients, {args.max_tokens} tokens per answer; tiers GPU {gpu / 2**20:.1f} MiB, "
              f"CPU {cpu / 2**20:.1f} MiB", flush=True)
        for policy in args.policy_list:
            with scratch.directory(root, "benchserve") as stores:
                config = ServiceConfig(model=args.model, run=RunConfig(policy, policy),
                                       store_root=stores, gpu_cache_bytes=gpu,
                                       cpu_cache_bytes=cpu, queue_size=args.clients + 1,
                                       timeout_s=3600)
                with Service(config, runtime=rt) as service, \
                        background_server(service,
                                          options=ServerOptions(cache_stats=True)) as url:
                    # One unrelated request first: one-off costs stay out of the figures.
                    service.complete(service.frontend.build(prompt="Warm up. " * 8,
                                                            max_tokens=2))
                    got = run_policy(url, rt.spec.name, system, users, args.clients,
                                     args.max_tokens)
            row = summarize(policy, got)
            results.append(row)
            print(f"{policy}: TTFT mean {row['ttft_mean_s']:.3f} s, P99 "
                  f"{row['ttft_p99_s']:.3f} s, {row['requests_per_s']:.2f} req/s", flush=True)
        batching = []
        if args.client_counts:
            from experiments.batching_load import batching_rows, print_batching

            batching = batching_rows(rt, args.model, root, args.client_counts,
                                     args.max_batch_size, args.requests_per_client,
                                     args.batch_max_tokens, args.batch_prompt_chars,
                                     kinds=args.prefix_kinds)
    print_table(results)
    if batching:
        print_batching(batching)
    write_json(args.json, {"model": args.model, "batching": batching, "workload": {
        "system_prompt_tokens": len(rt.tokenizer.encode(system)),
        "conversations": args.conversations, "turns": args.turns, "clients": args.clients,
        "max_tokens": args.max_tokens, "gpu_tier_bytes": gpu, "cpu_tier_bytes": cpu},
        "results": results})
    return 0


def print_table(results) -> None:
    print()
    print(f"{'policy':<10}{'reqs':>5}{'TTFT mean':>10}{'P99':>8}{'turns>1':>9}{'server':>8}"
          f"{'engine':>8}{'from store':>11}{'req/s':>7}{'tok/s':>7}  {'read GPU/CPU/disk MiB':>22}")
    for r in results:
        mib = "/".join(f"{r['bytes_read'][t] / 2**20:.1f}" for t in ("gpu", "cpu", "disk"))
        print(f"{r['policy']:<10}{r['requests']:>5}{r['ttft_mean_s']:>10.3f}"
              f"{r['ttft_p99_s']:>8.3f}{r['ttft_later_turns_mean_s']:>9.3f}"
              f"{r['server_ttft_mean_s']:>8.3f}{r['engine_ttft_mean_s']:>8.3f}"
              f"{100 * r['matched_fraction']:>10.0f}%{r['requests_per_s']:>7.2f}"
              f"{r['tokens_per_s']:>7.1f}  {mib:>22}")
    print("(TTFT: client-side, request sent to first streamed text, seconds; turns>1: mean "
          "over later turns; server: arrival to first token; engine: match, load, compute; "
          "from store: prompt tokens whose KV was read instead of computed)")


if __name__ == "__main__":
    sys.exit(run_main("python -m experiments.bench_serve", main))
