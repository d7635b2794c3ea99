"""Continuous action post-processing shared by the diffusion families (CogACT, HybridVLA).

Upstream (both families) turns a normalised action into robot units by clipping to [-1, 1],
binarising the gripper at 0.5 and un-normalising with the dataset's q01/q99 and mask (the
gripper's mask is False, so it stays 0/1). The statistics are ``prismatic.processing_prismatic.ActionStats``.
"""

from __future__ import annotations

import numpy as np

from .prismatic.processing_prismatic import ActionStats


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


def postprocess_actions(normalized: np.ndarray, stats: ActionStats) -> np.ndarray:
    """Normalised actions -> robot units: clip to [-1, 1], binarise the gripper at 0.5, un-normalise.

    normalized: [..., D] -> float64 [..., D].
    """
    normalized = np.asarray(normalized, dtype=np.float64)
    if normalized.shape[-1] != stats.dim:
        raise ValueError(f"actions have {normalized.shape[-1]} dims; the statistics have {stats.dim}")
    clipped = binarize_gripper(np.clip(normalized, -1.0, 1.0), gripper_dims(stats.dim))
    return stats.unnormalize(clipped)
