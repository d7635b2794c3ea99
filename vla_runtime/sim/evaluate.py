"""Closed-loop evaluation of a policy in a simulator, through the runtime API only.

Per episode: ``env.reset(task, seed)`` -> ``policy.new_session(instruction, SessionConfig)`` ->
``ActionQueue(session, execution_horizon)`` -> one ``queue.next(obs)`` and one ``env.step`` per
control step until success or the step limit. Timing covers the policy side only (``queue.next``),
not the simulator, so the control rate is what the policy could sustain on a robot.

``workers > 1`` runs episodes in spawned processes; each loads the policy and the simulator once
(process-pool initializer) and then takes episodes one by one.
"""

from __future__ import annotations

import atexit

import logging
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass, field, replace
from multiprocessing import get_context
from pathlib import Path
from typing import Callable

import numpy as np

from ..api import ActionQueue, Policy
from ..config import SessionConfig
from ..control import ControlConfig
from .actions import check_policy_action_dim
from .base import SimEnv
from .realtime import RealtimeEpisode, control_chunked
from .retention import RetentionTrace

log = logging.getLogger(__name__)

PolicyFactory = Callable[[], Policy]
EnvFactory = Callable[[], SimEnv]
ResultSink = Callable[[int, "EpisodeResult"], None]


@dataclass
class EvalConfig:
    """What ``evaluate`` runs.

    Args:
        tasks: task names of the simulator.
        episodes: episodes per task; episode i of a task uses seed ``seed + i``.
        seed: first seed. Episode i's session draws its noise (sampling heads) from seed ``session.seed + i``.
        session: the runtime session config (KV mode, history mode, execution horizon).
        workers: parallel processes (1 = in this process).
        out: directory for videos (first episode of each task); ``None`` = no videos.
        trace_retention: record what the chunked cache holds after every step (``EpisodeResult.retention``).
        control: run each episode on the robot's control loop in simulated time (``realtime``): the
            simulator advances one tick per period while steps take their measured time; ``None`` =
            policy and simulator in turn.
        time_scale: with ``control``, simulated step time = measured step time x this (plays a slower machine).
    """

    tasks: list[str]
    episodes: int
    seed: int = 0
    session: SessionConfig = field(default_factory=SessionConfig)
    workers: int = 1
    out: Path | None = None
    trace_retention: bool = False
    control: ControlConfig | None = None
    time_scale: float = 1.0

    def __post_init__(self) -> None:
        if not self.tasks:
            raise ValueError("`tasks` is empty; name at least one task")
        repeated = sorted({t for t in self.tasks if self.tasks.count(t) > 1})
        if repeated:
            raise ValueError(f"`tasks` names {', '.join(repeated)} more than once (each would run and count twice)")
        if self.episodes < 1:
            raise ValueError(f"`episodes` must be >= 1, got {self.episodes}")
        if self.workers < 1:
            raise ValueError(f"`workers` must be >= 1, got {self.workers}")
        if self.out is not None:
            self.out = Path(self.out)
        if not self.time_scale > 0:
            raise ValueError(f"`time_scale` must be > 0, got {self.time_scale}")


@dataclass
class EpisodeResult:
    """One episode's outcome and timings (milliseconds); ``retention`` when traced; ``cue_steps`` when the
    task reports them (``StepInfo.extra["cue_steps"]``, memory tasks); ``final_info``: the numbers of the last
    step's ``StepInfo.extra`` (a memory task's answer: presses made and asked, the pad the hand ended over,
    the miss distance; Meta-World's own info otherwise)."""

    task: str
    seed: int
    success: bool
    steps: int
    policy_s: float
    env_s: float
    step_ms: list[float]
    inference_ms: list[float]
    kv_bytes_max: int
    kv_final: dict
    error: str | None = None
    video: str | None = None
    retention: RetentionTrace | None = None
    cue_steps: list[int] | None = None
    control: dict | None = None  # ControlStats of a run on the control loop (``EvalConfig.control``)
    final_info: dict[str, float] | None = None


def run_episode(
    env: SimEnv, policy: Policy, task: str, seed: int, session_config: SessionConfig, *, video_path: Path | None = None,
    trace_retention: bool = False, control: ControlConfig | None = None, time_scale: float = 1.0,
) -> EpisodeResult:
    """Run one closed-loop episode; ``video_path`` records the primary camera to an mp4 (or gif);
    ``trace_retention`` records the chunks the cache holds after every inference step. ``control``: run
    on the robot's control loop in simulated time (``realtime``; ``time_scale`` stretches step times)
    instead of policy and simulator in turn."""
    obs = env.reset(task, seed)
    trace = RetentionTrace() if trace_retention else None
    session = policy.new_session(obs.instruction, session_config)
    frames = [next(iter(obs.images.values()))] if video_path is not None else None
    step_ms, inference_ms = [], []
    kv = {"max": 0, "final": {}}

    def on_step(result, ms: float, tick: int) -> None:
        inference_ms.append(ms)
        kv["max"] = max(kv["max"], int(result.kv.bytes))
        kv["final"] = result.kv.as_dict()
        if trace is not None:
            trace.record(session.retained_chunks(), result.kv.tokens_seen, tick=tick)

    def on_frame(new_obs) -> None:
        if frames is not None:
            frames.append(next(iter(new_obs.images.values())))

    if control is None:
        success, steps, env_s, error, info = _run_in_turn(env, session, session_config, obs, step_ms, on_step, on_frame,
                                                          label=f"{task} seed {seed}")
        stats = None
    else:
        driver = RealtimeEpisode(env, session, control, chunked=control_chunked(policy, session_config), time_scale=time_scale,
                                 action_dim=policy.action_dim, horizon=session_config.execution_horizon,
                                 on_step=on_step, on_frame=on_frame)  # fmt: skip
        success, info, stats, error = driver.run(obs, label=f"{task} seed {seed}")
        step_ms, env_s, steps = list(inference_ms), driver.env_s, info.step if info is not None else 0
        error = error or (info.extra.get("error") if info is not None else None)
    cue_steps = info.extra.get("cue_steps") if info is not None else None
    final_info = None if info is None else {k: float(v) for k, v in info.extra.items() if np.isscalar(v) and not isinstance(v, str)}
    video = None
    if frames is not None:
        from .media import write_preview

        video = str(write_preview(video_path, np.stack(frames), fps=env.fps))
    return EpisodeResult(
        task, seed, success, steps, sum(step_ms) / 1e3, env_s, step_ms, inference_ms, kv["max"], kv["final"], error,
        video, trace, None if cue_steps is None else [int(c) for c in cue_steps], stats, final_info,
    )  # fmt: skip


def _run_in_turn(env: SimEnv, session, session_config: SessionConfig, obs, step_ms: list[float], on_step, on_frame, *,
                 label: str):
    """Policy, then simulator, in turn (the world waits for the policy). Returns success, steps, simulator
    seconds, error, and the last ``StepInfo``."""
    queue = ActionQueue(session, horizon=session_config.execution_horizon)
    env_s, success, done, steps, error, info = 0.0, False, False, 0, None, None
    while not done:
        t0 = time.perf_counter()
        action, result = queue.next(obs.to_policy())
        t1 = time.perf_counter()
        step_ms.append((t1 - t0) * 1e3)
        if result is not None:
            on_step(result, (t1 - t0) * 1e3, steps)  # the policy saw the world after `steps` ticks
        try:
            obs, done, success, info = env.step(action)
        except ValueError as e:  # an action the simulator cannot take (wrong shape, NaN): a failed episode, not a crash
            log.warning("%s: episode ended at step %d: %s", label, steps + 1, e)
            return False, steps, env_s, str(e), info
        env_s += time.perf_counter() - t1
        steps = info.step
        error = info.extra.get("error", error)
        on_frame(obs)
    return success, steps, env_s, error, info


# -- worker processes --------------------------------------------------------------------------
_worker: dict = {}  # per worker process: the factories, then the policy and simulator built from them


def _init_worker(policy_factory: PolicyFactory, env_factory: EnvFactory, threads: int) -> None:
    import torch

    torch.set_num_threads(threads)
    _worker["factories"] = (policy_factory, env_factory)
    atexit.register(_close_worker)


def _close_worker() -> None:
    """Close the worker's simulator while the interpreter is still whole (atexit).

    Left to interpreter teardown, MuJoCo's OSMesa context is freed by ``__del__`` after the modules it
    calls are gone, and every worker printed a ``TypeError: 'NoneType' object is not callable`` traceback.
    """
    env = _worker.pop("env", None)
    if env is not None:
        env.close()


def _worker_episode(task: str, seed: int, config: EvalConfig, video_path: Path | None) -> EpisodeResult:
    # built on the first episode rather than in the initializer: an error here (bad checkpoint, unmappable
    # action space) reaches the caller as itself instead of as a broken process pool
    if "policy" not in _worker:
        policy_factory, env_factory = _worker["factories"]
        policy, env = policy_factory(), env_factory()
        try:
            check_policy_action_dim(policy.action_dim, env.name)
        except ValueError:
            env.close()
            raise
        _worker["policy"], _worker["env"] = policy, env
    return _run_job(_worker["env"], _worker["policy"], task, seed, config, video_path)


def _run_job(env: SimEnv, policy: Policy, task: str, seed: int, config: EvalConfig, video: Path | None) -> EpisodeResult:
    session = replace(config.session, seed=config.session.seed + seed - config.seed)  # each episode its own noise
    return run_episode(env, policy, task, seed, session, video_path=video, trace_retention=config.trace_retention,
                       control=config.control, time_scale=config.time_scale)  # fmt: skip


def _episode_jobs(config: EvalConfig) -> list[tuple[str, int, Path | None]]:
    jobs = []
    for task in config.tasks:
        for i in range(config.episodes):
            video = config.out / "videos" / f"{task}.mp4" if (config.out is not None and i == 0) else None
            jobs.append((task, config.seed + i, video))
    return jobs


def evaluate(
    policy_factory: PolicyFactory,
    env_factory: EnvFactory,
    config: EvalConfig,
    *,
    progress: bool = True,
    finished: dict[int, EpisodeResult] | None = None,
    on_result: ResultSink | None = None,
) -> list[EpisodeResult]:
    """Run every (task, seed) episode; results in job order (task-major, then seed).

    ``finished``: job index -> result of episodes an interrupted run already finished (not run again).
    ``on_result(job, result)`` is called as each episode ends (``results.append_result`` makes it durable).
    """
    from tqdm.auto import tqdm

    jobs = _episode_jobs(config)
    results: list[EpisodeResult | None] = [None] * len(jobs)
    for i, result in (finished or {}).items():
        if i >= len(jobs) or (result.task, result.seed) != jobs[i][:2]:
            raise ValueError(f"finished episode {i} ({result.task}, seed {result.seed}) is not job {i} of this run; "
                             "resume with the --tasks, --episodes and --seed of the interrupted run")
        results[i] = result
    todo = [i for i in range(len(jobs)) if results[i] is None]
    bar = tqdm(total=len(jobs), initial=len(jobs) - len(todo), desc="eval", unit="ep", disable=not progress)
    successes = sum(r.success for r in results if r is not None)

    def done(i: int, result: EpisodeResult) -> None:
        nonlocal successes
        results[i] = result
        if on_result is not None:
            on_result(i, result)
        successes += result.success
        bar.update(1)
        bar.set_postfix(success=f"{successes}/{bar.n}")

    if not todo:
        bar.close()
        return results
    if config.workers == 1:
        policy, env = policy_factory(), env_factory()
        try:
            check_policy_action_dim(policy.action_dim, env.name)
            for i in todo:
                task, seed, video = jobs[i]
                done(i, _run_job(env, policy, task, seed, config, video))
        finally:
            env.close()
            bar.close()
        return results
    threads = 1  # one intra-op thread per worker: N workers share the cores
    with ProcessPoolExecutor(
        max_workers=config.workers,
        mp_context=get_context("spawn"),
        initializer=_init_worker,
        initargs=(policy_factory, env_factory, threads),
    ) as pool:
        futures = {pool.submit(_worker_episode, *jobs[i][:2], config, jobs[i][2]): i for i in todo}
        failed: dict[int, BaseException] = {}  # job index -> its error
        try:
            for future in as_completed(futures):
                if future.cancelled():
                    continue
                try:
                    result = future.result()
                except Exception as e:  # noqa: BLE001 - raised below, once the episodes that finished are recorded
                    if not failed:
                        for other in futures:  # what has not started is not run (a resume runs it)
                            other.cancel()
                    failed[futures[future]] = e
                    continue
                done(futures[future], result)
        finally:
            bar.close()
    if failed:  # the first failed episode in job order, whichever worker failed first
        raise failed[min(failed)]
    return results


def episode_record(result: EpisodeResult) -> dict:
    """JSON-ready episode record (latency lists summarised; the retention trace is left to its picture)."""
    record = asdict(result)
    del record["retention"]
    for key in ("step_ms", "inference_ms"):
        values = record.pop(key)
        record[f"{key}_p50"] = float(np.percentile(values, 50)) if values else None
        record[f"{key}_p95"] = float(np.percentile(values, 95)) if values else None
    return record
