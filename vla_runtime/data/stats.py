"""Feature statistics in LeRobot's ``meta/stats.json`` form: min, max, mean, std, count, q01..q99.

Numeric features: exact, per dimension, over every frame. Images: exact per-channel statistics of
every pixel of every frame, from 256-bin histograms (uint8 values make the histogram exact),
scaled to [0, 1] and shaped [3, 1, 1] as LeRobot stores them.
"""

from __future__ import annotations

import numpy as np

from .layout import QUANTILES


def vector_stats(values: np.ndarray) -> dict[str, np.ndarray]:
    """values: [N, D] (or [N]) -> {stat: [D]} with ``count`` [1]."""
    v = np.asarray(values, dtype=np.float64)
    v = v.reshape(v.shape[0], -1)
    stats = {
        "min": v.min(axis=0),
        "max": v.max(axis=0),
        "mean": v.mean(axis=0),
        "std": v.std(axis=0),
        "count": np.array([v.shape[0]]),
    }
    for key, q in QUANTILES.items():
        stats[key] = np.quantile(v, q, axis=0)
    return stats


class ImageStats:
    """Accumulates per-channel pixel histograms of uint8 [T, H, W, 3] frames."""

    def __init__(self) -> None:
        self.hist = np.zeros((3, 256), dtype=np.int64)
        self.frames = 0

    def update(self, frames: np.ndarray) -> None:
        """frames: uint8 [T, H, W, 3]."""
        for c in range(3):
            self.hist[c] += np.bincount(frames[..., c].ravel(), minlength=256)
        self.frames += frames.shape[0]

    def add(self, other: "ImageStats") -> None:
        """Count another accumulator's frames into this one."""
        self.hist += other.hist
        self.frames += other.frames

    def stats(self) -> dict[str, np.ndarray]:
        """{stat: [3, 1, 1]} in [0, 1]; ``count`` [1] = frames seen."""
        levels = np.arange(256, dtype=np.float64) / 255.0
        total = self.hist.sum(axis=1, keepdims=True).astype(np.float64)  # [3, 1]
        p = self.hist / total
        mean = (p * levels).sum(axis=1)
        std = np.sqrt(np.maximum((p * levels**2).sum(axis=1) - mean**2, 0.0))
        cdf = np.cumsum(self.hist, axis=1) / total
        nonzero = self.hist > 0
        out = {
            "min": levels[nonzero.argmax(axis=1)],
            "max": levels[255 - nonzero[:, ::-1].argmax(axis=1)],
            "mean": mean,
            "std": std,
        }
        for key, q in QUANTILES.items():
            # smallest level whose cumulative share reaches q (the lower quantile of the pixel distribution)
            out[key] = levels[(cdf < q).sum(axis=1)]
        stats = {k: v.reshape(3, 1, 1) for k, v in out.items()}
        # LeRobot's key order: min, max, mean, std, count, quantiles
        return {**{k: stats[k] for k in ("min", "max", "mean", "std")}, "count": np.array([self.frames]),
                **{k: stats[k] for k in QUANTILES}}


def to_json(stats: dict[str, dict[str, np.ndarray]]) -> dict:
    """Nested lists/ints/floats for ``json.dump``."""
    return {key: {name: np.asarray(value).tolist() for name, value in s.items()} for key, s in stats.items()}


def from_json(data: dict) -> dict[str, dict[str, np.ndarray]]:
    return {key: {name: np.asarray(value) for name, value in s.items()} for key, s in data.items()}
