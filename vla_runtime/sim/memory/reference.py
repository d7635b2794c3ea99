"""``memory-reference``: a blue ball shows a spot on the table for the first steps; after a random delay with the
arm held, the robot must put its hand where the ball was and hold still.

Memory kind: **reference** (where): a continuous position seen once, needed ``delay`` steps later.
Cue: the spot, uniform over a 0.40 m x 0.30 m area of the table (a continuous draw per seed).
Chance: the best cue-blind answer is a hand held over a spot whose success disc lies inside the area:
``pi * SUCCESS_RADIUS**2 / area`` (no cue-blind point does better).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import ClassVar

import numpy as np

from .base import Marker, MarkerShape, episode_rng
from .reach import DELAY_MAX, DELAY_MIN, SUCCESS_RADIUS, TARGET_Z, ReachMemoryTask

#: (x, y) bounds of the remembered spot, metres: in front of the hand's start, where the arm hides no part of
#: the ball from the corner cameras
GOAL_LOW = (-0.25, 0.45)
GOAL_HIGH = (0.15, 0.75)
BALL_RADIUS = 0.04
BALL_Z = 0.05
BALL_RGBA = (0.1, 0.3, 1.0, 1.0)


@dataclass
class ReferenceTask(ReachMemoryTask):
    """Args:
    delay: steps the arm is held after the cue.
    goal: (x, y) of the spot, metres.
    """

    name: ClassVar[str] = "memory-reference"
    kind: ClassVar[str] = "reference"
    cue_steps: ClassVar[int] = 6

    goal: tuple[float, float]

    @classmethod
    def sample(cls, seed: int) -> "ReferenceTask":
        rng = episode_rng(seed, cls.name)
        goal = rng.uniform(GOAL_LOW, GOAL_HIGH)
        return cls(delay=int(rng.integers(DELAY_MIN, DELAY_MAX + 1)), goal=(float(goal[0]), float(goal[1])))

    @classmethod
    def chance_level(cls) -> float:
        width, depth = (h - lo for lo, h in zip(GOAL_LOW, GOAL_HIGH))
        assert 2 * SUCCESS_RADIUS <= min(width, depth), "the best blind spot's disc must fit in the goal area"
        return math.pi * SUCCESS_RADIUS**2 / (width * depth)

    @classmethod
    def guess_cue(cls, episode: "ReferenceTask", seed: int) -> "ReferenceTask":
        return replace(episode, goal=cls.sample(seed).goal)

    def instruction(self) -> str:
        return "Remember where the blue ball appears; when the lamp turns green, put the hand there and hold still"

    @classmethod
    def answers(cls, infos: list[dict[str, float]]) -> dict[str, int]:
        """How far from the spot the hand committed, in success radii (under one: success), or ``no answer``."""
        cm = 100 * SUCCESS_RADIUS
        bins = ((f"< {cm:.0f} cm", SUCCESS_RADIUS), (f"{cm:.0f}-{2 * cm:.0f} cm", 2 * SUCCESS_RADIUS),
                (f"{2 * cm:.0f}-{3 * cm:.0f} cm", 3 * SUCCESS_RADIUS), (f">= {3 * cm:.0f} cm", float("inf")))  # fmt: skip
        out = dict.fromkeys([b for b, _ in bins] + ["no answer"], 0)
        for info in infos:
            miss = info.get("miss_m")
            out["no answer" if miss is None else next(b for b, top in bins if miss < top)] += 1
        return out

    def target(self) -> np.ndarray:
        return np.array([self.goal[0], self.goal[1], TARGET_Z])

    def cue_markers(self, t: int) -> list[Marker]:
        if t >= self.cue_steps:
            return []
        return [Marker(MarkerShape.SPHERE, (self.goal[0], self.goal[1], BALL_Z), (BALL_RADIUS, 0.0, 0.0), BALL_RGBA)]
