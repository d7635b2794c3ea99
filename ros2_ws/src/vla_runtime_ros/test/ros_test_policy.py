"""A small test policy for the ROS tests: a real ``vla_runtime.api.Policy``, not a model.

It implements the runtime API contract exactly as a model family does (``register_family``,
``load_policy`` from a directory, ``new_session`` / ``step`` / ``reset``, ``StepResult`` with KV
stats), but its actions are a closed-form function of the image, the state and the step index, so
a test can predict every value the node publishes. Nodes load it with
``-p policy_modules:="[ros_test_policy]"`` (the test directory on ``PYTHONPATH``).

Checkpoint directory: ``ros_test_policy.json`` = ``RosTestPolicyConfig`` fields.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from vla_runtime.api import FAMILIES, PRIMARY_CAMERA, EpisodeSession, Observation, Policy, StepResult, register_family, validate_image
from vla_runtime.config import SessionConfig
from vla_runtime.kv.base import KVStats

FAMILY = "ros-test"
MARKER = "ros_test_policy.json"
BYTES_PER_TOKEN = 1024  # what one token's K/V would take (reported in KVStats.bytes)
PREFIX_MARK = 10.0  # added to the last action dimension by a step that was handed an RTC prefix


@dataclass
class RosTestPolicyConfig:
    action_dim: int = 7
    chunk_size: int = 1
    tokens_per_step: int = 10  # image + action tokens a step appends to the cache in history mode
    prompt_tokens: int = 12
    step_ms: float = 0.0  # simulated compute time per step (sleep)
    fault: str = ""  # "nan": non-finite actions; "raise": step raises RuntimeError; "start_twice": the first two
    # new_session calls of a loaded policy raise (a transient failure at an episode start) (failure-handling tests)


def expected_actions(image: np.ndarray, state: np.ndarray | None, cfg: RosTestPolicyConfig) -> np.ndarray:
    """The chunk a step returns for ``image`` uint8 [H, W, 3]: float [chunk_size, action_dim].

    action[k, j] = 0.5 * mean_rgb[j % 3] / 255 - 0.1 * j + 0.01 * k (+ sum(state) / 100 when given). A step
    handed the queued actions (``Observation.prefix``, ``blend: rtc``) adds ``PREFIX_MARK`` to the last dimension.
    """
    mean = image.reshape(-1, 3).mean(axis=0) / 255.0  # [3]
    j = np.arange(cfg.action_dim)
    k = np.arange(cfg.chunk_size)[:, None]
    actions = 0.5 * mean[j % 3] - 0.1 * j + 0.01 * k  # [chunk, action_dim]
    if state is not None:
        actions = actions + float(np.sum(state)) / 100.0
    return actions


class RosTestSession(EpisodeSession):
    def __init__(self, instruction: str, config: SessionConfig, policy_config: RosTestPolicyConfig) -> None:
        super().__init__(instruction, config)
        self.policy_config = policy_config
        self.steps = 0

    def step(self, obs: Observation) -> StepResult:
        start = time.perf_counter()
        image = validate_image(obs.images.get(PRIMARY_CAMERA), PRIMARY_CAMERA)
        if self.policy_config.step_ms:
            time.sleep(self.policy_config.step_ms / 1e3)
        actions = expected_actions(image, obs.state, self.policy_config)
        if obs.prefix is not None:
            actions[:, -1] += PREFIX_MARK
        if self.policy_config.fault == "raise":
            raise RuntimeError("test policy fault: CUDA out of memory (simulated)")
        if self.policy_config.fault == "nan":
            actions[:, 1] = np.nan
        self.steps += 1
        cfg = self.policy_config
        tokens = cfg.prompt_tokens + cfg.tokens_per_step * (self.steps if self.config.history == "history" else 1)
        kv = KVStats(tokens_raw=tokens, bytes=tokens * BYTES_PER_TOKEN, positions_used=tokens, tokens_seen=tokens)
        return StepResult(actions=actions, timings={"total": (time.perf_counter() - start) * 1e3}, kv=kv)

    def reset(self, instruction: str | None = None) -> None:
        if instruction is not None:
            self.instruction = instruction
        self.steps = 0


class RosTestPolicy(Policy):
    name = FAMILY
    config_class = RosTestPolicyConfig

    def __init__(self, config: RosTestPolicyConfig) -> None:
        self.config = config
        self._start_faults = 2 if config.fault == "start_twice" else 0

    @property
    def action_dim(self) -> int:
        return self.config.action_dim

    @property
    def chunk_size(self) -> int:
        return self.config.chunk_size

    def new_session(self, instruction: str, config: SessionConfig | None = None) -> RosTestSession:
        if self._start_faults:
            self._start_faults -= 1
            raise RuntimeError("test policy fault: out of memory at the episode start (simulated, transient)")
        return RosTestSession(instruction, config or SessionConfig(), self.config)

    def info(self) -> dict:
        return {"family": FAMILY, **asdict(self.config)}


def write_checkpoint(path: Path, **fields) -> Path:
    """A checkpoint directory for this policy."""
    path.mkdir(parents=True, exist_ok=True)
    (path / MARKER).write_text(json.dumps(asdict(RosTestPolicyConfig(**fields))))
    return path


def _load(path: Path, device: str = "cpu", dtype: str | None = None, adapter: str | None = None) -> RosTestPolicy:
    return RosTestPolicy(RosTestPolicyConfig(**json.loads((path / MARKER).read_text())))


if FAMILY not in FAMILIES:
    register_family(FAMILY, lambda path: (path / MARKER).is_file(), _load)
