"""``OFTTrainer``: OpenVLA-OFT's L1-regression recipe (moojink/openvla-oft ``vla-scripts/finetune.py``) on a
LeRobot dataset, single frame or in the runtime's history mode (``oft_history``): with the full cache, or with
the chunked cache and its ``ChunkGate`` trained (``kv.mode: chunked``, the default).

What trains: LoRA on the OpenVLA backbone's linear layers (``cfg.lora``; ``lm_head`` left out, the parallel
forward never runs it) + the whole ``L1RegressionActionHead`` + the proprio projector (when the model has
one). The loss is the mean L1 between the head's chunk and the normalised targets (``oft_data``): one
bidirectional forward per micro-batch, exactly the forward the runtime runs (``OpenVLAOFT.sequence`` /
``action_hidden``). Outputs, beside the run config and ``train_log.jsonl``: the LoRA adapter
(``adapter_config.json`` + ``adapter_model.safetensors``), ``action_head--{steps}_checkpoint.pt`` and
``proprio_projector--{steps}_checkpoint.pt`` in upstream's format (``module.``-prefixed keys) and
``dataset_statistics.json``; ``load_policy(CKPT, adapter=RUN)`` loads them back.

``session_config.json`` records the history mode and cache the model was trained for (the loader's default).

History mode with ``kv.mode: chunked`` also trains the gate (aggregators + LSTM + ``tau``) as the OpenVLA trainer
does: its own optimizer group (``gate.lr``), soft gates at ``gate.temperature_at(step)``, the retention term
``gate.retention_weight * (mean g - gate.retention_target)^2`` and ``gate.budget``; the forward is the chunked
cache's parallel form with the query blocks not kept (``vla_runtime.kv.query_parallel``). It writes
``gates.safetensors`` + ``kv_config.json``, which ``load_policy(CKPT, adapter=RUN)`` loads for history sessions.

Not yet: several processes, ``--resume``, ``merge``, ``trainable`` other than ``lora``.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import replace

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader

from vla_runtime.api import load_policy
from vla_runtime.checkpoints.openvla_oft import DDP_PREFIX
from vla_runtime.config import SessionConfig
from vla_runtime.kv import ChunkGate, KVConfig, KVMode, save_gate
from vla_runtime.kv.chunked_parallel import ForwardSchedule, ParallelAux
from vla_runtime.kv.gate import check_gate
from vla_runtime.kv.query_parallel import ParallelQueryAttention, QueryBlocks
from vla_runtime.models.openvla_oft.configuration_oft import ACTION_HEAD, PROPRIO_PROJECTOR
from vla_runtime.models.openvla_oft.modeling_oft import OpenVLAOFT

from . import outputs
from .config import FinetuneConfig, GateTraining
from .lora import apply_lora, resolve_targets
from .oft_data import OFTMicroBatches, OFTTrainingData
from .oft_history import HistoryLayout, PositionedMaskedForm
from .trainer import lr_factor

log = logging.getLogger(__name__)

UNUSED_BY_OFT = ("language_model.lm_head",)  # the parallel forward reads hidden states, never logits
METRICS = ("l1", "kept_ratio", "hard_kept")  # what ``OFTTrainModule.forward`` reports, averaged per log line


class OFTTrainModule(nn.Module):
    """``oft`` (the ``OpenVLAOFT``, LoRA injected into ``oft.vla``); ``forward`` returns the loss terms.
    ``history``: batches are windows of steps (``oft_history``), else single frames. ``gate`` + ``kv`` (history
    mode, ``KVMode.CHUNKED``): the chunked cache's parallel form with that gate; ``settings``: its loss and budget."""

    def __init__(
        self,
        oft: OpenVLAOFT,
        prompts: dict,
        *,
        history: bool = False,
        gate: ChunkGate | None = None,
        kv: KVConfig | None = None,
        settings: GateTraining | None = None,
    ) -> None:
        super().__init__()
        self.oft = oft
        self.prompts = prompts
        self.history = history
        self.gate = gate
        self.settings = settings or GateTraining()
        self.chunked = None
        if gate is not None:
            if not history or kv is None or kv.mode is not KVMode.CHUNKED:
                raise ValueError("a gate trains in history mode with a KVMode.CHUNKED `kv`")
            geometry = oft.vla.language_model.model.cfg.geometry
            self.chunked = kv.params.resolve(geometry)
            check_gate(gate, geometry, chunk=self.chunked.chunk)

    def predict(self, batch: dict, *, temperature: float = 1.0) -> torch.Tensor:
        """``pixels`` [B, C, H, W] (+ ``proprio`` [B, P]) of one ``task`` -> normalised chunks [B, K, A] (float32);
        history mode: ``pixels`` [B, S, C, H, W] (+ ``proprio`` [B, S, P]) -> [B, S, K, A]."""
        if self.history:
            return self.predict_history(batch, temperature=temperature)[0]
        oft = self.oft
        image_tokens = oft.embed_images([batch["pixels"]])
        proprio = oft.embed_proprio(batch["proprio"]) if "proprio" in batch else None
        embeds, start = oft.sequence(self.prompts[batch["task"]], image_tokens, proprio)
        return oft.action_head(oft.action_hidden(embeds, start)).float()

    def predict_history(self, batch: dict, *, temperature: float = 1.0) -> tuple[torch.Tensor, ParallelAux | None]:
        """Windows of S steps in one forward -> normalised chunks [B, S, K, A] (float32) and the gates' ``aux``
        (``None`` without a gate)."""
        hidden, aux = self.history_hidden(batch, temperature=temperature)
        oft, (b, s) = self.oft, hidden.shape[:2]
        return oft.action_head(hidden.flatten(0, 1)).view(b, s, oft.cfg.chunk_size, oft.cfg.action_dim).float(), aux

    def history_hidden(self, batch: dict, *, temperature: float = 1.0) -> tuple[torch.Tensor, ParallelAux | None]:
        """The head's rows of every step's query block, [B, S, K * A, dim], from one forward over
        ``P | O_1 | Q_1 | ... | O_S | Q_S``: the full cache's mask (``HistoryLayout``), or with a gate the chunked
        cache's parallel form (``ParallelQueryAttention``: observations kept and chunked, query blocks not kept;
        soft gates at ``temperature``)."""
        oft, prompt = self.oft, self.prompts[batch["task"]]
        b, s = batch["pixels"].shape[:2]
        image = oft.embed_images([batch["pixels"].flatten(0, 1)])  # [B * S, N, dim]
        proprio = oft.embed_proprio(batch["proprio"].flatten(0, 1)) if "proprio" in batch else None  # [B * S, 1, dim]
        obs = oft.observation(image, proprio)
        obs = obs.view(b, s, *obs.shape[1:])  # [B, S, O, dim]
        head = oft.history_prompt(prompt, b)  # [B, P, dim]
        query, first = oft.query_block(prompt, b)  # [B, Q, dim]
        x = torch.cat([head, *(t for i in range(s) for t in (obs[:, i], query))], dim=1)  # [B, N, dim]
        layout = HistoryLayout(head.shape[1], obs.shape[2], query.shape[1], s, first, oft.cfg.action_tokens)
        decoder = oft.vla.language_model.model
        if self.gate is None:
            form = PositionedMaskedForm(decoder.cfg.rope, layout.positions().to(x.device), layout.mask().to(x.device))
        else:
            p = self.chunked
            schedule = ForwardSchedule.build([layout.prompt] + [layout.obs] * s, layout.prompt, window=p.window, chunk=p.chunk)
            blocks = QueryBlocks(after=tuple(range(1, s + 1)), length=layout.query)
            form = ParallelQueryAttention(
                schedule, blocks, self.gate, p, decoder.cfg.rope, soft=True, temperature=temperature, budget=self.settings.budget
            )
        hidden = decoder(inputs_embeds=x, cache=form)[:, layout.head_rows().to(x.device)]  # [B, S, K * A, dim]
        return hidden, (form.aux() if self.gate is not None else None)

    def forward(self, batch: dict, *, temperature: float = 1.0) -> dict[str, torch.Tensor]:
        """``loss`` (to backpropagate): the mean L1 over the micro-batch's chunks (``targets`` [B, K, A] or
        [B, S, K, A]) plus, with a gate, the retention term; ``l1``, ``kept_ratio`` / ``hard_kept`` (mean soft /
        hard keep decision; 1 without a gate or chunk) detached."""
        aux = None
        if self.history:
            chunks, aux = self.predict_history(batch, temperature=temperature)
        else:
            chunks = self.predict(batch)
        l1 = F.l1_loss(chunks, batch["targets"].float())
        loss, one = l1, torch.ones((), device=l1.device)
        kept = hard = one
        if aux is not None and aux.keep_prob.numel():
            kept, hard = aux.kept_ratio, aux.kept.float().mean()
            if self.settings.retention_weight:
                loss = loss + self.settings.retention_weight * (kept - self.settings.retention_target) ** 2
        return {"loss": loss, "l1": l1.detach(), "kept_ratio": kept.detach().float(), "hard_kept": hard.detach().float()}


def check_oft_config(cfg: FinetuneConfig, world: int) -> None:
    """``ValueError`` naming each setting the OFT recipe does not support yet."""
    problems = []
    if cfg.history.episodic and cfg.kv.mode not in (KVMode.FULL, KVMode.CHUNKED):
        problems.append(f"kv.mode {cfg.kv.mode.value!r} in history mode (kv.mode full or chunked)")
    if cfg.history.episodic and cfg.data.window == 0:
        problems.append("data.window 0 (whole episodes; give a window of steps)")
    if cfg.trainable != "lora":
        problems.append(f"trainable {cfg.trainable!r} (OFT trains LoRA + the action head + the proprio projector: trainable: lora)")
    if world > 1:
        problems.append(f"{world} processes (one process only)")
    if cfg.resume:
        problems.append("--resume")
    if cfg.merge:
        problems.append("merge (load the output with adapter=)")
    if cfg.time_budget is not None:
        problems.append("time_budget (give max_steps)")
    if cfg.save_dtype is not None:
        problems.append("save_dtype (the output is a LoRA adapter and its heads, in float32)")
    if cfg.goal_weight:
        problems.append("goal_weight (the goal loss is the token trainer's)")
    if cfg.cue_weight:
        problems.append("cue_weight (the cue-count loss is the token trainer's)")
    if cfg.cue_seen_weight:
        problems.append("cue_seen_weight (the cue-seen loss is the token trainer's)")
    if cfg.decision_weight != 1:
        problems.append("decision_weight (the decision weights are the token trainer's)")
    if cfg.separable_weight != 1:
        problems.append("separable_weight (the separable weights are the token trainer's)")
    if problems:
        raise ValueError(f"{cfg.checkpoint} is an openvla-oft checkpoint; its fine-tuning does not support: {'; '.join(problems)}")


class OFTTrainer:
    """One single-process OFT run of ``cfg`` (the ``Trainer`` counterpart ``make_trainer`` picks)."""

    def __init__(self, cfg: FinetuneConfig, world: int = 1) -> None:
        check_oft_config(cfg, world)
        self.cfg, self.out = cfg, cfg.out
        if cfg.threads is not None:
            torch.set_num_threads(cfg.threads)
        if any((self.out / name).exists() for name in (outputs.RUN_CONFIG, outputs.LOG)):
            raise ValueError(f"{self.out} already holds a fine-tuning run; choose a new --out")
        torch.manual_seed(cfg.seed)
        self.policy = load_policy(cfg.checkpoint, device=cfg.device, dtype="float32")
        self.device = self.policy.device
        variant = self.policy.config
        if variant.diffusion or variant.film:
            raise ValueError(
                f"{cfg.checkpoint} is OpenVLA-OFT's {'diffusion variant' if variant.diffusion else 'FiLM (OFT+) variant'}: "
                "fine-tuning supports the L1-regression variant without FiLM only (inference supports both)"
            )
        bf16 = cfg.precision == "bf16" or (cfg.precision == "auto" and self.device.type == "cuda")
        self.autocast = (lambda: torch.autocast(self.device.type, dtype=torch.bfloat16)) if bf16 else contextlib.nullcontext
        self.data = OFTTrainingData.prepare(cfg, self.policy, cache_dir=cfg.data.cache_dir or self.out / "cache")
        oft = self.policy.model
        targets = [n for n in resolve_targets(oft.vla, cfg.lora.target_modules) if n not in UNUSED_BY_OFT]
        self.peft_model = apply_lora(oft.vla, replace(cfg.lora, target_modules=targets))
        for module in (oft.action_head, oft.proprio_projector):
            if module is not None:
                module.requires_grad_(True)
        self.history = cfg.history.episodic
        self.kv = cfg.kv.for_step(self._step_tokens(), whole_context=False) if self.history else KVConfig()
        self.gate = self._gate() if cfg.trains_gate else None
        self.module = OFTTrainModule(
            oft, self.data.prompts, history=self.history, gate=self.gate, kv=self.kv if self.gate is not None else None,
            settings=cfg.gate,
        ).to(self.device).train()  # fmt: skip
        gate_ids = {id(p) for p in self.gate.parameters()} if self.gate is not None else set()
        params = [p for p in self.module.parameters() if p.requires_grad]
        groups = [
            {"params": [p for p in params if id(p) not in gate_ids], "lr": cfg.lr, "base_lr": cfg.lr, "name": "policy"},
            {"params": [p for p in params if id(p) in gate_ids], "lr": cfg.gate.lr, "base_lr": cfg.gate.lr, "name": "gate"},
        ]
        groups = [g for g in groups if g["params"]]
        counts = ", ".join(f"{g['name']} {sum(p.numel() for p in g['params']):,}" for g in groups)
        total = sum(p.numel() for p in self.module.parameters())
        log.info("trainable parameters: %s of %s (%s)", f"{sum(p.numel() for p in params):,}", f"{total:,}", counts)
        self.optimizer = torch.optim.AdamW(groups, lr=cfg.lr, weight_decay=cfg.weight_decay, foreach=True)

    def _step_tokens(self) -> int:
        """History mode's tokens per step (``OpenVLAOFTSession.step_tokens``): the kept observation and the query."""
        oft = self.policy.model
        observation = oft.cfg.num_images * self.policy.checkpoint.base.config.vision.num_patches + (oft.cfg.proprio_dim is not None)
        return observation + oft.query_block(next(iter(self.data.prompts.values())), 1)[0].shape[1]

    def _gate(self) -> ChunkGate:
        """The policy's trained gate when it fits this cache, else a fresh one (mean pooling, keeps all)."""
        geometry = self.policy.gate_geometry
        existing = self.policy.kv_gate
        if existing is not None:
            try:
                check_gate(existing, geometry, chunk=self.kv.params.chunk)
                log.info("continuing from the checkpoint's trained chunk gate")
                return existing.float().to(self.device)
            except ValueError as e:
                log.warning("the checkpoint's chunk gate does not fit (%s); training a new one", e)
        return ChunkGate(self.kv.gate_config(geometry)).to(self.device)

    def train(self):
        """Run ``max_steps`` optimizer steps, log every ``log_every``, write the outputs; returns ``out``."""
        cfg = self.cfg
        self.out.mkdir(parents=True, exist_ok=True)
        outputs.write_run_config(self.out, cfg)
        batches = OFTMicroBatches(self.data, batch_size=cfg.batch_size, grad_accum=cfg.grad_accum, max_steps=cfg.max_steps, seed=cfg.seed)
        loader = iter(DataLoader(batches, batch_size=None, shuffle=False, num_workers=cfg.data.num_workers))
        params = [p for p in self.module.parameters() if p.requires_grad]
        sums, count, start = dict.fromkeys(METRICS, 0.0), 0, time.perf_counter()
        for step in range(cfg.max_steps):
            factor = lr_factor(step, schedule=cfg.lr_schedule, warmup=cfg.warmup_steps, max_steps=cfg.max_steps)
            for group in self.optimizer.param_groups:
                group["lr"] = group["base_lr"] * factor
            temperature = cfg.gate.temperature_at(step, cfg.max_steps)
            torch.manual_seed(cfg.seed * 1_000_003 + step)  # LoRA dropout
            for _ in range(cfg.grad_accum):
                batch = {k: v.to(self.device) if torch.is_tensor(v) else v for k, v in next(loader).items()}
                with self.autocast():
                    out = self.module(batch, temperature=temperature)
                (out["loss"] / cfg.grad_accum).backward()
                sums = {k: sums[k] + float(out[k]) for k in METRICS}
                count += 1
            if cfg.max_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            done = step + 1
            if done % cfg.log_every == 0 or done == cfg.max_steps:
                elapsed = time.perf_counter() - start
                lrs = {g["name"]: g["lr"] for g in self.optimizer.param_groups}
                record = {"step": done, "l1": sums["l1"] / count, "lr": lrs["policy"],
                          "steps_per_s": (count / cfg.grad_accum) / elapsed}  # fmt: skip
                if self.gate is not None:
                    record |= {"kept_ratio": sums["kept_ratio"] / count, "hard_kept": sums["hard_kept"] / count,
                               "gate_lr": lrs["gate"], "temperature": temperature}  # fmt: skip
                outputs.append_log(self.out, record)
                gate = f"  kept {record['kept_ratio']:.3f} (hard {record['hard_kept']:.3f})  T {temperature:.3g}" if self.gate is not None else ""
                log.info("step %d/%d  L1 %.4f  lr %.2e%s", done, cfg.max_steps, record["l1"], record["lr"], gate)
                sums, count, start = dict.fromkeys(METRICS, 0.0), 0, time.perf_counter()
        self.save()
        return self.out

    def save(self) -> None:
        """The adapter, the head and projector in upstream's component format, the statistics, the session config
        and (chunked history runs) the gate with its cache config."""
        out, steps, oft = self.out, self.cfg.max_steps, self.policy.model
        self.peft_model.save_pretrained(str(out), save_embedding_layers=False)
        (out / "README.md").unlink(missing_ok=True)  # peft's empty model-card template
        for module, name in ((oft.action_head, ACTION_HEAD), (oft.proprio_projector, PROPRIO_PROJECTOR)):
            if module is not None:
                state = {DDP_PREFIX + k: v.detach().cpu().contiguous() for k, v in module.state_dict().items()}
                torch.save(state, out / f"{name}--{steps}_checkpoint.pt")
        outputs.write_json(out / outputs.STATISTICS, self.data.statistics)
        if self.gate is not None:
            save_gate(self.gate, out, self.kv)
        outputs.write_json(out / outputs.SESSION_CONFIG, SessionConfig(kv=self.kv, history=self.cfg.history, center_crop=self.cfg.data.image_aug))
        log.info("wrote %s", out)
