"""A small ``vla_runtime.sim.SimEnv`` for the closed-loop ROS test that needs a policy to succeed.

A point on a line: the camera image's red channel encodes the position, the state is
``[x, steps / 100]``, and each 7-D policy action moves the point by ``0.5 * action[0]``. The episode
succeeds when ``x > goal`` and ends after ``max_steps`` otherwise. It records every frame it rendered
and every action it executed, so a test can check that each action was computed from one of its frames.
"""

from __future__ import annotations

import numpy as np
from vla_runtime.sim import SimEnv, SimObservation, StepInfo

TASK = "push-right"
INSTRUCTION = "push the block to the right"


class LineReachEnv(SimEnv):
    name = "line-reach"
    fps = 10

    def __init__(self, *, goal: float = 0.5, max_steps: int = 30, size: tuple[int, int] = (32, 40)) -> None:
        self.goal, self._max_steps, self.size = goal, max_steps, size
        self.frames: list[tuple[np.ndarray, np.ndarray]] = []  # (image, state) of every observation
        self.executed: list[np.ndarray] = []
        self.resets: list[tuple[str, int]] = []
        self.x, self.steps = 0.0, 0

    @property
    def tasks(self) -> list[str]:
        return [TASK]

    @property
    def cameras(self) -> list[str]:
        return ["front"]

    @property
    def state_names(self) -> list[str]:
        return ["x", "progress"]

    @property
    def max_steps(self) -> int:
        return self._max_steps

    def instruction(self, task: str) -> str:
        if task != TASK:
            raise KeyError(f"unknown task {task!r}; valid tasks: {TASK}")
        return INSTRUCTION

    def _observe(self) -> SimObservation:
        image = np.zeros((*self.size, 3), np.uint8)
        image[..., 0] = int(np.clip(60 + 150 * self.x, 0, 255))
        image[..., 1] = 90
        image[..., 2] = 30
        state = np.array([self.x, self.steps / 100], dtype=np.float32)
        self.frames.append((image, state))
        return SimObservation({"front": image}, state, INSTRUCTION, self.steps / self.fps)

    def reset(self, task: str, seed: int) -> SimObservation:
        self.instruction(task)
        self.resets.append((task, seed))
        self.x, self.steps = 0.0, 0
        return self._observe()

    def step(self, action: np.ndarray):
        action = np.asarray(action, dtype=np.float64)
        if action.shape != (7,):
            raise ValueError(f"expects one action of shape [7], got {action.shape}")
        self.executed.append(action)
        self.x += 0.5 * float(action[0])
        self.steps += 1
        success = self.x > self.goal
        truncated = self.steps >= self._max_steps
        return self._observe(), success or truncated, success, StepInfo(self.steps, truncated and not success, action[:1])

