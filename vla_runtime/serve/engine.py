"""``PolicyEngine``: the loaded policy, the session registry and the one worker thread that runs steps.

What a server replica owns: the websocket edge (``server.py``) decodes messages and submits ``Request``s;
the engine queues them (bounded by the caller), runs them on its worker thread (torch work stays on one
thread) and resolves a ``concurrent.futures.Future`` per request with the reply to send. Steps from
several sessions that are waiting together run as one batched forward when the policy offers
``step_batch`` (see ``BatchConfig``); otherwise one after another.
"""

from __future__ import annotations

import logging
import queue
import statistics
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field

from ..api import BatchInputError, Policy, StepResult
from ..config import CompileMode, SessionConfig
from ..kv import CacheFullError
from .config import BatchConfig
from .messages import BadRequest, Request, RequestKind
from .sessions import RobotSession, SessionClosed, SessionRegistry

log = logging.getLogger(__name__)


class InternalError(RuntimeError):
    """A step failed inside the runtime; the client is told its episode was reset (details go to the log)."""


@dataclass
class Job:
    robot: RobotSession
    request: Request
    future: Future = field(default_factory=Future)
    enqueued: float = field(default_factory=time.perf_counter)


_STOP = object()
STEP_MS_KEPT = 1000  # recent forwards kept per batch size (``PolicyEngine.step_ms``): bounded in a long-running server


class PolicyEngine:
    """Runs the sessions' requests on one worker thread.

    Args:
        policy: the loaded policy (``vla_runtime.api.load_policy``).
        session_config: every session's ``SessionConfig`` (history mode, cache).
        registry: the open sessions.
        batch: micro-batching (``max_batch=1``: one step at a time).
    """

    def __init__(self, policy: Policy, session_config: SessionConfig, registry: SessionRegistry, batch: BatchConfig | None = None) -> None:
        self.policy = policy
        self.session_config = session_config
        self.registry = registry
        self.batch = batch or BatchConfig()
        # a policy with step_batch checks every input before touching an episode, so its steps (one or several)
        # go through step_batch: a refused input then costs its session nothing
        self.checks_inputs_first = bool(getattr(policy, "batched_steps", False))
        # compiled sessions step one at a time through their own compiled step, their observation checked first
        self.checks_alone = self.checks_inputs_first and session_config.compile is not CompileMode.OFF
        if self.checks_alone and self.batch.max_batch > 1:
            raise ValueError(
                f"`compile` is {session_config.compile.value!r}, but the server batches {policy.name} steps (max_batch "
                f"{self.batch.max_batch}) through the family's batched forward (`step_batch`), which runs eager: the "
                "sessions would compile at creation and never run the graphs. Serve compiled sessions one robot at a "
                f"time (max_batch 1, `--max-batch 1`), or batched with compile {CompileMode.OFF.value!r}"
            )
        self.batched = self.batch.max_batch > 1 and self.checks_inputs_first
        if session_config.compile is CompileMode.REDUCE_OVERHEAD and registry.max_sessions > 1:
            log.warning(
                "compile %r with up to %d sessions: every session's cache buffers are static addresses of the shared "
                "CUDA graphs, and torch re-records a graph when such an address changes (a step of another robot), "
                "past a limit giving up its CUDA graphs (torch's mark_static_address docs; not measured here); %r "
                "compiles without CUDA graphs",
                CompileMode.REDUCE_OVERHEAD.value, registry.max_sessions, CompileMode.DEFAULT.value,
            )
        self._queue: queue.Queue = queue.Queue()
        self._carry: list[Job] = []  # a job taken while gathering that must wait for the next batch
        self._worker: threading.Thread | None = None
        self.batch_sizes: dict[int, int] = {}  # forwards run per batch size (steps only)
        self.batch_times: deque[float] = deque(maxlen=20)  # seconds of the recent batched steps
        self.step_ms: dict[int, deque[float]] = {}  # per batch size: ms of its recent forwards (STEP_MS_KEPT at most)
        self.rejoin_waits = 0  # gathers that waited past the window for robots expected back
        self.rejoined = 0  # steps that joined a batch during such a wait

    # ---- lifecycle -------------------------------------------------------------------------------

    def start(self) -> None:
        if self._worker is not None:
            raise RuntimeError("engine already started")
        self._worker = threading.Thread(target=self._run, name="vla-serve-worker", daemon=True)
        self._worker.start()

    def stop(self) -> None:
        """Finish the running batch, fail every queued request, end the worker."""
        if self._worker is None:
            return
        self._queue.put(_STOP)
        self._worker.join()
        self._worker = None

    # ---- called from the event loop ----------------------------------------------------------------

    def submit(self, robot: RobotSession, request: Request) -> Future:
        """Queue ``request`` for ``robot``; the future resolves to the reply dict, or raises ``BadRequest``,
        ``SessionClosed`` or ``InternalError``. Requests submitted before ``start`` run once it starts (the
        first batch takes all of them)."""
        job = Job(robot, request)
        if robot.answered_at is not None and (robot.submitted_at is None or robot.submitted_at < robot.answered_at):
            robot.round_trips.append(job.enqueued - robot.answered_at)
        robot.submitted_at = job.enqueued
        self._queue.put(job)
        return job.future

    def metadata(self) -> dict:
        """What a client learns on connect (besides the server's own fields)."""
        policy, cfg = self.policy, self.session_config
        return {
            "family": policy.name,
            "action_dim": int(policy.action_dim),
            "action_horizon": int(policy.chunk_size),
            "history": cfg.history.value,
            "kv": cfg.kv.mode.value,
            "max_batch": self.batch.max_batch if self.batched else 1,
        }

    # ---- worker thread -----------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            first = self._carry.pop(0) if self._carry else self._queue.get()
            if first is _STOP:
                self._drain()
                return
            jobs, stop = [first], False
            try:
                stop = self._gather(jobs)
                self._run_jobs(jobs)
            except Exception as e:  # noqa: BLE001 - a bug here must not stop the worker (every client would hang)
                log.exception("worker failed on a batch of %d requests", len(jobs))
                for job in jobs:
                    if not job.future.done():
                        job.future.set_exception(InternalError(f"internal error ({type(e).__name__})"))
            if stop:
                self._drain()
                return

    def _gather(self, jobs: list[Job]) -> bool:
        """Add to ``jobs`` (holding the first one) the steps of other sessions that are queued or arrive within the
        window, or, while robots expected back (``_expected_back``) are missing, until they arrive or the rejoin
        wait ends. Whether the server is stopping. (Every job taken is in ``jobs``, should this raise.)"""
        first = jobs[0]
        if not self.batched or first.request.kind is not RequestKind.STEP:
            return False
        start = time.perf_counter()
        window_end = start + self.batch.window_ms / 1e3
        expected, rejoin_end = self._expected_back(start, first.robot)
        waited = False
        while len(jobs) < self.batch.max_batch:
            # waiting only helps when another open session could still send a step
            could_join = len(self.registry) > len(jobs)
            waiting_for = bool(expected)
            deadline = max(window_end, rejoin_end) if waiting_for else window_end
            timeout = deadline - time.perf_counter() if could_join else 0.0
            try:
                job = self._queue.get(timeout=timeout) if timeout > 0 else self._queue.get_nowait()
            except queue.Empty:
                waited |= waiting_for and timeout > 0 and time.perf_counter() > window_end
                break
            waited |= waiting_for and time.perf_counter() > window_end
            if job is _STOP:
                return True
            if any(j.robot is job.robot for j in jobs):  # one step per session per batch
                self._carry.append(job)
                break
            jobs.append(job)
            self.rejoined += job.robot in expected and time.perf_counter() > window_end
            expected.discard(job.robot)
        self.rejoin_waits += waited
        return False

    def _expected_back(self, now: float, first) -> tuple[set, float]:
        """The robots (other than ``first``'s) whose next step is due within the rejoin wait of ``now``
        (``BatchConfig.rejoin_fraction`` of the recent median batch time), and when that wait ends. A robot
        overdue by more than the wait has stopped or slowed down: it is not waited for."""
        if not self.batch.rejoin_fraction or not self.batch_times:
            return set(), now
        wait = self.batch.rejoin_fraction * statistics.median(self.batch_times)
        due = ((r, r.expected_back()) for r in self.registry.sessions() if r is not first)
        return {r for r, t in due if t is not None and now - wait <= t <= now + wait}, now + wait

    def _drain(self) -> None:
        for job in self._carry:
            job.future.set_exception(SessionClosed("the server is shutting down"))
        self._carry.clear()
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                return
            if job is not _STOP:
                job.future.set_exception(SessionClosed("the server is shutting down"))

    def _run_jobs(self, jobs: list[Job]) -> None:
        """Apply resets/prompts, then step every job that has an observation (batched when possible)."""
        steps: list[tuple[Job, object]] = []
        for job in jobs:
            if not job.future.set_running_or_notify_cancel():
                continue
            try:
                session = job.robot.prepare(job.request, self.policy, self.session_config)
            except Exception as e:  # noqa: BLE001 - classified and answered, never kills the worker
                self._fail(job, e, stepped=False)
                continue
            if session is None:
                job.future.set_result({"reset": True, "episode": job.robot.episode})
            else:
                steps.append((job, session))
        if len(steps) == 1 and (self.checks_alone or not self.checks_inputs_first):
            self._step_alone(*steps[0])
        elif steps:
            self._step_batch(steps)

    def _step_alone(self, job: Job, session) -> None:
        if self.checks_alone:  # a refused observation costs its episode nothing, as in ``_step_batch``
            try:
                session.check_observation(job.request.observation)
            except (ValueError, KeyError) as e:
                self._fail(job, e, stepped=False)
                return
        start = time.perf_counter()
        try:
            result = session.step(job.request.observation)
        except Exception as e:  # noqa: BLE001
            self._fail(job, e, stepped=True)
            return
        elapsed = (time.perf_counter() - start) * 1e3
        self._record(1, elapsed)
        self._answer(job, result, start, elapsed)

    def _record(self, size: int, elapsed_ms: float) -> None:
        """A forward of ``size`` steps ran and took ``elapsed_ms`` (``batch_sizes``, ``step_ms``: what bounds
        batching's gain, an 8-row forward against 8 one-row ones, read by ``benchmarks/bench_serve.py``)."""
        self.batch_sizes[size] = self.batch_sizes.get(size, 0) + 1
        self.step_ms.setdefault(size, deque(maxlen=STEP_MS_KEPT)).append(elapsed_ms)

    def _step_batch(self, steps: list[tuple[Job, object]]) -> None:
        """``policy.step_batch`` over the steps (one or several); an observation the policy refuses up front
        fails alone, its episode intact, and the rest run again."""
        start = time.perf_counter()
        try:
            results = self.policy.step_batch([s for _, s in steps], [j.request.observation for j, _ in steps])
        except BatchInputError as e:  # no session changed: answer that one, batch the others
            # a full cache cannot take this episode's next step: the episode ends, as a step alone would end it
            self._fail(steps[e.index][0], e.error, stepped=isinstance(e.error, CacheFullError))
            rest = steps[: e.index] + steps[e.index + 1 :]
            if rest:
                self._step_batch(rest)
            return
        except Exception as e:  # noqa: BLE001 - every session of the batch may have been written to
            if len(steps) == 1:
                self._fail(steps[0][0], e, stepped=True)
                return
            # which row failed is unknown: every episode of the batch is reset, and no robot is told another's error
            log.error("batched step of sessions %s failed; their episodes are reset", [j.robot.id for j, _ in steps],
                      exc_info=e)  # fmt: skip
            for job, _ in steps:
                job.robot.forget_episode()
                job.future.set_exception(InternalError(
                    f"internal error ({type(e).__name__}) in a step batched with other robots' (the episode was reset)"
                ))  # fmt: skip
            return
        elapsed = (time.perf_counter() - start) * 1e3
        self.batch_times.append(elapsed / 1e3)
        self._record(len(steps), elapsed)
        for (job, _), result in zip(steps, results):
            self._answer(job, result, start, elapsed)

    def _answer(self, job: Job, result: StepResult, start: float, infer_ms: float) -> None:
        robot = job.robot
        robot.steps += 1
        robot.answered_at = time.perf_counter()  # before the reply can reach the robot: its round trip starts here
        if robot.closed:
            robot.episode_session = None  # closed while stepping: free the cache now
        job.future.set_result({
            "actions": result.actions,
            "server_timing": {"infer_ms": infer_ms, "queue_ms": (start - job.enqueued) * 1e3},
            "policy_timing": dict(result.timings),
            "episode": robot.episode,
            "step": robot.steps - 1,
            "kv": result.kv.as_dict(),
        })  # fmt: skip

    def _fail(self, job: Job, error: Exception, *, stepped: bool) -> None:
        """Answer ``job`` with its error. A step that failed part-way may have written to its cache, so its
        episode is dropped (the next step starts a fresh one with the same instruction)."""
        if stepped:
            job.robot.forget_episode()
        reset = " (the episode was reset)" if stepped else ""
        if isinstance(error, (BadRequest, SessionClosed)):
            job.future.set_exception(type(error)(f"{error}{reset}"))
        elif isinstance(error, (ValueError, KeyError)):  # the runtime refused the input (e.g. a state of the wrong size)
            msg = error.args[0] if isinstance(error, KeyError) and error.args else error
            job.future.set_exception(BadRequest(f"{msg}{reset}"))
        else:
            log.error("step of session %s failed; its episode is reset", job.robot.id, exc_info=error)
            job.future.set_exception(InternalError(f"internal error ({type(error).__name__}) while stepping{reset}"))
