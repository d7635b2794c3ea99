"""Static shapes for the caches CUDA graphs replay (``FullCache`` and ``ChunkedGatedCache`` with ``static_shapes``).

How many keys a static forward attends over: ``static_extent``, the held keys rounded up to a power of two (at
least ``STATIC_MIN_KEYS``, at most the buffer), so the shapes change a handful of times per episode (a CUDA graph
recorded each time, no recompilation: the sizes are symbolic) and the attention reads at most twice the keys it
needs. A single-mode step, whose cache restarts every step, always has the same extent. Attending over the whole
buffer instead would read its every slot: for LLaMA-2-7B's 4096 positions at 290 held tokens, 2 GiB of K/V per
decode token beside 12 GiB of weights.

The chunked cache's torch path:

The ``RotatedView`` holds each layer's keys rotated at their compacted positions, in attention order, so a key's
index in the view is its position. A dynamic forward attends over the first ``n_keys`` of them, a count that
changes with every token and differs per layer (each layer keeps its own chunks): a compiled forward then bakes
the counts into its shapes, and CUDA graphs record one graph per count. A static forward attends over the
view's first ``static_extent`` slots behind a mask instead, built inside the graph from a per-layer limit: the
same shapes at every length and layout within an extent. Everything the plan computes is a device op on scalars the
host already knows (no host synchronisation), done eagerly before the compiled layer pass.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .attention import grouped
from .rope import apply_rope
from .store import RotatedView, SlotStore, layer_buffers

STATIC_MIN_KEYS = 256  # the smallest extent: short contexts share one shape


def static_extent(n_keys: int, slots: int) -> int:
    """Keys a static forward attends over when ``n_keys`` are visible: the next power of two (``>= n_keys``, at
    least ``STATIC_MIN_KEYS``), capped at the buffer's ``slots``."""
    if not 0 < n_keys <= slots:
        raise ValueError(f"a static forward sees 1..{slots} keys, got {n_keys}")
    return min(slots, max(STATIC_MIN_KEYS, 1 << (n_keys - 1).bit_length()))


@dataclass
class StaticPlan:
    """One forward of T new tokens over a view of S slots, every layer's part stacked.

    Args:
        write: [L, T] long, the new tokens' view slots (= their compacted positions) per layer.
        limit: [L, T] long, the last view slot query i of layer l sees (causal: its own; a bidirectional block:
            the block's last).
        cos, sin: [L, T, D] float32, the new tokens' rotation per layer.
        key_bias: [L, E] score added to each view slot (``chunk_mass``: the chunk keys), or ``None``.
        key_index: [E] long, ``0 .. E-1``: the first E view slots are attended over (``static_extent``; its length
            is the graph's only size that varies, a few times per episode).
    """

    write: torch.Tensor
    limit: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    key_bias: torch.Tensor | None
    key_index: torch.Tensor


def static_plan(
    store: SlotStore, slot_index: torch.Tensor, chunk_counts: torch.Tensor, t: int, n_keys: int, *, causal: bool,
    chunk_bias: float = 0.0,
) -> StaticPlan:
    """The plan of a forward of ``t`` new tokens; ``slot_index``: [S] long, ``0 .. S-1`` (built once by the cache;
    the plan slices it); ``chunk_counts``: [L] long (device), retained chunks per layer; ``n_keys``: the most keys a
    layer sees (host-side: it sets the extent).

    Layer l holds ``n_pinned + chunk_counts[l] + n_raw`` keys before the forward (pinned | chunks | raw, in view
    order); the new tokens follow. ``chunk_bias``: added to every chunk key's score (0: none)."""
    cos_table, sin_table = store.rope.get(store.slots)  # [S, D]: position p's rotation
    held = chunk_counts + (store.n_pinned + store.n_raw)  # [L]
    write = held[:, None] + torch.arange(t, device=store.device)  # [L, T]
    limit = write if causal else (held + (t - 1))[:, None].expand(-1, t)
    key_index = slot_index[: static_extent(n_keys, store.slots)]
    key_bias = None
    if chunk_bias:
        first = store.n_pinned
        is_chunk = (key_index >= first) & (key_index < first + chunk_counts[:, None])  # [L, S]
        key_bias = is_chunk.to(store.k.dtype) * chunk_bias
    return StaticPlan(write, limit, cos_table[write], sin_table[write], key_bias, key_index)


def check_static_rope(store: SlotStore) -> None:
    """Static shapes rotate every forward at one table of positions: NTK (``dynamic``) scaling, which rescales
    with the sequence length, has none."""
    if store.rope.cfg.rope_type == "dynamic":
        raise ValueError("static shapes need a fixed RoPE table; rope_type 'dynamic' rescales with the length "
                         "(use static_shapes=False)")  # fmt: skip


def attend_static(
    view: RotatedView, plan: StaticPlan, layer: int, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor
) -> torch.Tensor:
    """Attention of the new queries over the view of ``layer`` (its first E slots) behind the plan's mask.

    q: [B, Hq, T, D] pre-RoPE; k_new, v_new: [B, Hkv, T, D] the new tokens (k pre-RoPE). The view must be current
    for the held keys (``RotatedView.sync_layers``, eagerly before the forward). Returns [B, Hq, T, D]."""
    cos, sin = plan.cos[layer], plan.sin[layer]  # [T, D]
    q, k_rot = apply_rope(q, cos, sin), apply_rope(k_new, cos, sin)
    vk, vv = layer_buffers(view, layer)  # [B, Hkv, S, D]
    vk.index_copy_(2, plan.write[layer], k_rot)
    vv.index_copy_(2, plan.write[layer], v_new)
    extent = plan.key_index.shape[0]
    hidden = plan.key_index[None, :] > plan.limit[layer][:, None]  # [T, E]
    scores = torch.zeros((), dtype=q.dtype, device=q.device) if plan.key_bias is None else plan.key_bias[layer].to(q.dtype)
    mask = scores.expand(hidden.shape).masked_fill(hidden, float("-inf"))  # [T, E] additive
    k, v = vk[:, :, :extent], vv[:, :, :extent]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=grouped(q, k))
