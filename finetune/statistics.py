"""``dataset_statistics.json`` in OpenVLA's format, computed from the training data.

    {"<dataset>": {"action": {"mask", "max", "mean", "min", "q01", "q99", "std"},
                   "proprio": {"max", "mean", "min", "q01", "q99", "std"},
                   "num_transitions": N, "num_trajectories": E}}

Actions are tokenised with BOUNDS_Q99 on the dimensions ``mask`` marks (OpenVLA: every dimension but
the last, the absolute gripper, which must already lie in [-1, 1]); the runtime un-normalises with the
same file (``ActionStats``). ``proprio`` is written when the dataset has ``observation.state``; the
runtime normalises a proprio projector's input with it.
"""

from __future__ import annotations

import numpy as np

from vla_runtime.data.stats import vector_stats

STAT_KEYS = ("max", "mean", "min", "q01", "q99", "std")


def default_action_mask(dim: int) -> list[bool]:
    """OpenVLA's convention: every dimension normalised but the last (the gripper); one dim: normalised."""
    return [True] * max(dim - 1, 1) + [False] * (dim > 1)


def _summary(values: np.ndarray) -> dict[str, list[float]]:
    stats = vector_stats(values)
    return {key: [float(x) for x in stats[key]] for key in STAT_KEYS}


def dataset_statistics(
    actions: np.ndarray,
    states: np.ndarray | None,
    *,
    mask: list[bool],
    n_episodes: int,
    action_names: list[str] | None = None,
) -> dict:
    """One dataset's entry. actions: [N, A] over every frame; states: [N, P] or ``None``.

    Raises ``ValueError`` when an un-normalised (mask False) dimension leaves [-1, 1]: tokenisation
    would clip it and the policy could never produce those values.
    """
    if len(mask) != actions.shape[1]:
        raise ValueError(
            f"`action_mask` has {len(mask)} entries; the dataset's actions have {actions.shape[1]} dimensions"
        )
    for d, normalised in enumerate(mask):
        lo, hi = float(actions[:, d].min()), float(actions[:, d].max())
        if not normalised and (lo < -1.0 or hi > 1.0):
            name = action_names[d] if action_names and d < len(action_names) else f"dim {d}"
            raise ValueError(
                f"action dimension {d} ({name}) is not normalised (action_mask False) but spans [{lo:.4g}, {hi:.4g}]; "
                "un-normalised dimensions must lie in [-1, 1] (set `data.action_mask` to normalise it)"
            )
    entry = {
        "action": {"mask": [bool(m) for m in mask], **_summary(actions)},
        "num_transitions": int(actions.shape[0]),
        "num_trajectories": int(n_episodes),
    }
    if states is not None:
        entry["proprio"] = _summary(states)
    return entry
