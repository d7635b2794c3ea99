"""What every memory task shares: its episode protocol, the verdict rule, the go lamp and the experts' motion.

A memory task runs inside a real Meta-World v3 env (``base_task``) and adds, per episode:

- a **cue** drawn from the episode's seed (continuous or discrete, independent of Meta-World's 50 fixed
  variations), shown only early in the episode (``markers``) or given in the instruction;
- phases: while ``frozen(t)`` the simulator holds the arm still whatever the policy sends, and the go
  lamp is red; then the lamp turns green and the robot acts;
- a **committed answer**: the episode ends when the robot has done its part and holds still
  (``HOLD_STEPS`` steps with the hand moving less than ``HOLD_TOL`` per step); ``observe`` judges it.

Step index convention: ``t`` is the index of the observation (0 = after reset); the action chosen at
observation ``t`` is the one ``frozen(t)`` refers to.
"""

from __future__ import annotations

import abc
import enum
import zlib
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

import numpy as np

#: the hand counts as still when it moved less than this per step (metres) ...
HOLD_TOL = 0.002
#: ... for this many consecutive steps
HOLD_STEPS = 5
#: native Meta-World action that keeps the arm where it is, gripper open
HOLD_ACTION = np.array([0.0, 0.0, 0.0, -1.0])
#: proportional gain of the experts' moves (Meta-World's experts use 25: 4 cm of error = full speed)
MOVE_GAIN = 25.0

LAMP_POS = (-0.45, 0.95, 0.05)  # back-left corner of the table, in view of the corner cameras
LAMP_RADIUS = 0.05
LAMP_WAIT_RGBA = (0.8, 0.05, 0.05, 1.0)
LAMP_GO_RGBA = (0.05, 0.9, 0.05, 1.0)


class Outcome(enum.Enum):
    """State of an episode's answer."""

    RUNNING = "running"
    SUCCESS = "success"
    FAILURE = "failure"


class MarkerShape(enum.Enum):
    SPHERE = "sphere"
    CYLINDER = "cylinder"


@dataclass(frozen=True)
class Marker:
    """A coloured shape drawn into the rendered scene only: no body, no contact, no effect on physics.

    Args:
        shape: sphere or (vertical) cylinder.
        pos: centre (x, y, z) in metres, world frame.
        size: sphere (radius, 0, 0); cylinder (radius, half-height, 0).
        rgba: colour in [0, 1].
    """

    shape: MarkerShape
    pos: tuple[float, float, float]
    size: tuple[float, float, float]
    rgba: tuple[float, float, float, float]


def go_lamp(go: bool) -> Marker:
    """The lamp that says whether the robot may act: red while the arm is held, green after."""
    return Marker(MarkerShape.SPHERE, LAMP_POS, (LAMP_RADIUS, 0.0, 0.0), LAMP_GO_RGBA if go else LAMP_WAIT_RGBA)


class Expert(Protocol):
    """A scripted expert for one episode: it keeps its own state (e.g. presses counted)."""

    def act(self, t: int, mw: Any) -> np.ndarray:
        """Native Meta-World action [4] for observation ``t`` of the Meta-World env ``mw``."""
        ...


def move_toward(hand: np.ndarray, target: np.ndarray, effort: float) -> np.ndarray:
    """Native action [4]: proportional move of the hand [3] toward ``target`` [3], clipped to Meta-World's range."""
    return np.r_[np.clip(MOVE_GAIN * (np.asarray(target) - hand), -1.0, 1.0), effort]


def hand_position(mw: Any) -> np.ndarray:
    """The hand position [3] of a Meta-World env: what the policy's state shows as ``hand_x, hand_y, hand_z``."""
    return np.array(mw.get_endeff_pos(), dtype=np.float64)


@dataclass
class StillnessMonitor:
    """Tracks whether the hand has held still for ``HOLD_STEPS`` consecutive steps."""

    last: np.ndarray | None = None
    still_steps: int = 0

    def update(self, hand: np.ndarray) -> bool:
        """hand: [3] -> True once the hand moved less than ``HOLD_TOL`` per step for ``HOLD_STEPS`` steps."""
        moved = np.inf if self.last is None else float(np.linalg.norm(hand - self.last))
        self.last = np.array(hand, dtype=np.float64)
        self.still_steps = self.still_steps + 1 if moved < HOLD_TOL else 0
        return self.still_steps >= HOLD_STEPS


def episode_rng(seed: int, task: str) -> np.random.Generator:
    """The random generator of ``task``'s episode ``seed`` (tasks draw different cues for one seed)."""
    if seed < 0:
        raise ValueError(f"seed must be >= 0, got {seed}")
    return np.random.default_rng([seed, zlib.crc32(task.encode())])


@dataclass
class MemoryTask(abc.ABC):
    """One episode of a memory task: its cue (dataclass fields set by ``sample``) and its running judgement.

    Subclasses are dataclasses whose init fields are the episode's parameters (cue, delay, layout);
    ``dataclasses.replace(episode, <cue field>=...)`` gives the same episode with another cue.
    """

    name: ClassVar[str]
    #: kind of memory tested (the README's table)
    kind: ClassVar[str]
    #: the Meta-World v3 env the task runs in
    base_task: ClassVar[str]
    #: step limit of an episode (the simulator's own limit applies too when lower)
    max_steps: ClassVar[int]

    outcome: Outcome = field(default=Outcome.RUNNING, init=False)

    @classmethod
    @abc.abstractmethod
    def sample(cls, seed: int) -> "MemoryTask":
        """The episode of ``seed`` (a new, unjudged object each call)."""

    def step_limit(self) -> int:
        """This episode's step limit: ``max_steps``, longer for a delay drawn beyond the usual range."""
        return self.max_steps

    @classmethod
    @abc.abstractmethod
    def chance_level(cls) -> float:
        """Success rate of the best cue-blind answer: an expert that always acts on the most likely cue."""

    @classmethod
    @abc.abstractmethod
    def guess_cue(cls, episode: "MemoryTask", seed: int) -> "MemoryTask":
        """``episode`` with its cue replaced by an independent draw (what a guessing expert believes)."""

    @classmethod
    def configure(cls, mw: Any) -> None:
        """Adjust the freshly built Meta-World env once (hide objects, tune joints); default: nothing."""

    @abc.abstractmethod
    def instruction(self) -> str:
        """What the robot is told (never the answer's position)."""

    def scene_vector(self, default: np.ndarray) -> np.ndarray:
        """Meta-World's reset vector (object/goal placement) for this episode; default: the variation's."""
        return default

    def hand_start(self, default: np.ndarray) -> np.ndarray:
        """Hand position [3] at reset; default: the base task's."""
        return default

    def after_reset(self, mw: Any) -> None:
        """Read what the episode needs from the reset scene (e.g. where the button is)."""

    @abc.abstractmethod
    def frozen(self, t: int) -> bool:
        """Whether the arm is held still for the action chosen at observation ``t``."""

    @abc.abstractmethod
    def markers(self, t: int) -> list[Marker]:
        """What is drawn into observation ``t``."""

    @abc.abstractmethod
    def judge(self, t: int, mw: Any) -> Outcome:
        """The outcome after the step that produced observation ``t`` (``RUNNING`` until the answer is in)."""

    @abc.abstractmethod
    def expert(self) -> Expert:
        """A scripted expert that knows this episode's cue."""

    def observe(self, t: int, mw: Any) -> Outcome:
        """Judge observation ``t``; a final outcome stays final."""
        if self.outcome is Outcome.RUNNING:
            self.outcome = self.judge(t, mw)
        return self.outcome

    def cue_shown(self) -> list[int]:
        """The observations the cue is drawn into, or the events to remember happened in (counting's presses
        so far); retention pictures mark them. Default: none."""
        return []

    def info(self) -> dict[str, float]:
        """Per-step values for ``StepInfo.extra`` (numbers only)."""
        return {}

    @classmethod
    def answers(cls, infos: list[dict[str, float]]) -> dict[str, int]:
        """How an evaluation's episodes answered, counted (label -> episodes), from each episode's last
        ``info()`` (``EpisodeResult.final_info``); what tells a lost memory from a missed reach. Default: none."""
        return {}
