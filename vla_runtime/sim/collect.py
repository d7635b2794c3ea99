"""Demonstrations from Meta-World's scripted experts, written as a LeRobot v3 dataset.

Each episode runs the task's expert (``metaworld.policies``) through the same 7-D -> 4-D mapping a
policy uses: the expert's 4-D action is converted to the 7-D policy convention, rounded to float32
(what the dataset stores) and executed from that stored value, so the recorded actions reproduce
the recorded trajectory exactly (except during a detour, below). Episodes where the expert fails within the step limit are
skipped and counted; the next seed is tried (``seed + k`` at attempt k, or the task's own list in ``seeds``; up to
``max_attempts_factor * episodes`` per task).

Every kept episode is durable before the next rollout starts (``LeRobotWriter``); ``resume=True``
continues a killed run: it keeps the finished episodes, and for each task goes on from the seed after
its last kept one, so interrupted-then-resumed and uninterrupted runs with the same flags write the
same episodes (and, with lossless images, the same statistics).

``detours`` (memory tasks with a go step): in that fraction of episodes, drawn per seed, the arm is first driven
toward a wrong answer for a few steps after go while the stored actions stay the expert's, which steer back
(``memory/detour.py``: recovery data against a history policy that copies its own motion). Each episode records
``episode_detours``: ``[go step, steps]``, or ``[]`` without one. ``slowdowns`` (the same tasks): in that fraction
of episodes the executed moves after go are the expert's slowed down by random factors while the stored actions stay
the expert's (``memory/slowdown.py``: speed noise against the same problem); recorded as ``episode_slowdowns``:
``[go step]`` or ``[]``. ``driven`` with a ``driver`` checkpoint (the same tasks): in that fraction of episodes a
trained policy drives the arm for a few steps after go while the stored actions stay the expert's (``driven.py``:
the learner's own mistakes, labelled); recorded as ``episode_driven``: ``[go step, steps]`` or ``[]``.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from ..data import DatasetFeatures, Episode, LeRobotWriter, WriterConfig
from .actions import POLICY_ACTION_NAMES
from .base import check_task
from .driven import PolicyDriver, draw_spell
from .memory import MEMORY_TASKS
from .memory.detour import draw_detour, supports_detours
from .memory.separable import separable_steps
from .memory.slowdown import draw_slowdown
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
        resume: continue the (interrupted) dataset in ``out`` instead of requiring a new directory.
        detours: fraction of episodes (0..1) with a detour after go (memory-reference, -order, -tally only).
        slowdowns: fraction of episodes (0..1) with speed noise after go (the same tasks only).
        driven: fraction of episodes (0..1) in which ``driver`` drives the arm after go (the same tasks only).
        driver: the policy checkpoint that drives (loaded in the session it was trained for); needs ``driven``.
        seeds: per task, the seeds to try in order instead of ``seed``, ``seed + 1``, ... (every task needs a list;
            re-collecting chosen episodes: an evaluation's failures, spots in one part of the table).
    """

    tasks: list[str]
    episodes: int
    out: Path
    seed: int = 0
    env: MetaWorldConfig = field(default_factory=MetaWorldConfig)
    video_codec: str | None = None
    max_attempts_factor: int = 3
    resume: bool = False
    detours: float = 0.0
    slowdowns: float = 0.0
    driven: float = 0.0
    driver: Path | None = None
    seeds: dict[str, list[int]] | None = None

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
        no_go_step = [t for t in self.tasks if t not in MEMORY_TASKS or not supports_detours(MEMORY_TASKS[t])]
        for name, fraction in (("detours", self.detours), ("slowdowns", self.slowdowns), ("driven", self.driven)):
            if not 0.0 <= fraction <= 1.0:
                raise ValueError(f"`{name}` is a fraction of episodes in [0, 1], got {fraction}")
            if fraction > 0 and no_go_step:
                raise ValueError(
                    f"{name} need memory tasks that hold the arm until a go step (memory-reference, memory-order, "
                    f"memory-tally); not {', '.join(no_go_step)}"
                )
        if (self.driver is None) != (self.driven == 0):
            raise ValueError("driven spells need both a `driver` checkpoint and a `driven` fraction > 0, or neither")
        if self.driver is not None:
            self.driver = Path(self.driver)
            if not (self.driver / "config.json").is_file():
                raise ValueError(f"`driver` must be a policy checkpoint directory (with config.json); got {self.driver}")
            if self.detours > 0 or self.slowdowns > 0:
                raise ValueError("driven spells cannot be combined with detours or slowdowns: one executes at a time")
        if self.seeds is not None:
            self._check_seeds()

    def _check_seeds(self) -> None:
        missing = [t for t in self.tasks if not self.seeds.get(t)]
        unknown = sorted(set(self.seeds) - set(self.tasks))
        if missing or unknown:
            raise ValueError(
                f"`seeds` must give a non-empty list for each task in `tasks` and no other: "
                f"{'missing ' + ', '.join(missing) if missing else ''}{'; ' if missing and unknown else ''}"
                f"{'not in tasks ' + ', '.join(unknown) if unknown else ''}"
            )
        self.seeds = {task: [int(s) for s in seeds] for task, seeds in self.seeds.items()}
        for task, seeds in self.seeds.items():
            if len(set(seeds)) != len(seeds) or min(seeds) < 0:
                raise ValueError(f"`seeds` for {task} must be distinct seeds >= 0, got {seeds}")

    def attempt_seeds(self, task: str) -> list[int]:
        """The seeds ``task`` tries, in order (at most ``max_attempts_factor * episodes`` of them)."""
        n = self.max_attempts_factor * self.episodes
        return self.seeds[task][:n] if self.seeds is not None else [self.seed + k for k in range(n)]


@dataclass
class TaskCollection:
    """Per-task outcome: episodes kept, expert failures skipped, frames written."""

    kept: int = 0
    failed: int = 0
    frames: int = 0


@dataclass
class ExpertRollout:
    """One expert rollout: ``episode`` (the observed frames and stored actions), ``success``, ``cue_steps``: the
    frames a memory task drew its cue into or counted its events at (``MemoryTask.cue_shown``; ``[]`` for other
    tasks), recorded per episode as ``episode_cue_steps``; ``separable_steps``: the frames whose expert action depends
    on the answer (``memory.separable``; ``[]`` but for the pad tasks), recorded as ``episode_separable_steps``;
    ``detour``: ``[start, steps]`` of its detour, or ``[]``; ``slowdown``: ``[start]`` of its slowdown, or ``[]``;
    ``driven``: ``[start, steps]`` of its driven spell, or ``[]``."""

    episode: Episode
    success: bool
    cue_steps: list[int]
    separable_steps: list[int] = field(default_factory=list)
    detour: list[int] = field(default_factory=list)
    slowdown: list[int] = field(default_factory=list)
    driven: list[int] = field(default_factory=list)


def run_expert_episode(
    env: MetaWorldEnv, task: str, seed: int, *, detours: float = 0.0, slowdowns: float = 0.0, driven: float = 0.0,
    driver: PolicyDriver | None = None,
) -> ExpertRollout:
    """One expert rollout of ``task`` from ``seed`` (``env`` without cameras records states only); ``detours``: the
    probability of a detour (``memory.detour.draw_detour``), during which the executed action is the decoy's and
    the stored one the expert's; ``slowdowns``: the probability of a slowdown (``memory.slowdown.draw_slowdown``),
    which scales the executed moves after go, the stored actions unscaled; ``driven``: the probability of a spell
    (``driven.draw_spell``) in which ``driver`` (fed every frame up to the spell's end) chooses the executed action."""
    obs = env.reset(task, seed)
    spell = draw_spell(env.memory_episode, seed, driven) if driven > 0 else None
    if spell is not None:
        if driver is None:
            raise ValueError("driven spells need a `driver`")
        driver.start(obs.instruction)
    detour = draw_detour(env.memory_episode, seed, detours) if detours > 0 else None
    slowdown = draw_slowdown(env.memory_episode, seed, slowdowns) if slowdowns > 0 else None
    images = {cam: [] for cam in env.cameras}
    states, actions = [], []
    success = False
    done = False
    info = None
    t = 0
    while not done:
        action = env.expert_action().astype(np.float32)  # the stored value is the executed value, but in a detour
        executed = env.expert_action(detour.decoy).astype(np.float32) if detour is not None and detour.covers(t) else action
        if slowdown is not None:  # ... or a slowdown
            executed = slowdown.executed(t, executed)
        if spell is not None and t < spell.end:
            chosen = driver.act(obs)  # the policy sees every frame until its spell ends ...
            executed = chosen if spell.covers(t) else executed  # ... and drives during it
            if t + 1 == spell.end:
                driver.stop()
        for cam in env.cameras:
            images[cam].append(obs.images[cam])
        states.append(obs.state)
        actions.append(action)
        obs, done, success, info = env.step(executed)
        t += 1
    episode = Episode(
        images={cam: np.stack(frames) for cam, frames in images.items()},
        state=np.stack(states),
        action=np.stack(actions),
        task=obs.instruction,
    )
    cue_steps = [int(t) for t in info.extra.get("cue_steps", [])] if info is not None else []
    memory = env.memory_episode
    separable = [] if memory is None else separable_steps(memory, episode.state)  # the state starts with the hand
    return ExpertRollout(
        episode, success, cue_steps, separable, [] if detour is None else detour.record(),
        [] if slowdown is None else slowdown.record(), [] if spell is None else spell.record(),
    )


def collect(config: CollectConfig, *, progress: bool = True) -> dict[str, TaskCollection]:
    """Record ``config.episodes`` successful expert episodes per task into ``config.out``."""
    from tqdm.auto import tqdm

    results = {task: TaskCollection() for task in config.tasks}
    started = time.perf_counter()
    with MetaWorldEnv(config.env) as env:
        h, w = config.env.resolution
        features = DatasetFeatures(
            cameras={cam: (h, w) for cam in env.cameras},
            state_names=env.state_names,
            action_names=list(POLICY_ACTION_NAMES),
        )
        extra = {"sim": env.name, "action_convention": "ee_delta_7d_gripper_open_1"}
        if config.detours > 0:
            extra["detours"] = config.detours  # the stored actions are labels, not the executed ones, in a detour
        if config.slowdowns > 0:
            extra["slowdowns"] = config.slowdowns  # ... and in a slowdown
        if config.driven > 0:
            extra["driven"] = config.driven  # ... and in a driven spell
            extra["driver"] = str(config.driver)
        driver = PolicyDriver(config.driver) if config.driver is not None else None
        writer_config = WriterConfig(fps=env.fps, robot_type="sawyer", video_codec=config.video_codec, extra_info=extra)
        with LeRobotWriter(config.out, features, writer_config, resume=config.resume) as writer, tqdm(
            total=config.episodes * len(config.tasks), desc="collect", unit="ep", disable=not progress
        ) as bar:
            first_attempt = _restore_progress(writer, config, results)
            bar.update(sum(r.kept for r in results.values()))
            for task in config.tasks:
                result = results[task]
                for seed in config.attempt_seeds(task)[first_attempt[task] :]:
                    if result.kept == config.episodes:
                        break
                    rollout = run_expert_episode(
                        env, task, seed, detours=config.detours, slowdowns=config.slowdowns, driven=config.driven,
                        driver=driver,
                    )
                    episode = rollout.episode
                    if not rollout.success:
                        result.failed += 1
                        log.info("expert failed %s seed %d within %d steps; skipped", task, seed, env.max_steps)
                        bar.set_postfix(failed=sum(r.failed for r in results.values()))
                        continue
                    writer.add_episode(
                        episode,
                        per_episode={"episode_seeds": seed, "episode_sim_tasks": task, "episode_cue_steps": rollout.cue_steps,
                                     "episode_separable_steps": rollout.separable_steps,
                                     **({"episode_detours": rollout.detour} if config.detours > 0 else {}),
                                     **({"episode_slowdowns": rollout.slowdown} if config.slowdowns > 0 else {}),
                                     **({"episode_driven": rollout.driven} if config.driven > 0 else {})},
                    )
                    result.kept += 1
                    result.frames += len(episode)
                    bar.update(1)
                if result.kept < config.episodes:
                    log.warning("%s: only %d of %d episodes after %d expert failures", task, result.kept, config.episodes, result.failed)
            kept = writer.num_episodes
    log.info("collected %d episodes in %.1f s", kept, time.perf_counter() - started)
    return results


def _restore_progress(writer: LeRobotWriter, config: CollectConfig, results: dict[str, TaskCollection]) -> dict[str, int]:
    """Count the episodes a resumed dataset already holds into ``results``; returns each task's first attempt
    (the one after its last kept seed: the failed attempts before it fail again, deterministically)."""
    first = {task: 0 for task in config.tasks}
    if writer.num_episodes == 0:
        return first
    recorded = writer.per_episode
    if len(recorded.get("episode_sim_tasks", [])) != writer.num_episodes:
        raise ValueError(f"cannot resume {config.out}: its info.json does not record the task and seed of each episode")
    for task, seed, length in zip(recorded["episode_sim_tasks"], recorded["episode_seeds"], writer.episode_lengths):
        if task not in results:
            raise ValueError(f"cannot resume {config.out}: it holds episodes of {task!r}, which --tasks does not name")
        results[task].kept += 1
        results[task].frames += length
        if results[task].kept > config.episodes:
            raise ValueError(f"cannot resume {config.out}: it holds more than --episodes {config.episodes} episodes of {task}")
        tried = config.attempt_seeds(task)
        if seed not in tried:
            raise ValueError(f"cannot resume {config.out}: it holds {task} seed {seed}, which this run would not try")
        first[task] = tried.index(seed) + 1
    for task, attempts in first.items():  # every attempt before a task's last kept seed that was not kept failed
        results[task].failed = attempts - results[task].kept
    return first


def record_cue_steps(root: Path, config: MetaWorldConfig | None = None, *, progress: bool = True) -> list[list[int]]:
    """Add ``episode_cue_steps`` and ``episode_separable_steps`` to a dataset ``collect`` wrote before it recorded
    them: every episode's expert is run again from its recorded task and seed without cameras, its states checked
    against the stored ones (the rollouts are deterministic), and both written to ``meta/vla_runtime.json``
    (atomically). ``config``: the simulator settings the dataset was collected with (default: ``collect``'s).
    Returns the cue steps."""
    from tqdm.auto import tqdm

    from ..data import LeRobotDataset, layout
    from ..data.durable import write_text_atomic

    ds = LeRobotDataset(root)
    if ds.extra.get("driven", 0.0) > 0:
        raise ValueError(
            f"{root} was collected with a policy driving ({ds.extra.get('driver')}): a replay cannot repeat its actions; "
            "collect recorded its cue and separable steps itself"
        )
    recorded = ds.extra.get(layout.PER_EPISODE_KEY, {})
    tasks, seeds = recorded.get("episode_sim_tasks", []), recorded.get("episode_seeds", [])
    if len(tasks) != len(ds) or len(seeds) != len(ds):
        raise ValueError(f"{root}: meta/vla_runtime.json does not record the task and seed of each of its {len(ds)} episodes")
    cue_steps, separable = [], []
    with MetaWorldEnv(replace(config or MetaWorldConfig(), cameras=())) as env:
        for i in tqdm(range(len(ds)), desc="replaying experts", unit="ep", disable=not progress):
            rollout = run_expert_episode(
                env, tasks[i], seeds[i], detours=ds.extra.get("detours", 0.0), slowdowns=ds.extra.get("slowdowns", 0.0)
            )
            stored = ds.episode(i).state
            if stored is None or rollout.episode.state.shape != stored.shape or not np.allclose(rollout.episode.state, stored, atol=1e-5):
                raise ValueError(f"episode {i} ({tasks[i]}, seed {seeds[i]}): the expert's replay does not reproduce the stored states")
            cue_steps.append(rollout.cue_steps)
            separable.append(rollout.separable_steps)
    extra = json.loads((root / layout.EXTRA_PATH).read_text())
    extra[layout.PER_EPISODE_KEY]["episode_cue_steps"] = cue_steps
    extra[layout.PER_EPISODE_KEY]["episode_separable_steps"] = separable
    write_text_atomic(root / layout.EXTRA_PATH, json.dumps(extra, indent=2))
    return cue_steps
