"""The retained-chunk budget of ``ChunkedGatedCache`` in closed form, hard and relaxed, for the parallel form.

Streaming applies the budget one chunk at a time (``admit``, below): a kept chunk takes a free
slot, else the lowest-scoring chunk among the retained ones and the newcomer leaves (ties: the oldest).
A chunk's score never changes after it formed, so by induction the retained set after any forward is
simply the **top M** of the kept chunks formed so far, ordered by score with ties going to the newer
chunk. Chunk j is therefore visible to a forward iff it was kept, formed before it, and fewer than M
kept chunks formed before that forward *beat* it (``i`` beats ``j``: ``s_i > s_j``, or ``s_i == s_j``
and ``i`` is newer). ``beaten_counts`` computes those counts for every prefix at once, so the parallel
form needs no per-chunk loop (tests hold it equal to ``admit`` replayed chunk by chunk).

Training under a budget (``BudgetMode``):

* ``HARD`` (default): the training forward shows exactly what streaming shows; an evicted chunk is
  masked, so no gradient reaches its score. The gate still learns to keep what the actions need, by the
  other route the rule leaves open: the budget only ranks *kept* chunks, so a gate that drops
  (``s < tau``) the chunks the loss does not need leaves the needed one inside the budget.
* ``SOFT``: a relaxed top-M. Every chunk formed before a forward is shown, with the score bias
  ``log m`` where ``m = sigmoid((s - theta) / T)`` and ``theta`` is the midpoint between the M-th and
  (M+1)-th highest kept scores at that forward (``m = 1`` while at most M are kept). A chunk inside
  the budget gets ``m -> 1``, one outside ``m -> 0`` as T anneals, so the soft form converges to the
  hard one, and the action loss reaches the score of an evicted chunk. But training then attends over
  every chunk of the episode where inference holds M, and on the recall ablation
  (``benchmarks/ablate_gate_budget.py``) it learned neither to keep the cue nor to answer, where HARD
  did both; it stays as an option for budgets where that mismatch is small.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch
import torch.nn.functional as F


class BudgetMode(enum.Enum):
    """How the training (soft) form of the parallel cache treats chunks the budget evicts."""

    HARD = "hard"
    SOFT = "soft"

    @classmethod
    def parse(cls, value: "str | BudgetMode") -> "BudgetMode":
        """From the YAML/CLI string; ``KeyError`` listing the valid names otherwise."""
        if isinstance(value, cls):
            return value
        try:
            return cls(value)
        except ValueError as e:
            raise KeyError(f"unknown budget mode {value!r}; known: {', '.join(m.value for m in cls)}") from e


def beaten_counts(scores: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    """How many kept chunks among the first ``p`` beat chunk ``j``, for every prefix ``p``.

    scores, kept: [B, n] (chronological). Returns [B, n + 1, n] int32 ``C[b, p, j]``; chunk j (kept,
    ``j < p``) is retained after the first ``p`` chunks formed iff ``C[b, p, j] < max_chunks``.
    """
    b, n = scores.shape
    idx = torch.arange(n, device=scores.device)
    s_i, s_j = scores[:, :, None], scores[:, None, :]  # [B, n, 1], [B, 1, n]
    newer = idx[:, None] > idx[None, :]  # [n, n]: i newer than j
    beats = kept[:, :, None] & ((s_i > s_j) | ((s_i == s_j) & newer))  # [B, n(i), n(j)]
    counts = beats.int().cumsum(1)  # [B, n, n]: among the first i + 1
    return torch.cat((counts.new_zeros(b, 1, n), counts), dim=1)  # [B, n + 1, n]


def visible_chunks(counts: torch.Tensor, kept: torch.Tensor, formed: torch.Tensor, max_chunks: int) -> torch.Tensor:
    """Hard visibility (what streaming holds) at a set of forwards.

    counts: ``beaten_counts`` [B, n + 1, n]; kept: [B, n]; formed: [S] long, chunks formed before each
    forward. Returns [B, S, n] bool (chunks at or past ``formed[s]`` are not visible).
    """
    n = kept.shape[1]
    c = counts[:, formed]  # [B, S, n]
    before = torch.arange(n, device=kept.device)[None, :] < formed[:, None]  # [S, n]
    return kept[:, None, :] & before[None] & (c < max_chunks)


def log_membership(
    scores: torch.Tensor, kept: torch.Tensor, formed: torch.Tensor, max_chunks: int, *, temperature: float
) -> torch.Tensor:
    """``log m`` of the relaxed top-M (see the module docstring) at a set of forwards.

    scores, kept: [B, n]; formed: [S] long, chunks formed before each forward. Returns [B, S, n]
    (0 where at most ``max_chunks`` kept chunks precede the forward; the threshold is detached).
    """
    b, n = scores.shape
    before = torch.arange(n, device=scores.device)[None, :] < formed[:, None]  # [S, n]
    eligible = kept[:, None, :] & before[None]  # [B, S, n]
    if n <= max_chunks:
        return scores.new_zeros(b, formed.shape[0], n)
    masked = scores.detach()[:, None, :].masked_fill(~eligible, float("-inf"))  # [B, S, n]
    top = masked.topk(max_chunks + 1, dim=-1).values  # [B, S, M + 1], descending
    over = eligible.sum(-1) > max_chunks  # [B, S]: the budget binds
    mid = 0.5 * (top[..., -1] + top[..., -2]) if max_chunks else top[..., 0] + 1.0  # M = 0: every chunk is out
    theta = torch.where(over, mid, torch.full_like(mid, float("-inf")))  # [B, S]
    return F.logsigmoid((scores[:, None, :] - theta[..., None]) / temperature)  # [B, S, n]


# ---- the rule streaming applies chunk by chunk (``ChunkedGatedCache``) ------------------------------------
NEVER = torch.iinfo(torch.int64).max  # the age of an empty slot


@dataclass(frozen=True)
class Admission:
    """One new chunk against the budget. ``write``: it takes ``slot`` (evicting the chunk there if the
    budget was full); ``budget_drop``: a chunk left because the budget was full (evicted or rejected)."""

    slot: torch.Tensor
    write: torch.Tensor
    budget_drop: torch.Tensor


def admit(
    valid: torch.Tensor, scores: torch.Tensor, ages: torch.Tensor, new_score: torch.Tensor, keep: torch.Tensor
) -> Admission:
    """Budget rule: a kept chunk takes a free slot; if none, the lowest-scoring chunk among the retained
    ones and the newcomer leaves (ties: the oldest, so an untrained gate is FIFO).

    valid, scores, ages: [..., M] (slot occupancy, score, chronological index); new_score, keep: [...].
    Returns an ``Admission`` with [...] tensors; no host sync.
    """
    if valid.shape[-1] == 0:  # no chunk slots: every kept chunk is dropped by the budget
        return Admission(slot=torch.zeros_like(keep, dtype=torch.long), write=torch.zeros_like(keep), budget_drop=keep)
    free = ~valid
    has_free = free.any(-1)
    free_slot = free.int().argmax(-1)
    masked = scores.masked_fill(~valid, float("inf"))
    low = masked.min(-1).values
    lowest = valid & (masked == low.unsqueeze(-1))
    victim = ages.masked_fill(~lowest, NEVER).argmin(-1)
    write = keep & (has_free | (new_score >= low))
    return Admission(slot=torch.where(has_free, free_slot, victim), write=write, budget_drop=keep & ~has_free)


def apply_admission(
    adm: Admission, valid: torch.Tensor, scores: torch.Tensor, ages: torch.Tensor, new_score: torch.Tensor, new_age: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The slot tables after ``adm``: (valid, scores, ages), each [..., M]."""
    if valid.shape[-1] == 0:
        return valid, scores, ages
    hit = torch.nn.functional.one_hot(adm.slot, valid.shape[-1]).bool() & adm.write.unsqueeze(-1)
    return (
        valid | hit,
        torch.where(hit, new_score.unsqueeze(-1).to(scores.dtype), scores),
        ages.masked_fill(hit, new_age),
    )
