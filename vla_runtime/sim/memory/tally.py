"""``memory-tally``: with the arm held, a yellow light flashes 1, 2 or 3 times behind a row of three white pads;
after a random delay, the robot must put its hand over the pad whose place in the row is the number of flashes
and hold still.

Memory kind: **counting** of events seen (how many), the counting that ``memory-counting`` cannot test cleanly:
there the robot's own presses are the events, a press stays visible while the button springs back, and a
memoryless policy read enough from that to count 60 % of episodes against a 25 % chance level. Here the arm is
held through the flashes and the delay, and nothing in a frame after the cue phase depends on the count:
- the cue phase has a fixed length (``SLOTS`` slots of ``SLOT_STEPS`` steps), so the go step says nothing
  about the count;
- the lit slots are a random subset of the slots, so *when* a flash came says nothing either: only how many;
- the light is behind the row, over no pad, so *where* it was says nothing.
Cue: the count (1..3) and which slots are lit; the row's position is a continuous draw per seed as well.
Chance: the count is uniform over 1..3, so 1/3.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

import numpy as np

from .base import Marker, MarkerShape, episode_rng
from .order import LIGHT_RADIUS, LIGHT_RGBA, LIGHT_Z, ROW_HIGH, ROW_LOW, PadRow
from .reach import DELAY_MAX, DELAY_MIN, TARGET_Z, ReachMemoryTask

COUNTS = (1, 2, 3)
#: the cue phase: SLOTS slots of SLOT_STEPS observations; a lit slot shows the light in its first LIT_STEPS
#: (a dark gap follows every flash, so two lit slots in a row are two flashes)
SLOTS, SLOT_STEPS, LIT_STEPS = 5, 4, 2
#: the light's offset from the middle pad, metres: behind the row (away from the camera), over no pad
LIGHT_BEHIND = 0.12


@dataclass
class TallyTask(PadRow, ReachMemoryTask):
    """Args:
    delay: steps the arm is held after the cue phase.
    row: (x, y) of the middle pad, metres.
    lit: the slots (0..SLOTS-1, increasing) in which the light flashes; the count is ``len(lit)``.
    """

    name: ClassVar[str] = "memory-tally"
    kind: ClassVar[str] = "tally"  # counting of events seen (memory-counting: of its own presses)
    cue_steps: ClassVar[int] = SLOTS * SLOT_STEPS

    row: tuple[float, float]
    lit: tuple[int, ...]

    def __post_init__(self) -> None:
        super().__post_init__()
        slots_ok = all(0 <= s < SLOTS for s in self.lit) and list(self.lit) == sorted(set(self.lit))
        if len(self.lit) not in COUNTS or not slots_ok:
            raise ValueError(
                f"`lit` must be {COUNTS[0]}..{COUNTS[-1]} increasing slots in 0..{SLOTS - 1}, got {self.lit}"
            )

    @property
    def count(self) -> int:
        """The number of flashes: the answer is pad ``count - 1`` (the first pad for one flash)."""
        return len(self.lit)

    @classmethod
    def sample(cls, seed: int) -> "TallyTask":
        rng = episode_rng(seed, cls.name)
        row = rng.uniform(ROW_LOW, ROW_HIGH)
        count = int(rng.choice(COUNTS))
        lit = tuple(sorted(int(s) for s in rng.choice(SLOTS, size=count, replace=False)))
        delay = int(rng.integers(DELAY_MIN, DELAY_MAX + 1))
        return cls(delay=delay, row=(float(row[0]), float(row[1])), lit=lit)

    @classmethod
    def chance_level(cls) -> float:
        return 1.0 / len(COUNTS)

    @classmethod
    def guess_cue(cls, episode: "TallyTask", seed: int) -> "TallyTask":
        return replace(episode, lit=cls.sample(seed).lit)

    def instruction(self) -> str:
        return ("Count the yellow flashes; when the lamp turns green, put the hand over the pad whose place in the "
                "row is that count and hold still")  # fmt: skip

    def target(self) -> np.ndarray:
        return np.array([*self.pad_xy(self.count - 1), TARGET_Z])

    def info(self) -> dict[str, float]:
        """Adds ``count`` and, once committed, ``pad``: the pad nearest the hand (counted 1..3 like the flashes)."""
        out = {**super().info(), "count": float(self.count)}
        if self._answer is not None:
            out["pad"] = float(self.nearest_pad(self._answer) + 1)
        return out

    @classmethod
    def answers(cls, infos: list[dict[str, float]]) -> dict[str, int]:
        """``N=n answered m``: the count shown and the pad the hand committed over (``no answer``: the step limit
        came first). A memory that lost a flash answers one too few."""
        out: dict[str, int] = {}
        for info in infos:
            key = "no answer" if "pad" not in info else f"N={int(info['count'])} answered {int(info['pad'])}"
            out[key] = out.get(key, 0) + 1
        return dict(sorted(out.items()))

    def cue_markers(self, t: int) -> list[Marker]:
        slot, phase = divmod(t, SLOT_STEPS)
        if t >= self.cue_steps or slot not in self.lit or phase >= LIT_STEPS:
            return []
        x, y = self.row
        return [Marker(MarkerShape.SPHERE, (x, y + LIGHT_BEHIND, LIGHT_Z), (LIGHT_RADIUS, 0.0, 0.0), LIGHT_RGBA)]

