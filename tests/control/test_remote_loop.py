"""``RemotePolicyLoop``: a robot's ticks driven by a remote chunk policy, on a simulated clock.

The request thread is real; the clock is the test's. ``SimClock`` moves time from one event to the next
(a request's planned start, a reply's arrival, a tick) and waits until the request thread has done what
that moment allows, so every run takes the same path whatever the machine's speed.
"""

import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from vla_runtime.control import ControlConfig
from vla_runtime.control.remote import RemotePolicyLoop

PERIOD = 0.1
HORIZON = 8
STEP_S = 0.25  # a round trip of 2.5 control periods


class SimClock:
    """Simulated seconds; threads sleep on it, ``advance`` runs every wake-up due by then, in order."""

    def __init__(self) -> None:
        self.t = 0.0
        self._cv = threading.Condition()
        self._deadlines: list[float] = []  # of the threads sleeping now
        self.queued = 0  # jobs submitted, not started (behind the one running: one worker)
        self.running = 0  # jobs started, not finished

    def __call__(self) -> float:
        return self.t

    def sleep_until(self, t: float) -> None:
        with self._cv:
            self._deadlines.append(t)
            self._cv.notify_all()
            self._cv.wait_for(lambda: self.t >= t)
            self._deadlines.remove(t)

    def track(self, executor: ThreadPoolExecutor):
        def submit(job):
            def run():
                with self._cv:
                    self.queued -= 1
                    self.running += 1
                try:
                    job()
                finally:
                    with self._cv:
                        self.running -= 1
                        self._cv.notify_all()
            with self._cv:
                self.queued += 1
            return executor.submit(run)
        return submit

    def _quiet(self) -> bool:
        """The running job sleeps until a later time (a queued one waits for it), or nothing runs or waits."""
        if self.running == 0:
            return self.queued == 0
        return len(self._deadlines) == self.running and all(d > self.t for d in self._deadlines)

    def settle(self) -> None:
        """Wait until every job sleeps until a later time or has finished."""
        with self._cv:
            assert self._cv.wait_for(self._quiet, timeout=600), "the request thread never settled"

    def advance(self, until: float) -> None:
        self.settle()
        while True:
            with self._cv:
                due = [d for d in self._deadlines if d <= until]
                if not due:
                    self.t = until
                    return
                self.t = min(due)
                self._cv.notify_all()
            self.settle()


class ChunkServer:
    """A remote chunk policy: reply ``n`` is ``HORIZON`` rows, row ``i`` = [n, i, observation]; it takes STEP_S."""

    def __init__(self, clock: SimClock) -> None:
        self.clock = clock
        self.asked: list[tuple[float, int]] = []  # (when, the observation's tick)

    def infer(self, observation: dict) -> dict:
        n = len(self.asked)
        self.asked.append((self.clock.t, observation["tick"]))
        self.clock.sleep_until(self.clock.t + STEP_S)
        return {"actions": np.array([[n, i, observation["tick"]] for i in range(HORIZON)], dtype=np.float64)}


@pytest.fixture()
def sim():
    clock = SimClock()
    server = ChunkServer(clock)
    with ThreadPoolExecutor(max_workers=1) as executor:
        loop = RemotePolicyLoop(server.infer, ControlConfig(rate_hz=1 / PERIOD, refill_threshold=1), clock=clock,
                                submit=clock.track(executor),
                                wait_until=lambda t, cancel: clock.sleep_until(t) or cancel.is_set())
        yield clock, server, loop
        loop.reset()
        clock.advance(clock.t + 10)


def run(clock, loop, ticks: int, first: int = 0) -> list:
    out = []
    for k in range(first, first + ticks):
        clock.advance(k * PERIOD)
        out.append(loop.tick({"tick": k}))
    clock.settle()
    return out


def test_after_the_first_reply_every_tick_has_an_action_from_the_chunks_in_order(sim):
    clock, server, loop = sim
    actions = run(clock, loop, 60)
    first = next(i for i, a in enumerate(actions) if a is not None)
    landed = server.asked[0][0] + STEP_S
    assert first == int(np.ceil(landed / PERIOD - 1e-9))  # the first tick after the first reply arrived
    assert all(a is not None for a in actions[first:]), [i for i, a in enumerate(actions) if a is None]
    rows = [(int(a[0]), int(a[1])) for a in actions[first:]]
    assert rows == sorted(rows) and len(set(rows)) == len(rows)  # chunk by chunk, row by row, none twice
    stats = loop.stats
    # late: only the first request, planned before any round trip was measured
    assert stats.fallbacks == first and stats.steps_late <= 1, stats
    # the next chunk is asked for while the queue still holds actions: more requests than a chunk per HORIZON ticks
    assert len(server.asked) >= (60 - first) / HORIZON


def test_rows_for_ticks_already_past_are_skipped(sim):
    clock, server, loop = sim
    actions = run(clock, loop, 40)
    used = {}
    for k, a in enumerate(actions):
        if a is not None:
            used.setdefault(int(a[0]), []).append((k, int(a[1])))
    for n, ticks in used.items():
        asked_at, seen = server.asked[n]
        for k, row in ticks:
            # row i serves the i-th tick from the observation's time: the action meant for tick k
            assert row == k - seen, (n, k, row, seen)
    assert loop.stats.actions_skipped > 0  # the first rows of every reply were for ticks gone by its arrival


def test_a_tick_called_late_with_its_due_time_gets_its_own_row(sim):
    """A robot loop that overran calls tick 30 at 30.6 periods; told when it was due, that call gets tick 30's row,
    and the call at 31 periods gets tick 31's (named by the call time, the late call took tick 31's row)."""
    clock, server, loop = sim
    run(clock, loop, 30)
    clock.advance(30.6 * PERIOD)
    late = loop.tick({"tick": 30}, due=30 * PERIOD)
    clock.advance(31 * PERIOD)
    on_time = loop.tick({"tick": 31})
    clock.settle()
    for k, action in ((30, late), (31, on_time)):
        assert action is not None, k
        _, seen = server.asked[int(action[0])]
        assert int(action[1]) == k - seen, (k, action, seen)
    with pytest.raises(ValueError, match="more than a period after now"):
        loop.tick({"tick": 32}, due=clock.t + 2 * PERIOD)


def test_each_request_takes_the_newest_observation_of_its_start(sim):
    clock, server, loop = sim
    run(clock, loop, 30)
    for when, seen in server.asked:
        assert seen == int(when / PERIOD + 1e-9)  # the tick at or before the request's start


def test_reset_drops_the_queue_and_the_reply_in_flight(sim):
    clock, server, loop = sim
    before = run(clock, loop, 10)
    assert before[-1] is not None
    loop.reset()
    after = run(clock, loop, 10, first=10)
    # the old episode's queued rows are gone: the first action after the reset comes from a request made after it
    first = next(a for a in after if a is not None)
    n = int(first[0])
    assert server.asked[n][0] >= 10 * PERIOD - 1e-9


def test_a_failed_request_is_raised_at_the_next_tick():
    clock = SimClock()

    def broken(observation):
        raise ConnectionError("server closed the connection")

    with ThreadPoolExecutor(max_workers=1) as executor:
        loop = RemotePolicyLoop(broken, ControlConfig(rate_hz=1 / PERIOD), clock=clock, submit=clock.track(executor),
                                wait_until=lambda t, cancel: clock.sleep_until(t) or cancel.is_set())
        assert loop.tick({"tick": 0}) is None
        clock.advance(PERIOD)
        with pytest.raises(RuntimeError, match="ConnectionError: server closed the connection"):
            loop.tick({"tick": 1})
        loop.tick({"tick": 2})  # raised once; the loop goes on
        loop.reset()
        clock.advance(clock.t + 10)  # the request planned at tick 2 wakes, cancelled


def test_a_request_that_fails_after_a_reset_is_not_raised_in_the_new_episode():
    clock = SimClock()

    def slow_then_broken(observation):
        clock.sleep_until(clock.t + 3 * PERIOD)  # still in flight when the robot resets
        raise ConnectionError("the old episode's request failed")

    with ThreadPoolExecutor(max_workers=1) as executor:
        loop = RemotePolicyLoop(slow_then_broken, ControlConfig(rate_hz=1 / PERIOD), clock=clock,
                                submit=clock.track(executor),
                                wait_until=lambda t, cancel: clock.sleep_until(t) or cancel.is_set())  # fmt: skip
        assert loop.tick({"tick": 0}) is None
        clock.advance(PERIOD)  # the request is in its policy call
        loop.reset()
        clock.advance(5 * PERIOD)  # it fails now, in the new episode
        loop.tick({"tick": 6})  # no error of the old episode's raised here
        loop.reset()
        clock.advance(10)


def test_publish_mode_immediate_is_refused():
    with pytest.raises(ValueError, match="publish_mode"):
        RemotePolicyLoop(lambda obs: {}, ControlConfig(publish_mode="immediate"))


def test_openpi_client_against_vla_runtime_serve_drives_the_loop(tmp_path):
    # the loop as a robot uses it: openpi's own client, `vla-runtime serve` on localhost, each tick's action
    # equal to what the policy gives for the observation its request took
    pytest.importorskip("openpi_client", reason="openpi-client is not installed (scripts/setup.sh installs it)")
    from openpi_client.websocket_client_policy import WebsocketClientPolicy

    from vla_runtime.api import Observation, load_policy
    from vla_runtime.checkpoints.tiny_openvla import make_tiny_openvla
    from vla_runtime.config import SessionConfig
    from vla_runtime.serve import ServeConfig
    from vla_runtime.serve.server import ServerThread, build_server

    policy = load_policy(make_tiny_openvla(tmp_path / "tiny-openvla", seed=0), device="cpu")
    frames = [np.random.default_rng(k).integers(0, 255, (64, 64, 3), dtype=np.uint8) for k in range(12)]
    thread = ServerThread(build_server(policy, SessionConfig(), ServeConfig(port=0)))
    port = thread.start()
    clock = SimClock()
    asked = []

    def infer(observation):
        asked.append(observation["tick"])
        return client.infer({"observation/image": frames[observation["tick"]], "prompt": "pick up the cube"})

    try:
        client = WebsocketClientPolicy("localhost", port)
        with ThreadPoolExecutor(max_workers=1) as executor:
            chunked = client.get_server_metadata()["action_horizon"] > 1  # OpenVLA: one action per request
            loop = RemotePolicyLoop(infer, ControlConfig(rate_hz=1 / PERIOD), chunked=chunked, clock=clock,
                                    submit=clock.track(executor),
                                    wait_until=lambda t, cancel: clock.sleep_until(t) or cancel.is_set())
            actions = run(clock, loop, len(frames))
            loop.reset()
            clock.advance(clock.t + 10)
    finally:
        thread.stop()
    got = [a for a in actions if a is not None]
    assert len(got) >= len(frames) - 2 and asked, (actions, asked)
    session = policy.new_session("pick up the cube")  # single mode: each action depends on its frame only
    expected = {k: session.step(Observation(images={"primary": frames[k]})).actions[0] for k in set(asked)}
    for action in got:
        assert any(np.allclose(action, e, atol=1e-5) for e in expected.values()), action
