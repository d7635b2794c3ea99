"""FullCache: stock behaviour, the reference every other cache is tested against.

Keys are rotated on write at their absolute positions 0, 1, 2, ... (positions never shift, so
rotated copies are stored). Buffers are preallocated; new tokens are written by slice.

``static_shapes=True``: every forward attends over the first ``static_extent`` slots (the held tokens rounded up
to a power of two) behind a visibility mask the plan builds (gpt-fast's ``input_pos``), so a forward of T tokens
has the same shapes at every length within an extent: a few CUDA graphs per T in an episode
(``CompileMode.REDUCE_OVERHEAD`` sessions use it) instead of one per length it reaches.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .attention import block_attention, causal_attention, grouped
from .base import CacheParams, KVStats, RowPlan
from .geometry import CacheGeometry
from .rope import apply_rope
from .slot_cache import SlotCache, check_growth
from .static_view import static_extent
from .store import SlotStore


@dataclass(frozen=True)
class FullParams(CacheParams):
    """Hyper-parameters of ``FullCache``: only ``capacity`` (tokens; ``None`` = the model's ``max_position``)."""


class CacheFullError(ValueError):
    """A forward would take a ``FullCache`` past its capacity: the episode cannot go on in it."""


class FullCache(SlotCache):
    """Every token kept, absolute positions. Buffers ``store.k, store.v: [L, B, Hkv, S, D]`` (k rotated; S = capacity,
    or fewer while a growing store has not needed them).
    ``static_shapes``: attend over a power-of-two extent behind a mask (see the module doc)."""

    params_class = FullParams

    def __init__(
        self,
        geometry: CacheGeometry,
        params: FullParams | None = None,
        *,
        batch: int = 1,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        static_shapes: bool = False,
        grow: bool = False,
    ) -> None:
        """``grow``: the store is allocated as the episode needs it (``SlotStore``; dynamic shapes only)."""
        super().__init__(geometry, params)
        check_growth(grow, static_shapes)
        self.static_shapes = static_shapes
        self.capacity = self.params.capacity
        self.store = SlotStore(
            geometry, slots=self.capacity, chunk_slots=0, batch=batch, device=device, dtype=dtype, rotate_on_read=False,
            grow=grow,
        )
        # static shapes: every slot's index [1, capacity], once (the plan compares the new tokens' positions with it)
        self._slot_index = torch.arange(self.capacity, device=device)[None, :] if static_shapes else None
        self.reset()

    def reset(self) -> None:
        super().reset()
        self._pending = 0
        self._cos = self._sin = None
        self._row_plan: RowPlan | None = None  # this forward's (``row_plan``)
        self._key_bias: torch.Tensor | None = None  # [L, n]: added to every score of the first n keys
        self._ahead: tuple[int, torch.Tensor, torch.Tensor] | None = None  # ``tokens_ahead``: first position, cos, sin

    def check_room(self, t: int) -> None:
        """``CacheFullError`` when ``t`` more tokens would not fit; nothing changes."""
        if self.length + t > self.capacity:
            raise CacheFullError(
                f"FullCache is full: {self.length} tokens held + {t} new > capacity {self.capacity}; "
                "raise KVConfig.capacity or use mode='chunked'"
            )

    def _begin_forward(self, t: int, device: torch.device) -> None:
        """First layer of a forward of ``t`` tokens: positions once for all layers."""
        start = self.length
        self.check_room(t)
        self.store.room_for(t)
        self._new_slots = torch.arange(start, start + t, device=device)  # [T]: the new tokens' slots and positions
        if self._ahead is None:
            self._cos, self._sin = self.store.rope.span(start, start + t)  # [T, D] each: the new tokens' positions
        else:  # rows settled by ``tokens_ahead``: a traced loop of forwards reads no table that may grow
            first, cos, sin = self._ahead
            self._cos, self._sin = cos[start - first : start - first + t], sin[start - first : start - first + t]
        self._pending = t
        self._row_plan = None  # made by ``row_plan`` if a RowsCache asks
        if self.static_shapes:  # [T, extent] additive: 0 where query i sees slot j, -inf elsewhere
            slots = self._slot_index[:, : static_extent(start + t, self.capacity)]
            last = start + t - 1 if self.bidirectional else self._new_slots[:, None]
            mask = torch.zeros(t, slots.shape[1], dtype=self.store.k.dtype, device=device)
            self._static_mask = mask.masked_fill(slots > last, float("-inf"))

    def plan_forward(self, t: int) -> None:
        if self._cos is None:
            self._begin_forward(t, self.store.device)

    # ---- a loop of one-token forwards traced as one graph (``policies.compiled.CompiledTokenLoop``) ---------
    @property
    def traces_token_loop(self) -> bool:
        """Dynamic shapes, no bidirectional block, no key bias: ``_begin_forward`` and ``end_forward`` are plain
        tensor ops and int arithmetic, so a loop of forwards, plans and commits included, traces without a break."""
        return not self.static_shapes and not self.bidirectional and self._key_bias is None

    @contextmanager
    def tokens_ahead(self, n: int) -> Iterator[None]:
        """Within: up to ``n`` one-token forwards (a traced loop's) take their RoPE rows from a span computed now,
        eagerly, and the room for them was checked now (``ValueError`` when the cache is full, the message an
        eager forward gives). The table itself grows by replacement (``RopeTable``), and a compiled graph that read
        it would need a new graph when it does."""
        self.check_room(n)
        self._ahead = (self.length, *self.store.rope.span(self.length, self.length + n))
        try:
            yield
        finally:
            self._ahead = None

    def attend(self, layer: int, q: torch.Tensor, k_raw: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [B, Hq, T, D]; k_raw, v: [B, Hkv, T, D] (k pre-RoPE) -> [B, Hq, T, D]."""
        if self._cos is None:
            self._begin_forward(q.shape[2], q.device)
        k, v_all = self.store.layer(layer)  # [B, Hkv, S, D]
        # the per-layer buffers (``store.layer_buffers``), written through an index: in place when compiled
        k.index_copy_(2, self._new_slots, apply_rope(k_raw, self._cos, self._sin))
        v_all.index_copy_(2, self._new_slots, v)
        q = apply_rope(q, self._cos, self._sin)
        if self.static_shapes:  # no held-token count in the graph: the mask's values change, its extent rarely
            extent = self._static_mask.shape[1]
            bias = self._bias_of(layer, extent)
            mask = self._static_mask if bias is None else self._static_mask + bias.to(q.dtype)[None, :]
            k, v_all = k[:, :, :extent], v_all[:, :, :extent]
            return F.scaled_dot_product_attention(q, k, v_all, attn_mask=mask, enable_gqa=grouped(q, k))
        start = self.length
        end = start + q.shape[2]
        bias = self._bias_of(layer, end)
        if self.bidirectional:
            return block_attention(q, k[:, :, :end], v_all[:, :, :end], key_bias=bias)
        return causal_attention(q, k[:, :, :end], v_all[:, :, :end], past=start, key_bias=bias)

    # ---- RowSeam: a forward over several sessions' caches rotates once for all rows (``RowsCache``) -----
    row_batching = True

    def row_plan(self, layer: int, t: int) -> RowPlan:
        """Absolute positions: the held tokens are ``0 .. length-1``, the new ones follow. One object for every
        layer of a forward."""
        if self._cos is None:
            self._begin_forward(t, self.store.device)
        if self._row_plan is None:  # this forward's (``_begin_forward`` forgets the last one's)
            self._row_plan = RowPlan(n_keys=self.length + t, cos=self._cos, sin=self._sin, causal=not self.bidirectional)
        return self._row_plan

    def row_attend(self, layer: int, q_rot: torch.Tensor, k_rot: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Rotated keys are what this cache stores: they go to the store at once."""
        start = self.length
        end = start + q_rot.shape[2]
        k_all, v_all = self.store.k[layer], self.store.v[layer]  # [1, Hkv, S, D]
        k_all[:, :, start:end], v_all[:, :, start:end] = k_rot, v
        bias = self._bias_of(layer, end)
        if self.bidirectional:
            return block_attention(q_rot, k_all[:, :, :end], v_all[:, :, :end], key_bias=bias)
        return causal_attention(q_rot, k_all[:, :, :end], v_all[:, :, :end], past=start, key_bias=bias)

    def row_commit(self, k_raw: torch.Tensor, v: torch.Tensor) -> None:
        """Nothing left to store (``row_attend`` stored the rotated keys)."""

    def end_forward(self, *, pin: bool = False) -> None:
        """Commit the forward's tokens (``pin`` changes nothing: every token is kept anyway)."""
        self._commit(self._pending, self.length + self._pending)
        self._pending = 0
        self._cos = self._sin = None

    # ---- filling from outside (a prefill that computes attention itself, e.g. KEEP) ------------------
    def buffers(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Writable views of the first ``n`` token slots: k (rotated at positions 0..n-1), v: [L, B, Hkv, n, D].

        For code that computes a prompt's K/V itself: write them here, then ``hold(n)``.
        """
        if n > self.capacity:
            raise ValueError(f"FullCache holds {self.capacity} tokens, asked for {n}")
        self.store.room_for(max(0, n - self.length))
        return self.store.k[:, :, :, :n], self.store.v[:, :, :, :n]

    def hold(self, n: int) -> None:
        """The first ``n`` slots (written through ``buffers``) are the tokens held from now on."""
        if not 0 <= n <= self.capacity:
            raise ValueError(f"FullCache holds 0..{self.capacity} tokens, asked to hold {n}")
        self.store.length = n
        self._positions_used = max(self._positions_used, n)

    @property
    def key_bias(self) -> torch.Tensor | None:
        """[L, n] scores added to the first ``n`` keys at each layer (``bias_keys``), or None."""
        return self._key_bias

    def bias_keys(self, bias: torch.Tensor | None) -> None:
        """Add ``bias: [L, n]`` to every later query's score of the first ``n`` held keys, per layer (None: no
        bias; ``reset`` clears it). What a prefill that mixes stored and computed KV leaves for decoding
        (``PrefillConfig.stored_bias``)."""
        if bias is not None and (bias.dim() != 2 or bias.shape[0] != self.geometry.n_layers or bias.shape[1] > self.length):
            raise ValueError(
                f"key bias must be [{self.geometry.n_layers} layers, n <= {self.length} held tokens], got {tuple(bias.shape)}"
            )
        self._key_bias = bias

    def _bias_of(self, layer: int, n_keys: int) -> torch.Tensor | None:
        """Layer ``layer``'s key bias over ``n_keys`` keys ([n_keys], zeros past the biased ones), or None."""
        if self._key_bias is None:
            return None
        return torch.nn.functional.pad(self._key_bias[layer], (0, n_keys - self._key_bias.shape[1]))

    # ---- stats -------------------------------------------------------------------------------------
    def held_slots(self) -> int:
        return self.length * self.geometry.n_layers

    def stats(self) -> KVStats:
        n = self.length
        return KVStats(tokens_raw=n, bytes=self.held_bytes(), positions_used=n, tokens_seen=n)
