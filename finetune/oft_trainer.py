"""``OFTTrainer``: OpenVLA-OFT's L1-regression recipe (moojink/openvla-oft ``vla-scripts/finetune.py``) on a
LeRobot dataset, single frame or in the runtime's history mode with the full cache (``oft_history``).

What trains: LoRA on the OpenVLA backbone's linear layers (``cfg.lora``; ``lm_head`` left out, the parallel
forward never runs it) + the whole ``L1RegressionActionHead`` + the proprio projector (when the model has
one). The loss is the mean L1 between the head's chunk and the normalised targets (``oft_data``): one
bidirectional forward per micro-batch, exactly the forward the runtime runs (``OpenVLAOFT.sequence`` /
``action_hidden``). Outputs, beside the run config and ``train_log.jsonl``: the LoRA adapter
(``adapter_config.json`` + ``adapter_model.safetensors``), ``action_head--{steps}_checkpoint.pt`` and
``proprio_projector--{steps}_checkpoint.pt`` in upstream's format (``module.``-prefixed keys) and
``dataset_statistics.json``; ``load_policy(CKPT, adapter=RUN)`` loads them back.

``session_config.json`` records the history mode and cache the model was trained for (the loader's default).

Not yet: the chunked cache's gate (history mode trains with ``kv.mode: full``), several processes,
``--resume``, ``merge``, ``trainable`` other than ``lora``.
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
from vla_runtime.config import HistoryMode, SessionConfig
from vla_runtime.kv import KVConfig, KVMode
from vla_runtime.models.openvla_oft.configuration_oft import ACTION_HEAD, PROPRIO_PROJECTOR
from vla_runtime.models.openvla_oft.modeling_oft import OpenVLAOFT

from . import outputs
from .config import FinetuneConfig
from .lora import apply_lora, resolve_targets
from .oft_data import OFTMicroBatches, OFTTrainingData
from .oft_history import HistoryLayout, PositionedMaskedForm
from .trainer import lr_factor

log = logging.getLogger(__name__)

UNUSED_BY_OFT = ("language_model.lm_head",)  # the parallel forward reads hidden states, never logits


class OFTTrainModule(nn.Module):
    """``oft`` (the ``OpenVLAOFT``, LoRA injected into ``oft.vla``); ``forward`` returns the L1 loss.
    ``history``: batches are windows of steps (``oft_history``), else single frames."""

    def __init__(self, oft: OpenVLAOFT, prompts: dict, *, history: bool = False) -> None:
        super().__init__()
        self.oft = oft
        self.prompts = prompts
        self.history = history

    def predict(self, batch: dict) -> torch.Tensor:
        """``pixels`` [B, C, H, W] (+ ``proprio`` [B, P]) of one ``task`` -> normalised chunks [B, K, A] (float32);
        history mode: ``pixels`` [B, S, C, H, W] (+ ``proprio`` [B, S, P]) -> [B, S, K, A]."""
        if self.history:
            return self.predict_history(batch)
        oft = self.oft
        image_tokens = oft.embed_images([batch["pixels"]])
        proprio = oft.embed_proprio(batch["proprio"]) if "proprio" in batch else None
        embeds, start = oft.sequence(self.prompts[batch["task"]], image_tokens, proprio)
        return oft.action_head(oft.action_hidden(embeds, start)).float()

    def predict_history(self, batch: dict) -> torch.Tensor:
        """Windows of S steps in one forward (``HistoryLayout``) -> normalised chunks [B, S, K, A] (float32)."""
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
        form = PositionedMaskedForm(decoder.cfg.rope, layout.positions().to(x.device), layout.mask().to(x.device))
        hidden = decoder(inputs_embeds=x, cache=form)[:, layout.head_rows().to(x.device)]  # [B, S, K * A, dim]
        return oft.action_head(hidden.flatten(0, 1)).view(b, s, oft.cfg.chunk_size, oft.cfg.action_dim).float()

    def forward(self, batch: dict) -> torch.Tensor:
        """The mean L1 loss over the micro-batch's chunks (``targets`` [B, K, A] or [B, S, K, A])."""
        return F.l1_loss(self.predict(batch), batch["targets"].float())


def check_oft_config(cfg: FinetuneConfig, world: int) -> None:
    """``ValueError`` naming each setting the OFT recipe does not support yet."""
    problems = []
    if cfg.history is HistoryMode.HISTORY and cfg.kv.mode is not KVMode.FULL:
        problems.append(f"kv.mode {cfg.kv.mode.value!r} in history mode (the gate is not trained for OFT yet: kv.mode full, or history: single)")
    if cfg.history is HistoryMode.HISTORY and cfg.data.window == 0:
        problems.append("data.window 0 (whole episodes; give a window of steps)")
    if cfg.trainable != "lora":
        problems.append(f"trainable {cfg.trainable!r} (OFT trains LoRA + the action head + the proprio projector: trainable: lora)")
    if world > 1:
        problems.append(f"{world} processes (one process only)")
    if cfg.resume:
        problems.append("--resume")
    if cfg.merge:
        problems.append("merge (load the output with adapter=)")
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
        bf16 = cfg.precision == "bf16" or (cfg.precision == "auto" and self.device.type == "cuda")
        self.autocast = (lambda: torch.autocast(self.device.type, dtype=torch.bfloat16)) if bf16 else contextlib.nullcontext
        self.data = OFTTrainingData.prepare(cfg, self.policy, cache_dir=cfg.data.cache_dir or self.out / "cache")
        oft = self.policy.model
        targets = [n for n in resolve_targets(oft.vla, cfg.lora.target_modules) if n not in UNUSED_BY_OFT]
        self.peft_model = apply_lora(oft.vla, replace(cfg.lora, target_modules=targets))
        for module in (oft.action_head, oft.proprio_projector):
            if module is not None:
                module.requires_grad_(True)
        self.history = cfg.history is HistoryMode.HISTORY
        self.module = OFTTrainModule(oft, self.data.prompts, history=self.history).to(self.device).train()
        params = [p for p in self.module.parameters() if p.requires_grad]
        log.info("trainable parameters: %s of %s", f"{sum(p.numel() for p in params):,}", f"{sum(p.numel() for p in self.module.parameters()):,}")
        self.optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, foreach=True)

    def train(self):
        """Run ``max_steps`` optimizer steps, log every ``log_every``, write the outputs; returns ``out``."""
        cfg = self.cfg
        self.out.mkdir(parents=True, exist_ok=True)
        outputs.write_run_config(self.out, cfg)
        batches = OFTMicroBatches(self.data, batch_size=cfg.batch_size, grad_accum=cfg.grad_accum, max_steps=cfg.max_steps, seed=cfg.seed)
        loader = iter(DataLoader(batches, batch_size=None, shuffle=False, num_workers=cfg.data.num_workers))
        params = [p for p in self.module.parameters() if p.requires_grad]
        total, count, start = 0.0, 0, time.perf_counter()
        for step in range(cfg.max_steps):
            for group in self.optimizer.param_groups:
                group["lr"] = cfg.lr * lr_factor(step, schedule=cfg.lr_schedule, warmup=cfg.warmup_steps, max_steps=cfg.max_steps)
            torch.manual_seed(cfg.seed * 1_000_003 + step)  # LoRA dropout
            for _ in range(cfg.grad_accum):
                batch = {k: v.to(self.device) if torch.is_tensor(v) else v for k, v in next(loader).items()}
                with self.autocast():
                    loss = self.module(batch)
                (loss / cfg.grad_accum).backward()
                total, count = total + float(loss.detach()), count + 1
            if cfg.max_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            done = step + 1
            if done % cfg.log_every == 0 or done == cfg.max_steps:
                elapsed = time.perf_counter() - start
                record = {"step": done, "l1": total / count, "lr": self.optimizer.param_groups[0]["lr"], "steps_per_s": (count / cfg.grad_accum) / elapsed}
                outputs.append_log(self.out, record)
                log.info("step %d/%d  L1 %.4f  lr %.2e", done, cfg.max_steps, record["l1"], record["lr"])
                total, count, start = 0.0, 0, time.perf_counter()
        self.save()
        return self.out

    def save(self) -> None:
        """The adapter, the head and projector in upstream's component format, and the statistics."""
        out, steps, oft = self.out, self.cfg.max_steps, self.policy.model
        self.peft_model.save_pretrained(str(out), save_embedding_layers=False)
        (out / "README.md").unlink(missing_ok=True)  # peft's empty model-card template
        for module, name in ((oft.action_head, ACTION_HEAD), (oft.proprio_projector, PROPRIO_PROJECTOR)):
            if module is not None:
                state = {DDP_PREFIX + k: v.detach().cpu().contiguous() for k, v in module.state_dict().items()}
                torch.save(state, out / f"{name}--{steps}_checkpoint.pt")
        outputs.write_json(out / outputs.STATISTICS, self.data.statistics)
        kv = self.cfg.kv if self.history else KVConfig()
        outputs.write_json(out / outputs.SESSION_CONFIG, SessionConfig(kv=kv, history=self.cfg.history, center_crop=self.cfg.data.image_aug))
        log.info("wrote %s", out)
