"""The retention picture: its data is the chunked cache's state, mapped to the steps the chunks came from."""

import numpy as np
import pytest
import torch

from vla_runtime.api import Observation, load_policy
from vla_runtime.checkpoints.tiny_openvla import make_tiny_openvla
from vla_runtime.config import SessionConfig
from vla_runtime.kv import ChunkGate, KVConfig, KVMode
from vla_runtime.sim.evaluate import EpisodeResult, episode_record
from vla_runtime.sim.retention import RetentionTrace, describe_sources, format_steps, plot_episodes

STEPS = 12


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    """A tiny OpenVLA history session, chunked cache with a budget of 3 and a gate that drops some chunks,
    traced after every step."""
    torch.manual_seed(0)
    policy = load_policy(make_tiny_openvla(tmp_path_factory.mktemp("ckpt") / "tiny", seed=0))
    kv = KVConfig.of(KVMode.CHUNKED, chunk=8, max_chunks=3)
    gate = ChunkGate(kv.gate_config(policy.config.llm.geometry))
    with torch.no_grad():
        gate.readout_weight.normal_(0.0, 3.0)
        gate.readout_bias.zero_()
    policy.kv_gate = gate
    session = policy.new_session("put the red cube in the blue bowl", SessionConfig(kv=kv, history="history"))
    rng = np.random.default_rng(0)
    trace, seen = RetentionTrace(), []
    for _ in range(STEPS):
        result = session.step(Observation(images={"primary": rng.integers(0, 256, (96, 128, 3), dtype=np.uint8)}))
        trace.record(session.retained_chunks(), result.kv.tokens_seen, tick=len(seen))  # one step per tick
        seen.append(result.kv)
    return session, trace, seen


def test_trace_maps_the_held_chunks_to_their_source_steps(traced):
    session, trace, stats = traced
    per_step = np.diff(trace.step_ends)
    assert len(set(per_step.tolist())) == 1  # every step appends the same tokens after the first
    grid = trace.held_by_step()  # [source step, control step]
    layers = session.cache.geometry.n_layers
    for x, s in enumerate(stats):
        assert grid[:, x].sum() == pytest.approx(s.chunks_retained / layers)  # every held chunk, once
    starts = session.cache.retained_starts()  # the cache's own state after the last step
    assert starts == trace.retained[-1] and 0 < sum(map(len, starts)) <= 3 * layers
    first = trace.step_ends[0]  # prompt + step 0
    expected = np.zeros(STEPS)
    for layer in starts:
        for start in layer:  # token -> step by the per-step token count
            expected[0 if start < first else 1 + (start - first) // per_step[0]] += 1 / layers
    np.testing.assert_allclose(grid[:, -1], expected)
    assert np.all(np.diag(grid) == 0)  # a step's own tokens are still raw after it
    held_step = int(np.argmax(expected))
    assert trace.cue_held(held_step) == pytest.approx(np.mean([any(trace.source_step(s) == held_step for s in layer) for layer in starts]))

    held = trace.held_sources()  # the last column, by source step, as the demo prints it
    assert held == {step: pytest.approx(v) for step, v in enumerate(expected) if v > 0}


def test_held_sources_are_described_as_runs_of_steps_with_cues_flagged():
    held = {0: 0.5, 1: 1.0, 2: 0.25, 3: 2.0, 7: 1.0, 8: 0.5}
    assert format_steps([9, 0, 1, 2, 3, 6, 7, 8]) == "0-3, 6-9" and format_steps([27, 45, 63]) == "27, 45, 63"
    text = describe_sources(held, cue_steps=[1, 2])
    assert text == "step 0: 0.5 chunks; steps 1-2 (cue): 1.2 chunks; step 3: 2.0 chunks; steps 7-8: 1.5 chunks"
    assert describe_sources({}) == "no chunks held"


def test_one_picture_per_traced_episode_with_the_cues_marked(traced, tmp_path):
    _, trace, _ = traced
    result = EpisodeResult("reach-v3", 1000, False, STEPS, 0.0, 0.0, [], [], 0, {}, retention=trace, cue_steps=[1])
    untraced = EpisodeResult("reach-v3", 1001, True, 3, 0.0, 0.0, [], [], 0, {})
    paths = plot_episodes([result, untraced], tmp_path)
    assert paths == [tmp_path / "reach-v3-seed1000.png"]
    assert paths[0].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and paths[0].stat().st_size > 5000
    assert "retention" not in episode_record(result) and episode_record(result)["cue_steps"] == [1]


def test_steps_are_counted_in_control_steps_when_a_policy_step_spans_several():
    """``eval --control-rate`` with steps slower than a tick: each policy step sees one tick's frame and the next
    steps later. The trace names chunks by that tick, the unit the task's cue steps come in."""
    import time

    from vla_runtime.api import EpisodeSession, StepResult
    from vla_runtime.control import ControlConfig
    from vla_runtime.kv.base import KVStats
    from vla_runtime.sim.base import SimObservation, StepInfo
    from vla_runtime.sim.evaluate import run_episode

    tokens = 10  # per policy step

    class OneChunkSession(EpisodeSession):  # holds one chunk: the one policy step 3 appended
        def reset(self, instruction=None):
            self.seen = []

        def step(self, obs):
            self.seen.append(int(obs.images["primary"][0, 0, 0]))  # the tick whose frame it saw
            time.sleep(0.02)  # x time_scale 3: a step takes 3 ticks of 20 ms or more
            return StepResult(actions=np.zeros((1, 7)), timings={}, kv=KVStats(tokens_seen=tokens * len(self.seen)))

        def retained_chunks(self):
            return ((3 * tokens,),) if len(self.seen) > 3 else ()

    class Policy:
        action_dim, chunk_size = 7, 1

        def new_session(self, instruction, config):
            self.session = OneChunkSession(instruction, config)
            self.session.reset()
            return self.session

    class TickWorld:
        name, fps = "ticks", 50

        def reset(self, task, seed):
            self.k = 0
            return self.obs()

        def step(self, action):
            self.k += 1
            return self.obs(), self.k >= 30, False, StepInfo(self.k, self.k >= 30, np.asarray(action), {"cue_steps": [3]})

        def obs(self):
            return SimObservation(images={"primary": np.full((2, 2, 3), self.k, np.uint8)}, state=np.zeros(4), instruction="go")

    policy = Policy()
    r = run_episode(TickWorld(), policy, "t", 0, SessionConfig(), trace_retention=True,
                    control=ControlConfig(rate_hz=50), time_scale=3.0)  # fmt: skip
    seen, trace = policy.session.seen, r.retention
    assert trace.ticks == seen and trace.policy_steps < r.steps  # a policy step spans several ticks
    source = seen[3]  # the control step whose frame policy step 3 saw
    assert source != 3 and trace.held_sources() == {source: 1.0}
    assert trace.cue_held(source) == 1.0 and trace.cue_held(3) == 0.0  # the task's cue tick 3 was never seen
    grid = trace.held_by_step()
    assert grid.shape == (trace.steps, trace.steps) and grid.sum(axis=0).tolist() == [0.0] * source + [1.0] * (trace.steps - source)
    assert grid[source, source:].tolist() == [1.0] * (trace.steps - source)  # held from policy step 3 on, every tick
    with pytest.raises(ValueError, match=f"tick 3 comes before the last step's \\({seen[-1]}\\)"):
        trace.record((), 0, tick=3)
