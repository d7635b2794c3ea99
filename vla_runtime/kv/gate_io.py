"""Saving and loading a trained ``ChunkGate`` with the ``KVConfig`` it was trained for (contract 3).

A gate directory holds ``gates.safetensors`` (float32 weights) and ``kv_config.json``
(``{"kv": <KVConfig flat form>, "gate": <ChunkGateConfig>}``).
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from .config import KVConfig
from .gate import ChunkGate, ChunkGateConfig

GATE_WEIGHTS = "gates.safetensors"
GATE_CONFIG = "kv_config.json"


def save_gate(gate: ChunkGate, directory: str | Path, kv_cfg: KVConfig) -> Path:
    """Write ``gates.safetensors`` (float32 weights) and ``kv_config.json`` into ``directory``; returns it."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {name: p.detach().float().contiguous().cpu() for name, p in gate.state_dict().items()}
    save_file(tensors, str(directory / GATE_WEIGHTS), metadata={"format": "pt", "kind": "vla_runtime.ChunkGate"})
    meta = {"kv": kv_cfg.to_dict(), "gate": asdict(gate.cfg)}
    (directory / GATE_CONFIG).write_text(json.dumps(meta, indent=2) + "\n")
    return directory


def has_gate(directory: str | Path) -> bool:
    """Whether ``directory`` holds a saved gate (``gates.safetensors`` + ``kv_config.json``)."""
    directory = Path(directory)
    return (directory / GATE_WEIGHTS).is_file() and (directory / GATE_CONFIG).is_file()


def saved_gate_geometry(directory: str | Path) -> dict[str, int | bool]:
    """The chunked cache's geometry a saved gate needs (``chunk``, ``aggregator_hidden``, ``gate_hidden``) and how
    the policy was trained to read its chunks (``chunk_mass``, ``False`` in configs written before it existed),
    read from ``kv_config.json`` without loading weights; ``{}`` when ``directory`` holds no readable gate
    (loading then reports what is wrong)."""
    if not has_gate(directory):
        return {}
    try:
        meta = json.loads((Path(directory) / GATE_CONFIG).read_text())
        geometry = {k: int(meta["gate"][k]) for k in ("chunk", "aggregator_hidden", "gate_hidden")}
        return geometry | {"chunk_mass": bool(meta["kv"].get("chunk_mass", False))}
    except (json.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError):
        return {}


def load_gate(directory: str | Path, *, device: torch.device | str = "cpu") -> tuple[ChunkGate, KVConfig]:
    """Read a gate written by ``save_gate``. Raises ``FileNotFoundError`` naming a missing file and
    ``ValueError`` naming missing, unexpected or mis-shaped tensors."""
    directory = Path(directory)
    for name in (GATE_WEIGHTS, GATE_CONFIG):
        if not (directory / name).is_file():
            raise FileNotFoundError(f"{directory / name} does not exist (a gate is saved as {GATE_WEIGHTS} + {GATE_CONFIG})")
    try:
        meta = json.loads((directory / GATE_CONFIG).read_text())
        kv_cfg = KVConfig.from_dict(meta["kv"])
        gate_cfg = ChunkGateConfig(**meta["gate"])
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise ValueError(f"{directory / GATE_CONFIG} is not a gate config ({e!r}); expected keys 'kv' and 'gate'") from e
    gate = ChunkGate(gate_cfg)
    try:
        tensors = load_file(str(directory / GATE_WEIGHTS))
    except SafetensorError as e:
        raise ValueError(f"{directory / GATE_WEIGHTS} is not a readable safetensors file (truncated or corrupt): {e}") from e
    expected = gate.state_dict()
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    shapes = sorted(
        f"{k}: {tuple(tensors[k].shape)} != {tuple(v.shape)}"
        for k, v in expected.items()
        if k in tensors and tensors[k].shape != v.shape
    )
    if missing or unexpected or shapes:
        raise ValueError(
            f"{directory / GATE_WEIGHTS} does not match {GATE_CONFIG}: missing {missing}, unexpected {unexpected}, shapes {shapes}"
        )
    gate.load_state_dict(tensors)
    return gate.to(device), kv_cfg
