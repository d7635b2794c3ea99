"""A policy and a simulator for ``evaluate`` with spawned workers (importable by name in the worker processes):
task ``bad`` crashes the simulator at reset; any other task's episode takes two steps and succeeds."""

from __future__ import annotations

import numpy as np

from vla_runtime.api import EpisodeSession, StepResult
from vla_runtime.kv.base import KVStats
from vla_runtime.sim.base import SimObservation, StepInfo


class StillSession(EpisodeSession):
    def reset(self, instruction=None) -> None:
        pass

    def step(self, obs) -> StepResult:
        return StepResult(actions=np.zeros((1, 7)), timings={}, kv=KVStats(tokens_raw=1, bytes=1, tokens_seen=1))


class StillPolicy:
    action_dim, chunk_size = 7, 1

    def new_session(self, instruction, config) -> StillSession:
        return StillSession(instruction, config)


class CrashingWorld:
    name, fps = "fake", 10

    def reset(self, task: str, seed: int) -> SimObservation:
        if task == "bad":
            raise RuntimeError(f"the simulator crashed on {task} seed {seed}")
        self.steps = 0
        return self._observation()

    def step(self, action):
        self.steps += 1
        return self._observation(), self.steps >= 2, True, StepInfo(self.steps, self.steps >= 2, np.asarray(action))

    def _observation(self) -> SimObservation:
        return SimObservation(images={"primary": np.zeros((2, 2, 3), np.uint8)}, state=np.zeros(2), instruction="go", t=0.0)

    def close(self) -> None:
        pass


def make_policy() -> StillPolicy:
    return StillPolicy()


def make_world() -> CrashingWorld:
    return CrashingWorld()
