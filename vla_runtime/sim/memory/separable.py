"""Separable steps: the steps of a memory task whose expert action depends on the answer.

In ``memory-tally`` and ``memory-order`` the answer is one of three pads. From go on, the expert moves toward the
true pad with a saturating gain (``base.MOVE_GAIN``: full speed beyond 4 cm), so for many steps its move toward the
true pad and toward another pad are the same (the way to the first pad passes the middle one). A step is
**separable** when the expert's move toward the true target differs, on some axis, by more than ``separation`` from
its move toward every wrong one: the only steps whose action label says what the answer is. They are rare (two
flashes in ``memory-tally``: the last dozen steps), and they are the decisions a memory policy must get right;
``vla-runtime finetune --separable-weight`` weights them, ``benchmarks/copycat_memory.py`` scores them.

In ``memory-reference`` the answer is a spot, and every spot one success radius or more from it is wrong. The
nearest wrong spots lie on the circle of that radius around it (``N_RING`` directions are checked): the gain being
monotone, a spot farther out on the same ray changes the move at least as much. Its separable steps are the last
steps of the reach and the hold: the wrong spot straight behind the true one draws the same full-speed move until
no axis of the hand is more than 2.8 cm from the true spot, as the pad beyond the middle one does in tally. They
are the steps whose label says where exactly to stop.

    separable(episode, hand)                  # bool: at hand [3], does the answer change the move?
    separable_steps(episode, hands)           # the steps t >= go (of hands [T, 3]) where it does

``memory-counting`` and Meta-World's own tasks have none.
"""

from __future__ import annotations

import numpy as np

from .base import MemoryTask, move_toward
from .order import N_PADS, PadRow
from .reach import OPEN, SUCCESS_RADIUS, TARGET_Z
from .reference import ReferenceTask

#: native Meta-World units (1 = full speed, 1 cm per step): a difference of 3 mm per step
SEPARATION = 0.3
#: directions around a ``memory-reference`` spot at which the nearest wrong spots are checked
N_RING = 32


def _wrong_targets(episode: MemoryTask) -> np.ndarray | None:
    """[K, 3] the nearest wrong targets: the other pads, or the ring one success radius around a reference spot;
    None for a task without a target to tell apart."""
    if isinstance(episode, PadRow):
        pads = np.array([[*episode.pad_xy(p), TARGET_Z] for p in range(N_PADS)])
        return pads[np.linalg.norm(pads[:, :2] - episode.target()[:2], axis=1) > 1e-9]
    if isinstance(episode, ReferenceTask):
        angles = np.linspace(0.0, 2 * np.pi, N_RING, endpoint=False)
        ring = SUCCESS_RADIUS * np.stack([np.cos(angles), np.sin(angles), np.zeros(N_RING)], axis=1)
        return episode.target() + ring
    return None


def separable(episode: MemoryTask, hand: np.ndarray, *, separation: float = SEPARATION) -> bool:
    """Whether, with the hand at ``hand`` [3], the expert's move toward the answer differs by more than
    ``separation`` (native units, on some axis) from its move toward each nearest wrong target; False for tasks
    without one (``memory-counting``, Meta-World's own)."""
    wrong = _wrong_targets(episode)
    return wrong is not None and _separates(np.asarray(hand, dtype=np.float64)[:3], episode.target(), wrong, separation)


def _separates(hand: np.ndarray, true: np.ndarray, wrong: np.ndarray, separation: float) -> bool:
    """hand, true: [3]; wrong: [K, 3] -> whether the move toward ``true`` differs from every move toward ``wrong``."""
    move = move_toward(hand, true, OPEN)[:3]
    return bool(min(np.abs(move - move_toward(hand, other, OPEN)[:3]).max() for other in wrong) > separation)


def separable_steps(episode: MemoryTask, hands: np.ndarray, *, separation: float = SEPARATION) -> list[int]:
    """hands: [T, >= 3] the hand position at each observation of an episode (its stored states start with it) ->
    the observations t >= ``episode.go_step`` where ``separable`` holds, increasing; ``[]`` for tasks without one."""
    wrong = _wrong_targets(episode)  # once per episode, not per step
    if wrong is None:
        return []
    hands = np.asarray(hands, dtype=np.float64)
    if hands.ndim != 2 or hands.shape[1] < 3:
        raise ValueError(f"`hands` must be [steps, >= 3] hand positions, got shape {hands.shape}")
    true = episode.target()
    return [t for t in range(episode.go_step, len(hands)) if _separates(hands[t, :3], true, wrong, separation)]
