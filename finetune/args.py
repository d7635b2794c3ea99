"""Command-line flags <-> ``FinetuneConfig`` fields (YAML first, flags override it).

Each flag names a dotted config field; flags left out do not touch the YAML's value or the default.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from vla_runtime.config import HISTORY_MODES, from_dict, read_yaml_mapping
from vla_runtime.device import DTYPES
from vla_runtime.kv.budget import BudgetMode

from .config import LORA_SHORTHANDS, LR_SCHEDULES, PRECISIONS, TRAINABLE_KV_MODES, FinetuneConfig

REQUIRED = ("checkpoint", "dataset", "out")


def _bool(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "y"):
        return True
    if value in ("0", "false", "no", "n"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got {text!r}")


_OPT_INT = {"type": int, "metavar": "N"}
_FLOAT = {"type": float, "metavar": "X"}

# (flag, dotted field, argparse kwargs, help)
FLAGS: list[tuple[str, str, dict, str]] = [
    ("--checkpoint", "checkpoint", {"type": Path, "metavar": "DIR"}, "policy checkpoint directory (OpenVLA HF layout)"),
    ("--dataset", "dataset", {"type": Path, "metavar": "DIR"}, "local LeRobot dataset directory (v3.0 or v2.1)"),
    ("--out", "out", {"type": Path, "metavar": "DIR"}, "output directory (adapter, gates, statistics, log, plot)"),
    ("--history", "history", {"choices": HISTORY_MODES},
     "history (windows of steps; default), observations (the same without action tokens in the context) or single"),
    ("--kv", "kv.mode", {"choices": [m.value for m in TRAINABLE_KV_MODES]}, "cache inference will use: chunked (trains the gate; default) or full"),
    ("--chunk", "kv.chunk", _OPT_INT, "chunk size C of the chunked cache (default 16)"),
    ("--kv-window", "kv.window", _OPT_INT, "raw recent window W in tokens (default: one control step's tokens)"),
    ("--max-chunks", "kv.max_chunks", _OPT_INT, "retained-chunk budget per layer (default: bounded by capacity only)"),
    ("--chunk-mass", "kv.chunk_mass", {"action": argparse.BooleanOptionalAction},
     "add log(chunk) to the attention score of every chunk key, so a chunk weighs what its tokens would "
     "(inference reads it from kv_config.json; default off)"),
    ("--lora-rank", "lora.rank", _OPT_INT, "LoRA rank (default 32)"),
    ("--lora-alpha", "lora.alpha", _FLOAT, "LoRA alpha (default min(rank, 16))"),
    ("--lora-dropout", "lora.dropout", _FLOAT, "LoRA dropout (default 0)"),
    ("--lora-targets", "lora.target_modules", {"nargs": "+", "metavar": "NAME"},
     f"LoRA target layers: a shorthand ({', '.join(LORA_SHORTHANDS)}; default all-linear) or layer names"),
    ("--camera", "data.camera", {"metavar": "NAME"}, "dataset camera used as the primary image (default: the first)"),
    ("--window", "data.window", _OPT_INT, "control steps per history window (default 8; 0 = whole episodes)"),
    ("--stride", "data.stride", _OPT_INT, "steps between window starts (default 4)"),
    ("--length-bucket", "data.length_bucket", _OPT_INT,
     "--window 0: pad episodes to a multiple of N steps so similar lengths batch together (default 16)"),
    ("--image-aug", "data.image_aug", {"action": argparse.BooleanOptionalAction},
     "random resized crop of 0.9 area (evaluate with the 0.9 centre crop; default off)"),
    ("--dataset-name", "data.dataset_name", {"metavar": "KEY"}, "key in dataset_statistics.json (default: the directory name)"),
    ("--action-mask", "data.action_mask", {"nargs": "+", "type": _bool, "metavar": "BOOL"},
     "per action dim: q01/q99-normalised? (default: all but the last, the gripper)"),
    ("--cache-dir", "data.cache_dir", {"type": Path, "metavar": "DIR"}, "decoded-frame cache directory (default OUT/cache)"),
    ("--num-workers", "data.num_workers", _OPT_INT, "DataLoader workers building batches (default 0)"),
    ("--gate-temperature", "gate.temperature", _FLOAT, "soft-gate temperature (default 1)"),
    ("--gate-temperature-final", "gate.temperature_final", _FLOAT, "temperature at the last step (geometric anneal; default 0.1)"),
    ("--retention-target", "gate.retention_target", _FLOAT, "mean keep probability the retention term pulls toward (default 0.5)"),
    ("--retention-weight", "gate.retention_weight", _FLOAT, "weight of the retention term (default 1)"),
    ("--gate-lr", "gate.lr", _FLOAT, "learning rate of the aggregator and gate (default 5e-3)"),
    ("--gate-budget", "gate.budget", {"choices": [m.value for m in BudgetMode]},
     "chunks the --max-chunks budget evicts: hard (masked as inference does; default) or soft (relaxed top-M)"),
    ("--batch-size", "batch_size", _OPT_INT, "windows per micro-batch per process (default 8)"),
    ("--grad-accum", "grad_accum", _OPT_INT, "micro-batches per optimizer step (default 1)"),
    ("--max-steps", "max_steps", _OPT_INT, "optimizer steps (default 1000; an upper bound with --time-budget)"),
    ("--time-budget", "time_budget", {"type": float, "metavar": "MIN"},
     "minutes of training: max_steps is fitted to the measured rate of steps, refitted every 20 (the schedule ends there)"),
    ("--lr", "lr", _FLOAT, "learning rate of LoRA / model weights (default 5e-4, constant)"),
    ("--lr-schedule", "lr_schedule", {"choices": LR_SCHEDULES}, "constant (default) or cosine"),
    ("--warmup-steps", "warmup_steps", _OPT_INT, "linear warm-up steps (default 0)"),
    ("--weight-decay", "weight_decay", _FLOAT, "AdamW weight decay (default 0.01)"),
    ("--max-grad-norm", "max_grad_norm", _FLOAT, "gradient clipping norm (default 1)"),
    ("--action-vocab-loss", "action_vocab_loss", {"action": argparse.BooleanOptionalAction},
     "cross-entropy over the action tokens only (default; --no-action-vocab-loss: whole vocabulary, as OpenVLA)"),
    ("--change-weight", "change_weight", _FLOAT,
     "history: weight of action tokens that differ from the previous step's (default 1; against copying past actions)"),
    ("--goal-weight", "goal_weight", _FLOAT,
     "weight of the auxiliary loss regressing the episode's final robot state at every step (default 0 = off)"),
    ("--cue-weight", "cue_weight", _FLOAT,
     "weight of the auxiliary loss regressing how many of the episode's recorded cue steps (counting: presses) "
     "came so far, at every step (default 0 = off)"),
    ("--cue-seen-weight", "cue_seen_weight", _FLOAT,
     "weight of the auxiliary loss classifying, from each frame's image tokens, whether a cue is drawn into it "
     "(default 0 = off)"),
    ("--decision-weight", "decision_weight", _FLOAT,
     "weight of the action tokens of the --decision-span steps after each recorded cue step (default 1 = off)"),
    ("--decision-span", "decision_span", _OPT_INT, "steps after each cue step that --decision-weight covers (default 12)"),
    ("--separable-weight", "separable_weight", _FLOAT,
     "weight of the action tokens of each episode's first --separable-span recorded separable steps, where the "
     "expert's action depends on the answer (default 1 = off)"),
    ("--separable-span", "separable_span", _OPT_INT, "separable steps per episode that --separable-weight covers (default 8)"),
    ("--seed", "seed", _OPT_INT, "seed of initialisation, data order and augmentation (default 0)"),
    ("--device", "device", {"metavar": "DEV"}, "cpu / cuda (default: cuda:LOCAL_RANK if available)"),
    ("--precision", "precision", {"choices": PRECISIONS}, "auto (bf16 autocast on CUDA; default), fp32, bf16"),
    ("--gradient-checkpointing", "gradient_checkpointing", {"action": argparse.BooleanOptionalAction},
     "recompute decoder layers in the backward pass"),
    ("--threads", "threads", _OPT_INT, "torch CPU threads per process"),
    ("--log-every", "log_every", _OPT_INT, "steps between log records (default 10)"),
    ("--save-every", "save_every", _OPT_INT, "steps between resumable checkpoints (default 500)"),
    ("--resume", "resume", {"action": argparse.BooleanOptionalAction}, "continue from OUT/checkpoints/last"),
    ("--merge", "merge", {"action": argparse.BooleanOptionalAction}, "also write OUT/merged: LoRA merged, original format"),
    ("--save-dtype", "save_dtype", {"choices": sorted(DTYPES)}, "dtype of written full checkpoints (default: the source's)"),
]  # fmt: skip


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", type=Path, metavar="YAML", help="FinetuneConfig YAML (flags override its values)")
    what = parser.add_mutually_exclusive_group()
    what.add_argument("--from-scratch", dest="trainable", action="store_const", const="all", default=argparse.SUPPRESS,
                      help="train every weight of the checkpoint (no LoRA); OUT becomes a full checkpoint")  # fmt: skip
    what.add_argument("--gates-only", dest="trainable", action="store_const", const="gates", default=argparse.SUPPRESS,
                      help="train only the chunk aggregator and gate")  # fmt: skip
    for flag, dest, kwargs, text in FLAGS:
        parser.add_argument(flag, dest=dest, default=argparse.SUPPRESS, help=text, **kwargs)


def _set(data: dict, dotted: str, value) -> None:
    *parents, leaf = dotted.split(".")
    for key in parents:
        data = data.setdefault(key, {})
    data[leaf] = value


def config_from_args(args: argparse.Namespace) -> FinetuneConfig:
    """YAML (``--config``) with the given flags on top -> a validated ``FinetuneConfig``."""
    values = vars(args)
    data: dict = {}
    if values.get("config") is not None:
        data = read_yaml_mapping(values["config"])
    for key, value in values.items():
        if key in ("config", "func", "command", "verbose"):
            continue
        if key == "lora.target_modules" and len(value) == 1 and value[0] in LORA_SHORTHANDS:
            value = value[0]
        _set(data, key, value)
    missing = [k for k in REQUIRED if data.get(k) is None]
    if missing:
        raise ValueError(f"missing {', '.join('--' + k for k in missing)} (give them as flags or in the --config YAML)")
    return from_dict(FinetuneConfig, data)
