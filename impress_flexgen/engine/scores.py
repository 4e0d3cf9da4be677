"""Log-probabilities of tokens under the model's own distribution, computed where the logits
are and kept small.

    scores = score_logits(logits, next_ids, k)     # logits (rows, vocab) on the device
    scores.rows()        # [(token, log-probability, [(token, log-probability)] * k)]

A row's log-softmax runs in float32 on the compute device, in one vectorised call for all
rows; only the chosen token's value and the k likeliest leave it (copies: nothing keeps
the (rows, vocab) logits alive). Turning scores into Python values, and those into text,
is left to whoever answers the request, off the thread that runs the model.
"""
from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass
class TokenScores:
    """Per scored position: the token that came, its log-probability, and the k likeliest
    tokens with theirs (k columns; 0 when only the token's own value was asked for)."""

    tokens: torch.Tensor          # (n,) int64
    logprobs: torch.Tensor        # (n,) float32
    top_ids: torch.Tensor         # (n, k) int64
    top_logprobs: torch.Tensor    # (n, k) float32

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in dataclasses.astuple(self))

    def rows(self) -> list[tuple]:
        """[(token, log-probability, [(token, log-probability)] of the k likeliest)]."""
        return [(t, lp, list(zip(ids, lps))) for t, lp, ids, lps in zip(
            self.tokens.tolist(), self.logprobs.tolist(), self.top_ids.tolist(),
            self.top_logprobs.tolist())]

    @staticmethod
    def cat(parts: list["TokenScores"], k: int) -> "TokenScores":
        if not parts:
            return TokenScores(torch.zeros(0, dtype=torch.int64), torch.zeros(0),
                               torch.zeros(0, k, dtype=torch.int64), torch.zeros(0, k))
        return TokenScores(*(torch.cat(column) for column in
                             zip(*(dataclasses.astuple(p) for p in parts))))


def step_scores(logits: torch.Tensor, rows: list[int], tokens: list[int],
                ks: list[int]) -> list[tuple]:
    """The (token, log-probability, top-k) rows of one decode step's picked tokens: row
    rows[i] of `logits` (batch, vocab) scores tokens[i] with its own ks[i] likeliest."""
    k = max(ks)
    scores = score_logits(logits[rows], tokens, k).rows()
    return [(t, lp, top[:ki]) for (t, lp, top), ki in zip(scores, ks)]


def score_hidden(logits_of, hidden: torch.Tensor, next_ids, k: int,
                 block_rows: int) -> TokenScores:
    """Scores of `next_ids` under the logits of `hidden` (rows, h) final hidden states,
    made `block_rows` rows at a time by `logits_of`: the logits held at once are at most
    block_rows x vocab, however many rows are scored."""
    parts = [score_logits(logits_of(hidden[lo:lo + block_rows]),
                          next_ids[lo:lo + block_rows], k)
             for lo in range(0, hidden.shape[0], block_rows)]
    return TokenScores.cat(parts, k)


def score_logits(logits: torch.Tensor, next_ids, k: int) -> TokenScores:
    """Scores of `next_ids` (one per row) under `logits` (rows, vocab), with the top `k`:
    one log_softmax, one gather and one topk over all rows, on the logits' device."""
    ids = torch.as_tensor(next_ids, dtype=torch.int64).to(logits.device)
    logits = logits.float()
    # log_softmax(x) = x - logsumexp(x): only the picked and the top k are shifted, no
    # second (rows, vocab) tensor is made.
    norm = torch.logsumexp(logits, dim=-1, keepdim=True)
    chosen = (logits.gather(1, ids[:, None]) - norm)[:, 0]
    if k:
        top = logits.topk(k, dim=-1)
        top_lp, top_ids = top.values - norm, top.indices
    else:
        top_lp = logits.new_zeros(logits.shape[0], 0)
        top_ids = ids.new_zeros(logits.shape[0], 0)
    return TokenScores(ids.cpu(), chosen.cpu(), top_ids.cpu(), top_lp.cpu())
