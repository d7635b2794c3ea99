"""Reach-a-remembered-spot tasks (reference, order): cue, then the arm held for a random delay, then reach and hold.

Timeline of an episode (observation index ``t``):

    [0, cue_steps)                 the cue is drawn; the arm is held; go lamp red
    [cue_steps, go_step)           delay of ``delay`` steps: nothing tells the cue any more; arm held; lamp red
    go_step = cue_steps + delay    the lamp turns green; the policy moves the arm
    after go_step                  the answer is committed when the hand has travelled ``MIN_TRAVEL`` from where
                                   it was at go and then holds still (``base.HOLD_STEPS``); success iff the hand
                                   is within ``SUCCESS_RADIUS`` of the remembered target

The scene is reach-v3's with its puck and goal site removed (invisible, no contacts, gravity-compensated so
it stays put), so everything the camera shows after the cue is the same for every cue.
"""

from __future__ import annotations

import abc
import zlib
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

import numpy as np

from .base import HOLD_ACTION, Marker, MemoryTask, Outcome, StillnessMonitor, go_lamp, hand_position, move_toward
from .scene import remove_body, remove_site

#: the delay D (steps with the arm held after the cue) is uniform over these, per episode: any sliding
#: window shorter than DELAY_MIN steps has lost the cue when the lamp turns green. Evaluations may draw
#: other delays (``MetaWorldConfig.memory_delays``, ``with_delay``): conditions a policy was not trained on
DELAY_MIN, DELAY_MAX = 20, 60
#: height of the hand (body position, as the state reports it) over a remembered spot
TARGET_Z = 0.10
#: the answer counts when the hand holds still within this distance (metres) of the target
SUCCESS_RADIUS = 0.06
#: travel (metres) from the position at go before a hold counts as an answer
MIN_TRAVEL = 0.05
OPEN = -1.0  # native gripper effort: fingers open


@dataclass
class ReachMemoryTask(MemoryTask):
    """A reach task whose target is only shown before the delay. Subclasses give the target and the cue."""

    base_task: ClassVar[str] = "reach-v3"
    max_steps: ClassVar[int] = 160
    #: observations showing the cue
    cue_steps: ClassVar[int]

    delay: int
    _monitor: StillnessMonitor = field(default_factory=StillnessMonitor, init=False, repr=False)
    _go_hand: np.ndarray | None = field(default=None, init=False, repr=False)
    _travel: float = field(default=0.0, init=False, repr=False)
    _answer: np.ndarray | None = field(default=None, init=False, repr=False)  # [3] the hand where it committed

    def __post_init__(self) -> None:
        if self.delay < 1:
            raise ValueError(f"`delay` must be >= 1 step, got {self.delay}")

    def step_limit(self) -> int:
        """``max_steps``, plus the steps a delay beyond ``DELAY_MAX`` adds (the time to answer stays the same)."""
        return self.max_steps + max(0, self.delay - DELAY_MAX)

    @property
    def go_step(self) -> int:
        """First observation with the green lamp (the first action that moves the arm answers it)."""
        return self.cue_steps + self.delay

    @abc.abstractmethod
    def target(self) -> np.ndarray:
        """The hand position [3] that answers the episode."""

    @abc.abstractmethod
    def cue_markers(self, t: int) -> list[Marker]:
        """The cue drawn into observation ``t`` (empty after the cue phase)."""

    def cue_shown(self) -> list[int]:
        return [t for t in range(self.cue_steps) if self.cue_markers(t)]

    def layout_markers(self) -> list[Marker]:
        """What is drawn in every observation besides the lamp (default: nothing)."""
        return []

    @classmethod
    def configure(cls, mw: Any) -> None:
        remove_body(mw, "obj")
        remove_site(mw, "goal")

    def frozen(self, t: int) -> bool:
        return t < self.go_step

    def markers(self, t: int) -> list[Marker]:
        return self.layout_markers() + self.cue_markers(t) + [go_lamp(t >= self.go_step)]

    def judge(self, t: int, mw: Any) -> Outcome:
        if t < self.go_step:
            return Outcome.RUNNING
        hand = hand_position(mw)
        if self._go_hand is None:
            self._go_hand = hand
        self._travel = max(self._travel, float(np.linalg.norm(hand - self._go_hand)))
        still = self._monitor.update(hand)
        if not (still and self._travel >= MIN_TRAVEL):
            return Outcome.RUNNING
        self._answer = hand
        hit = np.linalg.norm(hand - self.target()) < SUCCESS_RADIUS
        return Outcome.SUCCESS if hit else Outcome.FAILURE

    def expert(self) -> "ReachExpert":
        return ReachExpert(self.target(), self.go_step)

    def info(self) -> dict[str, float]:
        """``go_step``; once the answer is committed, ``miss_m``: the hand's distance from the target (metres)."""
        out = {"go_step": float(self.go_step)}
        if self._answer is not None:
            out["miss_m"] = float(np.linalg.norm(self._answer - self.target()))
        return out


@dataclass
class ReachExpert:
    """Holds still until the lamp turns green, then moves the hand straight to ``target`` and stays there."""

    target: np.ndarray
    go_step: int

    def act(self, t: int, mw: Any) -> np.ndarray:
        if t < self.go_step:
            return HOLD_ACTION.copy()
        return move_toward(hand_position(mw), self.target, OPEN)


def with_delay(episode: MemoryTask, seed: int, delays: tuple[int, int]) -> MemoryTask:
    """``episode`` (of ``seed``) with its delay drawn uniform over ``delays`` (inclusive) from the seed, its cue and
    layout unchanged; an episode without a delay (counting) is returned as it is."""
    if not isinstance(episode, ReachMemoryTask):
        return episode
    low, high = delays
    if not 1 <= low <= high:
        raise ValueError(f"memory delays must be 1 <= low <= high steps, got {low}:{high}")
    rng = np.random.default_rng([seed, zlib.crc32(f"{episode.name}/delay".encode())])
    return replace(episode, delay=int(rng.integers(low, high + 1)))
