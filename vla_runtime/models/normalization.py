"""Dataset statistics -> (un)normalisation of continuous actions and proprioception (BOUNDS_Q99).

``dataset_statistics.json`` maps a dataset key to ``{"action": {q01, q99, mask, ...}, "proprio": {...}}``.
Masked dims (True) are scaled between q01 and q99; unmasked dims (the gripper) pass through. A
missing ``mask`` means all True (older HybridVLA statistics have no proprio mask).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def resolve_unnorm_key(norm_stats: dict, unnorm_key: str | None) -> str:
    """The dataset key to use: ``unnorm_key`` if given (must exist), else the only key there is."""
    keys = sorted(norm_stats)
    if not keys:
        raise ValueError("the checkpoint's dataset statistics are empty; expected at least one dataset key")
    if unnorm_key is None:
        if len(keys) > 1:
            raise ValueError(f"the checkpoint has statistics for {len(keys)} datasets; pass `unnorm_key`, one of {keys}")
        return keys[0]
    if unnorm_key not in norm_stats:
        raise KeyError(f"unnorm_key {unnorm_key!r} is not in the dataset statistics; available: {keys}")
    return unnorm_key


@dataclass(frozen=True)
class BoundsStats:
    """q01/q99 bounds and the normalisation mask of one vector (actions or proprio), float64 [D]."""

    q01: np.ndarray
    q99: np.ndarray
    mask: np.ndarray

    @classmethod
    def from_dict(cls, stats: dict, *, where: str) -> "BoundsStats":
        """From ``{"q01": [...], "q99": [...], "mask": [...]?}``; ``where`` names the entry in errors."""
        for key in ("q01", "q99"):
            if key not in stats:
                raise KeyError(f"{where} has no {key!r} (keys: {sorted(stats)})")
        q01 = np.asarray(stats["q01"], dtype=np.float64)
        q99 = np.asarray(stats["q99"], dtype=np.float64)
        mask = np.asarray(stats.get("mask", np.ones_like(q01, dtype=bool)), dtype=bool)
        if not q01.shape == q99.shape == mask.shape or q01.ndim != 1:
            raise ValueError(
                f"{where}: q01 {q01.shape}, q99 {q99.shape} and mask {mask.shape} must be equal 1-D shapes"
            )
        return cls(q01=q01, q99=q99, mask=mask)

    @property
    def dim(self) -> int:
        return int(self.q01.shape[0])

    def unnormalize(self, x: np.ndarray) -> np.ndarray:
        """[-1, 1] -> robot units on masked dims: ``0.5 (x + 1)(q99 - q01) + q01``. x: [..., D]."""
        x = np.asarray(x, dtype=np.float64)
        return np.where(self.mask, 0.5 * (x + 1.0) * (self.q99 - self.q01) + self.q01, x)

    def normalize(self, x: np.ndarray) -> np.ndarray:
        """Robot units -> [-1, 1] on masked dims: ``clip(2 (x - q01) / (q99 - q01 + 1e-8) - 1, -1, 1)``. x: [..., D]."""
        x = np.asarray(x, dtype=np.float64)
        scaled = np.where(self.mask, 2.0 * (x - self.q01) / (self.q99 - self.q01 + 1e-8) - 1.0, x)
        return np.clip(scaled, -1.0, 1.0)


def gripper_dims(action_dim: int) -> tuple[int, ...]:
    """Gripper columns: 6 for single-arm 7-D, 6 and 13 for dual-arm 14-D, else the last column."""
    if action_dim == 14:
        return (6, 13)
    return (action_dim - 1,)


def binarize_gripper(actions: np.ndarray, dims: tuple[int, ...], *, half_is_open: bool = True) -> np.ndarray:
    """Gripper columns to {0, 1}; a copy. actions: [..., D].

    ``half_is_open``: where exactly 0.5 goes. Upstream un-normalisation writes ``0 if x < 0.5 else 1``
    (0.5 -> 1); both ensembles re-binarise with ``x > 0.5`` (0.5 -> 0), which matters when a 0 and a 1 average.
    """
    out = np.array(actions, dtype=np.float64, copy=True)
    for d in dims:
        opened = out[..., d] >= 0.5 if half_is_open else out[..., d] > 0.5
        out[..., d] = opened.astype(np.float64)
    return out


def postprocess_actions(normalized: np.ndarray, stats: BoundsStats) -> np.ndarray:
    """Diffusion output -> robot units: clip to [-1, 1], binarise the gripper at 0.5, un-normalise.

    normalized: [..., D] -> float64 [..., D]. The gripper stays 0/1 because its mask is False.
    """
    normalized = np.asarray(normalized, dtype=np.float64)
    if normalized.shape[-1] != stats.dim:
        raise ValueError(f"actions have {normalized.shape[-1]} dims; the statistics have {stats.dim}")
    clipped = binarize_gripper(np.clip(normalized, -1.0, 1.0), gripper_dims(stats.dim))
    return stats.unnormalize(clipped)
