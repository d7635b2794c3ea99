"""The training forward: a micro-batch of windows -> action-token cross-entropy (+ retention term).

``PolicyTrainModule`` holds the policy model (LoRA injected or not) and the ``ChunkGate`` as
submodules, so one ``DistributedDataParallel`` wraps everything that trains. Attention runs through a
training form (an object with the cache's ``attend``): ``ParallelChunkedAttention`` (the chunked
cache's parallel form, soft gates) in history mode with ``KVMode.CHUNKED``, else
``CausalForm`` (one causal forward at absolute positions, which is what ``FullCache`` streams);
``HistoryMode.OBSERVATIONS`` layouts use ``observation_form``'s forms.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from vla_runtime.kv import KVConfig
from vla_runtime.kv.attention import causal_attention
from vla_runtime.kv.budget import BudgetMode
from vla_runtime.kv.chunked_parallel import ForwardSchedule, ParallelChunkedAttention
from vla_runtime.kv.gate import ChunkGate, check_gate
from vla_runtime.kv.rope import RopeConfig, apply_rope, rope_cos_sin

from .data import IGNORE
from .layout import FlatLayout
from .observation_form import chunked_form, masked_form


class CausalForm:
    """Training form of ``FullCache``: the whole sequence in one causal forward at positions 0..N-1."""

    def __init__(self, rope: RopeConfig, n_tokens: int, device: torch.device) -> None:
        self.cos, self.sin = rope_cos_sin(torch.arange(n_tokens, device=device), rope)

    def attend(self, layer: int, q: torch.Tensor, k_raw: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [B, Hq, N, D]; k_raw, v: [B, Hkv, N, D] -> [B, Hq, N, D]."""
        return causal_attention(apply_rope(q, self.cos, self.sin), apply_rope(k_raw, self.cos, self.sin), v, past=0)

    def end_forward(self, *, pin: bool = False) -> None:
        """Nothing to commit."""


def head_rows(head: nn.Module, hidden: torch.Tensor, rows: slice) -> torch.Tensor:
    """``head(hidden)[..., rows]`` computing only those output rows (the 256 action ids of a 32064-row
    head: 125x less work), for a plain ``nn.Linear`` or a peft LoRA ``Linear`` around one
    (``base(x) + sum_adapters scaling * B(A(dropout(x)))``)."""
    lora = sys.modules.get("peft.tuners.lora")  # not imported: no layer can be peft's (a run without LoRA skips it)
    if lora is None or not isinstance(head, lora.LoraLayer):
        return F.linear(hidden, head.weight[rows], None if head.bias is None else head.bias[rows])
    base = head.get_base_layer()
    out = F.linear(hidden, base.weight[rows], None if base.bias is None else base.bias[rows])
    if head.disable_adapters or head.merged:
        return out
    for name in head.active_adapters:
        if name not in head.lora_A:
            continue
        a, b = head.lora_A[name], head.lora_B[name]
        down = a(head.lora_dropout[name](hidden))
        out = out + F.linear(down, b.weight[rows], None if b.bias is None else b.bias[rows]) * head.scaling[name]
    return out


@dataclass(frozen=True)
class LossSettings:
    """Args: action_range: [first, last] action token ids; action_vocab_loss: CE over those ids only;
    batch_size: the nominal rows per micro-batch (a smaller last micro-batch of a bucket weighs less);
    retention_target / retention_weight: the pull of the mean keep probability; budget: how the soft
    form treats chunks the budget evicts; change_weight: the weight of action tokens that differ from the
    step before's; goal_weight: the weight of the goal probe's squared error (0 = no probe); cue_weight: the
    weight of the cue-count probe's squared error (0 = no probe); step_weights: weight each step's action tokens
    by the batch's ``step_weight`` (the decision and separable weights); cue_seen_weight: the weight of the cue-seen
    probe's binary cross-entropy (0 = no probe)."""

    action_range: tuple[int, int]
    action_vocab_loss: bool
    batch_size: int
    retention_target: float
    retention_weight: float
    budget: BudgetMode = BudgetMode.HARD
    change_weight: float = 1.0
    goal_weight: float = 0.0
    cue_weight: float = 0.0
    step_weights: bool = False
    cue_seen_weight: float = 0.0


class PolicyTrainModule(nn.Module):
    """``vla`` (an ``OpenVLA``) + optional ``gate``; ``forward(batch, layout)`` returns the loss terms. With
    ``loss.goal_weight`` > 0, ``goal_head`` (a linear probe from the hidden state to a ``goal_dim`` state,
    trained here and never saved with the policy) adds the goal loss; with ``loss.cue_weight`` > 0,
    ``cue_head`` (a linear probe to one number, likewise not saved) adds the cue-count loss; with
    ``loss.cue_seen_weight`` > 0, ``seen_head`` (a linear probe on each image token, not saved) adds the cue-seen loss."""

    def __init__(
        self,
        vla: nn.Module,
        gate: ChunkGate | None,
        kv: KVConfig | None,
        loss: LossSettings,
        *,
        image_processor=None,
        gradient_checkpointing: bool = False,
        goal_dim: int | None = None,
    ) -> None:
        super().__init__()
        self.vla = vla
        self.image_processor = image_processor  # normalises uint8 ``frames`` batches on the model's device
        self.gate = gate
        self.kv = kv
        self.loss = loss
        self.gradient_checkpointing = gradient_checkpointing
        self.goal_head = None
        if loss.goal_weight > 0:
            if goal_dim is None:
                raise ValueError("the goal loss needs `goal_dim`, the size of the state it regresses")
            self.goal_head = nn.Linear(vla.language_model.cfg.dim, goal_dim)
        self.cue_head = nn.Linear(vla.language_model.cfg.dim, 1) if loss.cue_weight > 0 else None
        self.seen_head = nn.Linear(vla.language_model.cfg.dim, 1) if loss.cue_seen_weight > 0 else None
        self.chunked = None
        if gate is not None:
            geometry = vla.language_model.cfg.geometry
            self.chunked = kv.params.resolve(geometry)
            check_gate(gate, geometry, chunk=self.chunked.chunk)

    def pixels(self, batch: dict) -> torch.Tensor:
        """The batch's pixel values [B, S, C, H, W]: ``pixels`` as given, or uint8 ``frames`` [B, S, H, W, 3]
        normalised here (``TrainingData.pixels``)."""
        if "pixels" in batch:
            return batch["pixels"]
        frames = batch["frames"]
        pixels = self.image_processor.normalize(frames.flatten(0, 1))  # [B * S, C, H, W]
        return pixels.view(*frames.shape[:2], *pixels.shape[1:])

    def embed(self, batch: dict, layout: FlatLayout) -> tuple[torch.Tensor, torch.Tensor]:
        """Input embeddings [B, N, dim] (text ids embedded, image and proprio tokens scattered in) and the image
        tokens [B, S, n_image, dim]."""
        vla = self.vla
        pixels = self.pixels(batch)  # [B, S, C, H, W]
        b, steps = pixels.shape[:2]
        device = pixels.device
        dim = vla.language_model.cfg.dim
        text = vla.language_model.model.embed_tokens(batch["text_ids"])  # [B, Nt, dim]
        image = vla.embed_image(pixels.flatten(0, 1)).reshape(b, -1, dim)  # [B, S * n_image, dim]
        x = text.new_zeros(b, layout.n_tokens, dim)
        x = x.index_copy(1, layout.text_pos.to(device), text)
        x = x.index_copy(1, layout.image_pos.to(device), image.to(x.dtype))
        if "proprio" in batch:
            proprio = vla.embed_proprio(batch["proprio"].flatten(0, 1)).reshape(b, steps, dim)  # [B, S, dim]
            x = x.index_copy(1, layout.proprio_pos.to(device), proprio.to(x.dtype))
        return x, image.view(b, steps, -1, dim)

    def decode(self, x: torch.Tensor, attn) -> torch.Tensor:
        """The LLM decoder over [B, N, dim] with ``attn`` as its cache -> final-normed hidden [B, N, dim]."""
        decoder = self.vla.language_model.model
        if not self.gradient_checkpointing:
            return decoder(inputs_embeds=x, cache=attn)
        for layer in decoder.layers:  # LlamaModel.forward, each layer recomputed in the backward pass
            x = checkpoint(layer, x, attn, use_reentrant=False)
        attn.end_forward()
        return decoder.norm(x)

    def action_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [..., dim] -> float32 logits [..., V] (``action_vocab_loss``: [..., n_bins] over the action ids)."""
        head = self.vla.language_model.lm_head
        if not self.loss.action_vocab_loss:
            return head(hidden).float()
        first, last = self.loss.action_range
        return head_rows(head, hidden, slice(first, last + 1)).float()

    def forward(self, batch: dict, layout: FlatLayout, *, temperature: float = 1.0) -> dict[str, torch.Tensor]:
        """Returns ``loss`` (to backpropagate), ``ce_sum``, ``correct`` (argmax over the action ids equals
        the target), ``targets`` (padded steps' targets excluded), ``kept_ratio`` / ``hard_kept`` (mean
        soft / hard gate; 1 without a gate) and ``goal_mse`` (the goal probe's mean squared error over real
        steps; 0 without one)."""
        x, image = self.embed(batch, layout)
        b, n = x.shape[:2]
        rope = self.vla.language_model.cfg.rope
        if not layout.keeps_all:  # HistoryMode.OBSERVATIONS: each step's decodes are rolled back
            if self.gate is None:
                attn = masked_form(layout, rope, x.device)
            else:
                attn = chunked_form(
                    layout, self.gate, self.chunked, rope, temperature=temperature, budget=self.loss.budget
                )  # fmt: skip
        elif self.gate is not None:
            schedule = ForwardSchedule.build(
                layout.boundaries, layout.pinned, window=self.chunked.window, chunk=self.chunked.chunk
            )
            attn = ParallelChunkedAttention(
                schedule, self.gate, self.chunked, self.vla.language_model.cfg.rope, soft=True, temperature=temperature,
                budget=self.loss.budget,
            )  # fmt: skip
        else:
            attn = CausalForm(self.vla.language_model.cfg.rope, n, x.device)
        hidden = self.decode(x, attn)[:, layout.target_pos.to(x.device)]  # [B, T, dim]
        logits = self.action_logits(hidden)  # [B, T, V']
        first, last = self.loss.action_range
        labels = batch["labels"]  # [B, T], IGNORE on padded steps
        valid = labels != IGNORE
        target = labels - first if self.loss.action_vocab_loss else labels
        target = target.masked_fill(~valid, IGNORE)
        ce = F.cross_entropy(logits.flatten(0, 1), target.flatten(), reduction="none", ignore_index=IGNORE).view_as(labels)
        ce_sum = ce.sum()
        action_part = logits if self.loss.action_vocab_loss else logits[..., first : last + 1]
        correct = ((action_part.argmax(-1) + first == labels) & valid).sum()
        n_valid = valid.sum()
        rows = b / self.loss.batch_size  # weight of this micro-batch against a full one
        steps = batch["pixels" if "pixels" in batch else "frames"].shape[1]
        if self.loss.change_weight == 1.0 and not self.loss.step_weights:
            loss = rows * ce_sum / n_valid.clamp(min=1)  # the mean over real targets
        else:  # the weighted mean over real targets
            weight = change_weights(labels, steps=steps, weight=self.loss.change_weight) * valid
            if self.loss.step_weights:  # [B, S] -> every action token of the step
                weight = weight * batch["step_weight"].repeat_interleave(labels.shape[1] // steps, dim=1)
            loss = rows * (ce * weight).sum() / weight.sum().clamp(min=1)
        goal_mse = cue_mse = seen_bce = torch.zeros((), device=x.device)
        if self.loss.goal_weight:
            goal_mse = probe_error(self.goal_head, hidden, batch["goal"][:, None], valid, steps=steps)
            loss = loss + rows * self.loss.goal_weight * goal_mse
        if self.loss.cue_weight:
            cue_mse = probe_error(self.cue_head, hidden, batch["cue_count"][..., None], valid, steps=steps)
            loss = loss + rows * self.loss.cue_weight * cue_mse
        if self.loss.cue_seen_weight:
            real = valid.view(b, steps, -1)[:, :, 0]  # [B, S]
            seen_bce = seen_error(self.seen_head, image, batch["cue_seen"], real)
            loss = loss + rows * self.loss.cue_seen_weight * seen_bce
        one = torch.ones((), device=x.device)
        kept, hard = one, one
        if self.gate is not None:
            aux = attn.aux()
            kept = aux.kept_ratio
            hard = aux.kept.float().mean() if aux.kept.numel() else one
            if self.loss.retention_weight and aux.keep_prob.numel():
                loss = loss + rows * self.loss.retention_weight * (kept - self.loss.retention_target) ** 2
        return {
            "loss": loss,
            "ce_sum": ce_sum.detach(),
            "correct": correct.detach().float(),
            "targets": n_valid.detach().float(),
            "kept_ratio": kept.detach().float(),
            "hard_kept": hard.detach().float(),
            "goal_mse": goal_mse.detach().float(),
            "cue_mse": cue_mse.detach().float(),
            "seen_bce": seen_bce.detach().float(),
        }


def probe_error(
    head: nn.Module, hidden: torch.Tensor, target: torch.Tensor, valid: torch.Tensor, *, steps: int
) -> torch.Tensor:
    """head: a probe from the hidden state to P numbers; hidden: [B, S * A, dim] at the action targets' positions
    (step-major, as ``labels``); target: [B, S, P] (or [B, 1, P], one target for every step); valid: [B, S * A];
    steps: S -> the mean over real steps of the probe's squared error (mean over P), read at the position that
    predicts each step's first action token (it has seen the step's frame, not its action)."""
    b = hidden.shape[0]
    first = hidden.view(b, steps, -1, hidden.shape[-1])[:, :, 0]  # [B, S, dim]
    real = valid.view(b, steps, -1)[:, :, 0].float()  # [B, S]
    err = (head(first).float() - target.float()).pow(2).mean(-1)  # [B, S]
    return (err * real).sum() / real.sum().clamp(min=1)


def seen_error(head: nn.Module, image: torch.Tensor, seen: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """head: a probe from one image token to a logit; image: [B, S, n_image, dim] image tokens; seen: [B, S] 1 where
    a cue is drawn into the frame; real: [B, S] bool, the steps that are not padding -> the class-balanced binary
    cross-entropy of "a cue is in this frame", the frame's logit the max over its tokens' (the cue fills a few
    patches; which ones the probe must find). Each class present weighs half."""
    logit = head(image).squeeze(-1).float().amax(-1)  # [B, S]
    bce = F.binary_cross_entropy_with_logits(logit, seen.float(), reduction="none")
    pos, neg = (seen > 0.5) & real, (seen <= 0.5) & real
    parts = [bce[m].mean() for m in (pos, neg) if m.any()]
    return torch.stack(parts).mean() if parts else bce.sum() * 0.0


def change_weights(labels: torch.Tensor, *, steps: int, weight: float) -> torch.Tensor:
    """[B, S * A] target ids -> [B, S * A] loss weights: ``weight`` where a token differs from the same action
    dimension's token one step earlier, 1 elsewhere (the first step, and padded steps, weigh 1)."""
    b = labels.shape[0]
    per_step = labels.view(b, steps, -1)  # [B, S, A]
    changed = torch.zeros_like(per_step, dtype=torch.bool)
    changed[:, 1:] = per_step[:, 1:] != per_step[:, :-1]
    return (1.0 + (weight - 1.0) * changed.float()).view(b, -1)
