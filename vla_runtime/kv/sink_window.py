"""SinkWindowCache: the StreamingLLM baseline (Xiao et al. 2023) with decoupled positions.

Holds the pinned prompt, the next ``n_sink`` tokens (attention sinks) and the most recent ``window``
tokens; everything between is dropped at ``end_forward``. Keys are stored pre-RoPE and rotated at
their compacted positions (sinks, then the window, in order: StreamingLLM's "positions within the
cache"), so an episode of any length stays inside the model's position range.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .backend import select_backend
from .base import KVStats, kv_bytes
from .config import KVConfig
from .store import RotatedView, SlotStore, attend_slots

if TYPE_CHECKING:
    from ..models.llama import LlamaConfig


@dataclass(frozen=True)
class SinkWindowConfig:
    """Args:
    window: recent raw tokens kept W.
    n_sink: tokens after the pinned prompt kept as attention sinks.
    capacity: store slots (pinned + sinks + window + one forward's tokens must fit).
    backend: ``KVConfig.backend``.
    """

    window: int
    n_sink: int = 4
    capacity: int = 2048
    backend: str = "auto"

    def __post_init__(self) -> None:
        if self.window < 1:
            raise ValueError(f"`window` must be >= 1, got {self.window}")
        if self.n_sink < 0:
            raise ValueError(f"`n_sink` must be >= 0, got {self.n_sink}")
        if self.capacity <= self.window + self.n_sink:
            raise ValueError(f"`capacity` ({self.capacity}) must exceed window + n_sink ({self.window + self.n_sink})")

    @classmethod
    def from_kv(cls, kv: KVConfig, model_cfg: "LlamaConfig") -> "SinkWindowConfig":
        if kv.window is None:
            raise ValueError("KVConfig.window is None: set it (the policy fills in one frame of tokens)")
        return cls(window=kv.window, n_sink=kv.n_sink, capacity=kv.capacity or model_cfg.max_position, backend=kv.backend)


class SinkWindowCache:
    """Pinned prompt + ``n_sink`` sinks + recent ``window`` tokens; see the module docstring."""

    def __init__(
        self,
        kv_cfg: KVConfig,
        model_cfg: "LlamaConfig",
        *,
        batch: int = 1,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> None:
        self.cfg = cfg = SinkWindowConfig.from_kv(kv_cfg, model_cfg)
        self.model_cfg = model_cfg
        self.store = SlotStore(model_cfg, slots=cfg.capacity, chunk_slots=0, batch=batch, device=device, dtype=dtype)
        self.backend = select_backend(cfg.backend, model_cfg, device=device, dtype=dtype)
        self.view = RotatedView(self.store) if self.backend.kernel is None else None
        self.reset()

    def reset(self) -> None:
        self.store.reset()
        self._plan = None
        self._slots: torch.Tensor | slice | None = None
        self._n_keys = 0
        self._sinks = 0
        self._mark: int | None = None
        self._positions_used = 0

    def attend(self, layer: int, q: torch.Tensor, k_raw: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [B, Hq, T, D]; k_raw, v: [B, Hkv, T, D] (k pre-RoPE) -> [B, Hq, T, D]."""
        s = self.store
        if self._plan is None:  # first layer of this forward: slots and positions once for all layers
            t = q.shape[2]
            contiguous = s.contiguous_prefix(t)
            self._plan = s.plan(t)
            self._n_keys = s.n_pinned + s.n_raw + t
            if contiguous:
                self._slots = slice(0, self._n_keys)
            else:
                self._slots = torch.cat((torch.arange(s.n_pinned, device=s.device), self._plan.raw))
        s.write(layer, self._plan, k_raw, v)
        return attend_slots(s, self.backend, self.view, layer, q, k_raw, v, self._slots, self._n_keys)

    def end_forward(self, *, pin: bool = False) -> None:
        if self._plan is None:
            return
        s = self.store
        s.commit(self._plan.new)
        self._positions_used = max(self._positions_used, self._n_keys)
        self._plan = self._slots = None
        if pin:
            s.pin()
        elif self._mark is None:
            take = min(self.cfg.n_sink - self._sinks, s.n_raw)
            if take > 0:
                s.pin(s.n_pinned + take)
                self._sinks += take
            if s.n_raw > self.cfg.window:
                s.drop_raw(s.n_raw - self.cfg.window)

    def mark(self) -> int:
        """Open a mark: nothing is trimmed until ``rollback`` closes it."""
        self._mark = self.store.length
        return self._mark

    def rollback(self, mark: int) -> None:
        """Drop the tokens appended after ``mark`` and close the open mark."""
        self.store.check_rollback(mark)
        self.store.length = mark
        self._mark = None

    def stats(self) -> KVStats:
        s = self.store
        held = s.n_pinned + s.n_raw
        c = self.model_cfg
        return KVStats(
            tokens_raw=held,
            bytes=kv_bytes(
                held, n_layers=c.n_layers, n_kv_heads=c.n_kv_heads, head_dim=c.head_dim, batch=s.k.shape[1], dtype=s.k.dtype
            ),
            positions_used=self._positions_used,
            tokens_seen=s.length,
        )
