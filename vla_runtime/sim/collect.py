"""Demonstrations from Meta-World's scripted experts, written as a LeRobot v3 dataset.

Each episode runs the task's expert (``metaworld.policies``) through the same 7-D -> 4-D mapping a
policy uses: the expert's 4-D action is converted to the 7-D policy convention, rounded to float32
(what the dataset stores) and executed from that stored value, so the recorded actions reproduce
the recorded trajectory exactly. Episodes where the expert fails within the step limit are
skipped and counted; the next seed is tried (up to ``max_attempts_factor * episodes`` per task).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..data import DatasetFeatures, Episode, LeRobotWriter, WriterConfig
from .actions import POLICY_ACTION_NAMES
from .base import check_task
from .metaworld_env import MetaWorldConfig, MetaWorldEnv
from .metaworld_tasks import METAWORLD_ALL_TASKS

log = logging.getLogger(__name__)


@dataclass
class CollectConfig:
    """What ``collect`` records.

    Args:
        tasks: Meta-World task names (Meta-World's 50 or the memory tasks).
        episodes: successful episodes to record per task.
        out: new dataset directory.
        seed: first seed; attempt k of a task uses ``seed + k`` (the seed picks the scene variation).
        env: the simulator's rendering and step limit.
        video_codec: ``None`` stores lossless PNG frames; a ``VIDEO_CODECS`` name stores mp4.
        max_attempts_factor: give up on a task after ``max_attempts_factor * episodes`` attempts.
    """

    tasks: list[str]
    episodes: int
    out: Path
    seed: int = 0
    env: MetaWorldConfig = field(default_factory=MetaWorldConfig)
    video_codec: str | None = None
    max_attempts_factor: int = 3

    def __post_init__(self) -> None:
        self.out = Path(self.out)
        if not self.tasks:
            raise ValueError("`tasks` is empty; name at least one Meta-World task")
        for task in self.tasks:
            check_task(task, METAWORLD_ALL_TASKS, "Meta-World")
        if self.episodes < 1:
            raise ValueError(f"`episodes` must be >= 1, got {self.episodes}")
        if not self.env.cameras:
            raise ValueError("collect needs at least one camera in `env.cameras`")
        if self.max_attempts_factor < 1:
            raise ValueError(f"`max_attempts_factor` must be >= 1, got {self.max_attempts_factor}")


@dataclass
class TaskCollection:
    """Per-task outcome: episodes kept, expert failures skipped, frames written."""

    kept: int = 0
    failed: int = 0
    frames: int = 0


def run_expert_episode(env: MetaWorldEnv, task: str, seed: int) -> tuple[Episode, bool]:
    """One expert rollout -> (episode of the observed frames and stored actions, success)."""
    obs = env.reset(task, seed)
    images = {cam: [] for cam in env.cameras}
    states, actions = [], []
    success = False
    done = False
    while not done:
        action = env.expert_action().astype(np.float32)  # the stored value is the executed value
        for cam in env.cameras:
            images[cam].append(obs.images[cam])
        states.append(obs.state)
        actions.append(action)
        obs, done, success, _ = env.step(action)
    episode = Episode(
        images={cam: np.stack(frames) for cam, frames in images.items()},
        state=np.stack(states),
        action=np.stack(actions),
        task=obs.instruction,
    )
    return episode, success


def collect(config: CollectConfig, *, progress: bool = True) -> dict[str, TaskCollection]:
    """Record ``config.episodes`` successful expert episodes per task into ``config.out``."""
    from tqdm.auto import tqdm

    results = {task: TaskCollection() for task in config.tasks}
    seeds: list[int] = []
    started = time.perf_counter()
    with MetaWorldEnv(config.env) as env:
        h, w = config.env.resolution
        features = DatasetFeatures(
            cameras={cam: (h, w) for cam in env.cameras},
            state_names=env.state_names,
            action_names=list(POLICY_ACTION_NAMES),
        )
        # `seeds` fills up while recording; info.json is written when the writer closes
        extra = {"vla_runtime": {"sim": env.name, "action_convention": "ee_delta_7d_gripper_open_1", "episode_seeds": seeds}}
        writer_config = WriterConfig(fps=env.fps, robot_type="sawyer", video_codec=config.video_codec, extra_info=extra)
        with LeRobotWriter(config.out, features, writer_config) as writer, tqdm(
            total=config.episodes * len(config.tasks), desc="collect", unit="ep", disable=not progress
        ) as bar:
            for task in config.tasks:
                result = results[task]
                for attempt in range(config.max_attempts_factor * config.episodes):
                    if result.kept == config.episodes:
                        break
                    seed = config.seed + attempt
                    episode, success = run_expert_episode(env, task, seed)
                    if not success:
                        result.failed += 1
                        log.info("expert failed %s seed %d within %d steps; skipped", task, seed, env.max_steps)
                        bar.set_postfix(failed=sum(r.failed for r in results.values()))
                        continue
                    writer.add_episode(episode)
                    seeds.append(seed)
                    result.kept += 1
                    result.frames += len(episode)
                    bar.update(1)
                if result.kept < config.episodes:
                    log.warning("%s: only %d of %d episodes after %d expert failures", task, result.kept, config.episodes, result.failed)
    log.info("collected %d episodes in %.1f s", len(seeds), time.perf_counter() - started)
    return results
