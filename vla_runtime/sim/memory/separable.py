"""Separable steps: the steps of a pad task whose expert action depends on the answer.

In ``memory-tally`` and ``memory-order`` the answer is one of three pads. From go on, the expert moves toward the
true pad with a saturating gain (``base.MOVE_GAIN``: full speed beyond 4 cm), so for many steps its move toward the
true pad and toward another pad are the same (the way to the first pad passes the middle one). A step is
**separable** when the expert's move toward the true pad differs, on some axis, by more than ``separation`` from its
move toward every other pad: the only steps whose action label says which pad the episode is about. They are rare
(two flashes in ``memory-tally``: the last dozen steps), and they are the decisions a memory policy must get right;
``vla-runtime finetune --separable-weight`` weights them, ``benchmarks/copycat_memory.py`` scores them.

    separable(episode, hand)                  # bool: at hand [3], does the answer change the move?
    separable_steps(episode, hands)           # the steps t >= go (of hands [T, 3]) where it does

Tasks without pads (``memory-reference``, ``memory-counting``, Meta-World's own) have none.
"""

from __future__ import annotations

import numpy as np

from .base import MemoryTask, move_toward
from .order import N_PADS, PadRow
from .reach import OPEN, TARGET_Z

#: native Meta-World units (1 = full speed, 1 cm per step): a difference of 3 mm per step
SEPARATION = 0.3


def _pad_targets(episode: PadRow) -> np.ndarray:
    """[N_PADS, 3] the hand positions over each pad."""
    return np.array([[*episode.pad_xy(p), TARGET_Z] for p in range(N_PADS)])


def separable(episode: MemoryTask, hand: np.ndarray, *, separation: float = SEPARATION) -> bool:
    """Whether, with the hand at ``hand`` [3], the expert's move toward the answer differs by more than
    ``separation`` (native units, on some axis) from its move toward each other pad; False for tasks without pads."""
    if not isinstance(episode, PadRow):
        return False
    hand = np.asarray(hand, dtype=np.float64)[:3]
    true = np.asarray(episode.target(), dtype=np.float64)
    pads = _pad_targets(episode)
    others = pads[np.linalg.norm(pads[:, :2] - true[:2], axis=1) > 1e-9]
    move = move_toward(hand, true, OPEN)[:3]
    return bool(min(np.abs(move - move_toward(hand, other, OPEN)[:3]).max() for other in others) > separation)


def separable_steps(episode: MemoryTask, hands: np.ndarray, *, separation: float = SEPARATION) -> list[int]:
    """hands: [T, >= 3] the hand position at each observation of an episode (its stored states start with it) ->
    the observations t >= ``episode.go_step`` where ``separable`` holds, increasing; ``[]`` for tasks without pads."""
    if not isinstance(episode, PadRow):
        return []
    hands = np.asarray(hands, dtype=np.float64)
    if hands.ndim != 2 or hands.shape[1] < 3:
        raise ValueError(f"`hands` must be [steps, >= 3] hand positions, got shape {hands.shape}")
    return [t for t in range(episode.go_step, len(hands)) if separable(episode, hands[t], separation=separation)]
