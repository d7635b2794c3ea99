"""Parallel (training) form of ``ChunkedGatedCache``: one forward over a whole history sequence.

Streaming inference runs a history as many forwards (the pinned prompt, then per control step a
frame prefill and single-token decodes) and compresses at each ``end_forward``. This module computes
the same thing in **one** forward of the model over all N tokens, so the gate (and LoRA) can be
trained with ordinary backprop:

    logits, aux = parallel_forward(model, inputs_embeds, boundaries, pinned_len, gate, kv_cfg, soft=True)
    loss = ce(logits, targets) + lam * aux.kept_ratio        # e.g. a retention penalty

How it reproduces streaming exactly (hard gates):

* ``ForwardSchedule`` replays the cache's bookkeeping on token counts only: which forwards are
  pinned, which C-token ranges become chunks after which forward (``chunk_schedule``), and the
  *segments* — maximal runs of forwards between two compression events, during which the cache's
  compressed state does not change (only raw tokens are appended, which causality handles).
* Per layer (``ParallelChunkedAttention.attend``): the chunk representatives are the gate's
  aggregate of the chunk tokens' pre-RoPE k/v of this very forward; the LSTM runs over all chunks in
  order; the hard decisions (``score > tau``) go through the cache's budget rule in closed form
  (``budget.beaten_counts``: the retained set is the top M of the kept chunks so far), giving each
  chunk the forwards during which it is visible.
* Per segment the keys are ``pinned | visible chunks | raw tokens since the segment's raw head``
  with compacted positions ``0..P-1 | P..P+K-1 | P+K..`` exactly as the cache assigns them, and the
  segment's queries sit at ``P+K+(t-head)``. A query's distance to a chunk key and to a raw key thus
  follow different offsets: ``segment_attention`` attends the pinned and chunk keys per segment (grouped
  and padded) and the raw keys, whose distance to the query is plain token distance, as one band over the
  sequence, and merges the two softmax pieces exactly (``partial_attention``).

Soft gates (training): every formed chunk is a key, with the score bias ``log g``,
``g = sigmoid((s - tau) / temperature)``, plus, under a binding budget, the relaxed top-M bias ``log m``
of ``BudgetMode.SOFT`` (``budget.py``; the default ``BudgetMode.HARD`` masks evicted chunks instead). Chunks
streaming would hold keep their hard positions; any other shown chunk is placed half-way between its
visible neighbours (``P + #visible-before - 0.5``), so visible chunks and raw tokens sit where inference
puts them and, as the temperature falls, the soft form converges to the hard one. ``soft=False`` gives
hard gates (no gate bias, dropped and evicted chunks invisible): equal to streaming (tests hold this at atol 1e-4).
With ``ChunkedGatedParams.chunk_mass`` every chunk key's score also gets ``log C`` in both forms, as streaming adds it.

A batch of B windows must share the schedule (same boundaries and ``pinned_len``); decisions are per
row (the streaming cache shares one decision across its batch rows, so compare them with B = 1).

OpenVLA history windows (contract 2), as ``tests/kv/test_session.py`` does it::

    forwards = history_sequence(prompt, action_ids, has_proprio=False)      # processing_openvla
    embeds = torch.cat([vla.embed_forward(f, images=image_tokens) for f in forwards], dim=1)
    bounds = [f.length(n_image_tokens) for f in forwards]                    # bounds[0]: the pinned prompt
    logits, aux = parallel_forward(vla.language_model, embeds, bounds, bounds[0], gate, kv_cfg)
    # the last position of every forward after the prompt predicts the next action token
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import torch

from .budget import BudgetMode, beaten_counts, log_membership, visible_chunks
from .chunked_params import ChunkedGatedParams, chunk_schedule
from .config import KVConfig
from .gate import ChunkGate, check_gate
from .partial_attention import take
from .rope import RopeConfig
from .segment_attention import SegmentPlan, attend_segments

if TYPE_CHECKING:
    from torch import nn


@dataclass(frozen=True)
class Segment:
    """Forwards ``first_forward ..`` covering tokens ``[start, end)`` with one compressed state.

    ``pinned`` tokens are pinned and raw tokens start at ``head``.
    """

    start: int
    end: int
    pinned: int
    head: int
    first_forward: int


@dataclass(frozen=True)
class ForwardSchedule:
    """The streaming cache's token bookkeeping for one history sequence.

    Args:
        lengths: tokens of each forward, in order.
        pinned: tokens pinned by the prompt forwards (a prefix sum of ``lengths``; 0 = none).
        chunk_starts: first token of each chunk, chronological.
        chunk_forward: index of the forward after which each chunk formed.
        segments: see ``Segment``.
    """

    lengths: tuple[int, ...]
    pinned: int
    chunk: int
    window: int
    chunk_starts: tuple[int, ...]
    chunk_forward: tuple[int, ...]
    segments: tuple[Segment, ...]

    @property
    def n_tokens(self) -> int:
        return sum(self.lengths)

    @property
    def n_chunks(self) -> int:
        return len(self.chunk_starts)

    @classmethod
    def build(cls, lengths: Sequence[int], pinned_len: int, *, window: int, chunk: int) -> "ForwardSchedule":
        """Replay ``end_forward`` over forwards of ``lengths`` tokens; forwards ending at or before
        ``pinned_len`` are pinned (``end_forward(pin=True)``)."""
        lengths = tuple(int(n) for n in lengths)
        if not lengths or min(lengths) < 1:
            raise ValueError(f"`boundaries` must be forward lengths >= 1, got {list(lengths)}")
        ends = list(itertools.accumulate(lengths))
        if pinned_len and pinned_len not in ends:
            raise ValueError(f"`pinned_len` {pinned_len} must end a forward (forward ends: {ends[:8]}...)")
        pinned = head = 0
        seg = dict(start=0, pinned=0, head=0, first_forward=0)
        starts: list[int] = []
        formed: list[int] = []
        segments: list[Segment] = []
        for f, end in enumerate(ends):
            if end <= pinned_len:
                pinned = head = end
                changed = True
            else:
                n = chunk_schedule(end - head, window=window, chunk=chunk)
                starts += [head + j * chunk for j in range(n)]
                formed += [f] * n
                head += n * chunk
                changed = n > 0
            if changed or f == len(ends) - 1:
                segments.append(Segment(end=end, **seg))
                seg = dict(start=end, pinned=pinned, head=head, first_forward=f + 1)
        return cls(lengths, pinned_len, chunk, window, tuple(starts), tuple(formed), tuple(segments))


@dataclass
class ParallelAux:
    """What the gates did over the sequence (per batch row, layer and chunk, chronological).

    Args:
        keep_prob: [B, L, n] soft gate ``g`` (differentiable; use it for a retention loss).
        scores: [B, L, n] gate scores ``s``.
        kept: [B, L, n] bool hard decision ``s > tau``.
        retained: [B, L, n] bool kept and still within the budget after the last forward.
        schedule: the ``ForwardSchedule`` (chunk token ranges, formation forwards, segments).
    """

    keep_prob: torch.Tensor
    scores: torch.Tensor
    kept: torch.Tensor
    retained: torch.Tensor
    schedule: ForwardSchedule

    @property
    def kept_ratio(self) -> torch.Tensor:
        """Mean soft keep probability (a differentiable scalar); 1.0 when no chunk formed."""
        if self.keep_prob.numel() == 0:
            return torch.ones((), device=self.keep_prob.device)
        return self.keep_prob.mean()


class ParallelChunkedAttention:
    """The training form as an object with ``attend``: ``model(inputs_embeds=x, cache=this)`` runs it.

    One instance per forward (it collects the gates' outputs for ``aux``). ``end_forward`` is a no-op.
    ``params``: the cache's resolved ``ChunkedGatedParams`` (``max_chunks`` set); ``rope``: the model's schedule.
    ``budget`` says how the soft form treats chunks the budget evicts (``budget.BudgetMode``).
    """

    def __init__(
        self,
        schedule: ForwardSchedule,
        gate: ChunkGate,
        params: ChunkedGatedParams,
        rope: RopeConfig,
        *,
        soft: bool = True,
        temperature: float = 1.0,
        budget: BudgetMode = BudgetMode.HARD,
    ) -> None:
        if temperature <= 0:
            raise ValueError(f"`temperature` must be > 0, got {temperature}")
        self.schedule = schedule
        self.gate = gate
        self.params = params
        self.rope = rope
        self.soft = soft
        self.temperature = temperature
        self.budget = budget
        # chunks formed before each segment (its keys can only be those)
        self.formed = [bisect.bisect_left(schedule.chunk_forward, seg.first_forward) for seg in schedule.segments]
        self._plan: SegmentPlan | None = None  # built on the first layer's device
        self.layers: dict[int, dict[str, torch.Tensor]] = {}

    def end_forward(self, *, pin: bool = False) -> None:
        """Nothing to commit: the whole sequence was one forward."""

    # ---- gates --------------------------------------------------------------------------------------
    def _gates(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        """Chunk representatives, scores and soft gates of one layer.

        k, v: [B, Hkv, N, D]. Returns k_rep, v_rep [B, Hkv, n, D] (in k's dtype), scores [B, n], log_g [B, n].
        """
        sched, gate = self.schedule, self.gate
        b, hkv = k.shape[:2]
        starts = torch.tensor(sched.chunk_starts, device=k.device, dtype=torch.long)
        idx = starts[:, None] + torch.arange(sched.chunk, device=k.device)  # [n, C]
        k_rep, v_rep = gate.aggregate(take(k, idx), take(v, idx), layers=layer)  # [B, Hkv, n, D]
        state = gate.init_state(b, hkv, layers=layer, device=k.device)
        scores, _ = gate.score(k_rep, v_rep, state, layers=layer)  # [B, n]
        log_g = gate.log_keep_prob(scores, layer, temperature=self.temperature)
        return k_rep.to(k.dtype), v_rep.to(v.dtype), scores, log_g

    def _retention(self, scores: torch.Tensor, log_g: torch.Tensor, kept: torch.Tensor, formed: Sequence[int]):
        """Per segment: which chunks streaming holds, which the soft form shows, and their score bias.

        scores, log_g, kept: [B, n]; formed: [S] chunks formed before each segment (``self.formed``, or any
        other states of the cache, e.g. query blocks'). Returns visible, shown [B, S, n] bool, bias [B, S, n]
        or ``None`` (hard gates), retained [B, n] bool (held after the last forward).
        """
        m, n = self.params.max_chunks, scores.shape[1]
        formed = torch.tensor(list(formed) + [n], device=scores.device)  # [S + 1]: the end as a last "segment"
        with torch.no_grad():
            visible = visible_chunks(beaten_counts(scores.detach(), kept), kept, formed, m)  # [B, S + 1, n]
        visible, retained = visible[:, :-1], visible[:, -1]
        if not self.soft:
            return visible, visible, None, retained
        before = torch.arange(n, device=scores.device)[None, :] < formed[:-1, None]  # [S, n]
        bias = log_g[:, None, :].expand(-1, before.shape[0], -1)  # [B, S, n]
        if self.budget is BudgetMode.SOFT:
            shown = before[None].expand_as(visible)
            bias = bias + log_membership(scores, kept, formed[:-1], m, temperature=self.temperature)
        else:  # HARD: evicted chunks stay masked, gate-dropped ones are shown with log g
            shown = visible | (~kept[:, None, :] & before[None])
        return visible, shown, bias, retained

    # ---- attention ----------------------------------------------------------------------------------
    def chunk_keys(self, layer: int, k_raw: torch.Tensor, v: torch.Tensor, formed: Sequence[int]):
        """One layer's chunk representatives and what each cache state sees of them (records ``aux``).

        k_raw, v: [B, Hkv, N, D] (the schedule's tokens); formed: [S] chunks formed before each state.
        Returns k_rep, v_rep [B, Hkv, n, D], visible, shown [B, S, n] bool, bias [B, S, n] or ``None``.
        """
        b, hkv, n_tok, d = k_raw.shape
        if n_tok != self.schedule.n_tokens:
            raise ValueError(f"the sequence has {n_tok} tokens but the boundaries cover {self.schedule.n_tokens}")
        if self.schedule.n_chunks:
            k_rep, v_rep, scores, log_g = self._gates(layer, k_raw, v)
            kept = (scores > self.gate.threshold(layer)).detach()
            visible, shown, bias, retained = self._retention(scores, log_g, kept, formed)
        else:
            k_rep = v_rep = k_raw.new_zeros(b, hkv, 0, d)
            scores = log_g = k_raw.new_zeros(b, 0, dtype=torch.float32)
            kept = retained = torch.zeros(b, 0, dtype=torch.bool, device=k_raw.device)
            visible = shown = torch.zeros(b, len(formed), 0, dtype=torch.bool, device=k_raw.device)
            bias = None
        self.layers[layer] = dict(keep_prob=log_g.exp(), scores=scores, kept=kept, retained=retained)
        if self.params.chunk_mass:  # every chunk key's score + log C, as streaming adds it
            mass = self.params.chunk_score_bias
            bias = shown.new_full(shown.shape, mass, dtype=torch.float32) if bias is None else bias + mass
        return k_rep, v_rep, visible, shown, bias

    def attend(self, layer: int, q: torch.Tensor, k_raw: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [B, Hq, N, D]; k_raw, v: [B, Hkv, N, D] for the whole sequence -> [B, Hq, N, D]."""
        k_rep, v_rep, visible, shown, bias = self.chunk_keys(layer, k_raw, v, self.formed)
        if self._plan is None:
            self._plan = SegmentPlan.build(self.schedule, self.formed, q.device)
        return attend_segments(
            self._plan, self.rope, q, k_raw, v, k_rep, v_rep, visible=visible, shown=shown, bias=bias
        )

    def aux(self) -> ParallelAux:
        layers = [self.layers[i] for i in sorted(self.layers)]
        stack = lambda key: torch.stack([entry[key] for entry in layers], dim=1)  # noqa: E731  [B, L, n]
        return ParallelAux(
            keep_prob=stack("keep_prob"),
            scores=stack("scores"),
            kept=stack("kept"),
            retained=stack("retained"),
            schedule=self.schedule,
        )


def parallel_forward(
    model: "nn.Module",
    inputs_embeds: torch.Tensor,
    boundaries: Sequence[int],
    pinned_len: int,
    gate: ChunkGate,
    kv_cfg: KVConfig,
    *,
    soft: bool = True,
    temperature: float = 1.0,
    budget: BudgetMode = BudgetMode.HARD,
) -> tuple[torch.Tensor, ParallelAux]:
    """One forward of ``model`` over whole history windows, seeing what streaming inference sees.

    Args:
        model: the VLA's language model: called as ``model(inputs_embeds=, cache=)``, its ``cfg.geometry`` the
            ``CacheGeometry`` streaming caches get.
        inputs_embeds: [B, N, dim] the windows' input embeddings (B windows, one schedule).
        boundaries: tokens of each streaming forward in order, summing to N: the pinned prompt, then per
            control step its prefill and single-token decodes (``step_boundaries`` builds the OpenVLA one).
        pinned_len: tokens of the pinned prompt (a prefix of the forwards; 0 = nothing pinned).
        gate: the ``ChunkGate`` to train or check.
        kv_cfg: the ``KVMode.CHUNKED`` KVConfig inference uses (``chunk``, ``window``, ``max_chunks``, ``capacity``).
        soft: ``True`` = soft gates (score bias ``log g``) for training; ``False`` = hard gates, equal to
            a streaming ``ChunkedGatedCache`` run over the same forwards.
        temperature: of the soft gate ``g = sigmoid((s - tau) / temperature)`` and the relaxed budget.
        budget: how soft gates treat chunks the budget evicts (``BudgetMode``; ignored with hard gates).

    Returns:
        logits [B, N, V] float32, and a ``ParallelAux`` (per-chunk gate probabilities, ``kept_ratio``).
    """
    if inputs_embeds.dim() != 3:
        raise ValueError(f"`inputs_embeds` must be [B, N, dim], got shape {tuple(inputs_embeds.shape)}")
    if not isinstance(kv_cfg.params, ChunkedGatedParams):
        raise ValueError(f"parallel_forward reproduces the chunked cache; got a KVConfig of mode {kv_cfg.mode.value!r}")
    geometry = model.cfg.geometry
    params = kv_cfg.params.resolve(geometry)
    check_gate(gate, geometry, chunk=params.chunk)
    schedule = ForwardSchedule.build(boundaries, pinned_len, window=params.window, chunk=params.chunk)
    attn = ParallelChunkedAttention(schedule, gate, params, geometry.rope, soft=soft, temperature=temperature, budget=budget)
    logits = model(inputs_embeds=inputs_embeds, cache=attn)
    return logits, attn.aux()


def step_boundaries(prompt_len: int, step_lens: Sequence[int], decodes_per_step: int) -> list[int]:
    """Forward lengths of a history episode (contract 2): the prompt, then per step its prefill of
    ``step_lens[i]`` tokens followed by ``decodes_per_step`` single-token forwards (``action_dim - 1``
    for OpenVLA: the last action token is fed at the start of the next step's prefill)."""
    out = [prompt_len] if prompt_len else []
    for n in step_lens:
        out += [n] + [1] * decodes_per_step
    return out
