"""Dataset statistics (``dataset_statistics.json``, ``config.json`` ``norm_stats``) read and checked: each
quantity's bounds finite numbers with low <= high and a boolean mask, each dataset's entry a mapping. Errors are
one-line ValueErrors naming the dataset key and the statistic. ``ActionStats`` (``processing_prismatic``) and
OFT's ``BoundsStats`` read their bounds here.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np


def read_bounds(stats: Mapping, low_key: str, high_key: str, *, what: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``stats[low_key]``, ``stats[high_key]`` and ``stats["mask"]`` (default all True) as [D] arrays, checked:
    finite numbers, low <= high, a boolean mask of the same length. ``what`` names them in errors (dataset key
    and quantity)."""
    if not isinstance(stats, Mapping):
        raise ValueError(f"{what} statistics must be a mapping {{{low_key}, {high_key}, mask}}, got {type(stats).__name__}")
    if low_key not in stats or high_key not in stats:
        raise ValueError(f"{what} statistics need `{low_key}` and `{high_key}`; found keys {sorted(stats)}")
    low, high = (_vector(stats[k], f"{what} statistic `{k}`", "a list of numbers", "iuf") for k in (low_key, high_key))
    mask = _vector(stats["mask"], f"{what} statistic `mask`", "a list of booleans", "b") if "mask" in stats else np.ones_like(low, dtype=bool)
    if not low.shape == high.shape == mask.shape:
        raise ValueError(f"{what} statistics have mismatched shapes {low_key} {low.shape}, {high_key} {high.shape}, mask {mask.shape}")
    for key, values in ((low_key, low), (high_key, high)):
        if not np.isfinite(values).all():
            dims = np.flatnonzero(~np.isfinite(values)).tolist()
            raise ValueError(f"{what} statistic `{key}` has non-finite values {values[dims].tolist()} at dim(s) {dims}; expected finite numbers")
    if (low > high).any():
        dims = np.flatnonzero(low > high).tolist()
        raise ValueError(f"{what} statistics have `{low_key}` > `{high_key}` at dim(s) {dims}; expected {low_key} <= {high_key}")
    return low.astype(np.float64), high.astype(np.float64), mask


def _vector(values: object, name: str, expected: str, kinds: str) -> np.ndarray:
    """``values`` as a non-empty 1-D array whose dtype kind is one of ``kinds``; a ValueError naming ``name`` otherwise."""
    try:
        array = np.asarray(values)
    except ValueError:  # ragged nesting
        array = None
    if array is None or array.ndim != 1 or not array.size or array.dtype.kind not in kinds:
        raise ValueError(f"{name} must be {expected}, got {str(values)[:80]}")
    return array


def dataset_stats(norm_stats: Mapping, key: str, quantity: str) -> Mapping | None:
    """``norm_stats[key][quantity]`` (``action``, ``proprio``), ``None`` when the dataset has no such entry;
    a ValueError when the dataset's entry or the quantity's is not a mapping."""
    entry = norm_stats[key]
    if not isinstance(entry, Mapping):
        raise ValueError(f"dataset statistics {key!r} must map quantities to statistics ({{'action': {{q01, q99, mask}}}}), got {type(entry).__name__}")
    stats = entry.get(quantity)
    if stats is not None and not isinstance(stats, Mapping):
        raise ValueError(f"dataset statistics {key!r} `{quantity}` must be a mapping {{q01, q99, mask}}, got {type(stats).__name__}")
    return stats


def action_stats_entry(norm_stats: Mapping, key: str) -> Mapping:
    """``norm_stats[key]["action"]``, checked (``dataset_stats``); a ValueError when the dataset has none."""
    stats = dataset_stats(norm_stats, key, "action")
    if stats is None:
        raise ValueError(f"dataset statistics {key!r} have no `action` entry (keys: {sorted(norm_stats[key])}); expected {{'action': {{q01, q99, mask}}}}")
    return stats
