"""The simulator protocol every backend implements, and its observation type.

    env = make_env("metaworld", MetaWorldConfig(resolution=(128, 128)))
    obs = env.reset("drawer-open-v3", seed=0)          # SimObservation
    obs, done, success, info = env.step(action_7d)     # policy convention (see ``actions``)
    policy_obs = obs.to_policy()                       # api.Observation for session.step

A simulator never knows which policy or cache runs; the eval loop only talks to the runtime API.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field

import numpy as np

from ..api import PRIMARY_CAMERA, Observation


@dataclass
class SimObservation:
    """What a simulator shows the policy at one step.

    Args:
        images: camera name -> uint8 [H, W, 3] RGB, in the order the config lists the cameras
            (the first is the policy's primary camera).
        state: proprioception [state_dim] float32 (the robot's own state only, no object/goal positions).
        instruction: the task in natural language.
        t: simulated time since reset, seconds.
    """

    images: dict[str, np.ndarray]
    state: np.ndarray
    instruction: str
    t: float = 0.0

    def to_policy(self) -> Observation:
        """The runtime API's observation: the first camera becomes ``"primary"``, the others keep their names."""
        names = list(self.images)
        if not names:
            raise ValueError("this observation has no camera images (the simulator was built without cameras)")
        images = {PRIMARY_CAMERA: self.images[names[0]], **{n: self.images[n] for n in names[1:]}}
        return Observation(images=images, state=self.state, t=self.t)


@dataclass
class StepInfo:
    """Per-step diagnostics beside (done, success).

    Args:
        step: steps taken since reset (1 after the first ``step``).
        truncated: the step limit ended the episode.
        native_action: the action the simulator executed, in its own convention.
        extra: backend-specific values (Meta-World's reward terms, RLBench's error text).
    """

    step: int
    truncated: bool
    native_action: np.ndarray
    extra: dict = field(default_factory=dict)


class SimEnv(abc.ABC):
    """One simulator instance; episodes run one at a time. Use as a context manager to free the renderer."""

    #: registry key, set by subclasses
    name: str
    #: frames per second of one ``step`` (for datasets and videos)
    fps: int

    @property
    @abc.abstractmethod
    def tasks(self) -> list[str]:
        """Every task name ``reset`` accepts."""

    @property
    @abc.abstractmethod
    def cameras(self) -> list[str]:
        """Camera names in the observation, primary first."""

    @property
    @abc.abstractmethod
    def state_names(self) -> list[str]:
        """One name per entry of ``SimObservation.state``."""

    @property
    @abc.abstractmethod
    def max_steps(self) -> int:
        """Step limit of an episode."""

    @abc.abstractmethod
    def instruction(self, task: str, seed: int = 0) -> str:
        """The natural-language instruction for ``task`` (in episode ``seed``, for tasks whose instruction
        carries a per-episode parameter, e.g. how many presses)."""

    @abc.abstractmethod
    def reset(self, task: str, seed: int) -> SimObservation:
        """Start an episode of ``task``; the same (task, seed) gives the same initial scene."""

    @abc.abstractmethod
    def step(self, action: np.ndarray) -> tuple[SimObservation, bool, bool, StepInfo]:
        """Apply one policy action [7] -> (observation, done, success, info)."""

    def close(self) -> None:
        """Free renderers and simulator processes."""

    def __enter__(self) -> "SimEnv":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def check_task(task: str, valid: list[str], simulator: str) -> None:
    """``KeyError`` naming ``task`` and listing the valid names when it is unknown."""
    if task not in valid:
        raise KeyError(f"unknown {simulator} task {task!r}; valid tasks: {', '.join(sorted(valid))}")
