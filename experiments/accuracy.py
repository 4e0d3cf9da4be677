"""Task accuracy of each serving policy on a real model, every request through the engine.

    python -m experiments.accuracy [--model smollm2-135m] [--quick] [--sensitivity]
                                   [--only LABELS] [--json PATH] [--figure PATH]

Shared prefixes of natural text (public-domain books, impress_flexgen.bench.corpus; 2 x 1024
tokens, Emma and Genesis; quick: one) are reused by many queries, as in a few-shot setting.
For each configuration (policy x retention x knobs): a fresh store in a temporary directory;
each prefix stored once as a cold serve stores it (see "Seeding"); one warm-up query per
prefix (a later passage of its book: it feeds importance; policies that reorder are
reordered after the warm-ups, as in workload_runner.run_workload); then the task queries, each a
Request through Engine.serve with teacher-forced query logits. GPU/CPU tier capacities are
zero, so every chunk counted is read from the store's disk files. Tasks:

1. recall   The query is "\\n\\n" + a 24-token fragment quoted from the prefix, followed by
            a 16-token candidate continuation. 4 candidates: the true next 16 tokens and the
            16 tokens after 3 other occurrences, in the prefix, of the fragment's last token
            (word-initial, pairwise different first tokens, no overlaps), so every candidate
            reads on from the fragment and only the context tells the true one. Scored
            lm-eval style: the sum of the candidate tokens' log-probs given prefix + query,
            one request per candidate; `score` = fraction choosing the true one (chance
            25%). Fragments are spread evenly over the prefix, away from its first and last
            64 tokens (the sink and the most recent chunk, which chunk policies always keep).
2. fidelity The query is a 64-token passage following the prefix in its book. KL(full ||
            policy) averaged over query positions, top-1 agreement with full (`score`), and
            the perplexity of the query tokens under the policy.
3. retrieval A passkey sentence (" The secret passkey is 48213. Remember it.") at a random
            depth (10-90%, at a word boundary) of a 1024-token natural-text window; every
            query has its own window, book, depth and passkey (each such prefix is stored
            once, gets its warm-up, then the query). The question "\\n\\nWhat is the secret
            passkey? The secret passkey is " is served alone for 5 greedy tokens (decoding
            over the policy's kept set, the engine's default); `score` = exact match of all 5
            digits (chance ~0). Also `mc_accuracy`: the 5 true digits against 3 wrong
            passkeys that differ from it and each other in every digit, by log-likelihood
            (4 requests, chance 25%).

Candidates inside the query. The engine selects a request's prefix KV from all its new
tokens' queries, so in multiple choice the candidate's own tokens steer the selection (each
(context, candidate) pair is its own request, as in lm-eval and in the paper's accuracy
runs). A query-aware policy can thus score a candidate it could not have generated;
retrieval's greedy score selects from the question alone.

KL and top-1 agreement are against the `full` policy (every stored chunk loaded) on the same
request (recall and retrieval: the true candidate's request), so `full` runs first.
bytes_loaded_fraction = (K/V bytes read from all tiers + probe bytes) / matched prefix K/V
bytes, fallback_rate = layers that fell back to loading everything / layers, both from the
engine's per-request stats (workload_runner.summarize) over the task's requests. Bytes read are
whole stored chunks: a 16-token smollm2 chunk holds 6 KiB of K (or V) in an 8 KiB aligned
slot, so `full` reads 133% of the payload (64-token chunks: 24 KiB, no padding).

Seeding. What a cold serve stores does not depend on which selection a policy makes: with
nothing matched there is no selection, and the store writes the prefix's K/V and its probe
copy. It depends only on whether the policy is exact: an exact policy computes the prefix by
canonical calls (engine/attention.py), a selecting one in one call per product, and the two
differ in the last bits. So each prefix is served cold once per kind of policy the run has,
in a template store, and its stored K/V read back; each configuration's fresh store then gets
its kind's through PrefixStore.insert, the call the engine's cold serve makes, with the same
values. This saves a prefill of every prefix in every configuration. `--cold-serve` serves
cold in every configuration instead; tests/test_accuracy.py checks that both give identical
results.

Decode mode. The decode-phase page policies (icecache, quest, page_window = sink + recent
window, page_random; policies.DECODE_POLICIES) prefill exactly as `full` does and choose pages
only at decode steps, so prefill query logits would score them equal to full KV. Their rows
(`icecache@256` etc.: ServingConfig.decode_budget = 256 tokens per layer and step) score every
task through teacher-forced decode steps (Request.forced; step logits take the place of query
logits), against a `full (decode)` reference served the same way, since decode steps and a
prefill pass differ in rounding:
  recall     the query alone is prefilled; the candidate is forced token by token (row i of
             the step logits predicts candidate token i; 16 steps per candidate);
  fidelity   the passage's first token is the query and the other 63 are forced, so the same
             64 positions are scored as in prefill mode;
  retrieval  the 4-way choice as recall; the greedy digits are the same request in both modes.
A candidate's first token is predicted by prefill, i.e. over the whole prefix under every
decode-mode row; only the tokens after it are decode steps. The four passkeys differ in every
digit, so the first digit alone can decide retrieval's 4-way choice here: in decode mode it
does not separate the policies (smollm2-135m: 1.00 for all four), the greedy digits do.
Their `retention` is None and `budget` the token budget; bytes_loaded_fraction is the K/V moved
to the compute device per decode step (RequestStats.decode_bytes_per_step) over what full
decoding attends per step on the same requests; prefill_bytes_loaded_fraction keeps the
prefill's figure (the whole prefix, as `full`). Not in the figure (no retention axis).

Sensitivity (`--sensitivity`, included in the full run): the fidelity task at r = 0.25,
impress in chunk mode (base: the default RunConfig) and token mode (base: the paper's
settings: heads 0,1,2, fp16 probes, 64-token chunks, adaptive threshold), one knob at a
time: fixed thresholds 0.8/0.85/0.9; adaptive alpha 0.3/0.6/1.0; no threshold; probe heads
first:3 (one KV group on smollm2), group (0,3,6), all; fp16 vs int4 probe copies; chunk
size 16/32/64; the share of tokens reordering packs (0.1/0.25/0.5/1.0). Rows with the same
settings as another are measured once (`same_as`).

How the tasks were redesigned (smollm2-135m, 2 x 1024-token prefixes, seed 0):
- recall, first design: distractors were 16-token spans from anywhere in the prefix. Full
  KV chose right 10/10, but random chunks still chose right 7/10 at every retention from
  0.5 down to 0.05: the true continuation is the one that reads on from the fragment's last
  words, which the model sees without any context. Distractors that follow the same token
  elsewhere (the current design, `--recall-distractors matched`; the first is `random`)
  took that cue away: full 9/10, random chunks 5/10 at r = 0.25 and 0.05, sink+recent 4-5/10.
  The miss of full KV is in Genesis, where "And God" is followed by several near-alike
  verses.
- retrieval, first design: the 4-way choice was the score. Full KV: 6/6; random chunks at
  r = 0.5 and 0.25: also 6/6. The candidate digits are query tokens, and a random chunk
  choice per layer keeps the passkey's chunk in about r of the 30 layers, enough to rank
  four choices. Greedy digits from the question alone separate them (full 6/6, random 3/6
  at r = 0.5 and 0/6 below), so they are the score now; the choice is kept as mc_accuracy.
- Importance reordering (impress, i.e. impress:all) moves the tokens that warm-up queries
  found important into shared chunks. Sorting every token by accumulated importance (the
  first design) scattered what no earlier query attended to: a passkey's digits ended up in
  different chunks, and greedy retrieval fell from 6/6 (full KV, and impress without
  reordering) to 2/6 at r = 0.25, recall from 9/10 to 7/10. Now only the hottest share of
  tokens (StoreConfig.reorder_hot_fraction) is packed into the leading chunks and the rest
  keep their positional order: 6/6 and 9/10 again. `impress (sort all)` (fraction 1.0) and
  `impress-noreorder` (impress:itf: the same selection without reordering) are in the grid
  at r = 0.25 to show both effects.

Quick mode (CI): one 1024-token prefix (4 recall and 4 fidelity queries, 1 warm-up), 4
retrieval prefixes, r = 0.25, policies full, impress (default RunConfig) and random; decode-mode
rows only when --only names them; no sensitivity unless --sensitivity is given (then a small
subset). About 2.5 minutes here.

Torch runs single-threaded by default (--threads): on the shared 2-core machine, two
threads beside another busy process made each request several times slower.
"""
from __future__ import annotations

import dataclasses
import math
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from experiments import reproduce_figures as figures
from disk_layout.format import KV_FORMATS
from impress_flexgen.bench.corpus import list_texts, passages
from impress_flexgen.bench.runner import RunConfig, kl_divergence, summarize
from impress_flexgen.engine import FamilyMath, Request, StoreSpec, assemble
from impress_flexgen.entrypoints.args import ArgumentParser, choose_list, write_json
from impress_flexgen.entrypoints.process import run_main
from impress_flexgen.errors import UserError
from impress_flexgen.models.runtime import Runtime, RuntimeConfig
from impress_flexgen.store import scratch
from policies import ServingConfig, make_policy
from policies.base import resolve_probe_heads

TASKS = ("recall", "fidelity", "retrieval")
RETENTIONS = (0.5, 0.25, 0.1, 0.05)

# Query layout of the tasks.
FRAGMENT_TOKENS = 24
CONTINUATION_TOKENS = 16
FIDELITY_TOKENS = 64
WARMUP_TOKENS = 64
PASSKEY_DIGITS = 5
EDGE_TOKENS = 64          # recall fragments stay this far from both ends of the prefix
RETRIEVAL_TOKENS = 1024
NEEDLE = " The secret passkey is {key}. Remember it."
QUESTION = "\n\nWhat is the secret passkey? The secret passkey is"
RECALL_HEADER = "\n\n"
# Characters of text taken per token wanted: generous, the passage is cut to tokens after.
CHARS_PER_TOKEN = 6


@dataclasses.dataclass(frozen=True)
class Settings:
    prefix_tokens: int                 # shared prefixes (recall, fidelity)
    sources: tuple[str, ...]           # one shared prefix per book
    recall_per_prefix: int
    fidelity_per_prefix: int
    warmups_per_prefix: int
    retrieval_queries: int
    retrieval_tokens: int = RETRIEVAL_TOKENS
    recall_distractors: str = "matched"
    seed: int = 0


FULL = Settings(prefix_tokens=1024, sources=("austen_emma", "kjv_genesis"), recall_per_prefix=5,
                fidelity_per_prefix=4, warmups_per_prefix=1, retrieval_queries=6)
QUICK = Settings(prefix_tokens=1024, sources=("austen_emma",), recall_per_prefix=4,
                 fidelity_per_prefix=4, warmups_per_prefix=1, retrieval_queries=4)


# -- tasks ------------------------------------------------------------------------------
@dataclasses.dataclass
class Choice:
    """A multiple-choice item: query (without candidate), candidates, index of the true one."""

    prefix: int
    query: list[int]
    candidates: list[list[int]]
    answer: int = 0
    depth: float = 0.0          # where in the prefix the answer lives (0..1)


@dataclasses.dataclass
class Tasks:
    prefixes: list[list[int]]
    sources: list[str]
    warmup: list[tuple[int, list[int]]]
    recall: list[Choice]
    fidelity: list[tuple[int, list[int]]]
    retrieval: list[Choice]
    shared: list[int]            # indices of the shared prefixes
    needle: list[int]            # indices of the retrieval prefixes

    def prefixes_of(self, task: str) -> list[int]:
        return self.needle if task == "retrieval" else self.shared


def _text_tokens(tokenizer, name: str, n_tokens: int, seed: int, count: int = 1
                 ) -> list[list[int]]:
    """`count` token streams of at least n_tokens, each starting at a paragraph of `name`."""
    out = []
    for text in passages(name, n_tokens * CHARS_PER_TOKEN, count, seed=seed):
        ids = tokenizer.encode(text)
        if len(ids) < n_tokens:
            raise UserError(f"a passage of {name!r} gave {len(ids)} tokens, {n_tokens} needed")
        out.append(ids[:n_tokens])
    return out


def _word_start(tokenizer):
    cache: dict[int, bool] = {}

    def check(tok: int) -> bool:
        if tok not in cache:
            cache[tok] = tokenizer.decode([tok]).startswith(" ")
        return cache[tok]
    return check


def build_tasks(tokenizer, s: Settings) -> Tasks:
    rng = np.random.default_rng(s.seed)
    word = _word_start(tokenizer)
    prefixes, sources, warmup, recall, fidelity, retrieval = [], [], [], [], [], []
    n = s.prefix_tokens
    tail = (s.fidelity_per_prefix + s.warmups_per_prefix) * FIDELITY_TOKENS
    for name in s.sources:
        ids = _text_tokens(tokenizer, name, n + tail, s.seed)[0]
        p = len(prefixes)
        prefix = ids[:n]
        prefixes.append(prefix)
        sources.append(name)
        rest = ids[n:]
        windows = [rest[j * FIDELITY_TOKENS:(j + 1) * FIDELITY_TOKENS]
                   for j in range(s.fidelity_per_prefix + s.warmups_per_prefix)]
        fidelity += [(p, w) for w in windows[:s.fidelity_per_prefix]]
        warmup += [(p, w) for w in windows[s.fidelity_per_prefix:]]
        recall += _recall_items(p, prefix, s.recall_per_prefix, rng, word, tokenizer,
                                s.recall_distractors)
    shared = list(range(len(prefixes)))

    # Retrieval: one prefix per query, round-robin over the books (a further passage of a
    # book once every book has one); no two prefixes may start alike (they would share
    # radix nodes).
    names = list_texts()
    per_book = math.ceil(s.retrieval_queries / len(names))
    need = s.retrieval_tokens + WARMUP_TOKENS
    bases = {name: _text_tokens(tokenizer, name, need, s.seed + 1, per_book) for name in names}
    space = tokenizer.encode(" 1")[0]
    if tokenizer.decode([space]) != " ":
        raise UserError("tokenizer does not split a space before digits; retrieval needs it")
    question = tokenizer.encode(QUESTION) + [space]
    starts = {tuple(pre[:64]) for pre in prefixes}
    needle_idx = []
    for q in range(s.retrieval_queries):
        name = names[q % len(names)]
        base = bases[name][q // len(names)]
        if tuple(base[:64]) in starts:
            raise UserError("two prefixes of the accuracy run start alike; change --seed")
        starts.add(tuple(base[:64]))
        keys = _passkeys(rng)
        needle = tokenizer.encode(NEEDLE.format(key=keys[0]))
        cands = [tokenizer.encode(" " + k)[1:] for k in keys]
        if any(len(c) != PASSKEY_DIGITS for c in cands) or not any(
                needle[j:j + PASSKEY_DIGITS] == cands[0] for j in range(len(needle))):
            raise UserError("tokenizer does not give one token per digit; retrieval needs it")
        body = s.retrieval_tokens - len(needle)
        depth = int(rng.uniform(0.1, 0.9) * body)
        while depth < body and not word(base[depth]):
            depth += 1
        prefix = base[:depth] + needle + base[depth:body]
        p = len(prefixes)
        prefixes.append(prefix)
        sources.append(name)
        needle_idx.append(p)
        warmup.append((p, base[body:body + WARMUP_TOKENS]))
        # The true passkey's place among the choices, from its own generator (so the
        # passkeys and depths above do not depend on it).
        answer = int(np.random.default_rng([s.seed, 7, q]).integers(4))
        cands.insert(answer, cands.pop(0))
        retrieval.append(Choice(p, question, cands, answer, depth / s.retrieval_tokens))
    return Tasks(prefixes, sources, warmup, recall, fidelity, retrieval, shared, needle_idx)


def _passkeys(rng) -> list[str]:
    """A passkey and three wrong ones, all four different in every digit position."""
    digits = np.stack([rng.permutation(10)[:4] for _ in range(PASSKEY_DIGITS)], axis=1)
    return ["".join(str(d) for d in row) for row in digits]


def _recall_items(p: int, prefix: list[int], count: int, rng, word, tokenizer,
                  distractors: str = "matched") -> list[Choice]:
    """`count` recall items on one prefix, fragments spread evenly over it.

    distractors "matched": the 16 tokens after 3 other occurrences of the fragment's last
    token (so every candidate reads on fluently from the fragment, and only the context
    tells the true one); "random": 16-token spans from anywhere in the prefix (the first
    design: a model that lost the context still picks the fluent continuation often).
    Either way word-initial, pairwise different first tokens, no overlaps.
    """
    n, frag, cont = len(prefix), FRAGMENT_TOKENS, CONTINUATION_TOKENS
    lo, hi = EDGE_TOKENS, n - EDGE_TOKENS - frag - cont
    if hi <= lo + count:
        raise UserError(f"a {n}-token prefix is too short for {count} recall items")
    header = tokenizer.encode(RECALL_HEADER)
    after: dict[int, list[int]] = {}          # token -> positions right after it
    for j in range(n - cont):
        if word(prefix[j + 1]):
            after.setdefault(prefix[j], []).append(j + 1)
    bounds = np.linspace(lo, hi, count + 1).astype(int)
    items = []
    for i in range(count):
        # One fragment per stretch of the prefix, so depths are spread evenly.
        options = [a for a in range(bounds[i], bounds[i + 1])
                   if word(prefix[a]) and word(prefix[a + frag])]
        rng.shuffle(options)
        for a in options:
            e = a + frag                       # where the true continuation starts
            pool = (after.get(prefix[e - 1], []) if distractors == "matched"
                    else [b for b in range(n - cont + 1) if word(prefix[b])])
            starts = _distractors(prefix, pool, (a, e + cont), rng)
            if starts is not None:
                break
        else:
            raise UserError("no recall fragment with enough distractors; change --seed")
        cands = [prefix[e:e + cont]] + [prefix[b:b + cont] for b in starts]
        order = rng.permutation(4)
        cands = [cands[j] for j in order]
        items.append(Choice(p, header + prefix[a:e], cands, int(np.argmax(order == 0)), e / n))
    return items


def _distractors(prefix, pool, taken_span, rng, want: int = 3):
    """`want` starts from `pool`: spans not overlapping taken_span or each other, first
    tokens different from the true continuation's and each other's; None if impossible."""
    cont = CONTINUATION_TOKENS
    taken = [taken_span]
    firsts = {prefix[taken_span[1] - cont]}
    chosen = []
    for b in rng.permutation(np.asarray(pool, dtype=np.int64)):
        b = int(b)
        if any(b < e and b + cont > s for s, e in taken) or prefix[b] in firsts:
            continue
        chosen.append(b)
        taken.append((b, b + cont))
        firsts.add(prefix[b])
        if len(chosen) == want:
            return chosen
    return None


# -- configurations -------------------------------------------------------------------------
def main_runs(retentions, quick: bool) -> list[RunConfig]:
    if quick:
        return [RunConfig("full", "full", 1.0), *(
            r for x in retentions for r in (
                RunConfig("impress", "impress", x),
                RunConfig("random", "random", x)))]
    runs = [RunConfig("full", "full", 1.0), RunConfig("recomp", "recomp", 1.0)]
    for x in retentions:
        runs += [
            # Ours (the default RunConfig): whole chunks ranked by all heads' probe scores
            # on an importance-reordered layout, int4 probes, 16-token chunks, no fallback.
            RunConfig("impress", "impress", x),
            # The paper's mechanism: voted tokens, heads 0,1,2, fp16 probes, 64-token chunks,
            # adaptive agreement threshold.
            RunConfig("impress-token-adaptive", "impress", x, granularity="token",
                      threshold="adaptive", probe_heads="first:3", probe_format="fp16",
                      chunk_size=64),
            RunConfig("as_h2o_lfu", "as_h2o_lfu", x),
            RunConfig("random", "random", x),
            RunConfig("sink_recent", "sink_recent", x),
        ]
        # Cheaper probing on CPU: odd layers reuse the even layer's scores.
        runs.append(RunConfig("impress (probe every 2nd layer)", "impress", x, probe_every=2))
        if x == 0.25:   # variants at the paper's retention only (time)
            runs += [
                RunConfig("impress-adaptive", "impress", x, threshold="adaptive"),
                RunConfig("impress-token", "impress", x, granularity="token",
                          probe_heads="first:3", probe_format="fp16", chunk_size=64),
                # The same selection without reordering (impress:itf), and reordering
                # that sorts every token by importance (the first design).
                RunConfig("impress-noreorder", "impress:itf", x),
                RunConfig("impress (sort all)", "impress", x, reorder_hot_fraction=1.0),
                # IceCache's layout on disk: chunks of similar keys instead of importance.
                RunConfig("impress (semantic layout)", "impress", x, reorder_by="semantic"),
                # Cheaper probing on CPU: only the request's last queries score the prefix.
                RunConfig("impress (probe last 32)", "impress", x, probe_queries=32),
                RunConfig("impress (probe last 16)", "impress", x, probe_queries=16),
                RunConfig("impress (probe stride 2)", "impress", x, probe_stride=2),
                # Fewer probe heads (a third of the scoring): one per KV head, the paper's 0-2.
                RunConfig("impress (probe heads group)", "impress", x, probe_heads="group"),
                RunConfig("impress (probe heads first:3)", "impress", x, probe_heads="first:3"),
            ]
    return runs


# Decode-phase page policies, at their token budget (they act only after prefill).
DECODE_POLICY_ROWS = ("icecache", "quest", "page_window", "page_random")
DECODE_BUDGETS = (256,)
DECODE_REFERENCE = "full (decode)"


@dataclasses.dataclass(frozen=True)
class DecodeRun:
    """A row scored in decode mode; budget None for the full-KV reference."""

    run: RunConfig
    budget: int | None = None


def format_runs(formats, retentions) -> list[RunConfig]:
    """Rows per store format (--kv-formats), tagged by it: every chunk loaded (`random` at
    retention 1.0, a reader that is not exact, so it loads what an inexact format holds: the
    format's cost alone) and impress at each retention. `full` (the reference, exact)
    recomputes what a lossy format holds, so it is no row of a format."""
    return [RunConfig("full", "full", 1.0), *(
        r for f in formats for r in (
            RunConfig(f"every chunk [{f}]", "random", 1.0, kv_format=f),
            *(RunConfig(f"impress [{f}]", "impress", x, kv_format=f) for x in retentions)))]


def decode_runs(budgets=DECODE_BUDGETS) -> list[DecodeRun]:
    """The decode-mode rows, their full-KV reference first. Retention 1.0: prefill loads the
    whole prefix (these policies subclass `full`); only the budget shapes decoding."""
    return [DecodeRun(RunConfig(DECODE_REFERENCE, "full", 1.0)), *(
        DecodeRun(RunConfig(f"{name}@{b}", name, 1.0), b)
        for b in budgets for name in DECODE_POLICY_ROWS)]


SENS_BASES = {
    "chunk": RunConfig("impress", "impress", 0.25),
    "token": RunConfig("impress-token-adaptive", "impress", 0.25, granularity="token",
                       threshold="adaptive", probe_heads="first:3", probe_format="fp16",
                       chunk_size=64),
}


def sensitivity_runs(quick: bool) -> list[tuple[str, str, str, RunConfig]]:
    """(mode, knob, value, config), one knob changed at a time from each mode's base.
    Rows with the same settings as an earlier one (see _run_key) are measured once."""
    knobs = [("threshold", f"fixed {t}", {"threshold": "fixed", "threshold_value": t})
             for t in (0.8, 0.85, 0.9)]
    knobs += [("threshold", f"adaptive {a}", {"threshold": "adaptive", "adaptive_alpha": a})
              for a in (0.3, 0.6, 1.0)]
    knobs += [("threshold", "none", {"threshold": "none"})]
    knobs += [("probe_heads", h, {"probe_heads": h}) for h in ("first:3", "group", "all")]
    knobs += [("probe_format", f, {"probe_format": f}) for f in ("fp16", "int4")]
    knobs += [("chunk_size", str(c), {"chunk_size": c}) for c in (16, 32, 64)]
    knobs += [("reorder_hot_fraction", str(h), {"reorder_hot_fraction": h})
              for h in (0.1, 0.25, 0.5, 1.0)]
    if quick:
        keep = {"fixed 0.85", "adaptive 0.6", "first:3", "group", "fp16"}
        knobs = [k for k in knobs if k[1] in keep]
    return [(mode, knob, value, dataclasses.replace(base, label=f"{mode}: {knob}={value}",
                                                     **change))
            for mode, base in SENS_BASES.items() for knob, value, change in knobs]


def _run_key(run: RunConfig, heads: tuple[int, int]) -> tuple:
    """What determines a configuration's results; `heads` = (query heads, KV heads)."""
    d = dataclasses.asdict(run)
    d.pop("label")
    d["probe_heads"] = resolve_probe_heads(run.probe_heads, *heads)
    if d["threshold"] != "fixed":
        d.pop("threshold_value")
    if d["threshold"] != "adaptive":
        d.pop("adaptive_alpha")
    return tuple(sorted((k, str(v)) for k, v in d.items()))


# -- running ----------------------------------------------------------------------------------
class PrefixKV:
    """Each prefix's stored K/V as a cold serve of an exact (or a selecting) policy writes
    it, computed once (see "Seeding")."""

    def __init__(self, runtime: Runtime, tasks: Tasks, root: Path, progress=None,
                 needed=None, exact: bool = True):
        """`needed`: the prefixes the tasks run use (None: all)."""
        self.kv: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        cfg = ServingConfig(retention=1.0)
        policy = make_policy("full" if exact else "impress", cfg)
        tmp = scratch.make(root, "acctemplate")
        stack = assemble(runtime, policy, StoreSpec(tmp, chunk_size=16, probe_format="fp16",
                                                    reorder_interval=0, direct_io=False))
        engine, store = stack.engine, stack.store
        try:
            for p, ids in enumerate(tasks.prefixes):
                if needed is not None and p not in needed:
                    continue
                engine.serve(Request(ids, [ids[-1]], 1))          # the cold serve
                match = store.match_prefix(ids)
                try:
                    if sum(u for _, u in match.segments) != len(ids):
                        raise UserError("a prefix was not stored whole (length not a multiple "
                                        "of 64?)")
                    layers = []
                    for layer in range(runtime.spec.config.num_hidden_layers):
                        parts = [store.inspect().reads.read_layer(store.entry(node, layer), node)
                                 for node, _ in match.segments]
                        layers.append((torch.cat([k[:, :u] for (k, _), (_, u)
                                                  in zip(parts, match.segments)], 1),
                                       torch.cat([v[:, :u] for (_, v), (_, u)
                                                  in zip(parts, match.segments)], 1)))
                    self.kv[p] = layers
                finally:
                    store.release(match)
                if progress is not None:
                    progress.update(1)
        finally:
            stack.close()
            shutil.rmtree(tmp, ignore_errors=True)


@dataclasses.dataclass
class RunContext:
    runtime: Runtime
    tasks: Tasks
    root: Path
    # Per kind of policy (exact or not) its PrefixKV, made at first use; None: a literal
    # cold serve in every configuration.
    seeds: dict | None
    reference: dict
    progress: object = None
    needed: set | None = None       # the prefixes seeded

    def seed(self, exact: bool) -> PrefixKV:
        if exact not in self.seeds:
            self.seeds[exact] = PrefixKV(self.runtime, self.tasks, self.root, self.progress,
                                         self.needed, exact)
        return self.seeds[exact]


def _logprobs(logits: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits.double(), -1)


def _choice_ll(logits: torch.Tensor, query_len: int, cand: list[int]) -> float:
    """Sum of log-probs of the candidate tokens, predicted by rows query_len - 1 on (prefill:
    the candidate is the query's last len(cand) tokens; decode mode: query_len = 1)."""
    lp = _logprobs(logits[query_len - 1:query_len - 1 + len(cand)])
    return float(lp[torch.arange(len(cand)), torch.tensor(cand)].sum())


def _compare(ref: torch.Tensor | None, logits: torch.Tensor, kls: list, top1: list) -> None:
    if ref is None:
        return
    kls.append(kl_divergence(ref, logits))
    top1.append(float((ref.argmax(-1) == logits.argmax(-1)).float().mean()))


def _forced(resp) -> torch.Tensor:
    """A teacher-forced response's step logits as one (positions, vocab) tensor: row i is
    the distribution of the i-th forced position, as query_logits' row i is in prefill."""
    return torch.stack(resp.step_logits)


def evaluate(ctx: RunContext, run: RunConfig, tasks_to_run, decode: bool = False,
             budget: int | None = None) -> dict[str, dict]:
    """One configuration on a fresh store: {task: result row}.

    decode: score through teacher-forced decode steps instead of prefill query logits (see
    "Decode mode"); budget: the decode-phase policies' token budget (ServingConfig)."""
    cfg = run.serving()
    if budget is not None:
        cfg = dataclasses.replace(cfg, decode_budget=budget)
    policy = make_policy(run.policy, cfg)
    t = ctx.tasks
    is_ref = run.policy == "full" and run.retention == 1.0
    mode = "decode" if decode else "prefill"
    tmp = scratch.make(ctx.root, "accstore")
    stack = None
    try:
        stack = assemble(ctx.runtime, policy, StoreSpec(tmp, reorder_interval=10**9,
                                                        direct_io=False, **run.store_options()))
        engine, store = stack.engine, stack.store
        needed = sorted({p for task in tasks_to_run for p in t.prefixes_of(task)})
        if store is not None:
            for p in needed:
                ids = t.prefixes[p]
                if ctx.seeds is None:
                    engine.serve(Request(ids, [ids[-1]], 1))
                else:
                    store.insert(ids, 0, ctx.seed(policy.exact_reads).kv[p])
            for p, query in t.warmup:
                if p in needed:
                    engine.serve(Request(t.prefixes[p], query, 1))
                    _tick(ctx)
            if policy.reorder:
                store.reorder_now()
            store.tiers.cache.reset_metrics()

        def serve(p, query):
            """Prefill mode: row i of the logits predicts the token after query[i]."""
            resp = engine.serve(Request(t.prefixes[p], query, 1), query_logits=True)
            _tick(ctx)
            return resp, resp.query_logits

        def serve_forced(p, query, forced, steps):
            """Decode mode: `steps` rows; row 0 (from prefill) predicts forced[0], row i the
            token after forced[i - 1], which decode step i - 1 was fed."""
            resp = engine.serve(Request(t.prefixes[p], query, steps, forced=forced,
                                        keep_logits=True))
            _tick(ctx)
            return resp, _forced(resp)

        out = {}
        for task in tasks_to_run:
            rows, kls, top1, extra = [], [], [], {}
            if task == "fidelity":
                nll = []
                for i, (p, query) in enumerate(t.fidelity):
                    # Decode mode feeds the passage's first token as the query and forces the
                    # rest, so the same 64 positions are scored either way.
                    resp, logits = (serve_forced(p, query[:1], query[1:], len(query))
                                    if decode else serve(p, query))
                    rows.append(resp.stats)
                    key = (mode, "fidelity", i)
                    if is_ref:
                        ctx.reference[key] = logits
                    _compare(ctx.reference.get(key), logits, kls, top1)
                    lp = _logprobs(logits[:-1])
                    nll.append(-float(lp[torch.arange(len(query) - 1),
                                         torch.tensor(query[1:])].mean()))
                extra["perplexity"] = float(math.exp(np.mean(nll)))
                score = None  # top-1 agreement, set below
            else:
                items = t.recall if task == "recall" else t.retrieval
                correct, margins, exact = [], [], []
                for i, item in enumerate(items):
                    lls = []
                    for c, cand in enumerate(item.candidates):
                        if decode:
                            resp, logits = serve_forced(item.prefix, item.query, cand,
                                                        len(cand))
                        else:
                            resp, logits = serve(item.prefix, item.query + cand)
                        rows.append(resp.stats)
                        lls.append(_choice_ll(logits, 1 if decode else len(item.query), cand))
                        if c == item.answer:
                            key = (mode, task, i)
                            if is_ref:
                                ctx.reference[key] = logits
                            _compare(ctx.reference.get(key), logits, kls, top1)
                    correct.append(int(np.argmax(lls) == item.answer))
                    others = [x for j, x in enumerate(lls) if j != item.answer]
                    margins.append(lls[item.answer] - max(others))
                    if task == "retrieval":
                        # Greedy decoding, the same request in both modes.
                        gen = engine.serve(Request(t.prefixes[item.prefix], item.query,
                                                   PASSKEY_DIGITS))
                        _tick(ctx)
                        exact.append(int(gen.tokens == item.candidates[item.answer]))
                score = float(np.mean(correct))
                extra["margin_mean"] = float(np.mean(margins))
                extra["correct"] = correct
                if task == "retrieval":
                    # Multiple choice did not separate random chunks from full KV here
                    # (see the docstring): the greedy digits are the score.
                    extra["mc_accuracy"] = score
                    extra["exact_match"] = score = float(np.mean(exact))
                    extra["exact"] = exact
            row = summarize(run, policy, rows, kls, top1, store)
            if score is None:
                score = row["top1_agreement"] if not is_ref else 1.0
            loaded = row["bytes_loaded_fraction"]
            if decode:
                # What decoding moves per step, against full decoding of the same requests
                # (prefill reads the whole prefix under every decode-mode row).
                moved = float(sum(r.decode_bytes_per_step for r in rows))
                if is_ref:
                    ctx.reference[("decode bytes", task)] = moved
                ref_moved = ctx.reference.get(("decode bytes", task))
                extra["decode_bytes_per_step"] = moved / len(rows)
                extra["prefill_bytes_loaded_fraction"] = loaded
                loaded = moved / ref_moved if ref_moved else None
            out[task] = {
                "policy": row["policy"], "label": run.label, "config": row["config"],
                "kv_format": row["kv_format"],
                "retention": None if decode else run.retention, "budget": budget,
                "mode": mode, "task": task, "score": score,
                "kl": 0.0 if is_ref else row["kl"],
                "top1_agreement": 1.0 if is_ref else row["top1_agreement"],
                "bytes_loaded_fraction": loaded,
                "fallback_rate": row["fallback_rate"], **extra,
                "kl_median": 0.0 if is_ref else row["kl_median"],
                "read_amplification": row["read_amplification"],
                "requests": row["queries"], "ttft_mean_s": row["ttft_mean_s"],
                "bytes_read_total": row["bytes_read_total"],
                "reorders": row["reorders"],
            }
        return out
    finally:
        if stack is not None:
            stack.close()
        shutil.rmtree(tmp, ignore_errors=True)


def _tick(ctx: RunContext) -> None:
    if ctx.progress is not None:
        ctx.progress.update(1)


def _requests(tasks: Tasks, tasks_to_run, policy_reuses: bool) -> int:
    n = 0
    needed = {p for task in tasks_to_run for p in tasks.prefixes_of(task)}
    if policy_reuses:
        n += sum(1 for p, _ in tasks.warmup if p in needed)
    for task in tasks_to_run:
        n += {"recall": 4 * len(tasks.recall), "fidelity": len(tasks.fidelity),
              "retrieval": 5 * len(tasks.retrieval)}[task]
    return n


# -- command line -----------------------------------------------------------------------------
def parse_args(argv):
    p = ArgumentParser(prog="python -m experiments.accuracy",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--quick", action="store_true",
                   help="CI size: one 1024-token prefix, 4 queries per task, r = 0.25, "
                        "full / impress / random")
    p.add_argument("--sensitivity", action="store_true",
                   help="run the sensitivity study (fidelity, r = 0.25) instead of the main "
                        "grid (the full run does both)")
    p.add_argument("--no-sensitivity", action="store_true",
                   help="full run without the sensitivity study")
    p.add_argument("--tasks", default=",".join(TASKS), help="comma-separated subset of tasks")
    p.add_argument("--only", help="comma-separated labels of main-grid rows, e.g. impress or "
                                  "icecache@256 (full always runs, and full (decode) with "
                                  "any decode-mode row)")
    p.add_argument("--retentions", help="comma-separated retention ratios (default "
                                        "0.5,0.25,0.1,0.05; quick: 0.25)")
    p.add_argument("--prefix-tokens", type=int, help="shared prefix length (multiple of 64)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--recall-distractors", choices=("matched", "random"), default="matched",
                   help="recall distractors: what follows other occurrences of the fragment's "
                        "last token (default), or spans from anywhere (the first design)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument("--cold-serve", action="store_true",
                   help="serve every prefix cold in every configuration instead of seeding "
                        "each fresh store with the cold serve's K/V (same result, slower)")
    p.add_argument("--store-root", help="where stores go (default: the temp dir)")
    p.add_argument("--kv-formats", help="comma-separated store formats (fp32, bf16, fp16, "
                                        "int4): instead of the main grid, per format every "
                                        "chunk loaded and impress at each retention")
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--figure", metavar="PATH", help="PNG: score against retention per policy")
    args = p.parse_args(argv)
    args.tasks = choose_list(p, "--tasks", args.tasks, TASKS)
    if args.kv_formats is not None:
        args.kv_formats = choose_list(p, "--kv-formats", args.kv_formats, KV_FORMATS)
    try:
        args.retentions = (tuple(float(x) for x in args.retentions.split(","))
                           if args.retentions else ((0.25,) if args.quick else RETENTIONS))
    except ValueError:
        p.error("--retentions: comma-separated numbers")
    if any(not 0 < x < 1 for x in args.retentions):
        p.error("--retentions must lie in (0, 1)")
    if args.prefix_tokens is not None and (args.prefix_tokens < 256 or args.prefix_tokens % 64):
        p.error("--prefix-tokens must be a multiple of 64, at least 256")
    if args.threads < 1:
        p.error("--threads must be at least 1")
    if args.sensitivity and args.no_sensitivity:
        p.error("--sensitivity and --no-sensitivity exclude each other")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    settings = QUICK if args.quick else FULL
    settings = dataclasses.replace(settings, seed=args.seed,
                                   recall_distractors=args.recall_distractors)
    if args.prefix_tokens:
        settings = dataclasses.replace(settings, prefix_tokens=args.prefix_tokens)
    do_main = not args.sensitivity
    do_sens = args.sensitivity or (not args.quick and not args.no_sensitivity)
    runs = main_runs(args.retentions, args.quick) if do_main else []
    decoded = decode_runs() if do_main else []
    if args.kv_formats:
        runs, decoded, do_sens = format_runs(args.kv_formats, args.retentions), [], False
    if args.only and do_main:
        keep = {x for x in args.only.split(",") if x}
        unknown = keep - {r.label for r in runs} - {d.run.label for d in decoded}
        if unknown:
            raise UserError(f"--only: no row labelled {', '.join(sorted(unknown))} in this "
                            f"grid (labels: {', '.join(r.label for r in runs)}, "
                            f"{', '.join(d.run.label for d in decoded)})")
        runs = [r for r in runs if r.label in keep | {"full"}]
        decoded = [d for d in decoded if d.run.label in keep]
        if decoded and decoded[0].budget is not None:   # their reference always runs
            decoded.insert(0, decode_runs(())[0])
    elif args.quick:       # CI: decode rows only when named
        decoded = []
    sens = sensitivity_runs(args.quick) if do_sens else []
    if do_sens and "fidelity" not in args.tasks:
        raise UserError("the sensitivity study needs the fidelity task")
    if not do_main:  # the reference still runs
        runs = [RunConfig("full", "full", 1.0)]
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    root = Path(args.store_root) if args.store_root else Path(tempfile.gettempdir())
    t_start = time.perf_counter()
    try:
        with Runtime(RuntimeConfig(model=args.model)) as rt:
            tasks = build_tasks(rt.tokenizer, settings)
            main_tasks = args.tasks if do_main else ["fidelity"]
            # Only the prefixes of the tasks run are seeded.
            needed = {p for task in main_tasks for p in tasks.prefixes_of(task)}
            kinds = {make_policy(r.policy).exact_reads
                     for r in runs + [d.run for d in decoded] + [x[3] for x in sens]}
            total = len(needed) * len(kinds) if not args.cold_serve else 0
            total += sum(_requests(tasks, main_tasks, make_policy(r.policy).reuse)
                         for r in runs + [d.run for d in decoded])
            math_ = FamilyMath(rt.spec)
            heads = (math_.n_head, math_.n_kv_head)
            main_keys = {_run_key(r, heads) for r in runs} if "fidelity" in main_tasks else set()
            sens_keys = {_run_key(x[3], heads) for x in sens} - main_keys
            total += len(sens_keys) * _requests(tasks, ["fidelity"], True)
            results, sens_rows = [], []
            with tqdm(total=total, desc="requests", unit="req") as bar:
                ctx = RunContext(rt, tasks, root, None if args.cold_serve else {}, {}, bar,
                                 needed)
                fidelity_of = {}      # configuration key -> its fidelity row
                for run in runs:
                    rows = evaluate(ctx, run, main_tasks)
                    if "fidelity" in rows:
                        fidelity_of.setdefault(_run_key(run, heads), rows["fidelity"])
                    if do_main:
                        results += [rows[t] for t in main_tasks]
                for d in decoded:
                    rows = evaluate(ctx, d.run, main_tasks, decode=True, budget=d.budget)
                    results += [rows[t] for t in main_tasks]
                for mode, knob, value, run in sens:
                    key = _run_key(run, heads)
                    if key not in fidelity_of:
                        fidelity_of[key] = evaluate(ctx, run, ["fidelity"])["fidelity"]
                    row = fidelity_of[key]
                    policy = make_policy(run.policy, run.serving())
                    sens_rows.append({
                        "mode": mode, "knob": knob, "value": value, "label": run.label,
                        "same_as": row["label"] if row["label"] != run.label else None,
                        "config": {**dataclasses.asdict(run), **policy.describe()},
                        "retention": run.retention, "task": "fidelity",
                        **{k: row[k] for k in ("kl", "kl_median", "top1_agreement",
                                               "perplexity", "bytes_loaded_fraction",
                                               "fallback_rate", "read_amplification")}})
    finally:
        torch.set_num_threads(threads)
    elapsed = time.perf_counter() - t_start
    if results:
        print_table(results, args.tasks)
    if sens_rows:
        print_sensitivity(sens_rows)
    payload = {"model": args.model, "quick": args.quick, "elapsed_s": elapsed,
               "settings": {**dataclasses.asdict(settings), "tasks": args.tasks,
                            "retentions": list(args.retentions),
                            "seeding": "cold-serve" if args.cold_serve else "insert",
                            "fragment_tokens": FRAGMENT_TOKENS,
                            "continuation_tokens": CONTINUATION_TOKENS,
                            "fidelity_tokens": FIDELITY_TOKENS,
                            "retrieval": {"queries": len(tasks.retrieval),
                                          "prefix_tokens": settings.retrieval_tokens,
                                          "needle": NEEDLE, "question": QUESTION,
                                          "depths": [round(c.depth, 3) for c in
                                                     tasks.retrieval]},
                            "sources": tasks.sources},
               "results": results}
    if do_sens:
        payload["sensitivity"] = sens_rows
    write_json(args.json, payload)
    if args.figure and results:
        plot(results, args.figure, args.model)
    return 0


# -- output -----------------------------------------------------------------------------
def _fmt(x, spec):
    return "-" if x is None else format(x, spec)


def _pct(x):
    return None if x is None else 100 * x


def print_table(results, tasks) -> None:
    by = {}
    for r in results:
        by.setdefault((r["label"], r["retention"]), {})[r["task"]] = r
    head = f"{'config':<24}{'r':>6}"
    if "recall" in tasks:
        head += f"{'recall':>8}{'KL':>8}"
    if "retrieval" in tasks:
        head += f"{'retr MC':>8}{'retr EM':>8}"
    if "fidelity" in tasks:
        head += f"{'fid KL':>8}{'top1':>7}{'ppl':>7}"
    head += f"{'loaded%':>9}{'fallbk':>7}{'TTFT ms':>9}"
    print(head)
    for (label, r), rows in by.items():
        line = f"{label:<24}{_fmt(r, '6.2f'):>6}"
        if "recall" in tasks:
            x = rows["recall"]
            line += f"{x['score']:>8.2f}{_fmt(x['kl'], '.3f'):>8}"
        if "retrieval" in tasks:
            x = rows["retrieval"]
            line += f"{x['mc_accuracy']:>8.2f}{x['exact_match']:>8.2f}"
        if "fidelity" in tasks:
            x = rows["fidelity"]
            line += (f"{_fmt(x['kl'], '.4f'):>8}{_fmt(x['top1_agreement'], '.3f'):>7}"
                     f"{x['perplexity']:>7.2f}")
        x = rows.get("fidelity") or rows[tasks[0]]      # bytes and fallbacks of one task
        line += f"{_fmt(_pct(x['bytes_loaded_fraction']), '8.1f'):>8}%{x['fallback_rate']:>7.2f}"
        line += f"{1000 * x['ttft_mean_s']:>9.1f}"
        print(line)
    if any(r.get("mode") == "decode" for r in results):
        print("r -: decode mode, teacher-forced through decode steps; KL and top-1 against "
              f"'{DECODE_REFERENCE}', loaded% = K/V moved per decode step against it")


def print_sensitivity(rows) -> None:
    print(f"\n{'sensitivity (fidelity, r=0.25)':<44}{'KL':>8}{'top1':>7}{'ppl':>7}"
          f"{'loaded%':>9}{'fallbk':>7}")
    for r in rows:
        same = f"  (= {r['same_as']})" if r["same_as"] else ""
        print(f"{r['label']:<44}{_fmt(r['kl'], '.4f'):>8}{_fmt(r['top1_agreement'], '.3f'):>7}"
              f"{r['perplexity']:>7.2f}{100 * r['bytes_loaded_fraction']:>8.1f}%"
              f"{r['fallback_rate']:>7.2f}{same}")


def plot(results, path: str, model: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("recall", "score", "recall: accuracy (4-way choice)", False),
              ("retrieval", "score", "retrieval: greedy exact match (score)", False),
              ("retrieval", "mc_accuracy", "retrieval: 4-way choice (candidate in query)",
               False),
              ("fidelity", "kl", "fidelity: KL(full || policy)", True)]
    results = [r for r in results if r["retention"] is not None]   # decode rows: no r
    tasks = {r["task"] for r in results}
    panels = [p for p in panels if p[0] in tasks]
    cols = 2 if len(panels) > 1 else 1
    nrows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(5.2 * cols, 3.9 * nrows + 1.0),
                             squeeze=False)
    axes = axes.ravel()
    for ax in axes[len(panels):]:
        ax.set_visible(False)
    labels = list(dict.fromkeys(r["label"] for r in results))
    for ax, (task, field, title, log) in zip(axes, panels):
        rows = [r for r in results if r["task"] == task]
        for i, label in enumerate(labels):
            pts = sorted((r["retention"], r[field]) for r in rows
                         if r["label"] == label and r[field] is not None)
            if not pts:
                continue
            style = dict(color=f"C{i % 10}", label=label)
            if len(pts) == 1 and pts[0][0] == 1.0:       # full / recomp: a reference line
                if log and pts[0][1] <= 0:
                    continue
                ax.axhline(pts[0][1], ls="--", lw=1, **style)
            else:
                ax.plot([x for x, _ in pts], [y for _, y in pts], "o-", ms=4, **style)
        if (task, field) in (("recall", "score"), ("retrieval", "mc_accuracy")):
            ax.axhline(0.25, color="grey", ls=":", lw=1, label="chance (4-way)")
        ax.set_xscale("log")
        ax.set_xlim(0.04, 0.62)
        ax.set_xticks([0.05, 0.1, 0.25, 0.5])
        ax.set_xticklabels(["0.05", "0.1", "0.25", "0.5"])
        ax.minorticks_off()
        if log:
            ax.set_yscale("log")
            ax.set_ylim(bottom=1e-3)    # recomp's KL (~1e-7, rounding) would flatten the rest
        else:
            ax.set_ylim(-0.03, 1.03)
        ax.set_xlabel("retention r")
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
    handles, names = axes[0].get_legend_handles_labels()
    fig.legend(handles, names, loc="lower center", ncol=min(4, len(names)), fontsize=8)
    fig.suptitle(f"Accuracy per policy against retention, {model} (dashed: full KV)",
                 fontsize=11)
    legend_rows = math.ceil(len(names) / 4)
    fig.tight_layout(rect=(0, 0.035 * legend_rows + 0.02, 1, 0.96))
    figures.save(fig, path, dpi=120, tight=False)


if __name__ == "__main__":
    sys.exit(run_main("python -m experiments.accuracy", main))
