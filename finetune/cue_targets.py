"""Per-frame training targets drawn from the steps ``collect`` records per episode in ``meta/vla_runtime.json``
(``episode_cue_steps``, ``episode_separable_steps``): the cue count the cue-count probe regresses, the action-loss
weight of the decision steps that follow each cue step, and that of the first separable steps.

    cue_steps = recorded_steps(ds, CUE_STEPS, wanted_by="the cue-count loss")   # per episode: its cue steps
    cue_counts(cue_steps, lengths)                 # [F]: cue steps at or before each frame
    cue_seen(cue_steps, lengths)                   # [F]: 1 on the frames a cue is drawn into, else 0
    decision_weights(cue_steps, lengths, span=12, weight=5.0)   # [F]: 5 on the 12 frames after each, else 1
    separable_weights(separable_steps, lengths, span=8, weight=5.0)   # [F]: 5 on each episode's first 8, else 1
"""

from __future__ import annotations

import numpy as np

from vla_runtime.data import LeRobotDataset
from vla_runtime.data import layout as lerobot


#: the per-episode keys ``collect`` writes: the frames a cue was drawn into (counting: the presses), and the
#: frames whose expert action depends on the answer (``vla_runtime.sim.memory.separable``)
CUE_STEPS, SEPARABLE_STEPS = "episode_cue_steps", "episode_separable_steps"


def recorded_steps(ds: LeRobotDataset, key: str, *, wanted_by: str) -> list[list[int]]:
    """The per-episode step lists ``key`` of ``ds``; a clear error naming ``wanted_by`` (the option that needs
    them) for a dataset without them."""
    steps = ds.extra.get(lerobot.PER_EPISODE_KEY, {}).get(key)
    if steps is None or len(steps) != len(ds):
        raise ValueError(
            f"{ds.root} records no `{key}` for its episodes (in meta/vla_runtime.json), which {wanted_by} needs: "
            "collect it again with this version, or add them to a Meta-World dataset with "
            "`python scripts/record_cue_steps.py DATASET`"
        )
    return steps


def _check(steps: list[list[int]], lengths: list[int], what: str = "cue steps") -> None:
    if len(steps) != len(lengths):
        raise ValueError(f"{len(steps)} episodes' {what} for {len(lengths)} episodes")
    for episode, (recorded, n) in enumerate(zip(steps, lengths)):
        outside = [s for s in recorded if not (isinstance(s, (int, np.integer)) and 0 <= s < n)]
        if outside:  # e.g. a trimmed episode: a step past its end crashed, a negative one weighted its last frames
            raise ValueError(f"episode {episode} records {what} {outside} outside its {n} frames; expected steps in [0, {n})")


def cue_counts(cue_steps: list[list[int]], lengths: list[int]) -> np.ndarray:
    """Per episode, the frame indices of its cue steps -> float32 [F]: at each frame, how many of its episode's
    cue steps are at or before it."""
    _check(cue_steps, lengths)
    return np.concatenate(
        [np.searchsorted(np.sort(steps), np.arange(n), side="right") for steps, n in zip(cue_steps, lengths)]
    ).astype(np.float32)


def cue_seen(cue_steps: list[list[int]], lengths: list[int]) -> np.ndarray:
    """Per episode, the frame indices of its cue steps -> float32 [F]: 1 on those frames, 0 elsewhere (the cue-seen
    loss's labels)."""
    _check(cue_steps, lengths)
    out = [np.isin(np.arange(n), np.asarray(steps, dtype=np.int64)) for steps, n in zip(cue_steps, lengths)]
    return np.concatenate(out).astype(np.float32) if out else np.zeros(0, dtype=np.float32)


def decision_weights(cue_steps: list[list[int]], lengths: list[int], *, span: int, weight: float) -> np.ndarray:
    """-> float32 [F]: ``weight`` on the ``span`` frames after each cue step (frames t with 0 < t - c <= span for
    some cue step c of the episode), 1 elsewhere. For ``memory-counting`` these are the frames after each press,
    where the expert either presses again or backs off: the only frames whose action depends on the count."""
    _check(cue_steps, lengths)
    out = []
    for steps, n in zip(cue_steps, lengths):
        near = np.zeros(n, dtype=bool)
        for c in steps:
            near[c + 1 : c + 1 + span] = True
        out.append(np.where(near, weight, 1.0))
    return np.concatenate(out).astype(np.float32) if out else np.zeros(0, dtype=np.float32)


def separable_weights(separable_steps: list[list[int]], lengths: list[int], *, span: int | None, weight: float) -> np.ndarray:
    """-> float32 [F]: ``weight`` on the first ``span`` recorded separable steps of each episode (all of them for
    ``span`` None), 1 elsewhere. The first ones are where the expert starts to act on the answer (two flashes in
    ``memory-tally``: it slows down before the middle pad); the later ones mostly hold still over it."""
    _check(separable_steps, lengths, "separable steps")
    out = []
    for steps, n in zip(separable_steps, lengths):
        w = np.ones(n)
        w[np.sort(np.asarray(steps, dtype=np.int64))[:span]] = weight
        out.append(w)
    return np.concatenate(out).astype(np.float32) if out else np.zeros(0, dtype=np.float32)
