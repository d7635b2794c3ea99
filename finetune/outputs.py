"""What a run writes into its output directory, and the resumable training checkpoint.

out/
  adapter_config.json, adapter_model.safetensors   peft LoRA adapter        (trainable: lora)
  config.json, model.safetensors, tokenizer ...   full checkpoint          (trainable: all)
  gates.safetensors, kv_config.json               ChunkGate + KVConfig     (chunked history runs)
  dataset_statistics.json                         OpenVLA-format action/proprio statistics
  session_config.json                             the SessionConfig the model was trained for
  finetune_config.yaml                            the run's config (``--config`` reruns it)
  train_log.jsonl, training_curves.png            metrics every ``log_every`` steps, plotted
  checkpoints/last/                               trainable weights + optimizer (``--resume``)
  merged/                                         LoRA merged, original on-disk format (``--merge``)
"""

from __future__ import annotations

import dataclasses
import enum
import json
import logging
import shutil
from pathlib import Path

import torch
import yaml
from safetensors.torch import load_file, save_file
from vla_runtime.data import durable
from vla_runtime.kv import KVConfig

log = logging.getLogger(__name__)

STATISTICS = "dataset_statistics.json"
SESSION_CONFIG = "session_config.json"
RUN_CONFIG = "finetune_config.yaml"
LOG = "train_log.jsonl"
PLOT = "training_curves.png"
LAST = Path("checkpoints") / "last"
# where a save writes the next checkpoint, and where the one it replaces waits until the new one is in place
NEXT, PREVIOUS = LAST.with_name("last.tmp"), LAST.with_name("last.old")
# config fields a resumed run may change
RESUMABLE_CHANGES = {
    "max_steps",
    "save_every",
    "log_every",
    "resume",
    "merge",
    "threads",
    "device",
    "data.num_workers",
    "data.cache_dir",
}


def to_plain(obj):
    """Dataclasses / Paths / enums -> YAML/JSON-safe dicts and strings."""
    if isinstance(obj, enum.Enum):
        return obj.value
    if isinstance(obj, KVConfig):  # its YAML form is flat: mode + that cache's params
        return obj.to_dict()
    if dataclasses.is_dataclass(obj):
        return {f.name: to_plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, dict):
        return {k: to_plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_plain(v) for v in obj]
    return str(obj) if isinstance(obj, Path) else obj


def write_json(path: Path, data) -> None:
    path.write_text(json.dumps(to_plain(data), indent=2) + "\n")


def write_run_config(out: Path, cfg) -> None:
    """``finetune_config.yaml``, replaced atomically (a kill while it is rewritten leaves the old one)."""
    data = to_plain(cfg)
    data["resume"] = False
    durable.write_text_atomic(out / RUN_CONFIG, yaml.safe_dump(data, sort_keys=False))


def recorded_config(out: Path) -> dict:
    """The run's ``finetune_config.yaml`` (``ValueError`` naming it when it is not a mapping)."""
    path = out / RUN_CONFIG
    data = yaml.safe_load(path.read_text())
    if not isinstance(data, dict):
        raise ValueError(f"{path} is not a run config (a mapping of its fields); it cannot be resumed")
    return data


def config_changes(out: Path, cfg) -> list[str]:
    """Fields (dotted) whose value differs from the run recorded in ``out``, ignoring ``RESUMABLE_CHANGES``."""
    old = recorded_config(out)
    new = to_plain(cfg)

    def diff(a: dict, b: dict, prefix: str = "") -> list[str]:
        out = []
        for key in sorted(set(a) | set(b)):
            name = prefix + key
            if name in RESUMABLE_CHANGES:
                continue
            if isinstance(a.get(key), dict) and isinstance(b.get(key), dict):
                out += diff(a[key], b[key], name + ".")
            elif a.get(key) != b.get(key):
                out.append(f"{name}: {a.get(key)!r} -> {b.get(key)!r}")
        return out

    return diff(old, new)


# ---- resumable checkpoint --------------------------------------------------------------------------


def save_training_state(
    out: Path, *, params: dict[str, torch.Tensor], optimizer: torch.optim.Optimizer, state: dict
) -> None:
    """Write ``checkpoints/last`` so that a kill at any moment leaves one complete checkpoint to resume from:
    trainable weights (safetensors), optimizer (tensors and numbers only, read back with ``weights_only=True``)
    and ``state`` (``step`` and what else the run needs to resume: ``state.json``, written last). The new
    checkpoint is written and fsync-ed as ``last.tmp``; the old ``last`` moves aside as ``last.old`` before the new
    one takes its name, and is deleted only then (``recover_training_state`` finishes a save a kill interrupted)."""
    last, nxt, previous = out / LAST, out / NEXT, out / PREVIOUS
    shutil.rmtree(nxt, ignore_errors=True)
    durable.make_dirs(nxt)
    save_file({k: v.detach().contiguous().cpu() for k, v in params.items()}, str(nxt / "trainable.safetensors"))
    torch.save(optimizer.state_dict(), nxt / "optimizer.pt")
    for name in ("trainable.safetensors", "optimizer.pt"):
        durable.fsync_file(nxt / name)
    durable.write_text_atomic(nxt / "state.json", json.dumps(state) + "\n")  # last: the checkpoint is complete
    if last.exists():
        shutil.rmtree(previous, ignore_errors=True)
        last.rename(previous)
    nxt.rename(last)
    durable.fsync_dir(last.parent)
    shutil.rmtree(previous, ignore_errors=True)


def _complete_step(directory: Path) -> int | None:
    """The step of the checkpoint in ``directory`` if it is complete (its ``state.json`` is written last)."""
    path = directory / "state.json"
    return int(json.loads(path.read_text())["step"]) if path.is_file() else None


def recover_training_state(out: Path) -> dict | None:
    """Make the newest complete checkpoint ``checkpoints/last`` (a save a kill interrupted left it as ``last.tmp``
    or ``last.old``) and delete the others; returns its ``state.json`` (``None``: no checkpoint)."""
    found = [(step, d) for d in (out / LAST, out / NEXT, out / PREVIOUS) if (step := _complete_step(d)) is not None]
    if not found:
        return None
    _, newest = max(found, key=lambda f: f[0])
    if newest != out / LAST:
        log.warning("a checkpoint save was interrupted: resuming from %s", newest)
        shutil.rmtree(out / LAST, ignore_errors=True)
        newest.rename(out / LAST)
        durable.fsync_dir(out / LAST.parent)
    for stale in (out / NEXT, out / PREVIOUS):
        shutil.rmtree(stale, ignore_errors=True)
    return json.loads((out / LAST / "state.json").read_text())


def training_state(out: Path) -> dict | None:
    """``checkpoints/last/state.json`` (``None``: no checkpoint)."""
    path = out / LAST / "state.json"
    return json.loads(path.read_text()) if path.is_file() else None


def check_statistics(out: Path, statistics: dict) -> None:
    """``ValueError`` unless the data's statistics are the ones the run in ``out`` started with (the action bins
    its steps so far were trained on)."""
    path = out / STATISTICS
    if path.is_file() and json.loads(path.read_text()) != json.loads(json.dumps(to_plain(statistics))):
        raise ValueError(f"--resume: the dataset's statistics differ from {path}, the run's: the data changed since "
                         "the run started; resume it with the same data, or start a new --out")  # fmt: skip


def load_training_state(out: Path, *, device: torch.device) -> tuple[dict, dict[str, torch.Tensor], dict]:
    """(``state.json``, trainable weights, optimizer state) from ``checkpoints/last``."""
    last = out / LAST
    state = training_state(out)
    if state is None:
        raise FileNotFoundError(f"nothing to resume: {last} has no training checkpoint")
    params = load_file(str(last / "trainable.safetensors"), device=str(device))
    optimizer = torch.load(last / "optimizer.pt", map_location=device, weights_only=True)
    return state, params, optimizer


# ---- log and plot ---------------------------------------------------------------------------------


def append_log(out: Path, record: dict) -> None:
    with (out / LOG).open("a") as f:
        f.write(json.dumps(record) + "\n")


def truncate_log(out: Path, step: int) -> None:
    """Drop records past ``step`` (a resumed run repeats those steps)."""
    path = out / LOG
    if path.is_file():
        keep = [line for line in path.read_text().splitlines() if line.strip() and json.loads(line)["step"] <= step]
        path.write_text("".join(line + "\n" for line in keep))


def read_log(out: Path) -> list[dict]:
    path = out / LOG
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def plot_curves(out: Path, *, retention_target: float | None) -> Path | None:
    """``training_curves.png``: cross-entropy, action-token accuracy and (with a gate) kept ratios per step."""
    records = read_log(out)
    if not records:
        return None
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib is not installed; skipping %s", PLOT)
        return None
    steps = [r["step"] for r in records]
    panels = 3 if retention_target is not None else 2
    fig, axes = plt.subplots(1, panels, figsize=(4.5 * panels, 3.4))
    axes[0].plot(steps, [r["ce"] for r in records])
    axes[0].set(title="action-token cross-entropy", xlabel="step")
    axes[1].plot(steps, [r["accuracy"] for r in records])
    axes[1].set(title="action-token accuracy", xlabel="step", ylim=(0, 1))
    if retention_target is not None:
        axes[2].plot(steps, [r["kept_ratio"] for r in records], label="soft (mean g)")
        axes[2].plot(steps, [r["hard_kept"] for r in records], label="hard (s > tau)")
        axes[2].axhline(retention_target, color="gray", linestyle="--", label="target")
        axes[2].set(title="chunks kept", xlabel="step", ylim=(0, 1.02))
        axes[2].legend(fontsize=8)
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / PLOT, dpi=110)
    plt.close(fig)
    return out / PLOT
