"""``Trainer``: load the policy, prepare the data, wrap LoRA / gate / DDP, train, write the outputs.

One process per rank (``torchrun``); ``DistEnv`` carries rank and world size, read from the
environment by the entry point only. Rank 0 decodes the dataset, shows progress and writes files;
all ranks compute identical statistics, windows and data order.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

from vla_runtime.api import load_policy
from vla_runtime.checkpoints.export import save_openvla_like
from vla_runtime.config import SessionConfig
from vla_runtime.device import DTYPES, resolve_device
from vla_runtime.kv import ChunkGate, KVConfig, save_gate
from vla_runtime.kv.chunked_parallel import ForwardSchedule
from vla_runtime.kv.gate import check_gate
from vla_runtime.models.openvla.processing_openvla import history_frame

from . import outputs
from .config import FinetuneConfig
from .data import MicroBatches, TrainingData
from .lora import apply_lora, is_unused, unused_by_forward
from .model import LossSettings, PolicyTrainModule
from .resume import prepare_out_dir
from .schedule import TimeBudget, lr_factor

log = logging.getLogger(__name__)

METRICS = ("loss", "ce_sum", "correct", "targets", "kept_ratio", "hard_kept", "goal_mse", "cue_mse", "seen_bce", "micro", "windows", "tokens")


@dataclass(frozen=True)
class DistEnv:
    """This process's place in a ``torchrun`` job (rank 0 of 1 without one)."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def history_kv(kv: KVConfig, data: TrainingData) -> KVConfig:
    """The cache as a history session resolves it: ``window=None`` -> one frame's tokens + the decodes
    (``OpenVLASession``: its first frame + the fed-back action tokens). Written explicitly into ``kv_config.json``."""
    prev = 0 if data.keep_actions else None  # HistoryMode.OBSERVATIONS: no previous action token in a frame
    frame = history_frame(data.prompts[0], step=0, prev_token=prev, has_proprio=data.has_proprio)
    return kv.for_step(frame.length(data.n_image_tokens) + data.action_dim - 1, whole_context=False)


class Trainer:
    """One run of ``cfg`` in this process."""

    def __init__(self, cfg: FinetuneConfig, env: DistEnv = DistEnv()) -> None:
        self.cfg, self.env = cfg, env
        if cfg.threads is not None:
            torch.set_num_threads(cfg.threads)
        self.device = self._device()
        self.autocast = self._autocast()
        self.out = cfg.out
        self.step_cap = cfg.max_steps  # a time budget's refits never pass the configured steps
        # minutes left of the budget (a resumed run: what its checkpoint had left)
        self.budget_minutes = prepare_out_dir(cfg, world=env.world, is_main=env.is_main, barrier=self._barrier)
        torch.manual_seed(cfg.seed)  # LoRA and gate initialisation: identical on every rank
        self.policy = load_policy(cfg.checkpoint, device=self.device, dtype="float32")
        if self.policy.name != "openvla":
            raise ValueError(
                f"{cfg.checkpoint} is a {self.policy.name!r} checkpoint; fine-tuning supports OpenVLA checkpoints"
            )
        cache_dir = cfg.data.cache_dir or self.out / "cache"
        if env.is_main:  # rank 0 decodes the dataset once; the others read its cache (torchrun ends them if it fails)
            self.data = TrainingData.prepare(cfg, self.policy, cache_dir=cache_dir, build_cache=True)
        self._barrier()
        if not env.is_main:
            self.data = TrainingData.prepare(cfg, self.policy, cache_dir=cache_dir, build_cache=False, progress=False)
        if cfg.resume:
            outputs.check_statistics(self.out, self.data.statistics)
        self.kv = history_kv(cfg.kv, self.data) if cfg.history.episodic else cfg.kv
        self.gate = self._gate() if cfg.trains_gate else None
        self.peft_model = self._trainable()
        first, last = self.policy.config.action_token_range
        loss = LossSettings(
            (first, last), cfg.action_vocab_loss, cfg.batch_size, cfg.gate.retention_target, cfg.gate.retention_weight,
            cfg.gate.budget, cfg.change_weight, cfg.goal_weight, cfg.cue_weight, self.data.step_weight is not None,
            cue_seen_weight=cfg.cue_seen_weight,
        )  # fmt: skip
        module = PolicyTrainModule(
            self.policy.model,
            self.gate,
            self.kv if self.gate is not None else None,
            loss,
            image_processor=self.policy.image_processor,
            gradient_checkpointing=cfg.gradient_checkpointing,
            goal_dim=self.policy.config.proprio_dim,
        ).to(self.device)
        self.module = module.train()
        self.model = module
        if env.world > 1:
            ids = [self.device.index] if self.device.type == "cuda" else None
            self.model = DistributedDataParallel(module, device_ids=ids, find_unused_parameters=self._gate_may_idle())
        self.optimizer = self._optimizer()
        self.start_step = 0
        if cfg.resume:
            self._resume()

    # ---- setup -------------------------------------------------------------------------------------
    def _device(self) -> torch.device:
        cfg, env = self.cfg, self.env
        if cfg.device is None and torch.cuda.is_available():
            return torch.device("cuda", env.local_rank)
        device = resolve_device(cfg.device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", env.local_rank)
        return device

    def _autocast(self):
        bf16 = self.cfg.precision == "bf16" or (self.cfg.precision == "auto" and self.device.type == "cuda")
        if not bf16:
            return contextlib.nullcontext
        return lambda: torch.autocast(self.device.type, dtype=torch.bfloat16)

    def _barrier(self) -> None:
        if self.env.world > 1:
            dist.barrier()

    def _gate(self) -> ChunkGate:
        """The policy's trained gate when it fits this cache, else a fresh one (mean pooling, keeps all)."""
        llm_cfg = self.policy.config.llm
        existing = self.policy.kv_gate
        if existing is not None:
            try:
                check_gate(existing, llm_cfg.geometry, chunk=self.kv.params.chunk)
                log.info("continuing from the checkpoint's trained chunk gate")
                return existing.float().to(self.device)
            except ValueError as e:
                log.warning("the checkpoint's chunk gate does not fit (%s); training a new one", e)
        return ChunkGate(self.kv.gate_config(llm_cfg.geometry)).to(self.device)

    def _gate_may_idle(self) -> bool:
        """Whether some bucket's windows form no chunk (the gate then gets no gradient from that micro-batch,
        which DDP must be told). Every other trainable parameter is used by every forward."""
        if self.gate is None:
            return False
        c = self.kv.params.resolve(self.policy.config.llm.geometry)
        return any(
            ForwardSchedule.build(lay.boundaries, lay.pinned, window=c.window, chunk=c.chunk).n_chunks == 0
            for lay in self.data.layouts.values()
        )

    def _trainable(self):
        """Freeze / wrap per ``cfg.trainable``; returns the ``PeftModel`` for LoRA runs."""
        model, kind = self.policy.model, self.cfg.trainable
        if kind == "lora":
            peft_model = apply_lora(model, self.cfg.lora)
            return peft_model
        unused = unused_by_forward(model)
        for name, p in model.named_parameters():
            p.requires_grad_(kind == "all" and not is_unused(name, unused))
        return None

    def _optimizer(self) -> torch.optim.Optimizer:
        cfg = self.cfg
        gate_ids = {id(p) for p in self.gate.parameters()} if self.gate is not None else set()
        params = [p for p in self.module.parameters() if p.requires_grad]
        groups = [
            {"params": [p for p in params if id(p) not in gate_ids], "lr": cfg.lr, "base_lr": cfg.lr, "name": "policy"},
            {"params": [p for p in params if id(p) in gate_ids], "lr": cfg.gate.lr, "base_lr": cfg.gate.lr, "name": "gate"},
        ]
        groups = [g for g in groups if g["params"]]
        counts = {g["name"]: sum(p.numel() for p in g["params"]) for g in groups}
        total = sum(p.numel() for p in self.module.parameters())
        log.info("trainable parameters: %s of %s (%s)", f"{sum(counts.values()):,}", f"{total:,}",
                 ", ".join(f"{k} {v:,}" for k, v in counts.items()))  # fmt: skip
        return torch.optim.AdamW(groups, lr=cfg.lr, weight_decay=cfg.weight_decay, foreach=True)

    def trainable_state(self) -> dict[str, torch.Tensor]:
        return {name: p for name, p in self.module.named_parameters() if p.requires_grad}

    def _resume(self) -> None:
        state, params, optimizer = outputs.load_training_state(self.out, device=self.device)
        step = int(state["step"])
        own = self.trainable_state()
        if set(params) != set(own):
            raise ValueError(
                f"{self.out / outputs.LAST} holds other trainable tensors than this run (e.g. {sorted(set(params) ^ set(own))[:3]})"
            )
        with torch.no_grad():
            for name, p in own.items():
                p.copy_(params[name])
        self.optimizer.load_state_dict(optimizer)
        self.start_step = step
        log.info("resuming at step %d from %s", step, self.out / outputs.LAST)

    # ---- training ----------------------------------------------------------------------------------
    def loader(self) -> DataLoader:
        cfg, env = self.cfg, self.env
        batches = MicroBatches(
            self.data, batch_size=cfg.batch_size, grad_accum=cfg.grad_accum, max_steps=self.step_cap, seed=cfg.seed,
            rank=env.rank, world=env.world, start_step=self.start_step,
        )  # fmt: skip
        if env.is_main and self.start_step == 0:
            log.info(
                "%d windows in %d buckets, %d micro-batches of <= %d per epoch, %d optimizer steps per epoch (x%d processes)",
                len(self.data.windows), len(self.data.buckets), batches.per_epoch, cfg.batch_size, batches.steps_per_epoch, env.world,
            )  # fmt: skip
        workers = cfg.data.num_workers
        return DataLoader(
            batches, batch_size=None, shuffle=False, num_workers=workers, pin_memory=self.device.type == "cuda"
        )

    def _micro_step(self, batch: dict, temperature: float, last: bool) -> dict[str, float]:
        layout = self.data.layouts[tuple(batch.pop("key"))]
        tokens = float(batch.pop("tokens"))
        batch = {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}
        sync = contextlib.nullcontext() if last or self.env.world == 1 else self.model.no_sync()
        with sync:
            with self.autocast():
                out = self.model(batch, layout, temperature=temperature)
            (out["loss"] / self.cfg.grad_accum).backward()
        b = batch["labels"].shape[0]
        return {
            "loss": out["loss"].detach(), "ce_sum": out["ce_sum"], "correct": out["correct"], "targets": out["targets"],
            "kept_ratio": out["kept_ratio"] * b, "hard_kept": out["hard_kept"] * b, "goal_mse": out["goal_mse"] * b,
            "cue_mse": out["cue_mse"] * b, "seen_bce": out["seen_bce"] * b, "micro": 1.0, "windows": float(b),
            "tokens": tokens,
        }  # fmt: skip

    def _reduce(self, sums: torch.Tensor) -> torch.Tensor:
        if self.env.world > 1:
            dist.all_reduce(sums)
        return sums

    def _record(
        self, step: int, sums: torch.Tensor, elapsed: float, cpu: float, steps: int, temperature: float
    ) -> dict:
        m = dict(zip(METRICS, sums.tolist()))
        lrs = {g["name"]: g["lr"] for g in self.optimizer.param_groups}
        return {
            "step": step,
            "loss": m["loss"] / m["micro"],
            "ce": m["ce_sum"] / m["targets"],
            "accuracy": m["correct"] / m["targets"],
            "kept_ratio": m["kept_ratio"] / m["windows"],
            "hard_kept": m["hard_kept"] / m["windows"],
            "goal_mse": m["goal_mse"] / m["windows"],
            "cue_mse": m["cue_mse"] / m["windows"],
            "seen_bce": m["seen_bce"] / m["windows"],
            "lr": lrs.get("policy", 0.0),
            "gate_lr": lrs.get("gate", 0.0),
            "temperature": temperature,
            "steps_per_s": steps / elapsed,
            "cpu_ms_per_step": 1e3 * cpu / steps,  # this process's CPU time: robust on a shared machine
            "windows_per_s": m["windows"] / elapsed,
            "tokens_per_s": m["tokens"] / elapsed,
        }

    def train(self) -> Path:
        """Run from ``start_step`` to ``max_steps``, write the outputs; returns ``out``."""
        cfg, env = self.cfg, self.env
        if env.is_main:
            self.out.mkdir(parents=True, exist_ok=True)
            outputs.write_run_config(self.out, cfg)
            outputs.write_json(self.out / outputs.STATISTICS, self.data.statistics)
            outputs.truncate_log(self.out, self.start_step)
        params = [p for p in self.module.parameters() if p.requires_grad]
        batches = iter(self.loader())
        sums = torch.zeros(len(METRICS), dtype=torch.float64)
        interval_steps, interval_start, interval_cpu = 0, time.perf_counter(), time.process_time()
        total_time, total_steps = 0.0, 0
        bar = tqdm(
            total=cfg.max_steps, initial=self.start_step, desc="fine-tuning", unit="step", disable=not env.is_main
        )
        budget = TimeBudget(self.budget_minutes) if self.budget_minutes is not None else None
        cap = self.step_cap  # a refit may lengthen the run again (a slow start), never past the configured steps
        for step in itertools.count(self.start_step):
            if step >= cfg.max_steps:
                break
            factor = lr_factor(step, schedule=cfg.lr_schedule, warmup=cfg.warmup_steps, max_steps=cfg.max_steps)
            for group in self.optimizer.param_groups:
                group["lr"] = group["base_lr"] * factor
            temperature = cfg.gate.temperature_at(step, cfg.max_steps)
            torch.manual_seed(
                cfg.seed * 1_000_003 + step * env.world + env.rank
            )  # LoRA dropout, reproducible on resume
            for m in range(cfg.grad_accum):
                micro = self._micro_step(next(batches), temperature, last=m == cfg.grad_accum - 1)
                sums += torch.tensor([float(micro[k]) for k in METRICS], dtype=torch.float64)
            if cfg.max_grad_norm is not None:
                torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            interval_steps += 1
            bar.update(1)
            done = step + 1
            if budget is not None and (fitted := budget.after_step(done, cap)) is not None:
                self._fit_budget(fitted, bar)
            if done % cfg.log_every == 0 or done == cfg.max_steps:
                elapsed, cpu = time.perf_counter() - interval_start, time.process_time() - interval_cpu
                total_time, total_steps = total_time + elapsed, total_steps + interval_steps
                sums = self._reduce(sums.to(self._reduce_device())).cpu()
                record = self._record(done, sums, elapsed, cpu, interval_steps, temperature)
                if env.is_main:
                    outputs.append_log(self.out, record)
                    self._report(bar, record)
                sums.zero_()
                interval_steps, interval_start, interval_cpu = 0, time.perf_counter(), time.process_time()
            if done % cfg.save_every == 0 or done == cfg.max_steps:
                if env.is_main:
                    state = {"step": done, "max_steps": cfg.max_steps, "world": env.world,
                             "budget_left_s": budget.seconds_left() if budget is not None else None}  # fmt: skip
                    outputs.save_training_state(self.out, params=self.trainable_state(), optimizer=self.optimizer,
                                                state=state)  # fmt: skip
                self._barrier()
                interval_start, interval_cpu = time.perf_counter(), time.process_time()  # saving is not training time
        bar.close()
        if env.is_main:
            if total_steps:
                log.info("trained %d steps in %.1f s: %.3f steps/s", total_steps, total_time, total_steps / total_time)
            self.save()
        self._barrier()
        return self.out

    def _fit_budget(self, fitted: int, bar: tqdm) -> None:
        """``--time-budget``: the run ends at ``fitted`` (the same step on every rank), recorded for ``--resume``."""
        if self.env.world > 1:
            agreed = torch.tensor([fitted], dtype=torch.long, device=self._reduce_device())
            dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
            fitted = int(agreed.item())
        if fitted == self.cfg.max_steps:
            return
        log.info("time budget %.1f min: %d steps fit (max_steps %d -> %d)", self.cfg.time_budget, fitted, self.cfg.max_steps, fitted)
        self.cfg.max_steps = fitted
        bar.total = fitted
        bar.refresh()
        if self.env.is_main:
            outputs.write_run_config(self.out, self.cfg)

    def _report(self, bar: tqdm, r: dict) -> None:
        gate = self.gate is not None
        kept = {"kept": f"{r['kept_ratio']:.2f}"} if gate else {}
        bar.set_postfix(ce=f"{r['ce']:.3f}", acc=f"{r['accuracy']:.2f}", **kept)
        kept_text = (
            f"  kept {r['kept_ratio']:.3f} (hard {r['hard_kept']:.3f})  T {r['temperature']:.3g}" if gate else ""
        ) + (f"  goal {r['goal_mse']:.4f}" if self.module.goal_head is not None else "") + (
            f"  cue {r['cue_mse']:.4f}" if self.module.cue_head is not None else ""
        ) + (f"  seen {r['seen_bce']:.4f}" if self.module.seen_head is not None else "")
        log.info(
            "step %d/%d  loss %.4f  ce %.4f  acc %.3f%s  lr %.2e  %.2f steps/s  %.1f windows/s",
            r["step"], self.cfg.max_steps, r["loss"], r["ce"], r["accuracy"], kept_text, r["lr"], r["steps_per_s"], r["windows_per_s"],
        )  # fmt: skip

    def _reduce_device(self) -> torch.device:
        return self.device if self.env.world > 1 and self.device.type == "cuda" else torch.device("cpu")

    # ---- outputs -----------------------------------------------------------------------------------
    def save(self) -> None:
        """Write the adapter / full checkpoint, gates, session config and plot (rank 0)."""
        cfg, out = self.cfg, self.out
        if self.peft_model is not None:
            self.peft_model.save_pretrained(str(out), save_embedding_layers=False)
            (out / "README.md").unlink(missing_ok=True)  # peft's empty model-card template
        if cfg.trainable == "all":
            dtype = DTYPES[cfg.save_dtype] if cfg.save_dtype else None
            save_openvla_like(
                self.policy.model, out, source=cfg.checkpoint, norm_stats=self.data.statistics, dtype=dtype
            )
        if self.gate is not None:
            save_gate(self.gate, out, self.kv)
        session = SessionConfig(kv=self.kv, history=cfg.history, center_crop=cfg.data.image_aug)
        outputs.write_json(out / outputs.SESSION_CONFIG, session)
        outputs.plot_curves(out, retention_target=cfg.gate.retention_target if self.gate is not None else None)
        if cfg.merge:
            from .merge import merge_adapter

            dtype = DTYPES[cfg.save_dtype] if cfg.save_dtype else None
            merge_adapter(cfg.checkpoint, out, out / "merged", dtype=dtype)
        log.info("wrote %s", out)
