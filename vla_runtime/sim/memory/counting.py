"""``memory-counting``: "press the button N times, then pull back and hold still" (N = 1..4, in the instruction).

Memory kind: **counting** (how many so far): the button springs back after every press, so the scene after the
k-th press looks like the scene before the first; only the robot's own past tells how many presses are done.
A press counts when the button goes down by ``COUNT_DEPTH``; the next one only after it came back up
(``RELEASE_DEPTH``). The answer is committed when, after at least one press, the button is up, the hand is
``BACKOFF_HEIGHT`` above the button and holds still: success iff exactly N presses. A press beyond N fails at once.
Scene: button-press-topdown-v3 with the button box placed by a continuous draw per seed and a stiffer button
spring (Meta-World's barely lifts the button back). Chance: N is uniform over 1..4, so 1/4.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

import numpy as np

from .base import Marker, MemoryTask, Outcome, StillnessMonitor, episode_rng, go_lamp, hand_position, move_toward
from .scene import set_joint_stiffness

PRESS_COUNTS = (1, 2, 3, 4)
COUNT_WORDS = {1: "once", 2: "twice", 3: "three times", 4: "four times"}
#: (x, y) bounds of the button box, metres (Meta-World's own range for this task, drawn continuously)
BOX_LOW = (-0.1, 0.78)
BOX_HIGH = (0.1, 0.88)
BOX_Z = 0.115
HAND_START = (0.0, 0.7, 0.35)
BUTTON_JOINT = "btnbox_joint"
BUTTON_TOP_SITE = "buttonStart"
BUTTON_STIFFNESS = 10.0  # Meta-World's 0.5 leaves a pressed button down for seconds
#: button travel (metres) that counts as a press, and the travel below which it is up again
COUNT_DEPTH, RELEASE_DEPTH = 0.03, 0.01
#: the hand (body position) must be this far above the button's top for the hold to count as an answer
BACKOFF_HEIGHT = 0.10
CLOSED = 1.0  # native gripper effort: fingers closed (a narrow tip to press with)


def button_depression(mw: Any, rest: float) -> float:
    """How far (metres) the button is pushed in, from its rest position ``rest`` (joint value at reset)."""
    return rest - float(mw.data.joint(BUTTON_JOINT).qpos[0])


@dataclass
class CountingTask(MemoryTask):
    """Args:
    presses: N, the presses asked for.
    box: (x, y) of the button box, metres.
    """

    name: ClassVar[str] = "memory-counting"
    kind: ClassVar[str] = "counting"
    base_task: ClassVar[str] = "button-press-topdown-v3"
    max_steps: ClassVar[int] = 160

    presses: int
    box: tuple[float, float]
    count: int = field(default=0, init=False)
    _armed: bool = field(default=True, init=False, repr=False)
    _rest: float = field(default=0.0, init=False, repr=False)
    _top: np.ndarray | None = field(default=None, init=False, repr=False)
    _monitor: StillnessMonitor = field(default_factory=StillnessMonitor, init=False, repr=False)
    _press_steps: list[int] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.presses not in PRESS_COUNTS:
            raise ValueError(f"`presses` must be one of {PRESS_COUNTS}, got {self.presses}")

    @classmethod
    def sample(cls, seed: int) -> "CountingTask":
        rng = episode_rng(seed, cls.name)
        box = rng.uniform(BOX_LOW, BOX_HIGH)
        return cls(presses=int(rng.choice(PRESS_COUNTS)), box=(float(box[0]), float(box[1])))

    @classmethod
    def chance_level(cls) -> float:
        return 1.0 / len(PRESS_COUNTS)

    @classmethod
    def guess_cue(cls, episode: "CountingTask", seed: int) -> "CountingTask":
        return replace(episode, presses=cls.sample(seed).presses)

    @classmethod
    def configure(cls, mw: Any) -> None:
        set_joint_stiffness(mw, BUTTON_JOINT, BUTTON_STIFFNESS)

    def instruction(self) -> str:
        return f"Press the button {COUNT_WORDS[self.presses]}, then pull back and hold still"

    def scene_vector(self, default: np.ndarray) -> np.ndarray:
        return np.array([self.box[0], self.box[1], BOX_Z])

    def hand_start(self, default: np.ndarray) -> np.ndarray:
        return np.array(HAND_START)

    def after_reset(self, mw: Any) -> None:
        self._rest = float(mw.data.joint(BUTTON_JOINT).qpos[0])
        self._top = np.array(mw.data.site(BUTTON_TOP_SITE).xpos)

    def frozen(self, t: int) -> bool:
        return False

    def markers(self, t: int) -> list[Marker]:
        return [go_lamp(True)]

    def judge(self, t: int, mw: Any) -> Outcome:
        depth = button_depression(mw, self._rest)
        if self._armed and depth > COUNT_DEPTH:
            self.count += 1
            self._armed = False
            self._press_steps.append(t)
        elif depth < RELEASE_DEPTH:
            self._armed = True
        if self.count > self.presses:
            return Outcome.FAILURE
        hand = hand_position(mw)
        still = self._monitor.update(hand)
        backed_off = hand[2] >= self._top[2] + BACKOFF_HEIGHT
        if self.count >= 1 and self._armed and backed_off and still:
            return Outcome.SUCCESS if self.count == self.presses else Outcome.FAILURE
        return Outcome.RUNNING

    def expert(self) -> "CountingExpert":
        return CountingExpert(self.presses, self._top, self._rest)

    def cue_shown(self) -> list[int]:
        """The observations where a press was counted so far: what a counting memory must keep (retention
        pictures mark them)."""
        return list(self._press_steps)

    def info(self) -> dict[str, float]:
        """``presses``: presses made so far; ``asked``: N."""
        return {"presses": float(self.count), "asked": float(self.presses)}

    @classmethod
    def answers(cls, infos: list[dict[str, float]]) -> dict[str, int]:
        """``N=n made m``: episodes asked for n presses that made m (success needs m == n and the hold)."""
        out: dict[str, int] = {}
        for info in infos:
            if "asked" in info:
                key = f"N={int(info['asked'])} made {int(info['presses'])}"
                out[key] = out.get(key, 0) + 1
        return dict(sorted(out.items()))


class PressStage(enum.Enum):
    APPROACH = "approach"
    PRESS = "press"
    RELEASE = "release"
    BACK_OFF = "back_off"


#: where the expert aims the hand (body position) relative to the button's top; the fingertips touch the button
#: about 5 cm below the hand, and pushing / lifting aim past the switching point so the hand moves at full speed
HOVER = np.array([0.0, 0.0, 0.06])
PUSH = np.array([0.0, 0.0, -0.02])
LIFT = np.array([0.0, 0.0, 0.09])
LIFTED = 0.045
BACK_OFF = np.array([0.0, 0.0, 0.12])
#: the expert stops pushing once the judge has counted the press (the hand's lag carries the button ~1 cm further,
#: still inside its range)
PUSHED = COUNT_DEPTH
NEAR = 0.012


@dataclass
class CountingExpert:
    """Presses ``presses`` times, counting the presses it sees, then backs off and holds still.

    Args:
        presses: how many presses it makes (the episode's N for the expert; another value to test the rule).
        top: [3] the button's top at rest; rest: the button joint's value at rest.
    """

    presses: int
    top: np.ndarray
    rest: float
    done: int = 0
    stage: PressStage = PressStage.APPROACH

    def act(self, t: int, mw: Any) -> np.ndarray:
        hand, depth = hand_position(mw), button_depression(mw, self.rest)
        hover = self.top + HOVER
        if self.stage is PressStage.APPROACH and np.linalg.norm(hand - hover) < NEAR:
            self.stage = PressStage.PRESS if self.presses > self.done else PressStage.BACK_OFF
        elif self.stage is PressStage.PRESS and depth > PUSHED:
            self.done += 1
            self.stage = PressStage.RELEASE
        elif self.stage is PressStage.RELEASE and depth < RELEASE_DEPTH and hand[2] > self.top[2] + LIFTED:
            self.stage = PressStage.PRESS if self.presses > self.done else PressStage.BACK_OFF
        targets = {PressStage.APPROACH: hover, PressStage.PRESS: self.top + PUSH, PressStage.RELEASE: self.top + LIFT,
                   PressStage.BACK_OFF: self.top + BACK_OFF}  # fmt: skip
        return move_toward(hand, targets[self.stage], CLOSED)
