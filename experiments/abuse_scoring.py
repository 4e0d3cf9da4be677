"""Two ways one client's requests could hold up or swell a shared server, measured on a
server in this process (llama-tiny, random weights, loopback):

    python -m experiments.abuse_scoring [--quick] [--json out.json]

scoring_stall   a long prompt scored (echo with logprobs, the lm-eval use) with n choices,
                and 1-token requests sent while it is served, each after a random pause
                (so that they arrive at any point of the server's work): their median
                time must be within 2x the median of the same request alone (measured
                just before, in the same run); the scored answer must hold every choice's
                prompt log-probabilities.
logits_memory   requests decoding many tokens at once, without logprobs: the server's
                resident memory may grow by less than a quarter of what keeping every
                step's (batch x vocab) logits would take.

Each check is a function returning a dict with "passed" and its figures, so a harness
(experiments.abuse_test) can count them as classes. Exit status 0 when both pass.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import threading
import time

MODEL = "llama-tiny"
SHORT = {"model": MODEL, "prompt": "Hello", "max_tokens": 1, "temperature": 0}


def measure_scoring_stall(url: str, prompt_tokens: int = 2000, n: int = 4, top: int = 5,
                  alone_rounds: int = 5, factor: float = 2.0, seed: int = 0) -> dict:
    """A scored prompt of `prompt_tokens` token ids with `n` choices, and meanwhile 1-token
    requests, each after a random pause of up to twice the time alone: passed when their
    median took at most `factor` x the median of the same request alone."""
    import random

    import httpx2

    ids = [100 + (i * 7919) % 40000 for i in range(prompt_tokens)]
    scored = {"model": MODEL, "prompt": ids, "echo": True, "logprobs": top, "max_tokens": 1,
              "n": n, "temperature": 1.0, "seed": 1}
    with httpx2.Client(base_url=url, timeout=600) as client:
        _timed_post(client, SHORT)                            # the first one warms up
        alone = [_timed_post(client, SHORT) for _ in range(alone_rounds)]
        alone_s = statistics.median(t for _, t in alone)
        got: dict = {}

        def score() -> None:
            t0 = time.perf_counter()
            r = httpx2.post(url + "/v1/completions", json=scored, timeout=600)
            got["status"], got["seconds"] = r.status_code, time.perf_counter() - t0
            got["body"] = r.json() if r.status_code == 200 else r.text

        thread = threading.Thread(target=score)
        with _PeakRss() as rss:
            thread.start()
            time.sleep(min(0.2, alone_s * 4))   # it is being served: sent, read, queued
            during = []
            pause = random.Random(seed)
            while thread.is_alive():
                during.append(_timed_post(client, SHORT))
                time.sleep(pause.uniform(0, 2 * alone_s))
            thread.join()
    statuses = {s for s, _ in alone + during}
    body = got.get("body")
    complete = got.get("status") == 200 and len(body["choices"]) == n and all(
        len(c["logprobs"]["token_logprobs"]) == prompt_tokens + 1 for c in body["choices"])
    typical = statistics.median(t for _, t in during) if during else None
    passed = statuses == {200} and complete and bool(during) and typical <= factor * alone_s
    return {"passed": passed, "alone_s": round(alone_s, 4),
            "during_s": [round(t, 4) for _, t in during],
            "median_ratio": None if typical is None else round(typical / alone_s, 2),
            "worst_ratio": round(max(t for _, t in during) / alone_s, 2) if during else None,
            "scoring_s": round(got.get("seconds", 0.0), 3), "scoring_status": got.get("status"),
            "rss_before_mb": round(rss.before / 2**20, 1),
            "rss_growth_mb": round((rss.peak - rss.before) / 2**20, 1),
            "scored_complete": complete, "prompt_tokens": prompt_tokens, "n": n}


def measure_logits_memory(url: str, service, requests: int = 8, tokens: int = 400) -> dict:
    """`requests` requests decoding `tokens` tokens each, together, no logprobs: passed
    when this process's resident memory grew by less than a quarter of the bytes that
    every step's (batch x vocab) float32 logits would hold."""
    import gc

    import httpx2

    vocab = service.rt.spec.config.vocab_size
    batch = min(requests, service.config.max_batch_size)
    kept_bytes = tokens * batch * vocab * 4      # every step's logits, kept by each sequence
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": tokens,
            "temperature": 0, "ignore_eos": True}
    with httpx2.Client(base_url=url, timeout=600) as client:
        _timed_post(client, {**body, "max_tokens": 8})       # warm up
        gc.collect()
        codes: list = []

        def one() -> None:
            codes.append(_timed_post(client, body)[0])

        threads = [threading.Thread(target=one) for _ in range(requests)]
        with _PeakRss() as rss:
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            gc.collect()
    grew = rss.peak - rss.before
    passed = codes == [200] * requests and grew < kept_bytes / 4
    return {"passed": passed, "rss_before_mb": round(rss.before / 2**20, 1),
            "rss_growth_mb": round(grew / 2**20, 1),
            "logits_if_kept_mb": round(kept_bytes / 2**20, 1), "requests": requests,
            "tokens": tokens}


# The harness's entry points (experiments.abuse_test): each on a server of its own, with
# its store under `workdir`.
def scoring_stall(quick: bool, workdir=None) -> dict:
    # The quick round shares a busy machine with other checks: a wider factor still tells a
    # stall (hundreds of times the time alone) from scheduling noise around a 30 ms request.
    with tiny_server(workdir) as (url, _):
        return measure_scoring_stall(url, factor=3.0 if quick else 2.0)


def logits_memory(quick: bool, workdir=None) -> dict:
    with tiny_server(workdir) as (url, service):
        return measure_logits_memory(url, service, tokens=200 if quick else 400)


@contextlib.contextmanager
def tiny_server(workdir=None, **config):
    """(url, service) of a llama-tiny server on a loopback port, in a temporary folder."""
    from impress_flexgen.config import ServiceConfig
    from impress_flexgen.entrypoints.openai.server import background_server
    from impress_flexgen.service import Service

    with contextlib.ExitStack() as stack:
        root = workdir if workdir is not None else \
            stack.enter_context(tempfile.TemporaryDirectory())
        service = stack.enter_context(Service(ServiceConfig(model=MODEL, store_root=str(root),
                                                            **config)))
        yield stack.enter_context(background_server(service)), service


def _timed_post(client, body: dict) -> tuple[int, float]:
    t0 = time.perf_counter()
    r = client.post("/v1/completions", json=body)
    return r.status_code, time.perf_counter() - t0


class _PeakRss:
    """This process's resident memory before the block and its peak during it, sampled
    every 20 ms on a thread of its own."""

    def __enter__(self) -> "_PeakRss":
        import psutil

        self._process = psutil.Process()
        self.before = self.peak = self._process.memory_info().rss
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._done.wait(0.02):
            self.peak = max(self.peak, self._process.memory_info().rss)

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join()
        self.peak = max(self.peak, self._process.memory_info().rss)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer decoded tokens")
    ap.add_argument("--json", metavar="PATH", help="write the results here")
    args = ap.parse_args(argv)
    results = {}
    with tiny_server() as (url, service):
        results["scoring_stall"] = measure_scoring_stall(url)
        results["logits_memory"] = measure_logits_memory(url, service,
                                                         tokens=200 if args.quick else 400)
    for name, r in results.items():
        figures = ", ".join(f"{k} {v}" for k, v in r.items() if k not in ("passed",
                                                                            "during_s"))
        print(f"{name:14s} {'pass' if r['passed'] else 'FAIL'}  {figures}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0 if all(r["passed"] for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
