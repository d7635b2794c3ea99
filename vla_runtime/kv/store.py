"""Slot store shared by every cache (``SlotCache`` holds one): K/V buffers plus the token bookkeeping.

One key store and one value store per layer, ``k, v: [L, B, Hkv, S, D]`` (keys pre-RoPE in the
decoupled-position caches; ``FullCache``, whose positions never shift, stores them rotated), allocated whole, or
(``grow=True``: eager sessions) as the episode needs, each area grown by copying into larger buffers (``room_for``):

    slots [0, n_pinned)          pinned prefix: token t at slot t; never moves, never compressed
    slots [n_pinned, raw_end)    raw ring: token t >= n_pinned at n_pinned + (t - n_pinned) % ring_cap
    slots [raw_end, S)           chunk slots (only ``ChunkedGatedCache``; occupancy differs per layer)

Tokens are counted from the episode start: ``[0, n_pinned)`` pinned, ``[raw_head, length)`` raw,
everything in ``[n_pinned, raw_head)`` compressed or dropped. New tokens are written by slice (or
``index_copy_`` when the ring wraps). Attention reads the slots of one layer in attention order
(pinned | chunks | raw) whose compacted positions are simply ``0 .. N-1``; see ``attend_slots``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .attention import block_attention, causal_attention
from .backend import CacheBackend
from .base import RowPlan
from .geometry import CacheGeometry
from .rope import RopeTable, apply_rope


INITIAL_RAW_SLOTS = 256  # a growable store's first raw area (pinned prompt + raw ring)
INITIAL_CHUNK_SLOTS = 17  # and its first chunk area: 16 chunks and the scratch slot
GROWTH, GROWTH_STEP = 1.25, 64  # an area that is short grows by at least this factor, in multiples of this many slots


def grown(have: int, need: int) -> int:
    """The size an area of ``have`` slots grows to when ``need`` are asked for (see ``SlotStore.room_for``)."""
    want = max(need, math.ceil(have * GROWTH))
    return -(-want // GROWTH_STEP) * GROWTH_STEP


@dataclass
class ForwardPlan:
    """What one forward writes and reads; built once (first layer), shared by every layer.

    Args:
        new: number of new tokens T.
        write: [T] long, slots of the new tokens (an index even where they are contiguous: one code path whether
            or not the ring wraps, so a compiled forward has one graph for both).
        raw: [n_raw + T] long, raw slots in token order (held raw tokens, then the new ones).
    """

    new: int
    write: torch.Tensor
    raw: torch.Tensor


class SlotStore:
    """K/V buffers plus the token bookkeeping of pinned prefix and raw ring (see module doc)."""

    def __init__(
        self,
        geometry: CacheGeometry,
        *,
        slots: int,
        chunk_slots: int,
        batch: int,
        device: torch.device | str,
        dtype: torch.dtype,
        rotate_on_read: bool = True,
        grow: bool = False,
    ) -> None:
        """``rotate_on_read``: keys are stored pre-RoPE and rotated at compacted positions when read; ``False``: the
        owner stores keys rotated at their absolute positions (``FullCache``). Either way ``rope`` has the cos/sin
        rows. ``grow``: allocate ``INITIAL_RAW_SLOTS`` raw and ``INITIAL_CHUNK_SLOTS`` chunk slots and grow each area
        when a forward or a compression needs more (``room_for``), up to ``slots`` and ``chunk_slots``; otherwise every
        slot at once (what a compiled forward, whose graphs take the buffers as inputs, needs)."""
        self.max_slots, self.max_chunk_slots = slots, chunk_slots
        self.rotate_on_read = rotate_on_read
        self.shape = (geometry.n_layers, batch, geometry.n_kv_heads, geometry.head_dim)  # [L, B, Hkv, D]: all but S
        self.device = torch.device(device)
        self.dtype = dtype
        if grow:
            chunks = min(chunk_slots, INITIAL_CHUNK_SLOTS)
            self._allocate(min(slots - chunk_slots, INITIAL_RAW_SLOTS) + chunks, chunks)
        else:
            self._allocate(slots, chunk_slots)
        self.rope = RopeTable(geometry.rope, slots, device, grow=not rotate_on_read)
        self.reset()

    def _allocate(self, slots: int, chunk_slots: int) -> None:
        """New K/V buffers of ``slots`` slots (``k, v``; ``k_layers, v_layers``), the last ``chunk_slots`` of them for
        chunks."""
        self.slots, self.chunk_slots = slots, chunk_slots
        self.raw_end = slots - chunk_slots
        n, b, h, d = self.shape
        alloc = torch.empty if self.rotate_on_read else torch.zeros  # decoupled caches write every slot they read
        self.k = alloc((n, b, h, slots, d), device=self.device, dtype=self.dtype)
        self.v = alloc((n, b, h, slots, d), device=self.device, dtype=self.dtype)
        # [B, Hkv, S, D] views, one per layer: a forward writes its new tokens into these. Each is a tensor of its
        # own to torch.compile, which then updates it in place (writing into ``k[layer]``, a view it makes of the
        # whole buffer, makes inductor copy the whole buffer back every forward)
        self.k_layers, self.v_layers = self.k.unbind(0), self.v.unbind(0)
        static_addresses(self.k, self.v, *self.k_layers, *self.v_layers)

    def room_for(self, new: int, *, chunks: int = 0) -> bool:
        """A growable store makes room for ``new`` more raw tokens and ``chunks`` chunk slots (besides the scratch
        slot a cache keeps last), up to ``max_slots`` in all. Each area that is short grows to what is asked, and at
        least by ``GROWTH`` (rounded up to ``GROWTH_STEP`` slots); every held token and chunk is copied over (the raw
        ring re-laid for its new size, the chunk slots in their order after it; attention order and positions
        unchanged). Call it before planning a forward or admitting chunks, then refresh what was derived from the
        old buffers or ``raw_end`` (a ``RotatedView`` does so itself). Returns whether the buffers changed."""
        need_raw = self.n_pinned + self.n_raw + new
        need_chunks = min(self.max_chunk_slots, chunks + 1) if chunks else 0
        if (need_raw <= self.raw_end and need_chunks <= self.chunk_slots) or self.slots == self.max_slots:
            return False
        raw = self.raw_end if need_raw <= self.raw_end else min(self.max_slots - self.max_chunk_slots, grown(self.raw_end, need_raw))
        chunk_slots = self.chunk_slots if need_chunks <= self.chunk_slots else min(self.max_chunk_slots, grown(self.chunk_slots, need_chunks))
        old_k, old_v, old_cap, old_raw_end, kept = self.k, self.v, self.ring_cap, self.raw_end, self.chunk_slots - 1
        self._allocate(raw + chunk_slots, chunk_slots)
        held_old = self._ring_slots(self.raw_head, self.length, old_cap)
        held_new = self._ring_slots(self.raw_head, self.length, self.ring_cap)
        for buf, old in ((self.k, old_k), (self.v, old_v)):
            buf[..., : self.n_pinned, :] = old[..., : self.n_pinned, :]
            buf.index_copy_(3, held_new, old.index_select(3, held_old))
            if kept > 0:  # the chunk slots, not the scratch slot after them
                buf[..., self.raw_end : self.raw_end + kept, :] = old[..., old_raw_end : old_raw_end + kept, :]
        return True

    def reserved_bytes(self) -> int:
        """Bytes of the K/V buffers as allocated now (every slot, held or not)."""
        return self.slot_bytes() * self.slots * self.k.shape[0]

    def reset(self) -> None:
        self.n_pinned = 0
        self.raw_head = 0
        self.length = 0
        self.last_change = 0  # token count when the held layout last changed (pin / compress / trim)
        self.layout_version = getattr(self, "layout_version", 0) + 1  # bumped whenever held positions shift

    # ---- bookkeeping -------------------------------------------------------------------------------
    @property
    def ring_cap(self) -> int:
        return self.raw_end - self.n_pinned

    @property
    def n_raw(self) -> int:
        return self.length - self.raw_head

    def token_slots(self, start: int, end: int) -> torch.Tensor:
        """Slots of raw tokens ``[start, end)`` (all >= n_pinned): [end - start] long."""
        return self._ring_slots(start, end, self.ring_cap)

    def _ring_slots(self, start: int, end: int, ring_cap: int) -> torch.Tensor:
        t = torch.arange(start, end, device=self.device)
        return self.n_pinned + (t - self.n_pinned) % ring_cap

    def check_room(self, new: int) -> None:
        """``ValueError`` if the raw ring cannot hold ``new`` more tokens, grown as far as it can grow."""
        ring_cap = self.max_slots - self.max_chunk_slots - self.n_pinned
        if self.n_raw + new > ring_cap:
            raise ValueError(
                f"the raw ring holds {ring_cap} tokens ({self.n_raw} held + {new} new do not fit): raise "
                "KVConfig.capacity, lower `window`/`max_chunks`, or split the forward (an open mark defers compression)"
            )

    def plan(self, new: int) -> ForwardPlan:
        """Reserve ring slots for ``new`` tokens; raise ``ValueError`` if the ring cannot hold them (the owner of a
        growable store calls ``room_for`` first)."""
        self.check_room(new)
        raw = self.token_slots(self.raw_head, self.length + new)
        return ForwardPlan(new=new, write=raw[raw.shape[0] - new :], raw=raw)

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer``'s key and value buffers [B, Hkv, S, D], to write into in place (``layer_buffers``)."""
        return layer_buffers(self, layer)

    def write(self, layer: int, plan: ForwardPlan, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store the new tokens of ``layer``; k, v: [B, Hkv, T, D] (k pre-RoPE)."""
        k_buf, v_buf = self.layer(layer)
        k_buf.index_copy_(2, plan.write, k)
        v_buf.index_copy_(2, plan.write, v)

    def write_layers(self, plan: ForwardPlan, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store the new tokens of every layer at once; k, v: [L, B, Hkv, T, D] (k pre-RoPE)."""
        self.k.index_copy_(3, plan.write, k)
        self.v.index_copy_(3, plan.write, v)

    def commit(self, new: int) -> None:
        self.length += new

    def pin(self, upto: int | None = None) -> None:
        """Pin tokens ``[0, upto)`` (default: every held token, the prompt); they stay at slots 0..upto-1.

        Only before anything was compressed or trimmed: raw tokens then sit at slot == token index.
        """
        upto = self.length if upto is None else upto
        if self.raw_head != self.n_pinned:
            raise ValueError(
                f"cannot pin: {self.raw_head - self.n_pinned} tokens were already compressed or trimmed; "
                "pin the prompt (end_forward(pin=True)) before the first compression"
            )
        assert self.n_pinned <= upto <= self.length
        self.n_pinned = self.raw_head = upto
        self.last_change = self.length
        self.layout_version += 1

    def contiguous_prefix(self, new: int) -> bool:
        """Whether pinned + raw tokens (with ``new`` more) are exactly slots ``0 .. n_pinned + n_raw + new - 1``."""
        return self.raw_head == self.n_pinned and self.n_raw + new <= self.ring_cap

    def drop_raw(self, n: int) -> None:
        """The ``n`` oldest raw tokens leave the raw ring (compressed or trimmed)."""
        self.raw_head += n
        self.last_change = self.length
        self.layout_version += 1

    def slot_bytes(self) -> int:
        """Bytes one slot takes in one layer, K and V together (read off the buffers)."""
        per_layer_slot = lambda t: t[0, :, :, 0].numel() * t.element_size()  # noqa: E731  [B, Hkv, D]
        return per_layer_slot(self.k) + per_layer_slot(self.v)

    def check_rollback(self, mark: int) -> None:
        if not self.last_change <= mark <= self.length:
            raise ValueError(
                f"cannot roll back to {mark}: the cache holds {self.length} tokens and its layout last changed at "
                f"{self.last_change} (pin/compression); take `mark()` before the forwards you will roll back "
                "(an open mark defers compression; `rollback` closes it)"
            )


class RotatedView:
    """Torch path: per layer, the held keys rotated at their compacted positions and the values, contiguous in
    attention order (``k, v: [L, B, Hkv, S, D]``, the first ``n[layer]`` valid).

    Positions only shift when the layout changes (pin, compression, trim), so the view is rebuilt from the
    pre-RoPE store (gather + rotate N keys) once per change and otherwise only gets the new tokens
    appended (rotate T keys): a decode step costs O(T) RoPE work instead of O(N). Rollbacks never cross
    a layout change, so they just shorten the view.
    """

    def __init__(self, store: SlotStore) -> None:
        self._allocate(store)
        self.n = [0] * store.k.shape[0]
        self.version = [-1] * store.k.shape[0]

    def _allocate(self, store: SlotStore) -> None:
        self.k = torch.empty_like(store.k)  # untouched until used
        self.v = torch.empty_like(store.v)
        self.k_layers, self.v_layers = self.k.unbind(0), self.v.unbind(0)  # see ``SlotStore.k_layers``
        static_addresses(self.k, self.v, *self.k_layers, *self.v_layers)

    def fit(self, store: SlotStore) -> None:
        """As many slots as the store, after it grew (``SlotStore.room_for``): the rotated keys and the values held
        are copied over as they are (attention order and positions do not change when a store grows)."""
        if self.k.shape[3] == store.slots:
            return
        old_k, old_v = self.k, self.v
        self._allocate(store)
        self.k[..., : old_k.shape[3], :] = old_k
        self.v[..., : old_v.shape[3], :] = old_v

    def sync(self, store: SlotStore, layer: int, slots: torch.Tensor | slice, n_keys: int, held: int) -> None:
        """Make the first ``held`` keys of ``layer`` current: rebuild them from the store (gather + rotate at the
        forward's table of ``n_keys`` positions) if the layout changed since or the view is shorter."""
        self.fit(store)
        if self.version[layer] == store.layout_version and self.n[layer] >= held:
            return
        cos, sin = store.rope.get(n_keys)  # the forward's table (``dynamic`` scaling depends on n_keys)
        idx = slots[:held] if isinstance(slots, torch.Tensor) else torch.arange(held, device=store.device)
        self.k[layer][:, :, :held] = apply_rope(store.k[layer].index_select(2, idx), cos[:held], sin[:held])
        self.v[layer][:, :, :held] = store.v[layer].index_select(2, idx)
        self.version[layer], self.n[layer] = store.layout_version, held

    def sync_layers(self, store: SlotStore, slots: list[torch.Tensor | slice], n_keys: list[int], t: int) -> None:
        """``sync`` every layer before a forward of ``t`` new tokens (layer ``i`` reads ``slots[i]``, ``n_keys[i]``
        keys): the rebuild after a layout change happens here, eagerly, and the forward's ``attend`` calls find
        every layer current (a compiled forward then has one graph whether or not the layout changed)."""
        for layer, (layer_slots, n) in enumerate(zip(slots, n_keys)):
            self.sync(store, layer, layer_slots, n, n - t)

    def commit(self, store: SlotStore, n_keys: list[int]) -> None:
        """After a forward in which every layer attended through the view (before the layout changes): layer ``i``
        holds ``n_keys[i]`` current keys. Kept out of ``attend`` so that a planned forward (``sync_layers``) stores no
        Python state that depends on the token counts (``torch.compile`` would specialise on them)."""
        self.version = [store.layout_version] * len(n_keys)
        self.n = list(n_keys)

    def attend(self, store: SlotStore, layer: int, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
               slots: torch.Tensor | slice, n_keys: int, *, causal: bool = True,
               key_bias: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        """See ``attend_slots``; ``k_new, v_new``: [B, Hkv, T, D] the new tokens (k pre-RoPE)."""
        held = n_keys - q.shape[2]
        cos, sin = store.rope.get(n_keys)
        q, k_rot = apply_rope(q, cos[held:], sin[held:]), apply_rope(k_new, cos[held:], sin[held:])
        return self.attend_rotated(store, layer, q, k_rot, v_new, slots, n_keys, causal=causal, key_bias=key_bias)

    def attend_rotated(self, store: SlotStore, layer: int, q: torch.Tensor, k_rot: torch.Tensor, v_new: torch.Tensor,
                       slots: torch.Tensor | slice, n_keys: int, *, causal: bool = True,
                       key_bias: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        """``attend`` with the new queries and keys already rotated at ``n_keys-T .. n_keys-1`` (``RowsCache``
        rotates every row's at once): q [B, Hq, T, D]; k_rot, v_new [B, Hkv, T, D]. Returns [B, Hq, T, D]. The view
        is ``sync``-ed, then gets the new tokens appended. ``key_bias``: [n_keys] added to every query's score of
        each key (``ChunkedGatedParams.chunk_mass``), or ``None``."""
        held = n_keys - q.shape[2]
        self.sync(store, layer, slots, n_keys, held)
        vk, vv = layer_buffers(self, layer)  # [B, Hkv, S, D]
        if torch.compiler.is_compiling():  # through an index: inductor updates the buffer in place (a slice write
            new = torch.arange(held, n_keys, device=vk.device)  # made it copy the layer's whole buffer back)
            vk.index_copy_(2, new, k_rot)
            vv.index_copy_(2, new, v_new)
        else:  # eager: two copies and no index tensor, an op fewer per layer and row (a GPU step is bound by its ops)
            vk[:, :, held:n_keys] = k_rot
            vv[:, :, held:n_keys] = v_new
        if not causal:
            return block_attention(q, vk[:, :, :n_keys], vv[:, :, :n_keys], key_bias=key_bias)
        return causal_attention(q, vk[:, :, :n_keys], vv[:, :, :n_keys], past=held, key_bias=key_bias)


def static_addresses(*buffers: torch.Tensor) -> None:
    """Tell ``torch.compile`` that ``buffers`` (a cache's K/V, allocated once and written in place by the
    forward) keep their address across calls, like a module's buffers. CUDA graphs (``reduce-overhead``) only
    replay a graph that mutates an input when the input is static: unmarked, inductor skips CUDA graphs for every
    layer ("skipping cudagraphs due to mutated inputs", seen on an H100). Eager code is unaffected. Only CUDA
    buffers are marked (CUDA graphs exist only there), so CPU users do not pay torch._dynamo's import (~1 s)."""
    for buffer in buffers:
        if buffer.is_cuda:
            torch._dynamo.mark_static_address(buffer)


def layer_buffers(buffers: "SlotStore | RotatedView", layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``buffers.k[layer]``, ``buffers.v[layer]`` ([B, Hkv, S, D]) to write into in place: with autograd off, the
    views made once at construction (``k_layers``: a tensor of its own per layer, which a compiled forward updates
    in place); with autograd on, views made now, since a view made with autograd off (a cache built under
    ``no_grad``) cannot take a write that autograd records."""
    if torch.is_grad_enabled():
        return buffers.k[layer], buffers.v[layer]
    return buffers.k_layers[layer], buffers.v_layers[layer]


def row_plan_of(store: SlotStore, n_keys: int, t: int, *, causal: bool) -> RowPlan:
    """A decoupled cache's ``RowPlan``: its compacted positions ``0 .. n_keys-1``, the new tokens the last ``t``."""
    cos, sin = store.rope.get(n_keys)
    return RowPlan(n_keys=n_keys, cos=cos[n_keys - t :], sin=sin[n_keys - t :], causal=causal)


def attend_slots(
    store: SlotStore,
    backend: CacheBackend,
    view: RotatedView | None,
    layer: int,
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    slots: torch.Tensor | slice,
    n_keys: int,
    *,
    causal: bool = True,
    key_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of the new queries over ``n_keys`` slots of ``layer`` listed in attention order.

    q: [B, Hq, T, D] pre-RoPE; k_new, v_new: [B, Hkv, T, D] the new tokens, already written to the store
    as the last T of ``slots`` ([N] long tensor, or ``slice(0, N)`` when the held tokens are slots 0..N-1).
    Compacted positions are ``0 .. n_keys-1`` in that order, so queries sit at ``n_keys-T .. n_keys-1``.
    The Triton kernel reads the store directly; the torch path goes through ``view``. Returns [B, Hq, T, D].
    ``causal=False``: the new queries see each other both ways (a ``bidirectional_block`` forward); the
    causal-only kernel is then bypassed by gathering and rotating the keys (``gathered_block_attention``).
    ``key_bias``: [n_keys] score bias per key (torch path only: ``ValueError`` with the kernel), or ``None``.
    """
    if backend.kernel is None:
        return view.attend(store, layer, q, k_new, v_new, slots, n_keys, causal=causal, key_bias=key_bias)
    if key_bias is not None:
        raise ValueError("a per-key score bias runs on the torch attention path; the Triton kernel takes none")
    t = q.shape[2]
    idx = torch.arange(n_keys, device=q.device) if isinstance(slots, slice) else slots
    if not causal:
        return gathered_block_attention(store, layer, q, idx, n_keys)
    pos = torch.arange(n_keys, device=q.device, dtype=torch.int32)
    k_store, v_store = store.k[layer], store.v[layer]  # [B, Hkv, S, D]
    return backend.kernel(q, k_store, v_store, idx.to(torch.int32), pos, pos[n_keys - t :], store.rope.inv_freq(n_keys))


def gathered_block_attention(store: SlotStore, layer: int, q: torch.Tensor, idx: torch.Tensor, n_keys: int) -> torch.Tensor:
    """Every new query over every listed slot (the new tokens' too), keys gathered from the pre-RoPE store and
    rotated at compacted positions ``0 .. n_keys-1``: the kernel path's bidirectional-block fallback.

    q: [B, Hq, T, D] pre-RoPE; idx: [n_keys] long slots in attention order. Returns [B, Hq, T, D].
    """
    t = q.shape[2]
    cos, sin = store.rope.get(n_keys)
    k = apply_rope(store.k[layer].index_select(2, idx), cos, sin)  # [B, Hkv, N, D]
    v = store.v[layer].index_select(2, idx)  # [B, Hkv, N, D]
    return block_attention(apply_rope(q, cos[n_keys - t :], sin[n_keys - t :]), k, v)
