"""Attention over a query's keys in pieces, merged by log-sum-exp (the parallel forms' building blocks).

A query of the chunked cache's parallel (training) form sees keys of different kinds: the cache's *fixed* keys
(the pinned prompt and the chunk representatives, at positions that depend on the cache state the query runs
in), the *raw* tokens from the raw head up to the query, and, in a query block, its own block. Each kind is
cheapest to gather in its own grouping, so each is attended on its own (``partial_attention``: the output and
the log-sum-exp of the scores per query) and ``merge_partials`` combines the pieces into the softmax over all
of them, which is exact: ``softmax`` over the union of the pieces' keys.

Raw keys sit at the query's token distance whatever the state (the state's offset moves both), so a query
sees a contiguous run of them at plain token positions: ``BandPlan`` cuts the queries into tiles of
consecutive ones and gathers, per tile, the keys from its lowest first key to its highest last one once
(``band_attention``), instead of once per cache state as a dense per-state gather would.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from .rope import RopeConfig, apply_rope, rope_cos_sin

BAND_TILE = 64  # queries per tile of ``band_attention``


def take(x: torch.Tensor, idx: torch.Tensor, dim: int = 2) -> torch.Tensor:
    """``x`` indexed along ``dim`` by ``idx`` of any shape (``x[:, :, idx]`` for ``dim=2``), through ``index_select``,
    whose backward adds rows with ``index_add_``: advanced indexing's backward (``index_put_`` accumulating) was the
    largest op of a training step when many indices repeat, as overlapping tiles' keys do."""
    out = x.index_select(dim, idx.reshape(-1))
    return out.view(*x.shape[:dim], *idx.shape, *x.shape[dim + 1 :])


def partial_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, *, bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention over one piece of the keys, with its log-sum-exp (plain torch: every device, any bias).

    q: [B, Hq, T, D] rotated; k, v: [B, Hkv, K, D] (k rotated; Hq a multiple of Hkv, query head h reads key head
    ``h // (Hq // Hkv)``); mask: [B, 1, T, K] or [B, 1, 1, K] bool (True = visible); bias: broadcastable to
    [B, 1, T, K], added to the scores, or ``None``. Returns out [B, Hq, T, D] (float32) and lse [B, Hq, T]
    (float32, ``-inf`` for a query that sees no key of this piece; its output then carries no weight in
    ``merge_partials``).
    """
    b, hq, t, d = q.shape
    hkv, n_keys = k.shape[1], k.shape[2]
    if n_keys == 0:
        return q.new_zeros(b, hq, t, d, dtype=torch.float32), q.new_full((b, hq, t), float("-inf"), dtype=torch.float32)
    rep = hq // hkv
    scaled = q.float().reshape(b, hkv, rep * t, d) * d**-0.5  # [B, Hkv, rep * T, D]
    scores = torch.matmul(scaled, k.float().transpose(-1, -2)).view(b, hkv, rep, t, n_keys)  # [B, Hkv, rep, T, K]
    if bias is not None:
        scores = scores + bias.float()[:, :, None]
    seen = mask[:, :, None]  # [B, 1, 1, T or 1, K]
    anything = seen.any(-1, keepdim=True)  # [B, 1, 1, T or 1, 1]
    scores = scores.masked_fill(~seen, float("-inf"))
    if not bool(anything.all()):
        scores = scores.masked_fill(~anything, 0.0)  # an empty row stays finite
    lse = torch.logsumexp(scores, dim=-1)  # [B, Hkv, rep, T]
    probs = torch.softmax(scores, dim=-1)
    out = torch.matmul(probs.view(b, hkv, rep * t, n_keys), v.float()).view(b, hq, t, d)
    lse = lse.masked_fill(~anything[..., 0], float("-inf")).reshape(b, hq, t)
    return out, lse


class FlashPiece(torch.autograd.Function):
    """``partial_attention`` through the fused CPU attention kernel (``_scaled_dot_product_flash_attention_for_cpu``,
    which returns the log-sum-exp but does not differentiate it), with the log-sum-exp differentiable.

    The kernel's backward takes ``D = rowsum(grad_out * out)`` from the ``out`` it is given; the gradient through
    lse adds ``grad_lse`` to each score row's softmax weights, which is the same as handing it an ``out'`` with
    ``rowsum(grad_out * out') = D - grad_lse``. In ``merge_partials`` ``grad_lse`` is ``grad_out . (out - merged)``,
    so a row whose ``grad_out`` is zero has ``grad_lse`` zero too; another use must keep that.

    q, k, v: [N, H, T, D], [N, H, K, D] (equal head counts), mask: [N or 1, 1, T, K] additive (0 / -inf), every
    row seeing at least one key (the kernel returns lse 0 for an empty row). Returns out [N, H, T, D], lse [N, H, T].
    """

    @staticmethod
    def forward(ctx, q, k, v, mask):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, attn_mask=mask)
        ctx.save_for_backward(q, k, v, mask, out, lse)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        q, k, v, mask, out, lse = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        if grad_lse is not None:
            norm = (grad_out * grad_out).sum(-1, keepdim=True)  # [N, H, T, 1]
            if bool(((norm == 0) & (grad_lse[..., None] != 0)).any()):
                raise RuntimeError("FlashPiece: a gradient on lse where the output has none")
            shift = grad_lse[..., None] * grad_out / torch.where(norm > 0, norm, torch.ones_like(norm))
            out = out - shift  # rowsum(grad_out * out) drops by grad_lse
        grad_q, grad_k, grad_v = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out, q, k, v, out, lse, 0.0, False, attn_mask=mask
        )  # fmt: skip
        return grad_q, grad_k, grad_v, None


def merge_partials(parts: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """The softmax attention over the union of the pieces' keys.

    parts: (out [B, H, T, D], lse [B, H, T]) of ``partial_attention`` over disjoint key sets of the same queries.
    Every query must see at least one key in some piece. Returns [B, H, T, D] float32.
    """
    lse = torch.stack([p[1] for p in parts])  # [P, B, H, T]
    weights = torch.exp(lse - torch.logsumexp(lse, dim=0))  # [P, B, H, T]; 0 for a piece the query does not see
    return sum(w[..., None] * out for w, (out, _) in zip(weights, parts))


@dataclass(frozen=True)
class BandPlan:
    """Index tables of ``band_attention`` (built once per schedule, shared by every layer).

    Query ``i`` at position ``pos[i]`` sees keys ``lo[i] <= t < hi[i]``, key ``t`` at position ``t``.

    Args:
        n_queries: N.
        q_idx: [nt, T] long, query of each tile slot (padding repeats the last query).
        q_pos: [nt, T] float32, its position relative to the tile's first key.
        k_idx: [nt, W] long, key of each tile key slot (``base + j``, clamped into the keys).
        mask: [nt, T, W] bool, what each slot's query sees.
        nonempty: every query sees at least one key (the fused kernel's condition).
    """

    n_queries: int
    q_idx: torch.Tensor
    q_pos: torch.Tensor
    k_idx: torch.Tensor
    mask: torch.Tensor
    nonempty: bool

    @classmethod
    def build(
        cls, pos: Sequence[float], lo: Sequence[int], hi: Sequence[int], n_keys: int, device: torch.device, *, tile: int = BAND_TILE
    ) -> "BandPlan":
        """pos, lo, hi: per query (module doc); n_keys: the keys' count M. Tiles of ``tile`` consecutive queries,
        so queries whose runs move forward together (tokens in order) pad little."""
        n = len(pos)
        if not n:
            raise ValueError("a band of no queries")
        if min(hi[i] - lo[i] for i in range(n)) < 0 or min(lo) < 0 or max(hi) > n_keys:
            raise ValueError(f"key runs must lie within the {n_keys} keys")
        n_tiles = -(-n // tile)
        slots = [[min(i * tile + j, n - 1) for j in range(tile)] for i in range(n_tiles)]
        bases = [min(lo[q] for q in row) for row in slots]
        width = max(max(max(hi[q] for q in row) - base, 1) for row, base in zip(slots, bases))
        q_idx = torch.tensor(slots, dtype=torch.long)  # [nt, T]
        base = torch.tensor(bases, dtype=torch.long)[:, None]  # [nt, 1]
        keys = base + torch.arange(width)  # [nt, W]
        lo_t, hi_t = torch.tensor(lo)[q_idx], torch.tensor(hi)[q_idx]  # [nt, T]
        mask = (keys[:, None, :] >= lo_t[..., None]) & (keys[:, None, :] < hi_t[..., None])  # [nt, T, W]
        q_pos = torch.tensor(pos, dtype=torch.float64)[q_idx] - base  # [nt, T]
        return cls(
            n_queries=n,
            q_idx=q_idx.to(device),
            q_pos=q_pos.float().to(device),
            k_idx=keys.clamp(max=max(n_keys - 1, 0)).to(device),
            mask=mask.to(device),
            nonempty=all(h > l_ for h, l_ in zip(hi, lo)),
        )


def band_attention(
    plan: BandPlan, rope: RopeConfig, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``partial_attention`` of queries that each see a contiguous run of keys (``BandPlan``).

    q: [B, Hq, N, D]; k, v: [B, Hkv, M, D] (q and k before RoPE). Each tile rotates its keys at ``0 .. W-1`` and
    its queries at their positions relative to its first key, so positions stay as small as the runs are long.
    On a CPU the tiles run through the fused kernel (``FlashPiece``). Returns out [B, Hq, N, D], lse [B, Hq, N]
    (float32).
    """
    b, hq, _, d = q.shape
    hkv = k.shape[1]
    rep = hq // hkv
    nt, tile = plan.q_idx.shape
    width = plan.k_idx.shape[1]
    k_cos, k_sin = rope_cos_sin(torch.arange(width, device=k.device), rope)  # [W, D]
    q_cos, q_sin = rope_cos_sin(plan.q_pos, rope)  # [nt, T, D]
    queries = apply_rope(take(q, plan.q_idx), q_cos, q_sin)  # [B, Hq, nt, T, D]
    keys = apply_rope(take(k, plan.k_idx), k_cos, k_sin)  # [B, Hkv, nt, W, D]
    values = take(v, plan.k_idx)  # [B, Hkv, nt, W, D]
    if q.device.type == "cpu" and plan.nonempty:
        # tiles as the batch, (B, Hkv) as heads and the rep query heads of a key head as more queries: one
        # [nt, 1, rep * T, W] mask serves every row and head
        def tiles(x: torch.Tensor) -> torch.Tensor:  # [B, Hkv, (rep,) nt, L, D] -> [nt, B * Hkv, (rep *) L, D]
            x = x.view(b, hkv, -1, nt, x.shape[-2], d).permute(3, 0, 1, 2, 4, 5)
            return x.reshape(nt, b * hkv, -1, d)

        mask = torch.zeros(plan.mask.shape, dtype=queries.dtype, device=q.device).masked_fill(~plan.mask, float("-inf"))
        mask = mask.repeat(1, rep, 1)[:, None]  # [nt, 1, rep * T, W]
        out, lse = FlashPiece.apply(tiles(queries), tiles(keys), tiles(values), mask)
        out = out.reshape(nt, b, hq, tile, d).permute(1, 2, 0, 3, 4).reshape(b, hq, nt * tile, d)
        lse = lse.reshape(nt, b, hq, tile).permute(1, 2, 0, 3).reshape(b, hq, nt * tile)
        return out[:, :, : plan.n_queries].float(), lse[:, :, : plan.n_queries].float()

    def flat(x: torch.Tensor) -> torch.Tensor:  # [B, H, nt, T, D] -> [B * nt, H, T, D]
        return x.transpose(1, 2).reshape(b * nt, x.shape[1], x.shape[3], d)

    mask = plan.mask[None, :, None].expand(b, -1, -1, -1, -1).reshape(b * nt, 1, tile, width)  # [B * nt, 1, T, W]
    out, lse = partial_attention(flat(queries), flat(keys), flat(values), mask)
    out = out.view(b, nt, hq, tile, d).transpose(1, 2).reshape(b, hq, nt * tile, d)[:, :, : plan.n_queries]
    lse = lse.view(b, nt, hq, tile).transpose(1, 2).reshape(b, hq, nt * tile)[:, :, : plan.n_queries]
    return out, lse
