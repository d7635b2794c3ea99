"""CogACT through the runtime API: upstream's sequence, chunks, seeds, ensemble, execution horizon, caches."""

import numpy as np
import pytest
import torch

from vla_runtime.api import ActionPrefix, ActionQueue, BatchInputError, Observation, load_policy
from vla_runtime.config import SessionConfig
from vla_runtime.kv import FullCache, FullParams, KVConfig, KVMode
from vla_runtime.models.action_postprocess import postprocess_actions
from vla_runtime.models.cogact.configuration_cogact import AdaptiveEnsembleConfig
from vla_runtime.models.cogact.processing_cogact import AdaptiveEnsembler
from vla_runtime.models.prismatic.processing_prismatic import history_prompt

INSTRUCTION = "Put the eggplant in the basket"


def obs(image):
    return Observation(images={"primary": image})


@pytest.fixture(scope="module")
def policy(tiny_cogact):
    return load_policy(tiny_cogact)


def test_step_returns_a_16x7_chunk_in_robot_units(policy, frame):
    result = policy.new_session(INSTRUCTION).step(obs(frame(0)))
    assert result.actions.shape == (16, 7) and policy.chunk_size == 16
    stats = policy.norm_stats["bridge_orig"]["action"]
    assert np.all(result.actions[:, :6] >= np.array(stats["q01"][:6]) - 1e-9)
    assert np.all(result.actions[:, :6] <= np.array(stats["q99"][:6]) + 1e-9)
    assert set(np.unique(result.actions[:, 6])) <= {0.0, 1.0}
    assert set(result.timings) == {"vision", "prefill", "denoise", "total"}


def test_single_mode_runs_upstreams_sequence(policy, frame):
    """[BOS] + image + prompt + 29871 + EOS, cognition at EOS, DDIM with CFG: a hand-built reference."""
    image = frame(1)
    session = policy.new_session(INSTRUCTION, SessionConfig(seed=5))
    result = session.step(obs(image))
    prompt = policy.tokenizer.prompt(INSTRUCTION)
    ids = torch.tensor([[*prompt.input_ids, 2]])
    assert prompt.input_ids[-1] == 29871 and prompt.instruction == tuple(policy.tokenizer.encode(
        "In: What action should the robot take to put the eggplant in the basket?"))
    with torch.no_grad():
        embeds = policy.vlm.embed_prefix(policy.image_processor(image)[None], ids)
        hidden = policy.vlm.language_model.model(inputs_embeds=embeds, cache=FullCache(policy.vlm.cfg.llm.geometry, FullParams(capacity=64)))
        normalized = policy.model.action_model.sample(
            hidden[:, -1:], cfg_scale=1.5, generator=torch.Generator().manual_seed(5)
        )
    expected = postprocess_actions(normalized[0].numpy(), session.action_stats)
    np.testing.assert_allclose(result.actions, expected, atol=1e-6)
    assert result.kv.tokens_raw == embeds.shape[1]


def test_sampling_is_seeded_per_session_and_reset_restarts_it(policy, frame):
    image = frame(2)
    a = policy.new_session(INSTRUCTION, SessionConfig(seed=1))
    b = policy.new_session(INSTRUCTION, SessionConfig(seed=1))
    c = policy.new_session(INSTRUCTION, SessionConfig(seed=2))
    first = a.step(obs(image)).actions
    assert np.array_equal(first, b.step(obs(image)).actions)
    assert not np.array_equal(first, c.step(obs(image)).actions)
    second = a.step(obs(image)).actions
    assert not np.array_equal(first, second)  # fresh noise each step
    a.reset()
    assert np.array_equal(a.step(obs(image)).actions, first)


def test_cfg_scale_one_skips_guidance(tiny_cogact, frame):
    image = frame(3)
    guided = load_policy(tiny_cogact, cfg_scale=1.5).new_session(INSTRUCTION).step(obs(image))
    plain = load_policy(tiny_cogact, cfg_scale=1.0).new_session(INSTRUCTION).step(obs(image))
    assert not np.array_equal(guided.actions, plain.actions)
    with pytest.raises(ValueError, match="cfg_scale"):
        load_policy(tiny_cogact, cfg_scale=0.5)


def test_adaptive_ensemble_returns_one_action_per_step(tiny_cogact, frame):
    images = [frame(10 + i) for i in range(3)]
    chunks = load_policy(tiny_cogact).new_session(INSTRUCTION)
    ensembled = load_policy(tiny_cogact, ensemble_horizon=2).new_session(INSTRUCTION)
    reference = AdaptiveEnsembler(AdaptiveEnsembleConfig(horizon=2, alpha=0.1))
    for image in images:
        out = ensembled.step(obs(image)).actions
        assert out.shape == (1, 7)
        np.testing.assert_allclose(out[0], reference(chunks.step(obs(image)).actions))
    with pytest.raises(ValueError, match="exceeds the action chunk"):
        load_policy(tiny_cogact, ensemble_horizon=17)


def test_action_queue_executes_k_of_the_chunk(policy, frame):
    session = policy.new_session(INSTRUCTION, SessionConfig(execution_horizon=4))
    queue = ActionQueue(session, horizon=session.config.execution_horizon)
    executed, predicted = [], []
    for t in range(9):
        action, result = queue.next(obs(frame(t)))
        executed.append(action)
        if result is not None:
            predicted.append((t, result.actions))
    assert [t for t, _ in predicted] == [0, 4, 8]  # re-plan after 4 executed actions
    np.testing.assert_array_equal(np.stack(executed[:4]), predicted[0][1][:4])
    np.testing.assert_array_equal(np.stack(executed[4:8]), predicted[1][1][:4])
    assert len(queue) == 3  # actions 1..3 of the last chunk wait; 4..15 were dropped


@pytest.mark.parametrize("mode", list(KVMode), ids=lambda m: m.value)
def test_history_mode_keeps_the_episode_in_every_cache(policy, frame, mode):
    session = policy.new_session(INSTRUCTION, SessionConfig(kv=KVConfig(mode=mode), history="history"))
    prompt = policy.tokenizer.prompt(INSTRUCTION)
    frame_tokens = 16 + len(prompt.out) + 2  # image + "\nOut:" + 29871, EOS
    seen = []
    for t in range(3):
        result = session.step(obs(frame(20 + t)))
        assert result.actions.shape == (16, 7)
        seen.append(result.kv.tokens_seen)
    pinned = 1 + len(prompt.instruction)
    assert seen == [pinned + frame_tokens * (t + 1) for t in range(3)]
    stats = result.kv
    if mode is KVMode.CHUNKED:  # older frames went into chunks (kept or dropped by the gate)
        assert stats.chunks_retained + stats.chunks_dropped > 0 and stats.tokens_raw < stats.tokens_seen
    elif mode is KVMode.SINK_WINDOW:
        assert stats.tokens_raw < stats.tokens_seen
    else:
        assert stats.tokens_raw == stats.tokens_seen
    session.reset()
    assert session.cache.stats().tokens_seen == 0


def test_history_mode_streaming_equals_one_forward_over_the_episode(policy, frame):
    """Pinned prompt, then frames streamed through the cache == one forward over the whole episode's tokens."""
    images = [frame(30), frame(31)]
    session = policy.new_session(INSTRUCTION, SessionConfig(seed=3, history="history"))
    results = [session.step(obs(image)) for image in images]
    vlm = policy.vlm
    with torch.no_grad():
        parts = [vlm.embed_forward(history_prompt(session.prompt), images=[])]
        parts += [vlm.embed_forward(session.frame, images=[vlm.embed_image(policy.image_processor(im)[None])]) for im in images]
        hidden = vlm.language_model.model(inputs_embeds=torch.cat(parts, 1), cache=FullCache(vlm.cfg.llm.geometry, FullParams(capacity=128)))
        g = torch.Generator().manual_seed(3)
        torch.randn((1, 16, 7), generator=g)  # the first step's noise
        normalized = policy.model.action_model.sample(hidden[:, -1:], cfg_scale=1.5, generator=g)
    np.testing.assert_allclose(results[1].actions, postprocess_actions(normalized[0].numpy(), session.action_stats), atol=1e-5)


def test_rtc_prefix_fixes_the_frozen_rows_and_bends_the_rest(policy, frame):
    queued = policy.new_session(INSTRUCTION, SessionConfig(seed=1)).step(obs(frame(2))).actions[:6]  # robot units
    free = policy.new_session(INSTRUCTION, SessionConfig(seed=3)).step(obs(frame(0))).actions
    prefix = ActionPrefix(actions=queued, frozen=2, start=1)  # chunk row 0 is executed; rows 1-2 will be
    guided = policy.new_session(INSTRUCTION, SessionConfig(seed=3)).step(
        Observation(images={"primary": frame(0)}, prefix=prefix)
    ).actions
    np.testing.assert_allclose(guided[1:3], queued[:2], atol=1e-4)  # frozen rows: the queued actions
    assert not np.allclose(guided[1:3], free[1:3], atol=1e-3)
    assert not np.allclose(guided[3:7, :6], free[3:7, :6], atol=1e-3)  # decaying weights: pulled, not replaced


@pytest.mark.parametrize(("history", "kv"), [("history", "full"), ("history", "chunked"), ("single", "full")])
def test_step_batch_equals_steps_alone(policy, frame, history, kv):
    prompts = [INSTRUCTION, "open the drawer", "pick up the red block and put it in the bowl"]
    config = [SessionConfig(history=history, kv=KVConfig(mode=kv), seed=i) for i in range(len(prompts))]
    alone = [policy.new_session(p, c) for p, c in zip(prompts, config)]
    batched = [policy.new_session(p, c) for p, c in zip(prompts, config)]
    assert policy.batched_steps
    for t in range(4):
        frames = [obs(frame(10 * i + t)) for i in range(len(prompts))]
        expected = [s.step(o) for s, o in zip(alone, frames)]
        rows = range(len(prompts)) if t != 1 else [0, 2]  # at t = 1 row 1 steps alone: the caches' lengths differ
        for i in set(range(len(prompts))) - set(rows):
            batched[i].step(frames[i])
        results = policy.step_batch([batched[i] for i in rows], [frames[i] for i in rows])
        for i, result in zip(rows, results):
            np.testing.assert_allclose(result.actions, expected[i].actions, atol=1e-5)
            assert result.kv == expected[i].kv and set(result.timings) == {"vision", "prefill", "denoise", "total"}
    assert not np.allclose(expected[0].actions, expected[1].actions)  # the rows really differ


def test_step_batch_refuses_a_bad_observation_before_changing_anything(policy, frame):
    sessions = [policy.new_session(INSTRUCTION, SessionConfig(history="history")) for _ in range(2)]
    with pytest.raises(BatchInputError) as e:
        policy.step_batch(sessions, [obs(frame(0)), Observation(images={"wrist": frame(1)})])
    assert e.value.index == 1 and "no 'primary' image" in str(e.value)
    assert all(s.cache.stats().tokens_seen == 0 for s in sessions)


def test_step_batch_samples_a_row_with_an_rtc_prefix_on_its_own_as_alone(policy, frame):
    queued = policy.new_session(INSTRUCTION, SessionConfig(seed=9)).step(obs(frame(5))).actions[:4]
    guided = Observation(images={"primary": frame(0)}, prefix=ActionPrefix(actions=queued, frozen=2))
    alone = [policy.new_session(INSTRUCTION, SessionConfig(seed=i)) for i in range(2)]
    expected = [alone[0].step(guided), alone[1].step(obs(frame(1)))]
    batched = [policy.new_session(INSTRUCTION, SessionConfig(seed=i)) for i in range(2)]
    results = policy.step_batch(batched, [guided, obs(frame(1))])
    for result, want in zip(results, expected):
        np.testing.assert_allclose(result.actions, want.actions, atol=1e-5)
    np.testing.assert_allclose(results[0].actions[:2], queued[:2], atol=1e-4)


def test_a_prefix_the_head_cannot_take_is_refused_before_the_episode_changes(policy, frame):
    config = SessionConfig(history="history", seed=0)
    session, clean = policy.new_session(INSTRUCTION, config), policy.new_session(INSTRUCTION, config)
    session.step(obs(frame(0)))
    clean.step(obs(frame(0)))
    held = session.cache.stats().tokens_seen
    wide = Observation(images={"primary": frame(1)}, prefix=ActionPrefix(np.zeros((4, 6)), frozen=1))
    with pytest.raises(ValueError, match="`prefix` rows have 6 values; this policy's actions have 7"):
        session.step(wide)
    assert session.cache.stats().tokens_seen == held
    with pytest.raises(BatchInputError, match="observation 1 of the batch: .*`prefix` rows have 6 values"):
        policy.step_batch([clean, session], [obs(frame(1)), wide])
    np.testing.assert_array_equal(session.step(obs(frame(1))).actions, clean.step(obs(frame(1))).actions)
    for bad, match in (((np.full((2, 7), np.nan), 1), "finite numbers"), ((np.zeros(7), 1), r"\[n, action_dim\]"),
                       ((np.zeros((2, 7)), -1), "frozen must be an integer >= 0")):  # fmt: skip
        with pytest.raises(ValueError, match=match):
            ActionPrefix(*bad)
