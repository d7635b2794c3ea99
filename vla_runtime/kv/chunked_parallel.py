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
  order; the hard decisions (``score > tau``) go through the same budget rule as the cache
  (``admit``), giving each chunk the forwards during which it is visible.
* Per segment the keys are ``pinned | visible chunks | raw tokens since the segment's raw head``
  with compacted positions ``0..P-1 | P..P+K-1 | P+K..`` exactly as the cache assigns them, and the
  segment's queries sit at ``P+K+(t-head)``. A query's distance to a chunk key and to a raw key thus
  follow different offsets, which is why the scores are computed per segment (a handful per control
  step) rather than with one global mask.

Soft gates (training): every formed chunk that the budget has not evicted is a key, with the score
bias ``log g``, ``g = sigmoid((s - tau) / temperature)``. Kept chunks (``s > tau``) keep their hard
positions; a chunk the hard gate drops is placed half-way between its kept neighbours
(``P + #kept-before - 0.5``), so kept chunks and raw tokens sit where inference puts them and, as
``g`` approaches the hard decision, the soft form converges to the hard one. ``soft=False`` gives
hard gates (no bias, dropped chunks invisible): equal to streaming (tests hold this at atol 1e-4).

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

from .attention import masked_attention
from .chunked_gated import ChunkedGatedConfig, admit, apply_admission, chunk_schedule
from .config import KVConfig
from .gate import ChunkGate, check_gate
from .rope import apply_rope, rope_cos_sin

if TYPE_CHECKING:
    from ..models.llama import LlamaConfig, LlamaForCausalLM

_NEVER = 1 << 62


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
    """

    def __init__(
        self,
        schedule: ForwardSchedule,
        gate: ChunkGate,
        cfg: ChunkedGatedConfig,
        model_cfg: "LlamaConfig",
        *,
        soft: bool = True,
        temperature: float = 1.0,
    ) -> None:
        if temperature <= 0:
            raise ValueError(f"`temperature` must be > 0, got {temperature}")
        self.schedule = schedule
        self.gate = gate
        self.cfg = cfg
        self.model_cfg = model_cfg
        self.soft = soft
        self.temperature = temperature
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
        k_rep, v_rep = gate.aggregate(k[:, :, idx], v[:, :, idx], layers=layer)  # [B, Hkv, n, D]
        state = gate.init_state(b, hkv, layers=layer, device=k.device)
        scores, _ = gate.score(k_rep, v_rep, state, layers=layer)  # [B, n]
        log_g = gate.log_keep_prob(scores, layer, temperature=self.temperature)
        return k_rep.to(k.dtype), v_rep.to(v.dtype), scores, log_g

    @torch.no_grad()
    def _budget(self, scores: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
        """The cache's budget rule replayed per row: [B, n] index of the last forward during which each
        kept chunk is visible (``_NEVER`` if never evicted; its own formation forward if rejected)."""
        sched = self.schedule
        b, n = scores.shape
        m = self.cfg.max_chunks
        dev = scores.device
        valid = torch.zeros(b, m, dtype=torch.bool, device=dev)
        slot_scores = torch.zeros(b, m, dtype=torch.float32, device=dev)
        ages = torch.zeros(b, m, dtype=torch.long, device=dev)
        owner = torch.zeros(b, m, dtype=torch.long, device=dev)  # chunk index held by each slot
        last = torch.full((b, n), _NEVER, dtype=torch.long, device=dev)
        rows = torch.arange(b, device=dev)
        for j in range(n):
            f = sched.chunk_forward[j]
            s = scores[:, j].float()
            adm = admit(valid, slot_scores, ages, s, kept[:, j])
            if m:
                old = owner[rows, adm.slot]
                last[rows, old] = torch.where(adm.write & adm.budget_drop, f, last[rows, old])
            last[:, j] = torch.where(adm.budget_drop & ~adm.write, f, last[:, j])
            if m:
                hit = torch.nn.functional.one_hot(adm.slot, m).bool() & adm.write[:, None]
                owner = owner.masked_fill(hit, j)
            valid, slot_scores, ages = apply_admission(adm, valid, slot_scores, ages, s, j)
        return last

    # ---- attention ----------------------------------------------------------------------------------
    def attend(self, layer: int, q: torch.Tensor, k_raw: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [B, Hq, N, D]; k_raw, v: [B, Hkv, N, D] for the whole sequence -> [B, Hq, N, D]."""
        sched = self.schedule
        b, hkv, n_tok, d = k_raw.shape
        if n_tok != sched.n_tokens:
            raise ValueError(f"the sequence has {n_tok} tokens but the boundaries cover {sched.n_tokens}")
        n = sched.n_chunks
        if n:
            k_rep, v_rep, scores, log_g = self._gates(layer, k_raw, v)
            kept = (scores > self.gate.threshold(layer)).detach()
            last = self._budget(scores.detach(), kept)
        else:
            k_rep = v_rep = k_raw.new_zeros(b, hkv, 0, d)
            scores = log_g = k_raw.new_zeros(b, 0, dtype=torch.float32)
            kept = torch.zeros(b, 0, dtype=torch.bool, device=k_raw.device)
            last = torch.zeros(b, 0, dtype=torch.long, device=k_raw.device)
        self.layers[layer] = dict(
            keep_prob=log_g.exp(), scores=scores, kept=kept, retained=kept & (last == _NEVER)
        )
        outs = [self._segment(seg, q, k_raw, v, k_rep, v_rep, log_g, kept, last) for seg in sched.segments]
        return torch.cat(outs, dim=2)

    def _segment(self, seg: Segment, q, k, v, k_rep, v_rep, log_g, kept, last) -> torch.Tensor:
        """Queries of one segment over pinned | the chunks formed before it | its raw tokens.

        Every chunk formed before the segment is a key slot; the hard-visible ones (kept, not yet evicted)
        take positions ``P + rank``; in soft mode the gate-dropped ones are shown too, half-way between
        their kept neighbours; the rest are masked. Returns [B, Hq, T, D].
        """
        b = k.shape[0]
        dev = q.device
        f0, p = seg.first_forward, seg.pinned
        n = bisect.bisect_left(self.schedule.chunk_forward, f0)  # chunks formed before this segment
        kept, last = kept[:, :n], last[:, :n]
        visible = kept & (last >= f0)  # [B, n]
        shown = visible | ~kept if self.soft else visible
        before = visible.long().cumsum(1) - visible.long()  # kept chunks before each chunk
        c_pos = p + before.float() - 0.5 * (~visible).float()  # [B, n]
        offset = visible.sum(1, keepdim=True).float() + p - seg.head  # [B, 1]: P + K - head
        raw_pos = torch.arange(seg.head, seg.end, device=dev, dtype=torch.float32) + offset  # [B, R]
        q_pos = torch.arange(seg.start, seg.end, device=dev, dtype=torch.float32) + offset  # [B, T]
        pin_pos = torch.arange(p, device=dev, dtype=torch.float32).expand(b, p)  # [B, P]
        pos = torch.cat((pin_pos, c_pos, raw_pos), dim=1)  # [B, Nk]
        ones = lambda m: torch.ones(b, m, dtype=torch.bool, device=dev)  # noqa: E731
        ok = torch.cat((ones(p), shown, ones(raw_pos.shape[1])), dim=1)  # [B, Nk]
        keys = torch.cat((k[:, :, :p], k_rep[:, :, :n], k[:, :, seg.head : seg.end]), dim=2)  # [B, Hkv, Nk, D]
        values = torch.cat((v[:, :, :p], v_rep[:, :, :n], v[:, :, seg.head : seg.end]), dim=2)
        cos, sin = rope_cos_sin(pos, self.model_cfg.rope)  # [B, Nk, D]
        keys = apply_rope(keys, cos[:, None], sin[:, None])
        q_cos, q_sin = rope_cos_sin(q_pos, self.model_cfg.rope)  # [B, T, D]
        queries = apply_rope(q[:, :, seg.start : seg.end], q_cos[:, None], q_sin[:, None])
        mask = ok[:, None, None, :] & (pos[:, None, None, :] <= q_pos[:, None, :, None])  # [B, 1, T, Nk]
        bias = None
        if self.soft and n:
            chunk_bias = log_g[:, :n].masked_fill(~shown, 0.0)  # [B, n]
            zeros = chunk_bias.new_zeros
            bias = torch.cat((zeros(b, p), chunk_bias, zeros(b, raw_pos.shape[1])), dim=1)[:, None, None, :]
        return masked_attention(queries, keys, values, mask, bias=bias)

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
    model: "LlamaForCausalLM",
    inputs_embeds: torch.Tensor,
    boundaries: Sequence[int],
    pinned_len: int,
    gate: ChunkGate,
    kv_cfg: KVConfig,
    *,
    soft: bool = True,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, ParallelAux]:
    """One forward of ``model`` over whole history windows, seeing what streaming inference sees.

    Args:
        model: a ``LlamaForCausalLM`` (the VLA's language model).
        inputs_embeds: [B, N, dim] the windows' input embeddings (B windows, one schedule).
        boundaries: tokens of each streaming forward in order, summing to N: the pinned prompt, then per
            control step its prefill and single-token decodes (``step_boundaries`` builds the OpenVLA one).
        pinned_len: tokens of the pinned prompt (a prefix of the forwards; 0 = nothing pinned).
        gate: the ``ChunkGate`` to train or check.
        kv_cfg: the ``chunked`` KVConfig inference uses (``chunk``, ``window``, ``max_chunks``, ``capacity``).
        soft: ``True`` = soft gates (score bias ``log g``) for training; ``False`` = hard gates, equal to
            a streaming ``ChunkedGatedCache`` run over the same forwards.
        temperature: of the soft gate ``g = sigmoid((s - tau) / temperature)``.

    Returns:
        logits [B, N, V] float32, and a ``ParallelAux`` (per-chunk gate probabilities, ``kept_ratio``).
    """
    if inputs_embeds.dim() != 3:
        raise ValueError(f"`inputs_embeds` must be [B, N, dim], got shape {tuple(inputs_embeds.shape)}")
    cfg = ChunkedGatedConfig.from_kv(kv_cfg, model.cfg)
    check_gate(gate, kv_cfg, model.cfg)
    schedule = ForwardSchedule.build(boundaries, pinned_len, window=cfg.window, chunk=cfg.chunk)
    attn = ParallelChunkedAttention(schedule, gate, cfg, model.cfg, soft=soft, temperature=temperature)
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
