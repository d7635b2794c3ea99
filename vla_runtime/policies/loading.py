"""What every family loader (``load_<family>_policy``) settles before it reads weights: where the weights
go and the defaults a saved model brings (``session_config.json``, a trained ``ChunkGate``)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from ..config import SessionConfig, from_dict
from ..device import resolve_device, resolve_dtype
from ..kv import ChunkGate, KVConfig, has_gate, load_gate
from ..models.prismatic.configuration_prismatic import read_json

log = logging.getLogger(__name__)

SESSION_CONFIG = "session_config.json"  # the SessionConfig a fine-tuned model was trained for


@dataclass(frozen=True)
class LoadPlan:
    """A loader's settled arguments.

    Args:
        device, dtype: resolved (``device=None``: CUDA if available else CPU; ``dtype=None``: bfloat16 on
            CUDA, float32 on CPU; ``"meta"``: structure only).
        kv, unnorm_key: the caller's, else the saved session's, else (``kv``) the trained gate's.
        session: the saved ``SessionConfig``; else, with a trained gate, one with the gate's cache; else ``None``.
        gate: the trained ``ChunkGate`` (``None``: none saved, or a ``meta`` device).
    """

    device: torch.device
    dtype: torch.dtype
    kv: KVConfig | None
    unnorm_key: str | None
    session: SessionConfig | None
    gate: ChunkGate | None


def plan_load(
    path: str | Path,
    *,
    device: str | torch.device | None,
    dtype: str | torch.dtype | None,
    kv: KVConfig | None,
    unnorm_key: str | None,
    adapter: str | Path | None = None,
    full_only: str | None = None,
) -> LoadPlan:
    """Settle a loader's arguments for the checkpoint at ``path``.

    ``session_config.json`` and a trained gate (``gates.safetensors`` + ``kv_config.json``) are read from
    ``adapter`` (a fine-tuning output directory) first, else from ``path`` (models trained from scratch carry
    them there); the caller's ``kv``/``unnorm_key`` override the saved ones. full_only: the family's name when
    its runs load full checkpoints only (an ``adapter`` is then a ``ValueError``).
    """
    if adapter is not None and full_only is not None:
        raise ValueError(f"adapter {adapter}: {full_only} runs load full checkpoints only (adapter=None)")
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    places = [Path(path)] if adapter is None else [Path(adapter), Path(path)]
    session_file = next((d / SESSION_CONFIG for d in places if (d / SESSION_CONFIG).is_file()), None)
    session = from_dict(SessionConfig, read_json(session_file)) if session_file is not None else None
    if session is not None:
        kv, unnorm_key = kv or session.kv, unnorm_key or session.unnorm_key
    gate = None
    gate_dir = next((d for d in places if has_gate(d)), None)
    if gate_dir is not None and dev.type != "meta":
        gate, gate_kv = load_gate(gate_dir, device=dev)
        log.info("%s has a trained ChunkGate (%s)", gate_dir, gate_kv)
        session = session or SessionConfig(kv=gate_kv)
        kv = kv or gate_kv
    return LoadPlan(dev, dt, kv, unnorm_key, session, gate)
