"""A scored prompt's prefill, a piece at a time: the prompt's own log-probabilities (echo
with logprobs, the use of lm-eval) computed inside the passes that prefill it.

    scored = engine.open_scoring([request, *other_choices], piece_tokens=64)
    while not scored.advance(pause):  # a piece: one prefill pass, its rows scored; pause()
        ...                           # stops it between layers; other requests run here
    seqs = scored.sequences()         # a Sequence per choice, with the prompt's scores

Scoring needs the final hidden state of every prompt position, so the whole prompt is
computed (nothing is matched or stored). It goes in pieces of `piece_tokens` tokens: each
piece is one prefill pass attending the pieces before it (their K and V, given as the
shared pool's are) plus itself, so the answer is the one pass's, to rounding. A piece's
rows become logits (rows x vocab, float32), then at once the log-probability of the token
that came next and the top k (scores.score_hidden, on the compute device); the logits go
with the piece. So a scored prompt holds at most one piece's logits; a scheduler that runs
one piece per step, and pauses a piece between two layers when another request arrives,
keeps that request's wait to about one layer of one piece.

The choices of one request (n) share the prefill and its scores: after the last piece
each picks its own first token from the same last row and decodes from its own copy of
the context.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable

from ..errors import UserError
from ..scores import TokenScores, score_hidden
from .batch_prefill import PassInput, prefill_steps

# Tokens per piece (two store chunks): what a request arriving meanwhile waits for. On the
# 2-core CPU a 32-token piece of smollm2-135m computes about 10 GFLOP, less than a short
# request's time alone; where every pass streams offloaded weights, or on a GPU, more
# tokens per piece (--score-piece-tokens) cost fewer passes.
PIECE_TOKENS = 32


class ScoredPrefill:
    """One scored prompt's prefill, its pieces so far and their scores."""

    def __init__(self, e, requests: list, piece_tokens: int = PIECE_TOKENS):
        """`e`: the engine; `requests`: the choices (checked), the first one leading."""
        lead = requests[0]
        if lead.prefix:
            raise UserError("a scored prompt is all query: it has no prefix")
        if any(r.query != lead.query or r.prompt_logprobs != lead.prompt_logprobs
               for r in requests[1:]):
            raise UserError("the choices of a scored prompt must share its prompt")
        if piece_tokens < 1:
            raise UserError("a scored prompt's pieces need at least 1 token")
        self.e, self.requests, self.piece = e, requests, piece_tokens
        self.ids = list(lead.query)
        self.k = lead.prompt_logprobs
        with e._serving:
            self.job = e._open(lead, False, 0)     # nothing to match: it has no prefix
        self.done = 0                # prompt tokens prefilled
        self.parts: list[TokenScores] = []
        self.context: _Prefilled | None = None
        self.steps = None            # the piece under way, paused between two layers
        self.last = None             # the last piece's (kept, new_kv, last row, out weights)

    @property
    def finished(self) -> bool:
        return self.done == len(self.ids)

    @property
    def next_piece(self) -> int:
        """Tokens the next advance() prefills."""
        return min(self.piece, len(self.ids) - self.done)

    def advance(self, pause: Callable[[], bool] | None = None) -> bool:
        """Prefill the next piece and score its rows; True once the whole prompt is in.
        `pause`, asked after each layer: True leaves the piece there, and the next call
        goes on from it (another request's pass runs in between)."""
        e, ids, job = self.e, self.ids, self.job
        lo = self.done
        hi = lo + self.next_piece
        if self.steps is None:
            self.steps = prefill_steps(e.layers, [PassInput(
                ids[lo:hi], 0, [], job.stats, n_hidden=hi - lo, given=self.context)])
        with e._serving:
            while True:
                try:
                    next(self.steps)
                except StopIteration as done:
                    kept, new_kv, tail, out_w = done.value[0]
                    break
                if pause is not None and pause():
                    return False
            self.steps = None
            # Row i predicts token lo + i + 1; the prompt's last row predicts the first
            # new token (the choices' own), not a prompt token.
            rows = hi - lo if hi < len(ids) else hi - lo - 1
            if rows:
                with job.stats.timer("compute_s"):
                    self.parts.append(score_hidden(
                        functools.partial(e.math.logits, out_w), tail[:rows],
                        ids[lo + 1:lo + 1 + rows], self.k, self.piece))
        self.done = hi
        if self.finished:
            self.context, self.last = None, (kept, new_kv, tail[-1:], out_w)
        else:
            self.context = _Prefilled(new_kv)
        return self.finished

    def sequences(self) -> list:
        """After the last piece: a Sequence per choice (its first token picked, its decode
        context its own), each with the prompt's scores."""
        e, job = self.e, self.job
        kept, new_kv, tail, out_w = self.last
        self.last = None
        scores = TokenScores.cat(self.parts, self.k)
        self.parts = []
        jobs = [job] + [dataclasses.replace(
            job, req=req, match=None, use_store=False,
            stats=dataclasses.replace(job.stats, bytes_read=dict(job.stats.bytes_read),
                                      jaccard=list(job.stats.jaccard)))
            for req in self.requests[1:]]
        out = []
        try:
            with e._serving:
                for mine in jobs:
                    e._first_token(mine, tail, out_w)
                    seq = e._to_decode(mine, kept, new_kv)
                    seq.prompt_scores = scores
                    out.append(seq)
        finally:
            job.release(e)
        return out

    def run(self) -> list:
        """Every piece now, then the sequences (a request served alone)."""
        try:
            while not self.advance():
                pass
        except BaseException:
            self.close()
            raise
        return self.sequences()

    def close(self) -> None:
        """Give up (a failure, a request gone): unpin what it matched."""
        if self.steps is not None:
            self.steps.close()
        self.job.release(self.e)
        self.context = self.last = self.steps = None


class _Prefilled:
    """The K and V of the pieces already prefilled, per layer (KV, n, d) on the compute
    device, given to the next piece as a prefix it attends in full."""

    def __init__(self, layers: list):
        self.layers = layers
        self.n_tokens = int(layers[0][0].shape[1])

    def start(self, layer: int) -> None:
        pass

    def kv(self, layer: int, device, dtype):
        return self.layers[layer]

    def close(self) -> None:
        pass
