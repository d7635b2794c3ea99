"""Per-robot state of the server: one ``RobotSession`` per connection, kept in a ``SessionRegistry``.

Everything one robot owns (its episode session with its KV cache, the instruction, counters) lives in its
``RobotSession``; the registry owns the sessions and their limits. Neither is a module global, so a Ray Serve
replica (or a test) can own a registry and an engine of its own.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from typing import Callable

from ..api import EpisodeSession, Policy
from ..config import SessionConfig
from .messages import BadRequest, Request


class SessionLimitReached(RuntimeError):
    """A new connection would exceed ``max_sessions``; the message is the reason sent to the client."""


class SessionClosed(RuntimeError):
    """A step for a session that was closed (disconnect or idle timeout) while the step waited."""


#: recent round trips (an answer to the robot's next request) kept per robot
ROUND_TRIPS_KEPT = 8


class RobotSession:
    """One robot's connection: its episode (``EpisodeSession``, created at the first step that has a
    prompt), the current instruction and the counters reported back.

    The worker thread steps it; the event loop thread opens, touches and closes it. ``close`` drops the
    episode session (its KV cache is freed once an in-flight step finishes).

    Args:
        session_id: unique within the registry. peer: the client's address (for logs). now: clock reading.
    """

    def __init__(self, session_id: str, peer: str, now: float) -> None:
        self.id = session_id
        self.peer = peer
        self.created = now
        self.last_active = now
        self.in_flight = 0  # requests submitted and not answered yet
        self.closed = False
        self.instruction: str | None = None
        self.episode_session: EpisodeSession | None = None
        self.episode = 0  # index of the current episode (incremented by a reset or a new prompt)
        self.steps = 0  # steps run in the current episode
        self._started = False  # an episode has begun (a step ran or a prompt was set)
        # the engine's clock (perf_counter seconds): when it last took a request of this robot and answered a step
        self.submitted_at: float | None = None
        self.answered_at: float | None = None
        self.round_trips: deque[float] = deque(maxlen=ROUND_TRIPS_KEPT)  # answer -> next request, seconds

    def expected_back(self) -> float | None:
        """When (the engine's clock) this robot's next step should arrive: its last answer plus the longest of its
        recent round trips. ``None`` while one of its requests is pending, before its first round trip, or closed."""
        if self.closed or self.answered_at is None or not self.round_trips:
            return None
        if self.submitted_at is not None and self.submitted_at > self.answered_at:
            return None
        return self.answered_at + max(self.round_trips)

    # ---- worker thread ---------------------------------------------------------------------------

    def new_episode(self, prompt: str | None) -> None:
        """End the current episode (if one began); ``prompt`` replaces the instruction when given."""
        if prompt is not None:
            self.instruction = prompt
        if self.episode_session is not None:
            self.episode_session.reset(self.instruction)
        if self._started:
            self.episode += 1
        self.steps = 0
        self._started = self.instruction is not None

    def prepare(self, request: Request, policy: Policy, config: SessionConfig) -> EpisodeSession | None:
        """Apply the request's reset/prompt; return the episode session to step (``None`` for a reset only).

        A prompt different from the current instruction starts a new episode, as does ``reset``.
        """
        if self.closed:
            raise SessionClosed(f"session {self.id} is closed")
        if request.reset or (request.prompt is not None and request.prompt != self.instruction):
            self.new_episode(request.prompt)
        if request.observation is None:
            return None
        if self.instruction is None:
            raise BadRequest("the first step of a session needs a prompt (the task instruction)")
        if self.episode_session is None:
            self.episode_session = policy.new_session(self.instruction, config)
            self._started = True
        return self.episode_session

    def forget_episode(self) -> None:
        """Drop the episode session (after a failed step its cache state is unknown); the next step starts a
        fresh episode with the same instruction."""
        self.episode_session = None
        if self._started:
            self.episode += 1
        self.steps = 0
        self._started = False

    # ---- event loop thread -----------------------------------------------------------------------

    def close(self) -> None:
        self.closed = True
        self.episode_session = None


class SessionRegistry:
    """The open sessions, at most ``max_sessions``; ``idle`` lists those silent for ``idle_timeout_s``.

    Args:
        max_sessions: sessions open at once. idle_timeout_s: seconds without a message before a session is idle.
        clock: monotonic seconds (tests pass a fake one).
    """

    def __init__(self, max_sessions: int, idle_timeout_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_sessions = max_sessions
        self.idle_timeout_s = idle_timeout_s
        self.clock = clock
        self._sessions: dict[str, RobotSession] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)  # notified when a session opens or closes

    def open(self, peer: str) -> RobotSession:
        """A new session, or ``SessionLimitReached`` with a reason a client can show."""
        with self._lock:
            if len(self._sessions) >= self.max_sessions:
                raise SessionLimitReached(
                    f"server full: {len(self._sessions)} of {self.max_sessions} sessions in use; try again later"
                )
            robot = RobotSession(f"s{next(self._ids)}", peer, self.clock())
            self._sessions[robot.id] = robot
            self._changed.notify_all()
            return robot

    def close(self, robot: RobotSession) -> None:
        """Forget ``robot`` and drop its episode (idempotent)."""
        robot.close()
        with self._lock:
            self._sessions.pop(robot.id, None)
            self._changed.notify_all()

    def touch(self, robot: RobotSession) -> None:
        robot.last_active = self.clock()

    def idle(self) -> list[RobotSession]:
        """Sessions without a message for ``idle_timeout_s`` and no request in flight."""
        now = self.clock()
        with self._lock:
            return [r for r in self._sessions.values() if r.in_flight == 0 and now - r.last_active >= self.idle_timeout_s]

    def sessions(self) -> list[RobotSession]:
        with self._lock:
            return list(self._sessions.values())

    def wait_for(self, predicate: Callable[[int], bool], timeout: float | None = None) -> bool:
        """Block until ``predicate(number of open sessions)`` holds (or ``timeout`` s pass); returns whether it holds."""
        with self._changed:
            return self._changed.wait_for(lambda: predicate(len(self._sessions)), timeout)

    def __len__(self) -> int:
        with self._lock:
            return len(self._sessions)
