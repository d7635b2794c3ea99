"""Detours: recovery demonstrations for the reach-type memory tasks (reference, order, tally).

A history policy trained on clean expert episodes can learn to copy its own recent motion instead of reading its
memory: in clean demonstrations the hand's motion after go always heads for the right answer, so "keep going the
way I was going" predicts the next action almost as well as the cue does (the copycat problem of behaviour cloning
with history). In closed loop the first step of a wrong guess then becomes the evidence for the next. The full-cache
memory policy showed exactly this on ``memory-tally``: driven by the expert, it stops at the middle pad once it has
seen itself slow down there; driving itself, it never slows down and goes on to the first pad.

A detour breaks that correlation. For ``steps`` control steps from the go step, the arm is driven by a *decoy*
expert that acts on another cue (``guess_cue``: another pad, another spot), while the action the dataset stores at
every step stays the true expert's (which at those states steers back to the right answer); then the true expert
drives to the end. The frames show the hand heading for a wrong answer, the labels say where the memory points.
This is DART's idea (Laskey et al., 2017: demonstrations under injected disturbances, labelled by the expert) with
the disturbance shaped like the learner's own mistake.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import numpy as np

from .base import Expert, MemoryTask
from .reach import SUCCESS_RADIUS, ReachMemoryTask

#: a detour lasts this many control steps (inclusive range): from a nudge to most of the way to a wrong pad
DETOUR_STEPS = (2, 16)
#: the decoy's answer lies at least this far (metres) from the true one, so a detour heads somewhere wrong
DECOY_MIN_DISTANCE = 2 * SUCCESS_RADIUS
_STREAM = 0xDE70  # the detour draws' own random stream (independent of the cue's), per task and seed


@dataclass(frozen=True)
class Detour:
    """The arm follows ``decoy`` for the actions chosen at observations ``start .. start + steps - 1``."""

    start: int
    steps: int
    decoy: Expert

    def covers(self, t: int) -> bool:
        """Whether the action chosen at observation ``t`` is the decoy's."""
        return self.start <= t < self.start + self.steps

    def record(self) -> list[int]:
        """``[start, steps]``: what a dataset keeps per episode (``episode_detours``)."""
        return [self.start, self.steps]


def supports_detours(task: type[MemoryTask]) -> bool:
    """Whether ``task`` holds the arm until a go step and then reaches for its answer (what a detour needs)."""
    return issubclass(task, ReachMemoryTask)


def draw_disturbed(episode: MemoryTask, seed: int, fraction: float, stream: int, what: str) -> np.random.Generator | None:
    """Whether ``episode`` (of ``seed``) gets a disturbance (``what``: detours, slowdowns, driven spells): with
    probability ``fraction``, drawn from its own random ``stream`` and the task's name and ``seed`` only (so a rerun or
    a resumed collection draws the same), the generator to draw the disturbance's shape from; ``None`` otherwise.
    ``ValueError`` unless ``fraction`` is in [0, 1] and ``episode`` has a go step."""
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"the {what} fraction must be in [0, 1], got {fraction}")
    if not isinstance(episode, ReachMemoryTask):
        raise ValueError(
            f"{what} need a memory task that holds the arm until a go step (memory-reference, memory-order, "
            f"memory-tally); {episode.name} has none"
        )
    rng = np.random.default_rng([seed, stream, zlib.crc32(episode.name.encode())])
    return rng if rng.random() < fraction else None


def draw_detour(episode: MemoryTask, seed: int, fraction: float) -> Detour | None:
    """With probability ``fraction`` (drawn from ``seed``, so a rerun or a resumed collection draws the same), a
    detour of ``episode``: 2-16 steps from its go step toward the answer of another cue at least
    ``DECOY_MIN_DISTANCE`` from the true one; ``None`` otherwise. The draws depend on the task and ``seed`` only.
    ``ValueError`` for a task without a go step."""
    rng = draw_disturbed(episode, seed, fraction, _STREAM, "detours")
    if rng is None:
        return None
    steps = int(rng.integers(DETOUR_STEPS[0], DETOUR_STEPS[1] + 1))
    for _ in range(100):  # a discrete cue repeats 1 time in 3 at most: 100 draws all repeating is ~1e-48
        decoy = type(episode).guess_cue(episode, int(rng.integers(2**31)))
        if np.linalg.norm(decoy.target() - episode.target()) >= DECOY_MIN_DISTANCE:
            return Detour(episode.go_step, steps, decoy.expert())
    raise RuntimeError(f"{episode.name} seed {seed}: no cue with an answer {DECOY_MIN_DISTANCE} m from the true one")
