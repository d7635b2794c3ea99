"""Micro-batching: several sessions' steps as one batched forward give each session what it gets alone;
a refused input fails alone; a failing batch resets the episodes it touched; robots expected back are waited for."""

import time

import numpy as np
import pytest

from vla_runtime.api import BatchInputError, Observation
from vla_runtime.config import CompileMode, SessionConfig
from vla_runtime.kv import KVConfig
from vla_runtime.kv.rows import RowsCache
from vla_runtime.serve.config import MAX_REJOIN_FRACTION, BatchConfig
from vla_runtime.serve.engine import InternalError, PolicyEngine
from vla_runtime.serve.messages import BadRequest, Request, RequestKind
from vla_runtime.serve.sessions import SessionRegistry

PROMPTS = ["pick up the cube", "open the drawer", "stack the red block on the blue one", "go"]  # different lengths


def step(f, prompt=None, state=None):
    return Request(RequestKind.STEP, prompt=prompt, observation=Observation(images={"primary": f}, state=state))


@pytest.mark.parametrize(
    ("history", "kv"),
    [("history", "full"), ("history", "chunked"), ("history", "sink_window"), ("observations", "chunked"), ("single", "full")],
)
def test_step_batch_equals_steps_alone(tiny_policy, frame, history, kv):
    config = SessionConfig(history=history, kv=KVConfig(mode=kv))
    alone = [tiny_policy.new_session(p, config) for p in PROMPTS]
    batched = [tiny_policy.new_session(p, config) for p in PROMPTS]
    for t in range(6):
        obs = [Observation(images={"primary": frame(10 * i + t)}) for i in range(len(PROMPTS))]
        expected = [s.step(o) for s, o in zip(alone, obs)]
        # odd steps: half the sessions batched, the others alone, so the caches' lengths differ from then on
        rows = range(len(PROMPTS)) if t % 2 == 0 or t > 3 else range(0, len(PROMPTS), 2)
        for i in set(range(len(PROMPTS))) - set(rows):
            batched[i].step(obs[i])
        results = tiny_policy.step_batch([batched[i] for i in rows], [obs[i] for i in rows])
        for i, result in zip(rows, results):
            np.testing.assert_array_equal(result.actions, expected[i].actions)
            np.testing.assert_array_equal(batched[i].last_tokens, alone[i].last_tokens)
            assert result.kv == expected[i].kv
    assert any(np.any(alone[0].last_tokens != s.last_tokens) for s in alone[1:])  # the rows really differ
    if kv == "chunked":
        assert alone[0].cache.stats().chunks_retained > 0  # compressed chunks took part


def test_step_batch_refuses_a_bad_input_before_changing_anything(tiny_proprio_policy, frame):
    sessions = [tiny_proprio_policy.new_session("stack", SessionConfig(history="history")) for _ in range(3)]
    obs = [Observation(images={"primary": frame(i)}, state=np.zeros(8)) for i in range(3)]
    obs[1] = Observation(images={"primary": frame(1)}, state=np.zeros(3))
    with pytest.raises(BatchInputError, match=r"observation 1 of the batch: observation `state` has shape \(3,\)") as info:
        tiny_proprio_policy.step_batch(sessions, obs)
    assert info.value.index == 1
    assert all(s.cache.stats().tokens_seen == 0 for s in sessions)
    with pytest.raises(ValueError, match="distinct sessions"):
        tiny_proprio_policy.step_batch([sessions[0], sessions[0]], obs[:2])
    with pytest.raises(ValueError, match="distinct caches"):
        RowsCache([sessions[0].cache, sessions[0].cache])


def test_an_engine_of_a_batching_family_refuses_to_batch_compiled_sessions(tiny_policy):
    registry = SessionRegistry(max_sessions=8, idle_timeout_s=60)
    with pytest.raises(ValueError, match=r"`compile` is 'default', but the server batches openvla steps \(max_batch 8\) "
                                         r"through the family's batched forward .* one robot at a time \(max_batch 1, `--max-batch 1`\)"):
        PolicyEngine(tiny_policy, SessionConfig(compile=CompileMode.DEFAULT), registry, BatchConfig(max_batch=8))


def test_cuda_graphed_sessions_of_several_robots_are_warned_about(tiny_policy, caplog):
    for sessions, warned in ((2, True), (1, False)):
        caplog.clear()
        registry = SessionRegistry(max_sessions=sessions, idle_timeout_s=60)
        PolicyEngine(tiny_policy, SessionConfig(compile=CompileMode.REDUCE_OVERHEAD), registry, BatchConfig(max_batch=1))
        assert ("torch re-records a graph when such an address changes" in caplog.text) is warned


@pytest.mark.slow  # the session's warm-up compiles (inductor, ~30 s on 2 cores)
def test_compiled_sessions_step_alone_and_a_refused_observation_keeps_the_episode(tiny_proprio_policy, frame, monkeypatch):
    """``max_batch`` 1 with ``compile``: each robot's step is its session's compiled step (the eager session's
    actions; the eager batched forward is never called), and an observation the step would refuse is answered
    before the step runs, the episode intact."""
    monkeypatch.setattr(tiny_proprio_policy, "step_batch", lambda *a: pytest.fail("a compiled session went through step_batch"))
    config = SessionConfig(history="history", compile=CompileMode.DEFAULT)
    engine, (robot,) = engine_with(tiny_proprio_policy, 1, config=config, max_batch=1)
    eager = tiny_proprio_policy.new_session("stack", SessionConfig(history="history"))
    state = np.linspace(-1, 1, 8)
    engine.start()
    try:
        first = engine.submit(robot, step(frame(0), "stack", state)).result()
        np.testing.assert_allclose(first["actions"], eager.step(Observation(images={"primary": frame(0)}, state=state)).actions,
                                   rtol=0, atol=1e-6)
        with pytest.raises(BadRequest, match=r"observation `state` has shape \(3,\)") as info:
            engine.submit(robot, step(frame(1), state=np.zeros(3))).result()
        assert "episode was reset" not in str(info.value)
        second = engine.submit(robot, step(frame(1), state=state)).result()
        assert (second["episode"], second["step"]) == (0, 1)  # the same episode, its second step
        np.testing.assert_allclose(second["actions"], eager.step(Observation(images={"primary": frame(1)}, state=state)).actions,
                                   rtol=0, atol=1e-6)
    finally:
        engine.stop()
    assert engine.batch_sizes == {1: 2}  # the refused observation never reached a forward


def engine_with(policy, n, config=SessionConfig(history="history"), max_batch=8):
    registry = SessionRegistry(max_sessions=8, idle_timeout_s=60)
    engine = PolicyEngine(policy, config, registry, BatchConfig(max_batch=max_batch, window_ms=0))
    return engine, [registry.open(f"robot{i}") for i in range(n)]


def test_engine_runs_queued_steps_of_several_sessions_as_one_batch(tiny_policy, frame):
    engine, robots = engine_with(tiny_policy, 4)
    alone = [tiny_policy.new_session(p, SessionConfig(history="history")) for p in PROMPTS]
    try:
        for t in range(3):
            futures = [engine.submit(r, step(frame(10 * i + t), PROMPTS[i])) for i, r in enumerate(robots)]
            if t == 0:
                engine.start()  # submitted before start: the first batch takes all four
            replies = [f.result() for f in futures]
            for i, reply in enumerate(replies):
                np.testing.assert_array_equal(reply["actions"], alone[i].step(Observation(images={"primary": frame(10 * i + t)})).actions)
                assert (reply["episode"], reply["step"]) == (0, t)
    finally:
        engine.stop()
    assert engine.batch_sizes[4] >= 1
    assert sum(n * count for n, count in engine.batch_sizes.items()) == 12
    # every forward's time recorded under its batch size (what bench_serve reads)
    assert {n: len(ms) for n, ms in engine.step_ms.items()} == engine.batch_sizes
    assert all(t > 0 for ms in engine.step_ms.values() for t in ms)


def test_engine_answers_a_refused_input_alone_and_batches_the_rest(tiny_proprio_policy, frame):
    engine, robots = engine_with(tiny_proprio_policy, 3, config=SessionConfig())
    good = np.linspace(-1, 1, 8)
    futures = [engine.submit(r, step(frame(i), "stack", good if i != 1 else np.zeros(5))) for i, r in enumerate(robots)]
    engine.start()
    try:
        with pytest.raises(BadRequest, match=r"observation `state` has shape \(5,\)") as info:
            futures[1].result()
        assert "episode was reset" not in str(info.value)
        expected = tiny_proprio_policy.new_session("stack", SessionConfig()).step(Observation(images={"primary": frame(0)}, state=good))
        np.testing.assert_array_equal(futures[0].result()["actions"], expected.actions)
        assert futures[2].result()["step"] == 0
        assert engine.batch_sizes == {2: 1}
        assert engine.submit(robots[1], step(frame(1), state=good)).result()["episode"] == 0  # the episode survived
    finally:
        engine.stop()


class FailingBatches:
    """The real policy, except that ``step_batch`` writes to every row's cache and then raises."""

    batched_steps = True

    def __init__(self, policy):
        self._policy = policy

    def __getattr__(self, name):
        return getattr(self._policy, name)

    def step_batch(self, sessions, observations):
        for s, o in zip(sessions, observations):
            s.step(o)
        raise RuntimeError("half-way")


def test_a_failing_batch_resets_the_episodes_it_touched(tiny_policy, frame):
    engine, robots = engine_with(FailingBatches(tiny_policy), 2)
    futures = [engine.submit(r, step(frame(i), "go")) for i, r in enumerate(robots)]
    engine.start()
    try:
        for f in futures:
            with pytest.raises(InternalError, match=r"internal error \(RuntimeError\) in a step batched with other robots' "
                                                    r"\(the episode was reset\)"):
                f.result()
        assert all(r.episode_session is None and r.episode == 1 for r in robots)
    finally:
        engine.stop()


def rejoin_engine(policy, n):
    """Two-plus robots stepped twice as one batch: each has answered steps and a short round trip. Window 0 and a
    rejoin wait of up to 10,000 batch times (the most the config takes; a wait ends when the robots expected back
    arrive, not at its end, so the test thread has that long to send the next step however slow the machine)."""
    registry = SessionRegistry(max_sessions=8, idle_timeout_s=60)
    engine = PolicyEngine(policy, SessionConfig(history="history"), registry,
                          BatchConfig(window_ms=0, rejoin_fraction=MAX_REJOIN_FRACTION))  # fmt: skip
    robots = [registry.open(f"robot{i}") for i in range(n)]
    return engine, robots


def step_all(engine, robots, frame, t):
    futures = [engine.submit(r, step(frame(10 * i + t), PROMPTS[i])) for i, r in enumerate(robots)]
    return [f.result() for f in futures]


def taken(engine) -> None:
    """Until the worker has taken every queued request (generous bound: a slow machine is slower, not red)."""
    deadline = time.monotonic() + 120
    while not engine._queue.empty():
        assert time.monotonic() < deadline, "the worker never took the queued request"
        time.sleep(0.001)


def test_robots_expected_back_are_waited_for_and_batched_together(tiny_policy, frame):
    engine, robots = rejoin_engine(tiny_policy, 2)
    first = [engine.submit(r, step(frame(i), PROMPTS[i])) for i, r in enumerate(robots)]
    engine.start()  # the first batch takes both
    try:
        assert [f.result()["step"] for f in first] == [0, 0]
        step_all(engine, robots, frame, 1)  # both have a round trip now
        assert all(r.expected_back() is not None for r in robots)
        before = dict(engine.batch_sizes)
        late = engine.submit(robots[0], step(frame(2), PROMPTS[0]))
        taken(engine)  # the worker holds robot 0's step ...
        other = engine.submit(robots[1], step(frame(12), PROMPTS[1]))  # ... and robot 1 comes back after it
        assert (late.result()["step"], other.result()["step"]) == (2, 2)
    finally:
        engine.stop()
    assert engine.batch_sizes.get(2, 0) == before.get(2, 0) + 1 and engine.batch_sizes.get(1, 0) == before.get(1, 0)
    assert engine.rejoin_waits >= 1 and engine.rejoined >= 1


def test_a_robot_not_due_back_soon_or_long_overdue_is_not_waited_for(tiny_policy, frame):
    engine, robots = rejoin_engine(tiny_policy, 2)
    engine.start()
    try:
        step_all(engine, robots, frame, 0)
        step_all(engine, robots, frame, 1)
        robots[1].round_trips.clear()
        robots[1].round_trips.append(1e6)  # it steps once in eleven days
        before, waits = dict(engine.batch_sizes), engine.rejoin_waits
        assert engine.submit(robots[0], step(frame(2), PROMPTS[0])).result()["step"] == 2
        robots[1].round_trips.clear()
        robots[1].round_trips.append(0.001)
        robots[1].answered_at -= 1e6  # it was due back eleven days ago: it stopped, and is not waited for either
        robots[1].submitted_at -= 2e6
        assert robots[1].expected_back() is not None
        assert engine.submit(robots[0], step(frame(3), PROMPTS[0])).result()["step"] == 3
    finally:
        engine.stop()
    assert engine.batch_sizes.get(1, 0) == before.get(1, 0) + 2
    assert engine.rejoin_waits == waits and engine.rejoined == 0


def test_a_robot_is_expected_back_only_between_an_answer_and_its_next_request():
    registry = SessionRegistry(max_sessions=2, idle_timeout_s=60)
    robot = registry.open("robot")
    assert robot.expected_back() is None  # never answered
    robot.answered_at, robot.submitted_at = 10.0, 9.0
    assert robot.expected_back() is None  # answered, but no round trip seen yet
    robot.round_trips.extend([0.02, 0.05, 0.03])
    assert robot.expected_back() == pytest.approx(10.05)  # its slowest recent round trip
    robot.submitted_at = 10.04
    assert robot.expected_back() is None  # its next request is in
    robot.submitted_at, robot.closed = 9.0, True
    assert robot.expected_back() is None
    with pytest.raises(ValueError, match="rejoin_fraction"):
        BatchConfig(rejoin_fraction=-0.1)


def test_a_robot_whose_full_cache_cannot_take_the_step_fails_alone(tiny_policy, frame):
    """History mode, a full cache of bounded capacity: a robot whose cache cannot take its next step is refused
    before the batch runs (its episode ends, as alone), and the robot batched with it steps as if alone."""
    probe = tiny_policy.new_session("go", SessionConfig(history="history"))
    for t in range(2):
        probe.step(Observation(images={"primary": frame(t)}))
    held = probe.cache.stats().tokens_raw
    need = probe.frame.length(tiny_policy.vlm.cfg.vision.num_patches) + probe.head_tokens  # a later step's most tokens
    config = SessionConfig(history="history", kv=KVConfig.of("full", capacity=held + need - 1))
    engine, (full, fresh) = engine_with(tiny_policy, 2, config=config)
    engine.start()
    try:
        for t in range(2):
            engine.submit(full, step(frame(t), "go")).result()
    finally:
        engine.stop()
    batched = PolicyEngine(tiny_policy, config, engine.registry, BatchConfig(window_ms=0))
    futures = [batched.submit(full, step(frame(2))), batched.submit(fresh, step(frame(5), "go"))]
    batched.start()  # the first batch takes both
    try:
        with pytest.raises(BadRequest, match=rf"FullCache is full: {held} tokens held \+ {need} new > capacity "
                                             rf"{held + need - 1}.* \(the episode was reset\)"):  # fmt: skip
            futures[0].result()
        alone = tiny_policy.new_session("go", config).step(Observation(images={"primary": frame(5)}))
        np.testing.assert_array_equal(futures[1].result()["actions"], alone.actions)
        assert (fresh.episode, full.episode, full.episode_session) == (0, 1, None)
    finally:
        batched.stop()
    exact = tiny_policy.new_session("go", SessionConfig(history="history", kv=KVConfig.of("full", capacity=held + need)))
    for t in range(3):  # one more slot: the third step fits exactly (the check is no stricter than the cache)
        tiny_policy.step_batch([exact], [Observation(images={"primary": frame(t)})])
    assert exact.cache.stats().tokens_raw == held + need


def test_a_failure_while_gathering_a_batch_answers_its_requests_and_the_worker_goes_on(tiny_policy, frame, monkeypatch):
    engine, (robot,) = engine_with(tiny_policy, 1)
    gather, calls = engine._gather, []

    def overflowing_once(jobs):  # what an unbounded wait did to ``queue.get`` before the config refused one
        calls.append(len(jobs))
        if len(calls) == 1:
            raise OverflowError("timestamp out of range for platform time_t")
        return gather(jobs)

    monkeypatch.setattr(engine, "_gather", overflowing_once)
    first = engine.submit(robot, step(frame(0), "go"))
    engine.start()
    try:
        with pytest.raises(InternalError, match=r"internal error \(OverflowError\)"):
            first.result(timeout=120)  # a generous bound: a dead worker would leave it unanswered for ever
        assert engine.submit(robot, step(frame(1), "go")).result()["step"] == 0  # the worker still runs
    finally:
        engine.stop()
