"""OpenVLA-OFT's action/proprio (un)normalisation with one dataset's statistics.

Upstream (``modeling_prismatic._unnormalize_actions``, ``openvla_utils.normalize_proprio``) picks the
bounds by the platform's ``NormalizationType``: ``min``/``max`` (BOUNDS, ALOHA) or ``q01``/``q99``
(BOUNDS_Q99, LIBERO/Bridge); dims whose ``mask`` is False pass through. The regression head's output is
*not* clipped before un-normalising; proprio is clipped to [-1, 1] after normalising (every dim).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import numpy as np

from ..prismatic.statistics import read_bounds
from .configuration_oft import NormalizationType

EPS = 1e-8  # upstream adds it to (high - low) both ways


@dataclass(frozen=True)
class BoundsStats:
    """One quantity's bounds. low/high/mask: [D]."""

    low: np.ndarray
    high: np.ndarray
    mask: np.ndarray

    @classmethod
    def from_dict(cls, stats: Mapping, kind: NormalizationType, *, what: str) -> "BoundsStats":
        """``stats``: a ``dataset_statistics.json`` entry (``{"q01": [...], "q99": [...], "mask": ...}``)."""
        lo_key, hi_key = ("min", "max") if kind is NormalizationType.BOUNDS else ("q01", "q99")
        if isinstance(stats, Mapping) and not {lo_key, hi_key} <= stats.keys():
            raise ValueError(f"{what} statistics need `{lo_key}` and `{hi_key}` for {kind.name}; found {sorted(stats)}")
        return cls(*read_bounds(stats, lo_key, hi_key, what=what))

    @property
    def dim(self) -> int:
        return len(self.low)

    def unnormalize(self, x: np.ndarray) -> np.ndarray:
        """Normalised [..., D] -> robot units (masked dims; no clipping, as upstream)."""
        x = np.asarray(x, dtype=np.float64)
        return np.where(self.mask, 0.5 * (x + 1.0) * (self.high - self.low + EPS) + self.low, x)

    def normalize(self, x: np.ndarray) -> np.ndarray:
        """Robot units [..., D] -> [-1, 1] (masked dims scaled; then every dim clipped, as upstream)."""
        x = np.asarray(x, dtype=np.float64)
        return np.clip(np.where(self.mask, 2.0 * (x - self.low) / (self.high - self.low + EPS) - 1.0, x), -1.0, 1.0)
