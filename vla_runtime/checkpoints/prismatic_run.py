"""Prismatic run directories (CogACT, HybridVLA, openvla-7b-prismatic): read and write the upstream layout.

    <run>/config.json                 draccus dump of the training config (``vla.base_vlm``, window sizes, ...)
    <run>/dataset_statistics.json     {dataset_key: {"action": {q01, q99, mask, ...}, "proprio": {...}}}
    <run>/checkpoints/step-XXXXXX-epoch-XX-loss=X.XXXX.pt   {"model": {module_name: state_dict}}

``.pt`` files are read with ``torch.load(weights_only=True)`` (tensors and plain containers only, no
arbitrary unpickling) and memory-mapped, so listing modules costs no reading of weights.

Imports nothing from ``vla_runtime.models`` (family detection uses it); the VLM is built in ``prismatic_vlm``.
"""

from __future__ import annotations

import json
import pickle
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

CONFIG_FILE = "config.json"
STATISTICS_FILE = "dataset_statistics.json"
CHECKPOINT_DIR = "checkpoints"
_STEP = re.compile(r"step-(\d+)")


def _read_json(path: Path) -> dict:
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist; a Prismatic run directory needs it")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data


def find_checkpoint(run_dir: Path) -> Path:
    """The run's ``.pt``: the only one, else the one with the largest ``step-N``."""
    ckpt_dir = run_dir / CHECKPOINT_DIR
    files = sorted(ckpt_dir.glob("*.pt")) if ckpt_dir.is_dir() else []
    if not files:
        raise FileNotFoundError(f"no checkpoint: {ckpt_dir}/*.pt does not exist")
    if len(files) == 1:
        return files[0]
    steps = {f: int(m.group(1)) for f in files if (m := _STEP.search(f.name))}
    best = max(steps.values(), default=None)
    latest = [f for f, s in steps.items() if s == best]
    if len(latest) != 1:
        names = ", ".join(f.name for f in files)
        raise ValueError(f"{ckpt_dir} holds several checkpoints ({names}); pass `checkpoint=` to pick one")
    return latest[0]


def is_run_dir(path: Path) -> bool:
    """``config.json`` plus at least one ``checkpoints/*.pt``."""
    return (path / CONFIG_FILE).is_file() and any((path / CHECKPOINT_DIR).glob("*.pt"))


def load_checkpoint_modules(path: Path) -> dict[str, dict[str, torch.Tensor]]:
    """``{module_name: state_dict}`` of a ``.pt`` (memory-mapped, ``weights_only=True``); a ValueError naming the
    file when it cannot be read (truncated, corrupt) or its modules are not state dicts of tensors."""
    try:
        blob = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as e:
        raise ValueError(
            f"{path} holds objects other than tensors and plain containers; it is not loaded "
            f"(weights_only=True refuses arbitrary pickles): {e}"
        ) from e
    except (RuntimeError, OSError, EOFError, ValueError) as e:
        reason = str(e).splitlines()[0].split(". ")[0] if str(e) else type(e).__name__  # torch appends paragraphs of advice
        raise ValueError(f"cannot read {path} as a torch checkpoint (truncated or corrupt?): {reason}") from e
    if not isinstance(blob, dict) or "model" not in blob:
        found = sorted(blob) if isinstance(blob, dict) else type(blob).__name__
        raise KeyError(f"{path} has no top-level 'model' entry (found: {found}); expected {{'model': {{module: state_dict}}}}")
    modules = blob["model"]
    if not isinstance(modules, dict):
        raise ValueError(f"{path} `model` is a {type(modules).__name__}; expected {{module_name: state_dict}}")
    for name, state in modules.items():
        if not isinstance(state, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items()):
            raise ValueError(f"{path} module {name!r} is not a state dict of tensors (got {type(state).__name__}); expected {{name: tensor}}")
    return modules


@dataclass(frozen=True)
class PrismaticRun:
    """An opened run directory: its config, statistics and the chosen checkpoint file."""

    path: Path
    config: dict
    norm_stats: dict
    checkpoint: Path

    @classmethod
    def open(cls, path: str | Path, *, checkpoint: str | Path | None = None) -> "PrismaticRun":
        """``checkpoint``: a ``.pt`` path or a file name under ``checkpoints/``; ``None`` = ``find_checkpoint``."""
        path = Path(path)
        if not path.is_dir():
            raise FileNotFoundError(f"run directory {path} does not exist")
        config = _read_json(path / CONFIG_FILE)
        norm_stats = _read_json(path / STATISTICS_FILE)
        if checkpoint is None:
            ckpt = find_checkpoint(path)
        else:
            ckpt = Path(checkpoint)
            ckpt = ckpt if ckpt.is_absolute() or ckpt.exists() else path / CHECKPOINT_DIR / ckpt
            if not ckpt.is_file():
                raise FileNotFoundError(f"checkpoint {ckpt} does not exist")
        return cls(path=path, config=config, norm_stats=norm_stats, checkpoint=ckpt)

    def modules(self) -> dict[str, dict[str, torch.Tensor]]:
        """All module state dicts of the checkpoint (memory-mapped)."""
        return load_checkpoint_modules(self.checkpoint)

    def require(self, modules: dict[str, dict], names: tuple[str, ...], *, why: str = "") -> None:
        """``KeyError`` naming every module of ``names`` the checkpoint lacks (and listing what it has)."""
        missing = [n for n in names if n not in modules]
        if missing:
            hint = f" {why}" if why else ""
            raise KeyError(f"{self.checkpoint} lacks module(s) {missing} (found: {sorted(modules)}).{hint}")

    def check_module(self, name: str, state: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Tensor]) -> None:
        """Module ``name``'s ``state`` against the model's ``expected`` state dict (meta tensors will do): the same
        tensor names and shapes, floating point where the model's are; a ValueError naming the ``.pt`` otherwise."""
        missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
        if missing or unexpected:
            raise ValueError(
                f"{self.checkpoint} module {name!r} does not match the model: missing {missing[:5] or 'none'}, "
                f"unexpected {unexpected[:5] or 'none'}"
            )
        for key, want in expected.items():
            got = state[key]
            if got.shape != want.shape:
                raise ValueError(f"{self.checkpoint} module {name!r}: `{key}` has shape {list(got.shape)}; expected {list(want.shape)}")
            if want.is_floating_point() and not got.is_floating_point():
                raise ValueError(f"{self.checkpoint} module {name!r}: `{key}` is {got.dtype}; expected a floating-point weight")


def save_run(
    out: str | Path,
    *,
    config: dict,
    norm_stats: dict,
    modules: dict[str, dict[str, torch.Tensor]],
    step: int = 0,
    epoch: int = 0,
    loss: float = 0.0,
) -> Path:
    """Write a run directory in the upstream layout; returns the ``.pt`` path. Tensors are saved contiguous."""
    out = Path(out)
    (out / CHECKPOINT_DIR).mkdir(parents=True, exist_ok=True)
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=2))
    (out / STATISTICS_FILE).write_text(json.dumps(norm_stats, indent=2))
    ckpt = out / CHECKPOINT_DIR / f"step-{step:06d}-epoch-{epoch:02d}-loss={loss:.4f}.pt"
    state = {name: {k: v.detach().contiguous().cpu() for k, v in sd.items()} for name, sd in modules.items()}
    torch.save({"model": state}, ckpt)
    return ckpt


def run_config_has(path: Path, keys: tuple[str, ...], module: str) -> bool:
    """Family detection: a run directory whose ``config.json`` has one of ``keys`` or, failing that,
    whose checkpoint holds ``module`` (read from the memory-mapped ``.pt``, no weights)."""
    if not is_run_dir(path):
        return False
    try:
        config = _read_json(path / CONFIG_FILE)
    except ValueError:
        return False
    if any(k in config for k in keys):
        return True
    try:
        return module in load_checkpoint_modules(find_checkpoint(path))
    except (ValueError, KeyError, FileNotFoundError):
        return False


def detect_cogact(path: Path) -> bool:
    """A CogACT run directory: ``config.json`` with ``action_model_type``, or an ``action_model`` in the checkpoint."""
    return run_config_has(Path(path), ("action_model_type",), "action_model")


def detect_hybridvla(path: Path) -> bool:
    """A HybridVLA run directory: ``config.json`` with ``use_diff``/``need_to_sub``, or diffusion modules in the checkpoint."""
    return run_config_has(Path(path), ("use_diff", "need_to_sub"), "x_embedder")
