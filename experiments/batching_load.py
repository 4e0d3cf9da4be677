"""Concurrent clients against one service, batched and one request at a time (bench_serve).

Each client sends its requests one after another (a closed loop); each request is a prompt
and a fixed number of tokens to generate. With a shared prefix every prompt starts with the
same passage (stored by a first request, then read from the store) and ends with its own
question; with distinct prefixes every prompt is a passage of its own. Every figure is
measured in this process, from submitting a job to its streamed text: time to first token
(TTFT), time per output token after the first (TPOT), output tokens and requests per second.
"""
from __future__ import annotations

import contextlib
import threading
import time

import numpy as np

from impress_flexgen.bench.corpus import passages


# Distinct prompts' passages: a book holds a few dozen non-overlapping 2,000-character
# passages, so more prompts than PER_BOOK are spread over the next books.
BOOKS = ("austen_pride_and_prejudice", "kjv_genesis", "milton_paradise_lost",
         "shakespeare_hamlet")
PER_BOOK = 24


def prompts(kind: str, n: int, chars: int, seed: int) -> list[str]:
    questions = passages("austen_emma", 120, n, seed + 1)
    if kind == "shared":
        system = passages(BOOKS[0], chars, 1, seed)[0]
        return [f"{system}\n\nQuestion: {q}" for q in questions]
    books = BOOKS[:-(-n // PER_BOOK)]
    texts = [t for i, book in enumerate(books)
             for t in passages(book, chars, len(range(i, n, len(books))), seed + 2)]
    return [f"{t}\n\nQuestion: {q}" for t, q in zip(texts, questions)]


def run_clients(service, texts: list[str], clients: int, max_tokens: int) -> dict:
    """Serve `texts` from `clients` threads, each taking the next text when done."""
    rows, errors = [], []
    lock = threading.Lock()
    todo = list(texts)

    def client() -> None:
        while True:
            with lock:
                if not todo:
                    return
                text = todo.pop(0)
            job = service.frontend.build(prompt=text, max_tokens=max_tokens)
            first = []
            sent = time.perf_counter()
            try:
                done = service.submit(job, lambda s: first or first.append(
                    time.perf_counter())).future.result()
            except Exception as exc:  # noqa: BLE001 - reported after the run
                with lock:
                    errors.append(str(exc))
                return
            end = time.perf_counter()
            t_first = first[0] if first else end
            n = done.completion_tokens
            with lock:
                rows.append({"ttft_s": t_first - sent, "latency_s": end - sent, "tokens": n,
                             "tpot_s": (end - t_first) / (n - 1) if n > 1 else None})

    threads = [threading.Thread(target=client) for _ in range(clients)]
    t0 = time.perf_counter()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    wall = time.perf_counter() - t0
    if errors:
        raise RuntimeError(errors[0])
    ttft = np.array([r["ttft_s"] for r in rows])
    tpot = [r["tpot_s"] for r in rows if r["tpot_s"] is not None]
    return {"requests": len(rows), "wall_s": wall,
            "output_tokens_per_s": sum(r["tokens"] for r in rows) / wall,
            "requests_per_s": len(rows) / wall, "ttft_mean_s": float(ttft.mean()),
            "ttft_p99_s": float(np.percentile(ttft, 99)),
            "tpot_mean_s": float(np.mean(tpot)) if tpot else None}


def batching_rows(rt, model: str, root, client_counts, batch_size: int, per_client: int,
                  max_tokens: int, chars: int, policy: str = "impress",
                  kinds=("shared", "distinct")) -> list[dict]:
    """Rows {clients, max_batch_size, prefix, ...}: batched and max-batch-size 1 over the
    same requests, shared and distinct prefixes."""
    from impress_flexgen.bench.runner import RunConfig
    from impress_flexgen.service import Service, ServiceConfig
    from impress_flexgen.store import scratch

    rows = []
    for kind in kinds:
        # Both modes side by side, client count by client count (batched, then one at a
        # time), so that a machine whose speed drifts during the run skews both alike.
        with contextlib.ExitStack() as stack:
            services = {}
            for size in dict.fromkeys((batch_size, 1)):
                stores = stack.enter_context(scratch.directory(root, "benchbatch"))
                config = ServiceConfig(model=model, run=RunConfig(policy, policy),
                                       store_root=stores, queue_size=max(client_counts) + 1,
                                       timeout_s=3600, max_batch_size=size)
                service = services[size] = stack.enter_context(Service(config, runtime=rt))
                warm = prompts(kind, 1, chars, 99)[0] if kind == "distinct" else \
                    prompts(kind, 1, chars, 0)[0]
                service.complete(service.frontend.build(prompt=warm, max_tokens=2))
            for clients in client_counts:
                for size, service in services.items():
                    texts = prompts(kind, clients * per_client, chars, 10 * clients)
                    got = run_clients(service, texts, clients, max_tokens)
                    row = {"clients": clients, "max_batch_size": size, "prefix": kind, **got}
                    rows.append(row)
                    print(f"{kind} prefix, {clients} clients, max batch {size}: "
                          f"{row['output_tokens_per_s']:.1f} tok/s, "
                          f"{row['requests_per_s']:.2f} req/s, TTFT mean "
                          f"{row['ttft_mean_s']:.2f} s P99 {row['ttft_p99_s']:.2f} s, "
                          f"TPOT {row['tpot_mean_s'] or 0:.3f} s", flush=True)
    return rows


def print_batching(rows: list[dict]) -> None:
    print()
    print(f"{'prefix':<9}{'clients':>8}{'batch':>6}{'tok/s':>8}{'req/s':>7}{'TTFT':>7}"
          f"{'P99':>7}{'TPOT':>7}{'x tok/s':>8}")
    base = {(r["prefix"], r["clients"]): r for r in rows if r["max_batch_size"] == 1}
    for r in rows:
        b = base.get((r["prefix"], r["clients"]))
        gain = r["output_tokens_per_s"] / b["output_tokens_per_s"] if b else float("nan")
        print(f"{r['prefix']:<9}{r['clients']:>8}{r['max_batch_size']:>6}"
              f"{r['output_tokens_per_s']:>8.1f}{r['requests_per_s']:>7.2f}"
              f"{r['ttft_mean_s']:>7.2f}{r['ttft_p99_s']:>7.2f}{r['tpot_mean_s'] or 0:>7.3f}"
              f"{gain:>8.2f}")
    print("(x tok/s: output tokens/s against max batch size 1 with the same clients)")
