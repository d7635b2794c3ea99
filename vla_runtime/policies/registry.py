"""The policy families a checkpoint directory can hold, and loading one (``load_policy``).

The built-in families are named here by where their code lives and imported only when used: telling
a checkpoint's family imports its small configuration module, loading it the family's policy module.
Plug-ins (families defined outside vla_runtime) add themselves with ``register_family``. Every built-in
family's loader takes the speed options of ``models.speed`` (``quantize``, ``fuse``, ``prepack``); a plug-in says
whether its loader does (``register_family(..., speed_options=True)``), and ``check_speed_options`` refuses them
by name for a checkpoint whose family does not.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Callable

from .base import Policy

Detector = Callable[[Path], bool]
Loader = Callable[..., Policy]


class _Lazy:
    """A function named ``"module:attribute"``, imported at its first call."""

    def __init__(self, target: str) -> None:
        self.target = target

    def __call__(self, *args, **kwargs):
        module, attribute = self.target.split(":")
        return getattr(importlib.import_module(module), attribute)(*args, **kwargs)

    def __repr__(self) -> str:
        return f"<lazy {self.target}>"


def _builtin(detector: str, loader: str) -> tuple[Detector, Loader]:
    return _Lazy(f"vla_runtime.{detector}"), _Lazy(f"vla_runtime.policies.{loader}")


# family name -> (detector(path) -> bool, loader(path, **kwargs) -> Policy), asked in this order
FAMILIES: dict[str, tuple[Detector, Loader]] = {
    # an OFT directory is also an OpenVLA directory: asked first
    "openvla-oft": _builtin(
        "models.openvla_oft.configuration_oft:detect_openvla_oft", "openvla_oft:load_openvla_oft_policy"
    ),
    "openvla": _builtin("models.prismatic.configuration_prismatic:detect_openvla", "openvla:load_openvla_policy"),
    "cogact": _builtin("checkpoints.prismatic_run:detect_cogact", "cogact:load_cogact_policy"),
    "hybridvla": _builtin("checkpoints.prismatic_run:detect_hybridvla", "hybridvla:load_hybridvla_policy"),
}
SPEED_FAMILIES: set[str] = set(FAMILIES)  # the families whose loader takes quantize / fuse / prepack (models.speed)


def register_family(name: str, detect: Detector, load: Loader, *, speed_options: bool = False) -> None:
    """Add a policy family: ``detect(path)`` says whether a directory holds one, ``load(path, **kwargs)`` loads it.
    ``speed_options``: ``load`` takes ``quantize``, ``fuse`` and ``prepack`` (``models.speed.speed_up`` applies them)."""
    if name in FAMILIES:
        raise ValueError(f"policy family {name!r} is already registered")
    FAMILIES[name] = (detect, load)
    if speed_options:
        SPEED_FAMILIES.add(name)


def detect_family(path: str | Path) -> str:
    """Which registered family a checkpoint directory holds; ``FileNotFoundError``/``ValueError`` otherwise."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"checkpoint directory {path} does not exist")
    if not path.is_dir():
        raise ValueError(f"checkpoint path {path} is a file; expected a checkpoint directory")
    for name, (detect, _) in FAMILIES.items():
        if detect(path):
            return name
    raise ValueError(
        f"{path} is not a checkpoint this runtime knows: expected config.json (OpenVLA HF format) "
        f"or a run directory with checkpoints/*.pt (CogACT/HybridVLA); known families: {', '.join(sorted(FAMILIES))}"
    )


def check_speed_options(path: str | Path, given: dict[str, str]) -> None:
    """``given``: each speed option a caller passes -> how its user wrote it (``--fuse``, ``parameter `fuse```).
    ``ValueError`` naming the first of them and the checkpoint's family when that family's loader does not take
    them (a plug-in registered without ``speed_options``); nothing to check when ``given`` is empty."""
    if not given:
        return
    family = detect_family(path)
    if family not in SPEED_FAMILIES:
        raise ValueError(
            f"{next(iter(given.values()))} applies to the families whose loader takes the speed options "
            f"({', '.join(sorted(SPEED_FAMILIES))}); {path} is a {family} checkpoint"
        )


def load_policy(path: str | Path, **kwargs) -> Policy:
    """Load a policy checkpoint; the family is recognised from the directory.

    kwargs: ``device`` ("cpu"/"cuda"), ``dtype`` ("float32"/"bfloat16"/None = per-device default),
    ``adapter`` (fine-tuning output directory), family-specific options.
    """
    name = detect_family(path)
    return FAMILIES[name][1](Path(path), **kwargs)
