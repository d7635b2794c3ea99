"""``FinetuneConfig``: everything one fine-tuning run needs, with working defaults (YAML and CLI load it).

Defaults follow OpenVLA's LoRA recipe (``shared/research/openvla.md`` §6): rank 32, alpha
``min(rank, 16)``, dropout 0, every linear layer, gaussian init, AdamW at a constant 5e-4. The KV side
(seed 002 §3, §4.2): the chunked cache's aggregator and gate train beside LoRA with soft gates, a
learnable threshold and a retention term pulling the mean keep probability toward a target.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

from vla_runtime.config import HistoryMode, history_mode
from vla_runtime.device import DTYPES
from vla_runtime.kv import KVConfig, KVMode
from vla_runtime.kv.budget import BudgetMode

log = logging.getLogger(__name__)

# what trains: LoRA + gates (the seed's recipe), the gates alone, or every weight (training from scratch)
TRAINABLE = ("lora", "gates", "all")
LR_SCHEDULES = ("constant", "cosine")
PRECISIONS = ("auto", "fp32", "bf16")
# KV modes with a training form: full (plain causal attention) and chunked (the parallel form)
TRAINABLE_KV_MODES = (KVMode.FULL, KVMode.CHUNKED)
# LoRA target shorthands (resolved in ``lora.TARGET_SETS``)
LORA_SHORTHANDS = ("all-linear", "llm-linear")


def _check_positive(obj, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if value is None or value <= 0:
            raise ValueError(f"`{name}` must be > 0, got {value}")


@dataclass
class LoraSettings:
    """peft LoRA on the policy's linear layers (OpenVLA: ``LoraConfig(r=32, lora_alpha=16, lora_dropout=0,
    target_modules="all-linear", init_lora_weights="gaussian")``).

    Args:
        rank: LoRA rank r.
        alpha: scaling numerator (scale = alpha / rank); ``None`` = ``min(rank, 16)`` as OpenVLA.
        dropout: dropout on the LoRA branch's input.
        target_modules: a shorthand (``all-linear``: every linear layer the forward pass uses, vision
            towers, projectors, LLM and ``lm_head``, as OpenVLA; ``llm-linear``: the LLM's attention and
            MLP projections only) or a list of module names (full names or suffixes such as ``q_proj``).
        init: peft ``init_lora_weights`` (``gaussian`` as OpenVLA, or ``default`` = Kaiming-uniform A).
    """

    rank: int = 32
    alpha: float | None = None
    dropout: float = 0.0
    target_modules: str | list[str] = "all-linear"
    init: str = "gaussian"

    def __post_init__(self) -> None:
        _check_positive(self, "rank")
        if self.alpha is not None:
            _check_positive(self, "alpha")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"`dropout` must be in [0, 1), got {self.dropout}")
        if isinstance(self.target_modules, str) and self.target_modules not in LORA_SHORTHANDS:
            raise KeyError(
                f"unknown LoRA target shorthand {self.target_modules!r}; known: {', '.join(LORA_SHORTHANDS)} (or a list of layer names)"
            )
        if isinstance(self.target_modules, (list, tuple)):
            if not self.target_modules or not all(isinstance(t, str) and t for t in self.target_modules):
                raise ValueError(
                    f"`target_modules` must be a shorthand or a non-empty list of names, got {self.target_modules}"
                )
            self.target_modules = list(self.target_modules)
        if self.init not in ("gaussian", "default"):
            raise ValueError(f"`init` is {self.init!r}; expected 'gaussian' or 'default'")

    @property
    def lora_alpha(self) -> float:
        """The alpha peft gets (``alpha`` or OpenVLA's ``min(rank, 16)``)."""
        return self.alpha if self.alpha is not None else min(self.rank, 16)


@dataclass
class DataConfig:
    """Episodes -> training windows.

    Args:
        camera: dataset camera fed as the policy's primary image; ``None`` = the dataset's first camera
            (what ``vla-runtime eval`` feeds as ``primary``).
        window: control steps per history window (``history`` mode; ``single`` mode trains on steps);
            0 = whole episodes, one window each (what a history session sees from the first step to the last).
        stride: steps between consecutive window starts in an episode (the last window always ends at
            the episode's end, so every step is covered); unused with ``window: 0``.
        length_bucket: with ``window: 0``, episodes are padded (last frame repeated, targets masked) up to a
            multiple of this many steps, so episodes of similar length share a bucket and batch together;
            causality keeps the padding from changing anything the real steps compute.
        image_aug: random resized crop covering 0.9 of the image area (OpenVLA's ``image_aug`` crop);
            evaluate such a model with ``SessionConfig.center_crop=True``.
        dataset_name: key of the statistics in ``dataset_statistics.json``; ``None`` = the dataset
            directory's name.
        action_mask: per action dimension, whether it is q01/q99-normalised; ``None`` = OpenVLA's
            convention: every dimension but the last (the absolute gripper, which must lie in [-1, 1]).
        cache_dir: where decoded frames are cached (one ``.npy`` per dataset and camera, memory-mapped);
            ``None`` = ``<out>/cache``.
        num_workers: DataLoader worker processes building batches (0 = in the training process).
    """

    camera: str | None = None
    window: int = 8
    stride: int = 4
    length_bucket: int = 16
    image_aug: bool = False
    dataset_name: str | None = None
    action_mask: list[bool] | None = None
    cache_dir: Path | None = None
    num_workers: int = 0

    def __post_init__(self) -> None:
        _check_positive(self, "stride", "length_bucket")
        if self.window < 0:
            raise ValueError(f"`window` must be >= 0 (0 = whole episodes), got {self.window}")
        if self.num_workers < 0:
            raise ValueError(f"`num_workers` must be >= 0, got {self.num_workers}")
        if self.cache_dir is not None:
            self.cache_dir = Path(self.cache_dir)
        if self.action_mask is not None:
            self.action_mask = [bool(m) for m in self.action_mask]


@dataclass
class GateTraining:
    """How the chunked cache's aggregator and gate train (``KVMode.CHUNKED`` in history mode).

    Args:
        temperature: soft gate ``g = sigmoid((s - tau) / temperature)`` at the start of training.
        temperature_final: temperature at the last step (geometric anneal from ``temperature``), so the
            soft gates end close to the hard keep/drop decisions inference takes (at T = 1 a chunk the
            hard gate drops still gets weight g ~ 0.3 in training); ``None`` = constant.
        retention_target: the mean keep probability the retention term pulls toward.
        retention_weight: weight of ``(mean g - retention_target)^2`` in the loss; 0 = no pull.
        lr: learning rate of the gate and aggregator (the untrained gate keeps every chunk by a margin
            of 3; Adam moves about ``lr`` per step, so the policy's LoRA rate would take thousands of steps).
        budget: how training treats chunks the ``kv.max_chunks`` budget evicts: ``hard`` (default) masks
            them as inference does, and the gate learns to drop what the actions do not need so the budget
            keeps what they do; ``soft`` shows them with the relaxed top-M bias (a gradient reaches evicted
            chunks, but training then sees far more chunks than inference; it lost the README's ablation).
            See ``vla_runtime.kv.budget``.
    """

    temperature: float = 1.0
    temperature_final: float | None = 0.1
    retention_target: float = 0.5
    retention_weight: float = 1.0
    lr: float = 5e-3
    budget: BudgetMode = BudgetMode.HARD

    def __post_init__(self) -> None:
        _check_positive(self, "temperature", "lr")
        self.budget = BudgetMode.parse(self.budget)
        if self.temperature_final is not None:
            _check_positive(self, "temperature_final")
        if not 0.0 <= self.retention_target <= 1.0:
            raise ValueError(f"`retention_target` must be in [0, 1], got {self.retention_target}")
        if self.retention_weight < 0:
            raise ValueError(f"`retention_weight` must be >= 0, got {self.retention_weight}")

    def temperature_at(self, step: int, max_steps: int) -> float:
        if self.temperature_final is None or max_steps <= 1:
            return self.temperature
        frac = min(step, max_steps - 1) / (max_steps - 1)
        return self.temperature * (self.temperature_final / self.temperature) ** frac


@dataclass
class FinetuneConfig:
    """One fine-tuning run.

    Args:
        checkpoint: policy checkpoint directory (any ``load_policy`` path; OpenVLA family).
        dataset: local LeRobot dataset directory (v3.0 or v2.1).
        out: output directory (adapter, gates, statistics, log, plot; ``checkpoints/last`` for resuming).
        trainable: ``lora`` (LoRA + gates), ``gates`` (only the aggregator and gate) or ``all`` (every
            weight, no LoRA: training from scratch; ``out`` becomes a full checkpoint).
        history: ``history`` (windows of consecutive steps, one cache per episode) or ``single``.
        kv: the cache inference will use; ``chunked`` trains the gate, ``full`` is plain attention.
        lora: LoRA settings (``trainable == "lora"``).
        data: windows, camera, augmentation.
        gate: gate temperature, retention term, gate learning rate.
        batch_size: windows per micro-batch (per process).
        grad_accum: micro-batches per optimizer step (per process).
        max_steps: optimizer steps (an upper bound with ``time_budget``).
        time_budget: minutes of training: after a few timed steps ``max_steps`` is lowered to what fits
            (``budget.TimeBudget``), recorded in the run's config; ``None`` = run ``max_steps``.
        lr: learning rate (AdamW) of LoRA / model weights.
        lr_schedule: ``constant`` (OpenVLA) or ``cosine`` (to 0 at ``max_steps``), after ``warmup_steps``.
        warmup_steps: linear warm-up steps.
        weight_decay: AdamW weight decay (torch's default 0.01, as OpenVLA).
        max_grad_norm: gradient clipping norm; ``None`` = no clipping.
        action_vocab_loss: cross-entropy over the ``n_bins`` action tokens, the choice the runtime's
            (default, restricted) greedy decoding makes, computing only those rows of ``lm_head`` (125x
            less head work; on tiny models the head dominates). ``False`` = OpenVLA's cross-entropy over
            the whole vocabulary (use it if you decode with ``decoding=ActionDecoding.FULL``).
        change_weight: history mode: weight of an action token that differs from the same dimension's token
            of the step before (1 = plain cross-entropy). A policy that sees its past actions learns to copy
            them (the "copycat" failure: it holds still forever because holding was right at the previous
            step); the steps where the action changes (e.g. the go signal) carry what it must learn.
        goal_weight: weight of the auxiliary goal loss (0 = off; needs a policy with a proprio input): at every
            step, a linear probe on the hidden state that predicts the step's first action token regresses the
            normalised robot state of its episode's last frame (where the demonstration ends: the remembered
            spot, the pad that lit first). A dense target for what the action tokens teach only in the last
            steps: see the cue, keep it, carry it to the end. The probe is a training aid: it is not saved.
        cue_weight: weight of the auxiliary cue-count loss (0 = off; needs a dataset that records
            ``episode_cue_steps``, as ``collect`` does for the memory tasks): at every step, a second probe at the
            goal probe's position regresses how many of its episode's cue steps are at or before the step
            (standardised over the dataset's frames)
            (``memory-counting``: the presses made so far; the cue tasks: the frames the cue was drawn into). A
            dense target for a memory the final state does not show (how many presses), not saved either.
        cue_seen_weight: weight of the auxiliary cue-seen loss (0 = off; needs ``episode_cue_steps`` too): for
            every frame, a linear probe on each of its image tokens (the vision tower's output, before the LLM),
            max-pooled over the tokens, classifies whether a cue is drawn into the frame (class-balanced binary
            cross-entropy). A dense target for *seeing* the cue, which the action loss teaches only through the
            answer many steps later; not saved.
        decision_weight / decision_span: weight of every action token of the ``decision_span`` steps after each
            recorded cue step (1 = off; needs ``episode_cue_steps`` too). ``memory-counting``: the steps after
            each press, where the expert presses again or backs off, the only ones whose action reads the count.
        separable_weight / separable_span: weight of every action token of each episode's first ``separable_span``
            separable steps (1 = off; ``None`` span = all of them; needs ``episode_separable_steps``, as ``collect``
            records for the pad tasks): the steps whose expert action depends on the answer (``memory-tally``:
            where the hand slows down before the middle pad for two flashes and keeps going for one).
        seed: seeds initialisation, data order and augmentation (resumed runs repeat them exactly).
        device: ``None`` = CUDA if available (``cuda:LOCAL_RANK`` under torchrun), else CPU.
        precision: ``auto`` = bf16 autocast on CUDA, float32 on CPU; ``fp32``; ``bf16`` (autocast).
        gradient_checkpointing: recompute decoder layers in the backward pass (less memory, ~30% slower).
        threads: torch CPU threads per process (``None`` = torch's default).
        log_every: steps between log lines / JSONL records.
        save_every: steps between resumable checkpoints (and at the end).
        resume: continue from ``out/checkpoints/last``.
        merge: also write ``out/merged``: the checkpoint with LoRA merged, in its on-disk format.
        save_dtype: dtype of written full checkpoints (``merge``, ``trainable: all``); ``None`` = the
            source checkpoint's ``torch_dtype`` (bfloat16 upstream).
    """

    checkpoint: Path
    dataset: Path
    out: Path
    trainable: str = "lora"
    history: HistoryMode = HistoryMode.HISTORY  # a string from YAML/CLI is turned into the enum
    kv: KVConfig = field(default_factory=lambda: KVConfig(KVMode.CHUNKED))
    lora: LoraSettings = field(default_factory=LoraSettings)
    data: DataConfig = field(default_factory=DataConfig)
    gate: GateTraining = field(default_factory=GateTraining)
    batch_size: int = 8
    grad_accum: int = 1
    max_steps: int = 1000
    time_budget: float | None = None
    lr: float = 5e-4
    lr_schedule: str = "constant"
    warmup_steps: int = 0
    weight_decay: float = 0.01
    max_grad_norm: float | None = 1.0
    action_vocab_loss: bool = True
    change_weight: float = 1.0
    goal_weight: float = 0.0
    cue_weight: float = 0.0
    cue_seen_weight: float = 0.0
    decision_weight: float = 1.0
    decision_span: int = 12
    separable_weight: float = 1.0
    separable_span: int | None = 8
    seed: int = 0
    device: str | None = None
    precision: str = "auto"
    gradient_checkpointing: bool = False
    threads: int | None = None
    log_every: int = 10
    save_every: int = 500
    resume: bool = False
    merge: bool = False
    save_dtype: str | None = None

    def __post_init__(self) -> None:
        self.checkpoint, self.dataset, self.out = Path(self.checkpoint), Path(self.dataset), Path(self.out)
        choices = {
            "trainable": TRAINABLE,
            "lr_schedule": LR_SCHEDULES,
            "precision": PRECISIONS,
        }
        self.history = history_mode(self.history)
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"`{name}` is {getattr(self, name)!r}; expected one of {', '.join(allowed)}")
        if self.time_budget is not None and not self.time_budget > 0:
            raise ValueError(f"`time_budget` must be > 0 minutes, got {self.time_budget}")
        if self.kv.mode not in TRAINABLE_KV_MODES:
            trainable = ", ".join(m.value for m in TRAINABLE_KV_MODES)
            raise ValueError(f"`kv.mode` is {self.kv.mode.value!r}; training supports {trainable}")
        data = self.data
        if self.history.episodic and data.window and data.stride > data.window:  # single mode has no windows
            log.warning("`data.stride` %d > `data.window` %d would leave the steps between windows untrained; windows "
                        "start every %d steps", data.stride, data.window, data.window)  # fmt: skip
            data.stride = data.window
        if self.trainable == "gates" and not self.trains_gate:
            raise ValueError(
                "`trainable: gates` needs history mode with kv.mode 'chunked' (there is no gate to train otherwise)"
            )
        if self.merge and self.trainable != "lora":
            raise ValueError(
                f"`merge` merges LoRA into the checkpoint; trainable={self.trainable!r} has no LoRA to merge"
            )
        _check_positive(self, "batch_size", "grad_accum", "max_steps", "lr", "log_every", "save_every")
        if self.change_weight < 1:
            raise ValueError(f"`change_weight` must be >= 1 (1 = plain cross-entropy), got {self.change_weight}")
        if not self.goal_weight >= 0:
            raise ValueError(f"`goal_weight` must be >= 0 (0 = no goal loss), got {self.goal_weight}")
        if not self.cue_weight >= 0:
            raise ValueError(f"`cue_weight` must be >= 0 (0 = no cue-count loss), got {self.cue_weight}")
        if not self.cue_seen_weight >= 0:
            raise ValueError(f"`cue_seen_weight` must be >= 0 (0 = no cue-seen loss), got {self.cue_seen_weight}")
        if self.decision_weight < 1:
            raise ValueError(f"`decision_weight` must be >= 1 (1 = off), got {self.decision_weight}")
        if self.separable_weight < 1:
            raise ValueError(f"`separable_weight` must be >= 1 (1 = off), got {self.separable_weight}")
        _check_positive(self, "decision_span", *(["separable_span"] if self.separable_span is not None else []))
        if self.warmup_steps < 0 or self.weight_decay < 0:
            raise ValueError(
                f"`warmup_steps` and `weight_decay` must be >= 0, got {self.warmup_steps}, {self.weight_decay}"
            )
        if self.max_grad_norm is not None:
            _check_positive(self, "max_grad_norm")
        if self.save_dtype is not None and self.save_dtype not in DTYPES:
            raise ValueError(f"`save_dtype` is {self.save_dtype!r}; expected one of {', '.join(sorted(DTYPES))}")
        if self.save_dtype is not None and not (self.merge or self.trainable == "all"):  # kept in shared recipes' flags
            log.warning("`save_dtype` %s sets the dtype of full checkpoints (`merge`, or `trainable: all`); this "
                        "trainable=%r run without `merge` writes only its adapter and gates, in float32",
                        self.save_dtype, self.trainable)  # fmt: skip
        if self.threads is not None:
            _check_positive(self, "threads")

    @property
    def trains_gate(self) -> bool:
        """The chunked cache compresses only in history mode; single mode and ``full`` have no gate."""
        return self.history.episodic and self.kv.mode is KVMode.CHUNKED

    @property
    def trains_lora(self) -> bool:
        return self.trainable == "lora"
