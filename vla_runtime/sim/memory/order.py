"""``memory-order``: three white pads on the table; a yellow light flashes over one pad, then over another; after a
random delay with the arm held, the robot must put its hand over the pad that lit **first** and hold still.

Memory kind: **order** (which came first): two events that look alike, and the answer is the older one. The most
recent event is a lure: a memory that keeps only the latest light (a window that still sees the second flash but
not the first) points at the wrong pad. The pads stay in view the whole episode; only the flashes are the cue.
Cue: which pad lights first and which second (6 orders); the row's position on the table is a continuous draw per
seed as well. Chance: the first pad is uniform over the three, so the best cue-blind answer succeeds 1/3 of the time.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

import numpy as np

from .base import Marker, MarkerShape, episode_rng
from .reach import DELAY_MAX, DELAY_MIN, TARGET_Z, ReachMemoryTask

N_PADS = 3
#: x offsets of the pads from the row's centre, metres (neighbouring targets are further apart than two
#: success radii, so an answer is never near two pads)
PAD_OFFSETS = (-0.13, 0.0, 0.13)
ROW_LOW = (-0.1, 0.5)
ROW_HIGH = (-0.02, 0.68)
PAD_RADIUS, PAD_HALF_HEIGHT = 0.045, 0.01
PAD_RGBA = (0.92, 0.92, 0.92, 1.0)
LIGHT_RADIUS, LIGHT_Z = 0.04, 0.09
LIGHT_RGBA = (1.0, 0.85, 0.0, 1.0)
#: the first light shows in observations [0, 4), the second in [6, 10)
LIGHT_STEPS, GAP_STEPS = 4, 2


class PadRow:
    """Three white pads in a row centred at ``self.row`` (x, y), metres: the scene of ``memory-order`` and
    ``memory-tally``."""

    row: tuple[float, float]

    def pad_xy(self, pad: int) -> tuple[float, float]:
        return self.row[0] + PAD_OFFSETS[pad], self.row[1]

    def nearest_pad(self, hand: np.ndarray) -> int:
        """The pad (0..2) nearest the hand position [>= 2] in x, y."""
        return int(np.argmin([np.linalg.norm(np.asarray(self.pad_xy(p)) - hand[:2]) for p in range(N_PADS)]))

    def layout_markers(self) -> list[Marker]:
        size = (PAD_RADIUS, PAD_HALF_HEIGHT, 0.0)
        return [Marker(MarkerShape.CYLINDER, (*self.pad_xy(p), PAD_HALF_HEIGHT), size, PAD_RGBA) for p in range(N_PADS)]


@dataclass
class OrderTask(PadRow, ReachMemoryTask):
    """Args:
    delay: steps the arm is held after the second light.
    row: (x, y) of the middle pad, metres.
    first: index of the pad that lights first (0..2, left to right in x).
    second: index of the pad that lights second (another pad).
    """

    name: ClassVar[str] = "memory-order"
    kind: ClassVar[str] = "order"
    cue_steps: ClassVar[int] = 2 * LIGHT_STEPS + GAP_STEPS

    row: tuple[float, float]
    first: int
    second: int

    def __post_init__(self) -> None:
        super().__post_init__()
        if not (0 <= self.first < N_PADS and 0 <= self.second < N_PADS and self.first != self.second):
            raise ValueError(f"`first` and `second` must be two different pads in 0..{N_PADS - 1}, got {self.first}, {self.second}")

    @classmethod
    def sample(cls, seed: int) -> "OrderTask":
        rng = episode_rng(seed, cls.name)
        row = rng.uniform(ROW_LOW, ROW_HIGH)
        first, second = (int(i) for i in rng.permutation(N_PADS)[:2])
        delay = int(rng.integers(DELAY_MIN, DELAY_MAX + 1))
        return cls(delay=delay, row=(float(row[0]), float(row[1])), first=first, second=second)

    @classmethod
    def chance_level(cls) -> float:
        return 1.0 / N_PADS

    @classmethod
    def guess_cue(cls, episode: "OrderTask", seed: int) -> "OrderTask":
        other = cls.sample(seed)
        return replace(episode, first=other.first, second=other.second)

    def instruction(self) -> str:
        return ("Two yellow lights flash over the pads, one after the other; when the lamp turns green, "
                "put the hand over the pad that lit first and hold still")  # fmt: skip

    def target(self) -> np.ndarray:
        return np.array([*self.pad_xy(self.first), TARGET_Z])

    def info(self) -> dict[str, float]:
        """Adds the cue (``first``, ``second``) and, once committed, ``pad``: the pad nearest the hand (a memory
        that kept only the latest flash answers ``second``)."""
        out = {**super().info(), "first": float(self.first), "second": float(self.second)}
        if self._answer is not None:
            out["pad"] = float(self.nearest_pad(self._answer))
        return out

    @classmethod
    def answers(cls, infos: list[dict[str, float]]) -> dict[str, int]:
        """Where the hand committed: over the pad that lit ``first``, the ``second`` (the lure), the ``other``
        one, or ``no answer`` (the step limit came first)."""
        out = dict.fromkeys(("first", "second", "other", "no answer"), 0)
        for info in infos:
            pad = info.get("pad")
            key = "no answer" if pad is None else next((k for k in ("first", "second") if pad == info[k]), "other")
            out[key] += 1
        return out

    def cue_markers(self, t: int) -> list[Marker]:
        if t < LIGHT_STEPS:
            lit = self.first
        elif LIGHT_STEPS + GAP_STEPS <= t < self.cue_steps:
            lit = self.second
        else:
            return []
        return [Marker(MarkerShape.SPHERE, (*self.pad_xy(lit), LIGHT_Z), (LIGHT_RADIUS, 0.0, 0.0), LIGHT_RGBA)]
