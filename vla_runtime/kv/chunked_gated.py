"""ChunkedGatedCache: the KV-Efficient cache (seed 002) with decoupled positions (MemArt/MEPIC).

Regions, oldest first: pinned prefix (everything up to the forward that called
``end_forward(pin=True)``; never compressed) | retained chunks (one k/v per chunk and layer) | raw
tokens waiting to fill a chunk | raw recent window of ``window`` tokens.

At ``end_forward`` every run of ``chunk`` raw tokens that has left the window becomes one chunk (the
same token ranges in every layer). Per layer, the ``ChunkGate`` aggregates its C pre-RoPE keys and
values into one pair, its LSTM scores it, and the chunk is kept iff ``score > tau``; the keep/drop
decision is per layer. At most ``max_chunks`` chunks are retained per layer: when a kept chunk finds
the budget full, the lowest-scoring chunk among the retained ones and the newcomer leaves (ties: the
oldest). Eviction flips a slot: surviving K/V never moves (IntentKV's slot map, with a kept-slot list
rather than a sentinel key).

Positions are compacted per layer (retention differs per layer): pinned ``0..P-1``, retained chunks
one position each in chronological order, then the raw tokens in order; so the positions a layer uses
never exceed the slots it holds. Keys are stored pre-RoPE in one slot store per layer: that is what the
Triton kernel reads (it fuses the gather and RoPE). On the torch path a ``RotatedView`` keeps the held
keys rotated at their compacted positions, contiguous in attention order: positions shift only when the
layout changes (a compression, about once per control step), so the view is rebuilt then (gather and
rotate N keys) and otherwise only the T new keys are rotated and appended; SDPA reads contiguous memory.
Rotating every held key at every forward instead cost ~3x more cache overhead per 7B-geometry step on
CPU (8 forwards per step, most of them single-token decodes); the price is a second copy of the held
K/V on the torch path (``stats().bytes`` counts the store only).

With a batch B > 1 the rows share one slot layout: a chunk's score is the batch mean.
``mark()`` opens a mark that defers compression until ``rollback`` closes it, so a rollback restores
the exact state. The training form that reproduces this cache in one forward is
``vla_runtime.kv.chunked_parallel``; ``chunk_schedule`` (``chunked_params``) is shared with it, and the budget rule (``budget.admit``) with ``budget``'s closed form.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from .backend import select_backend
from .base import KVStats, RowPlan
from .budget import NEVER, admit, apply_admission
from .chunked_params import ChunkedGatedParams, chunk_schedule
from .gate import ChunkGate, check_gate
from .geometry import CacheGeometry
from .slot_cache import SlotCache, check_growth
from .static_view import StaticPlan, attend_static, check_static_rope, static_plan
from .store import RotatedView, SlotStore, attend_slots, row_plan_of


class ChunkedGatedCache(SlotCache):
    """The KV-Efficient cache; see the module docstring. The gate (weights) is owned by the policy."""

    params_class = ChunkedGatedParams

    def __init__(
        self,
        geometry: CacheGeometry,
        params: ChunkedGatedParams | None = None,
        *,
        batch: int = 1,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        gate: ChunkGate | None = None,
        static_shapes: bool = False,
        grow: bool = False,
    ) -> None:
        """``gate``: the policy's ``ChunkGate``; ``None`` builds the untrained default (mean-pooling
        aggregator, keeps every chunk). ``static_shapes``: every forward attends over the rotated view's first
        ``static_extent`` slots behind a mask (``static_view``; the torch path), so a forward of T tokens has one
        shape at every length and layout within an extent (``CompileMode.REDUCE_OVERHEAD`` sessions use it).
        ``grow``: the raw area is allocated as the episode needs it (``SlotStore``; eager forwards only)."""
        super().__init__(geometry, params)
        p = self.params
        check_growth(grow, static_shapes)
        if gate is None:
            gate = ChunkGate(p.gate_config(geometry)).to(device)
        check_gate(gate, geometry, chunk=p.chunk)
        self.gate = gate
        self.batch = batch
        # one scratch slot past the chunk slots takes the writes of layers that do not keep a chunk
        self.store = SlotStore(
            geometry, slots=p.capacity + 1, chunk_slots=p.max_chunks + 1, batch=batch, device=device, dtype=dtype,
            grow=grow,
        )
        self._scratch = torch.tensor(self.store.slots - 1, device=device)
        self._layers = torch.arange(geometry.n_layers, device=device)
        self.static_shapes = static_shapes
        self.backend = select_backend(self._backend_name(p, static_shapes), geometry, device=device, dtype=dtype)
        self.view = RotatedView(self.store) if self.backend.kernel is None else None
        if static_shapes:  # every view slot is read (masked): none may hold NaN from an uninitialised buffer
            check_static_rope(self.store)
            self._slot_index = torch.arange(self.store.slots, device=device)  # the plans' key index, sliced
            self.view.k.zero_()
            self.view.v.zero_()
        n, m = geometry.n_layers, p.max_chunks
        self.chunk_valid = torch.zeros(n, m, dtype=torch.bool, device=device)
        self.chunk_score = torch.zeros(n, m, dtype=torch.float32, device=device)
        self.chunk_age = torch.zeros(n, m, dtype=torch.long, device=device)
        self.gate_dropped = torch.zeros(n, dtype=torch.long, device=device)
        self.budget_dropped = torch.zeros(n, dtype=torch.long, device=device)
        self.reset()

    @staticmethod
    def _backend_name(p: ChunkedGatedParams, static_shapes: bool) -> str:
        """``chunk_mass`` and static shapes run on the torch path: the Triton kernel takes no per-key score bias
        and reads a slot list as long as the held keys."""
        needs = "`chunk_mass`" if p.chunk_mass else "static shapes" if static_shapes else None
        if needs is None or p.backend == "torch":
            return p.backend
        if p.backend == "triton":
            raise ValueError(f"{needs} needs the torch attention backend (the Triton kernel has no per-key score "
                             "bias and no fixed-shape slot list); set backend 'torch' or 'auto'")
        return "torch"

    def reset(self) -> None:
        """Forget the episode (tokens, chunks, LSTM state); the gate's weights are untouched."""
        super().reset()
        self.chunk_valid.zero_()
        self.chunk_score.zero_()
        self.chunk_age.zero_()
        self.gate_dropped.zero_()
        self.budget_dropped.zero_()
        self.lstm_state = self.gate.init_state(self.batch, self.geometry.n_kv_heads, device=self.chunk_valid.device)
        self.chunks_formed = 0
        self._chunk_token_start: list[int] = []  # first token of every chunk formed, chronological
        self._chunk_slots = self._retained_slots()  # per layer, chronological; rebuilt after each compression
        self._plan = None
        self._static: StaticPlan | None = None  # this forward's, with ``static_shapes``
        self._slots: list[torch.Tensor | slice] = []
        self._n_keys: list[int] = []
        self._pinned_slots = torch.arange(0, device=self.chunk_valid.device)
        self._row_plans: dict[int, RowPlan] = {}  # this forward's, by key count (``row_plan``)

    # ---- attention ---------------------------------------------------------------------------------
    def _retained_slots(self) -> list[torch.Tensor]:
        """Per layer: store slots of the retained chunks in chronological order (one host sync). A chunk takes the
        lowest free slot, so only the first ``chunks_formed`` slots can be taken: the sort looks at those only.
        Computed where the layout changes (``reset``, ``_compress``: between forwards), so a forward's attention
        never waits for the host (what lets ``torch.compile`` capture it whole)."""
        used = slice(0, min(self.chunks_formed, self.params.max_chunks))
        order = torch.argsort(self.chunk_age[:, used].masked_fill(~self.chunk_valid[:, used], NEVER), dim=-1)  # [L, m]
        self._chunk_counts = self.chunk_valid.sum(-1)  # [L] on the device, for a static plan
        counts = self._chunk_counts.tolist()
        slots = [self.store.raw_end + order[i, :c] for i, c in enumerate(counts)]
        if not self.static_shapes:  # a traced token loop reads them: their lengths vary, no graph may fix one
            for layer_slots in slots:
                torch._dynamo.maybe_mark_dynamic(layer_slots, 0)
        return slots

    def _store_grew(self) -> None:
        """After ``SlotStore.room_for`` grew the buffers: the chunk slots, and the scratch slot after them, moved."""
        self._scratch = torch.tensor(self.store.slots - 1, device=self.store.device)
        self._chunk_slots = self._retained_slots()

    def _begin_forward(self, t: int) -> None:
        s = self.store
        if s.room_for(t):
            self._store_grew()
        chunks = self._chunk_slots
        contiguous = s.contiguous_prefix(t)
        self._plan = s.plan(t)
        self._row_plans.clear()  # made by ``row_plan`` if a RowsCache asks
        if self._pinned_slots.numel() != s.n_pinned:
            self._pinned_slots = torch.arange(s.n_pinned, device=s.device)
        pinned = self._pinned_slots
        self._slots, self._n_keys, self._key_bias = [], [], []
        for layer_chunks in chunks:
            n = s.n_pinned + layer_chunks.numel() + s.n_raw + t
            if contiguous and layer_chunks.numel() == 0:
                self._slots.append(slice(0, n))
            else:
                self._slots.append(torch.cat((pinned, layer_chunks, self._plan.raw)))
            self._n_keys.append(n)
            self._key_bias.append(self._chunk_bias(layer_chunks.numel(), n))
        if self.static_shapes:  # the held keys current in the view before the first layer (``attend_static``)
            self.view.sync_layers(s, self._slots, self._n_keys, t)
            self._static = static_plan(s, self._slot_index, self._chunk_counts, t, max(self._n_keys),
                                       causal=not self.bidirectional, chunk_bias=self.params.chunk_score_bias)  # fmt: skip

    def _chunk_bias(self, n_chunks: int, n_keys: int) -> torch.Tensor | None:
        """[n_keys] score bias of one layer's keys in attention order: ``chunk_score_bias`` on its ``n_chunks``
        chunk keys, 0 elsewhere; ``None`` without ``chunk_mass`` or chunks."""
        if not self.params.chunk_mass or n_chunks == 0:
            return None
        bias = torch.zeros(n_keys, dtype=self.store.k.dtype, device=self.store.device)
        bias[self.store.n_pinned : self.store.n_pinned + n_chunks] = self.params.chunk_score_bias
        return bias

    def plan_forward(self, t: int) -> None:
        if self._plan is None:
            self._begin_forward(t)
            if self.view is not None:
                self.view.sync_layers(self.store, self._slots, self._n_keys, t)

    # ---- a loop of one-token forwards traced as one graph (``policies.compiled.CompiledTokenLoop``) ---------
    @property
    def traces_token_loop(self) -> bool:
        """Under an open mark (``history: observations`` decodes its action tokens so) nothing compresses until the
        rollback, so each forward's plan and commit are tensor ops and int arithmetic and a loop of them traces
        without a break; without one a forward may end in a compression, whose admission reads the gate's scores
        on the host. Only after the episode's first compression: before it the slots are one contiguous range, and
        that graph specialises on the token count (a new instruction would need a new graph in a control tick).
        Dynamic shapes only, not in a bidirectional block."""
        compressed = self.store.raw_head != self.store.n_pinned
        return self._mark is not None and compressed and not self.static_shapes and not self.bidirectional

    @contextmanager
    def tokens_ahead(self, n: int) -> Iterator[None]:
        """Within: up to ``n`` one-token forwards (a traced loop's). The raw ring's room for them is checked now,
        eagerly (``ValueError``, an eager forward's message), and the first is planned now: after a compression the
        rotated view is rebuilt there (every held key gathered and rotated), eagerly, not inside the graph."""
        self.store.check_room(n)
        self.plan_forward(1)
        yield

    def attend(self, layer: int, q: torch.Tensor, k_raw: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [B, Hq, T, D]; k_raw, v: [B, Hkv, T, D] (k pre-RoPE) -> [B, Hq, T, D]."""
        if self._plan is None:  # first layer of this forward: slots and positions once for all layers
            self._begin_forward(q.shape[2])
        self.store.write(layer, self._plan, k_raw, v)
        if self._static is not None:
            return attend_static(self.view, self._static, layer, q, k_raw, v)
        return attend_slots(
            self.store, self.backend, self.view, layer, q, k_raw, v, self._slots[layer], self._n_keys[layer],
            causal=not self.bidirectional, key_bias=self._key_bias[layer],
        )

    # ---- RowSeam: a forward over several sessions' caches rotates once for all rows (``RowsCache``) -----
    @property
    def row_batching(self) -> bool:
        return self.view is not None  # the Triton kernel reads the store itself: no rotated view to hand over

    def row_plan(self, layer: int, t: int) -> RowPlan:
        """The same object for the layers that hold the same number of keys (usually all)."""
        if self._plan is None:
            self._begin_forward(t)
        n = self._n_keys[layer]
        if n not in self._row_plans:
            self._row_plans[n] = row_plan_of(self.store, n, t, causal=not self.bidirectional)
        return self._row_plans[n]

    def row_attend(self, layer: int, q_rot: torch.Tensor, k_rot: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return self.view.attend_rotated(self.store, layer, q_rot, k_rot, v, self._slots[layer], self._n_keys[layer],
                                        causal=not self.bidirectional, key_bias=self._key_bias[layer])  # fmt: skip

    def row_commit(self, k_raw: torch.Tensor, v: torch.Tensor) -> None:
        self.store.write_layers(self._plan, k_raw, v)

    # ---- commit / compress ---------------------------------------------------------------------------
    def end_forward(self, *, pin: bool = False) -> None:
        if self._end(pin):
            self._compress()

    @classmethod
    def end_forward_rows(cls, caches: "list[ChunkedGatedCache]", *, pin: bool = False) -> None:
        """``end_forward`` of several batch-1 caches (``RowsCache``): the chunks they form go through the gate
        together, one aggregator and LSTM pass per group of caches sharing a gate and a chunk count, each
        row with its own LSTM state; what each cache keeps is what it keeps alone (up to float rounding of
        the batched matmuls)."""
        groups: dict[tuple[int, int], list[ChunkedGatedCache]] = {}
        for cache in caches:
            n = cache._chunks_due() if cache._end(pin) else 0
            if n:
                groups.setdefault((id(cache.gate), n), []).append(cache)
        for (_, n), group in groups.items():
            if len(group) == 1 or any(c.batch != 1 for c in group):
                for cache in group:
                    cache._compress()
                continue
            gate, hkv = group[0].gate, group[0].geometry.n_kv_heads
            with torch.no_grad():
                k, v = (torch.cat(x, dim=1) for x in zip(*(c._due_chunks(n) for c in group)))  # [L, B, Hkv, n, C, D]
                state = tuple(torch.cat(x, dim=1) for x in zip(*(c.lstm_state for c in group)))  # [L, B*Hkv, H]
                k_rep, v_rep = gate.aggregate(k, v)  # [L, B, Hkv, n, D]
                scores, state = gate.score(k_rep, v_rep, state)  # [L, B, n]
            for i, cache in enumerate(group):
                row, heads = slice(i, i + 1), slice(i * hkv, (i + 1) * hkv)
                cache._admit_formed(k_rep[:, row], v_rep[:, row], scores[:, row], (state[0][:, heads], state[1][:, heads]))

    def _end(self, pin: bool) -> bool:
        """Commit the forward; whether the cache may compress now."""
        if self._plan is None:
            return False
        may_compress = self._commit(self._plan.new, max(self._n_keys))
        if self.view is not None:
            self.view.commit(self.store, self._n_keys)
        self._plan = self._static = None
        if pin:
            self.store.pin()
        return may_compress and not pin

    def _chunks_due(self) -> int:
        return chunk_schedule(self.store.n_raw, window=self.params.window, chunk=self.params.chunk)

    def _due_chunks(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The n oldest raw chunks' pre-RoPE keys and values: [L, B, Hkv, n, C, D] each."""
        s, c = self.store, self.params.chunk
        idx = s.token_slots(s.raw_head, s.raw_head + n * c)  # [n * C]: one index_select, not an advanced index
        return s.k.index_select(3, idx).unflatten(3, (n, c)), s.v.index_select(3, idx).unflatten(3, (n, c))

    @torch.no_grad()
    def _compress(self) -> None:
        n = self._chunks_due()
        if n == 0:
            return
        k_rep, v_rep = self.gate.aggregate(*self._due_chunks(n))  # [L, B, Hkv, n, D]
        scores, state = self.gate.score(k_rep, v_rep, self.lstm_state)  # [L, B, n]
        self._admit_formed(k_rep, v_rep, scores, state)

    def _admit_formed(self, k_rep: torch.Tensor, v_rep: torch.Tensor, scores: torch.Tensor, state: tuple) -> None:
        """The n oldest raw chunks leave the raw area, each layer keeping those its gate and budget admit.
        k_rep, v_rep: [L, B, Hkv, n, D]; scores: [L, B, n]; state: the LSTM state after them."""
        s, c, n = self.store, self.params.chunk, scores.shape[-1]
        if s.room_for(0, chunks=min(self.params.max_chunks, self.chunks_formed + n)):  # a chunk takes the lowest free slot
            self._store_grew()
        self.lstm_state = state
        scores = scores.mean(1).to(self.chunk_score.dtype)  # [L, n]: batch rows share one layout
        keep = scores > self.gate.threshold().detach().to(scores.dtype)[:, None]
        k_rep, v_rep = k_rep.to(s.k.dtype), v_rep.to(s.v.dtype)
        if self.chunks_formed + n <= self.params.max_chunks:  # no layer can fill its budget: admit all at once
            self._admit_all(k_rep, v_rep, scores, keep)
        else:
            for j in range(n):
                self._admit_one(k_rep[..., j, :], v_rep[..., j, :], scores[:, j], keep[:, j])
        self.gate_dropped += (~keep).sum(1)
        self._chunk_token_start += range(s.raw_head, s.raw_head + n * c, c)
        s.drop_raw(n * c)
        self._chunk_slots = self._retained_slots()

    def _admit_one(self, k_rep: torch.Tensor, v_rep: torch.Tensor, score: torch.Tensor, keep: torch.Tensor) -> None:
        """One chunk through the budget rule (``admit``). k_rep, v_rep: [L, B, Hkv, D]; score, keep: [L]."""
        s = self.store
        adm = admit(self.chunk_valid, self.chunk_score, self.chunk_age, score, keep)
        # layers that do not keep the chunk write it to the scratch slot, which is never read
        target = torch.where(adm.write, s.raw_end + adm.slot, self._scratch)  # [L]
        s.k[self._layers, :, :, target] = k_rep
        s.v[self._layers, :, :, target] = v_rep
        self.chunk_valid, self.chunk_score, self.chunk_age = apply_admission(
            adm, self.chunk_valid, self.chunk_score, self.chunk_age, score, self.chunks_formed
        )
        self.budget_dropped += adm.budget_drop
        self.chunks_formed += 1

    def _admit_all(self, k_rep: torch.Tensor, v_rep: torch.Tensor, scores: torch.Tensor, keep: torch.Tensor) -> None:
        """n chunks at once when no budget can fill (what ``admit`` does then: the j-th kept chunk takes the
        j-th free slot). k_rep, v_rep: [L, B, Hkv, n, D]; scores, keep: [L, n]."""
        s, n = self.store, keep.shape[1]
        # a chunk takes the lowest free slot, so slots from ``chunks_formed`` on are all free: n of them suffice,
        # and only the first w slots can change (the rest of the budget, up to ``max_chunks``, is not touched)
        w = self.chunks_formed + n
        free_first = torch.argsort(self.chunk_valid[:, :w].to(torch.int8), dim=1, stable=True)  # [L, w]
        slot = free_first.gather(1, (keep.long().cumsum(1) - 1).clamp(min=0))  # [L, n]
        target = torch.where(keep, s.raw_end + slot, self._scratch)  # [L, n]
        s.k[self._layers[:, None], :, :, target] = k_rep.permute(0, 3, 1, 2, 4)  # [L, n, B, Hkv, D]
        s.v[self._layers[:, None], :, :, target] = v_rep.permute(0, 3, 1, 2, 4)
        hit = torch.nn.functional.one_hot(slot, w).bool() & keep[..., None]  # [L, n, w]
        taken = hit.any(1)  # [L, w]
        ages = torch.arange(self.chunks_formed, w, device=keep.device)
        self.chunk_valid[:, :w] |= taken
        self.chunk_score[:, :w] = torch.where(taken, (hit * scores[..., None]).sum(1), self.chunk_score[:, :w])
        self.chunk_age[:, :w] = torch.where(taken, (hit * ages[None, :, None]).sum(1), self.chunk_age[:, :w])
        self.chunks_formed += n

    # ---- stats -------------------------------------------------------------------------------------
    def retained_per_layer(self) -> list[int]:
        return self.chunk_valid.sum(-1).tolist()

    def retained_starts(self) -> tuple[tuple[int, ...], ...]:
        """Per layer: the first token (counted from the episode start, like ``KVStats.tokens_seen``) of each
        retained chunk, chronological; a chunk covers ``params.chunk`` tokens from there. One host sync: call
        it when you want to show what the gate kept, not on every step."""
        ages = self.chunk_age.masked_fill(~self.chunk_valid, NEVER).sort(dim=-1).values.tolist()
        return tuple(tuple(self._chunk_token_start[a] for a in row if a != NEVER) for row in ages)

    def held_slots(self) -> int:
        """Pinned and raw tokens in every layer, plus the retained chunks of each layer."""
        s = self.store
        return (s.n_pinned + s.n_raw) * self.geometry.n_layers + int(self.chunk_valid.sum())

    def stats(self) -> KVStats:
        s, n_layers = self.store, self.geometry.n_layers
        retained = int(self.chunk_valid.sum())
        dropped = int(self.gate_dropped.sum() + self.budget_dropped.sum())
        return KVStats(
            tokens_raw=s.n_pinned + s.n_raw,
            tokens_compressed=retained / n_layers,
            chunks_retained=retained,
            chunks_dropped=dropped,
            bytes=self.held_bytes(),
            positions_used=self._positions_used,
            retained_ratio=retained / (retained + dropped) if retained + dropped else 1.0,
            tokens_seen=s.length,
        )
