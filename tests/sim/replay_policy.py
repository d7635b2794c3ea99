"""Test policies: real ``Policy``/``EpisodeSession`` objects, no model behind them.

``ReplayPolicy`` reads a LeRobot dataset written by ``collect`` and, in each episode, finds the
demonstration whose first frame equals the first camera image it is shown (Meta-World renders a
seed's scene identically every time), then replays that demonstration's stored 7-D actions, as
chunks of ``chunk`` actions. Closed-loop success therefore proves that the stored actions map
back through the simulator's 7 -> 4 mapping exactly and that seeds reproduce scenes.

It reports a stand-in memory of one 64-byte token per control step as its KV stats, so the eval
report's KV column can be checked. Module-level factories keep it picklable for spawned workers.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from vla_runtime.api import EpisodeSession, Observation, Policy, StepResult
from vla_runtime.config import SessionConfig
from vla_runtime.data import LeRobotDataset
from vla_runtime.kv.base import KVStats

BYTES_PER_STEP = 64


@dataclass
class ReplayConfig:
    chunk: int = 1
    action_dim: int = 7
    nan_after: int | None = None  # emit NaN actions from this step on (a broken policy)


class ReplaySession(EpisodeSession):
    def __init__(self, instruction: str, config: SessionConfig, policy: "ReplayPolicy") -> None:
        super().__init__(instruction, config)
        self.policy = policy
        self.reset()

    def reset(self, instruction: str | None = None) -> None:
        if instruction is not None:
            self.instruction = instruction
        self.actions: np.ndarray | None = None
        self.t = 0

    def step(self, obs: Observation) -> StepResult:
        if self.actions is None:
            self.actions = self.policy.match(self.instruction, obs.images["primary"])
        chunk = self.actions[self.t : self.t + self.policy.config.chunk]
        if len(chunk) == 0:  # past the demonstration: hold still, gripper as it was
            chunk = np.concatenate([np.zeros(6), self.actions[-1, 6:]])[None]
        if self.policy.config.nan_after is not None and self.t >= self.policy.config.nan_after:
            chunk = np.full_like(chunk, np.nan)
        self.t += len(chunk)
        kv = KVStats(tokens_raw=self.t, bytes=self.t * BYTES_PER_STEP, tokens_seen=self.t)
        return StepResult(actions=np.asarray(chunk, dtype=np.float64), timings={"total": 0.0}, kv=kv)


class ReplayPolicy(Policy):
    name = "test-replay"
    config_class = ReplayConfig

    def __init__(self, dataset_dir, config: ReplayConfig | None = None) -> None:
        self.config = config or ReplayConfig()
        ds = LeRobotDataset(dataset_dir)
        self.demos = [ds.episode(i) for i in range(len(ds))]

    @property
    def action_dim(self) -> int:
        return self.config.action_dim

    @property
    def chunk_size(self) -> int:
        return self.config.chunk

    def match(self, instruction: str, image: np.ndarray) -> np.ndarray:
        for demo in self.demos:
            first = next(iter(demo.images.values()))[0]
            if demo.task == instruction and np.array_equal(first, image):
                return demo.action
        raise ValueError(f"no demonstration of {instruction!r} starts with this frame")

    def new_session(self, instruction: str, config: SessionConfig | None = None) -> EpisodeSession:
        return ReplaySession(instruction, config or SessionConfig(), self)

    def info(self) -> dict:
        return {"family": self.name, "demos": len(self.demos)}


def make_replay_policy(dataset_dir, chunk: int = 1, action_dim: int = 7, nan_after: int | None = None) -> ReplayPolicy:
    return ReplayPolicy(dataset_dir, ReplayConfig(chunk=chunk, action_dim=action_dim, nan_after=nan_after))
