"""HybridVLA through the runtime API: the shared prefix, DDIM on the cached prefix vs re-prefilling the
upstream sequence, the AR branch, the collaborative ensemble, windows, seeds, caches and input errors."""

import numpy as np
import pytest
import torch

from vla_runtime.api import BatchInputError, Observation, load_policy
from vla_runtime.config import SessionConfig
from vla_runtime.kv import FullCache, FullParams, KVConfig, KVMode
from vla_runtime.models.action_postprocess import postprocess_actions
from vla_runtime.models.hybridvla.configuration_hybridvla import BOD_TOKEN_ID, CollaborativeEnsembleConfig
from vla_runtime.models.hybridvla.modeling_hybridvla import denoise_by_reprefill
from vla_runtime.models.hybridvla.processing_hybridvla import collaborative_ensemble

INSTRUCTION = "close the box"
STATE = np.array([0.2785, -0.0082, 1.4719, -3.1416, 0.2423, 3.1416, 1.0])  # sim.py's initial RLBench state


def obs(image, state=STATE):
    return Observation(images={"primary": image}, state=state)


@pytest.fixture(scope="module")
def policy(tiny_hybridvla):
    return load_policy(tiny_hybridvla)


def upstream_prefix(policy, session, image, state):
    """Upstream's diffusion-pass prefix, built by hand: [BOS] + image + prompt + 29871 + <BOD> + proprio."""
    ids = torch.tensor([[*session.prompt.input_ids, BOD_TOKEN_ID]])
    with torch.no_grad():
        embeds = policy.vlm.embed_prefix(policy.image_processor(image)[None], ids)
        normed = torch.as_tensor(session.proprio_stats.normalize(state), dtype=torch.float32)[None]
        return torch.cat([embeds, policy.model.head.embed_proprio(normed)], dim=1)


@pytest.mark.parametrize("fixture", ["tiny_hybridvla", "tiny_hybridvla_window3"])
def test_prefix_reuse_equals_reprefilling_upstreams_sequence(request, frame, fixture):
    """The session's DDIM (prefix prefilled once, [t, x] appended and rolled back per step) equals running
    the whole upstream sequence [prefix, t, x] afresh at every step -- for future windows 0 and 3."""
    policy = load_policy(request.getfixturevalue(fixture), mode="diff")
    image = frame(0)
    session = policy.new_session(INSTRUCTION, SessionConfig(seed=4))
    result = session.step(obs(image))
    chunk = policy.config.head.chunk
    assert result.actions.shape == (chunk, 7) and "denoise" in result.timings and "decode" not in result.timings
    prefix = upstream_prefix(policy, session, image, STATE)
    noise = torch.randn((1, chunk, 7), generator=torch.Generator().manual_seed(4))
    reference = denoise_by_reprefill(
        policy.model.lm, policy.model.head, FullCache(policy.vlm.cfg.llm.geometry, FullParams(capacity=128)), policy.diffusion, noise, prefix
    )
    np.testing.assert_allclose(result.actions, postprocess_actions(reference[0].numpy(), session.action_stats), atol=1e-5)
    assert result.kv.tokens_raw == prefix.shape[1]  # every appended diffusion token was rolled back


def test_ar_branch_decodes_on_the_shared_prefix(policy, frame):
    image = frame(1)
    session = load_policy(policy.checkpoint.run.path, mode="ar").new_session(INSTRUCTION, SessionConfig(seed=6))
    result = session.step(obs(image))
    assert result.actions.shape == (1, 7) and session.last_tokens.shape == (1, 7)
    assert np.all((session.last_confidences > 0) & (session.last_confidences <= 1))
    prefix = upstream_prefix(policy, session, image, STATE)
    g = torch.Generator().manual_seed(6)
    t = torch.randint(0, 100, (1,), generator=g)
    noise = torch.randn((1, 1, 7), generator=g)
    with torch.no_grad():  # upstream's AR pass: [prefix, t, x, <EOD>, 29871] + the generated tokens, one forward
        tail = policy.vlm.language_model.model.embed_tokens(torch.tensor([[32002, 29871, *session.last_tokens[0, :-1]]]))
        full = torch.cat([prefix, policy.model.head.embed_step(noise, t), tail], dim=1)
        logits = policy.vlm.language_model(inputs_embeds=full, cache=FullCache(policy.vlm.cfg.llm.geometry, FullParams(capacity=128)))[:, -7:]
    np.testing.assert_array_equal(logits.argmax(-1).numpy(), session.last_tokens)
    np.testing.assert_allclose(logits.softmax(-1).amax(-1)[0].numpy(), session.last_confidences, rtol=1e-4)
    expected = postprocess_actions(policy.ar_tokens.normalized(session.last_tokens[0]), session.action_stats)
    np.testing.assert_allclose(result.actions[0], expected)
    assert result.kv.tokens_raw == prefix.shape[1]


def test_collaborative_ensemble_in_the_session(tiny_hybridvla, frame):
    image = frame(2)
    # the same seed draws the same noise whatever the threshold: never / always use the AR action
    never = load_policy(tiny_hybridvla, ensemble_threshold=1e9).new_session(INSTRUCTION, SessionConfig(seed=8))
    always = load_policy(tiny_hybridvla, ensemble_threshold=0.0).new_session(INSTRUCTION, SessionConfig(seed=8))
    diff_only = never.step(obs(image)).actions
    both = always.step(obs(image)).actions
    assert never.last_used_ar is False and always.last_used_ar is True
    np.testing.assert_array_equal(never.last_tokens, always.last_tokens)
    ar = postprocess_actions(always.policy.ar_tokens.normalized(always.last_tokens[0]), always.action_stats)
    expected, used = collaborative_ensemble(diff_only[0], ar, always.last_confidences, CollaborativeEnsembleConfig(threshold=0.0))
    assert used
    np.testing.assert_allclose(both[0], expected)
    default = load_policy(tiny_hybridvla).new_session(INSTRUCTION, SessionConfig(seed=8))
    np.testing.assert_array_equal(default.step(obs(image)).actions, diff_only)  # random weights: AR never confident
    assert default.last_used_ar is False


def test_window3_returns_the_chunk_with_the_first_action_ensembled(tiny_hybridvla_window3, frame):
    session = load_policy(tiny_hybridvla_window3, ensemble_threshold=0.0).new_session(INSTRUCTION)
    result = session.step(obs(frame(3)))
    assert result.actions.shape == (4, 7) and session.last_used_ar


def test_seeded_and_reset(policy, frame):
    image = frame(4)
    a = policy.new_session(INSTRUCTION, SessionConfig(seed=1))
    first = a.step(obs(image)).actions
    assert np.array_equal(first, policy.new_session(INSTRUCTION, SessionConfig(seed=1)).step(obs(image)).actions)
    assert not np.array_equal(first, policy.new_session(INSTRUCTION, SessionConfig(seed=2)).step(obs(image)).actions)
    a.step(obs(image))
    a.reset()
    assert np.array_equal(a.step(obs(image)).actions, first)


def test_state_is_required_and_reaches_the_model(policy, frame):
    session = policy.new_session(INSTRUCTION, SessionConfig(seed=0))
    image = frame(5)
    with pytest.raises(ValueError, match=r"needs the robot state: Observation.state = \[7\]"):
        session.step(obs(image, None))
    with pytest.raises(ValueError, match=r"shape \(3,\); HybridVLA accepts xyz_rpy_gripper \[7\], xyz_quat_gripper \[8\]"):
        session.step(obs(image, np.zeros(3)))
    a = policy.new_session(INSTRUCTION, SessionConfig(seed=0)).step(obs(image, STATE)).actions
    b = policy.new_session(INSTRUCTION, SessionConfig(seed=0)).step(obs(image, STATE + 0.3)).actions
    assert not np.array_equal(a, b)


def test_modes_and_options_are_validated(tiny_hybridvla):
    with pytest.raises(KeyError, match="unknown HybridVLA mode 'both'"):
        load_policy(tiny_hybridvla, mode="both")
    with pytest.raises(KeyError, match="unknown ensemble rule"):
        load_policy(tiny_hybridvla, ensemble_rule="vote")
    with pytest.raises(ValueError, match="no integer stride"):
        load_policy(tiny_hybridvla, ddim_steps=30)
    shifted = load_policy(tiny_hybridvla, need_to_sub=7)
    assert (shifted.ar_tokens.first_id, shifted.ar_tokens.last_id) == (31737, 31992)


@pytest.mark.parametrize("mode", list(KVMode), ids=lambda m: m.value)
def test_history_mode_keeps_only_observations_in_every_cache(policy, frame, mode):
    session = policy.new_session(INSTRUCTION, SessionConfig(kv=KVConfig(mode=mode), history="history"))
    prompt = session.prompt
    frame_tokens = 16 + len(prompt.out) + 2 + 1  # image + "\nOut:" + 29871, <BOD> + proprio
    seen = []
    for t in range(3):
        result = session.step(obs(frame(20 + t), STATE + 0.01 * t))
        assert result.actions.shape == (1, 7)
        seen.append(result.kv.tokens_seen)
    pinned = 1 + len(prompt.instruction)
    assert seen == [pinned + frame_tokens * (t + 1) for t in range(3)]  # branch tokens rolled back each step
    stats = result.kv
    if mode is KVMode.CHUNKED:  # older frames went into chunks (kept or dropped by the gate)
        assert stats.chunks_retained + stats.chunks_dropped > 0 and stats.tokens_raw < stats.tokens_seen
    elif mode is KVMode.SINK_WINDOW:
        assert stats.tokens_raw < stats.tokens_seen
    else:
        assert stats.tokens_raw == stats.tokens_seen


def test_state_layouts_of_the_simulators_map_to_upstreams(tiny_hybridvla, frame):
    """RLBench's [xyz, quaternion xyzw, open] and Meta-World's [xyz, opening] reach the model as
    upstream's [x, y, z, roll, pitch, yaw, gripper]."""
    from scipy.spatial.transform import Rotation

    image = frame(6)
    state = np.array([0.2785, -0.0082, 1.4719, -3.1, 0.2423, 3.1, 1.0])  # angles inside scipy's ranges (no 2 pi wrap)
    quat = Rotation.from_euler("xyz", state[3:6]).as_quat()  # scalar-last, as RLBench's gripper_pose
    direct = load_policy(tiny_hybridvla).new_session(INSTRUCTION, SessionConfig(seed=0)).step(obs(image, state)).actions
    rlbench = np.concatenate([state[:3], quat, state[6:]])
    via_quat = load_policy(tiny_hybridvla).new_session(INSTRUCTION, SessionConfig(seed=0)).step(obs(image, rlbench)).actions
    np.testing.assert_allclose(via_quat, direct, atol=1e-6)
    metaworld = np.array([0.0, 0.6, 0.2, 1.0])
    padded = np.array([0.0, 0.6, 0.2, 0.0, 0.0, 0.0, 1.0])
    a = load_policy(tiny_hybridvla).new_session(INSTRUCTION, SessionConfig(seed=0)).step(obs(image, metaworld)).actions
    b = load_policy(tiny_hybridvla).new_session(INSTRUCTION, SessionConfig(seed=0)).step(obs(image, padded)).actions
    np.testing.assert_array_equal(a, b)
    forced = load_policy(tiny_hybridvla, state_layout="xyz_quat_gripper").new_session(INSTRUCTION)
    with pytest.raises(ValueError, match="state layout 'xyz_quat_gripper' has 8 values"):
        forced.step(obs(image, STATE))
    with pytest.raises(KeyError, match="unknown state layout 'joints'"):
        load_policy(tiny_hybridvla, state_layout="joints")


@pytest.mark.parametrize(("history", "kv"), [("single", "full"), ("history", "full"), ("history", "chunked")])
def test_step_batch_equals_steps_alone(policy, frame, history, kv):
    prompts = ["put the red cube in the bowl", "open the drawer", "close the microwave door please"]
    configs = [SessionConfig(history=history, kv=KVConfig(mode=kv), seed=i) for i in range(len(prompts))]
    alone = [policy.new_session(p, c) for p, c in zip(prompts, configs)]
    batched = [policy.new_session(p, c) for p, c in zip(prompts, configs)]
    assert policy.batched_steps
    for t in range(4):
        frames = [obs(frame(10 * i + t), STATE + 0.01 * i) for i in range(len(prompts))]
        expected = [s.step(o) for s, o in zip(alone, frames)]
        rows = range(len(prompts)) if t != 1 else [0, 2]  # at t = 1 row 1 steps alone: the caches' lengths differ
        for i in set(range(len(prompts))) - set(rows):
            batched[i].step(frames[i])
        results = policy.step_batch([batched[i] for i in rows], [frames[i] for i in rows])
        for i, result in zip(rows, results):
            np.testing.assert_array_equal(batched[i].last_tokens, alone[i].last_tokens)  # the AR branch's ids
            np.testing.assert_allclose(result.actions, expected[i].actions, atol=1e-5)
            assert batched[i].last_used_ar == alone[i].last_used_ar and result.kv == expected[i].kv
    assert any(np.any(alone[0].last_tokens != s.last_tokens) for s in alone[1:])  # the rows really differ


def test_step_batch_refuses_a_missing_state_before_changing_anything(policy, frame):
    sessions = [policy.new_session("open the drawer", SessionConfig(history="history")) for _ in range(2)]
    with pytest.raises(BatchInputError) as e:
        policy.step_batch(sessions, [obs(frame(0)), Observation(images={"primary": frame(1)})])
    assert e.value.index == 1 and "needs the robot state" in str(e.value)
    assert all(s.cache.stats().tokens_seen == 0 for s in sessions)
