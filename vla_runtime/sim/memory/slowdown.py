"""Slowdowns: speed noise on the executed moves after go, labelled by the expert (reference, order, tally).

The full-cache memory policy fails ``memory-tally`` by copying its own motion (``detour.py`` tells the story): in
clean demonstrations the hand moves at full speed until the expert starts to slow down near the answer, and slows
down from then on, so "my last frames show me slowing down" predicts the next action almost as well as the count
does. Driving itself, such a policy never starts to slow down at the middle pad.

A slowdown takes that cue away. From the go step to the end of the episode, each executed move is the expert's
scaled per axis by a factor drawn from ``SPEED_RANGE``, held for spells of ``SPELL_STEPS`` steps, while the
dataset stores the expert's unscaled action. The frames then show the hand slowing down and speeding up for no
reason, the labels keep saying "full speed toward the answer" until the answer is near, and only the memory tells
where that is. This is DART (Laskey et al., 2017: demonstrations under injected noise, labelled by the expert)
with the noise shaped like the motion cue the policy copied. Unlike a detour, the hand never heads for a wrong
answer, so the labels never ask the policy to turn around.

The factors keep the hand moving: at full speed (1 cm per step) the slowest spell moves it 3.5 mm per step,
above the 2 mm a step that ``base.HOLD_TOL`` counts as holding still, so a slowdown does not commit an answer on
the way. Near the answer the expert's moves shrink and the hand still settles there.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .base import MemoryTask
from .detour import draw_disturbed

#: a spell of one speed lasts this many control steps (inclusive range)
SPELL_STEPS = (2, 8)
#: the per-axis factor on the executed move during a spell (uniform over this range)
SPEED_RANGE = (0.35, 1.0)
_STREAM = 0x510D  # the slowdown draws' own random stream (independent of the cue's and the detours'), per task and seed


@dataclass(frozen=True, eq=False)
class Slowdown:
    """From observation ``start`` on, the executed move of the action chosen at observation ``t`` is the stored
    one's times ``factors[t - start]`` (per axis; the last row holds beyond the end)."""

    start: int
    factors: np.ndarray  # [horizon, 3]

    def executed(self, t: int, action: np.ndarray) -> np.ndarray:
        """action: [7] policy convention, chosen at observation ``t`` -> the action to execute [7] (a copy)."""
        out = np.array(action, copy=True)
        if t >= self.start:
            out[:3] *= self.factors[min(t - self.start, len(self.factors) - 1)]
        return out

    def record(self) -> list[int]:
        """``[start]``: what a dataset keeps per episode (``episode_slowdowns``)."""
        return [self.start]


def draw_slowdown(episode: MemoryTask, seed: int, fraction: float) -> Slowdown | None:
    """With probability ``fraction`` (drawn from ``seed`` and the task's name, so a rerun or a resumed collection
    draws the same), the slowdown of ``episode`` from its go step to its step limit; ``None`` otherwise.
    ``ValueError`` for a task without a go step or a fraction outside [0, 1]."""
    rng = draw_disturbed(episode, seed, fraction, _STREAM, "slowdowns")
    if rng is None:
        return None
    horizon = episode.step_limit() - episode.go_step + 1
    spells, covered = [], 0
    while covered < horizon:
        steps = int(rng.integers(SPELL_STEPS[0], SPELL_STEPS[1] + 1))
        spells.append(np.repeat(rng.uniform(*SPEED_RANGE, size=(1, 3)), steps, axis=0))
        covered += steps
    return Slowdown(episode.go_step, np.concatenate(spells)[:horizon])
