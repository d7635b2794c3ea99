"""The chunked cache's ``ChunkGate`` as every policy family owns it (contract 3): loaded from a trained
``gates.safetensors`` beside the checkpoint, else an untrained default built on first use."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from ..kv import ChunkGate, KVConfig, has_gate, load_gate
from ..kv.geometry import CacheGeometry

log = logging.getLogger(__name__)


class GateOwner:
    """Mixin of a policy that owns ``kv_gate`` (a ``ChunkGate`` or ``None``), on ``device``, for a model of
    ``gate_geometry``."""

    kv_gate: ChunkGate | None
    device: torch.device

    @property
    def gate_geometry(self) -> CacheGeometry:
        raise NotImplementedError

    def chunk_gate(self, kv: KVConfig) -> ChunkGate | None:
        """The ``ChunkGate`` the cache of ``kv`` uses, ``None`` when it needs none (``KVConfig.gate_config``): the
        loaded one, else an untrained default (mean-pooling aggregator, keeps every chunk) built once for ``kv``'s
        chunk size and kept on the policy."""
        gate_cfg = kv.gate_config(self.gate_geometry)
        if gate_cfg is None:
            return None
        if self.kv_gate is None:
            self.kv_gate = ChunkGate(gate_cfg).to(self.device)
        return self.kv_gate


def trained_gate(path: str | Path, device: torch.device, kv: KVConfig | None) -> tuple[ChunkGate | None, KVConfig | None]:
    """A trained ``ChunkGate`` saved in ``path`` (``gates.safetensors`` + ``kv_config.json``) and the default
    cache: ``kv`` if given, else the one the gate was trained for. ``(None, kv)`` when there is none."""
    if not has_gate(path) or device.type == "meta":
        return None, kv
    gate, gate_kv = load_gate(path, device=device)
    if kv is None:
        log.info("%s has a trained ChunkGate: the default cache is %s", path, gate_kv)
    return gate, kv or gate_kv
