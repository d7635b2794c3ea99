"""OpenVLA ``history`` sessions on the decoupled caches: the runtime API end to end on a tiny checkpoint."""

import itertools
import shutil

import numpy as np
import pytest
import torch

from vla_runtime.api import Observation, load_policy
from vla_runtime.checkpoints.tiny_openvla import make_tiny_openvla
from vla_runtime.config import SessionConfig
from vla_runtime.kv import ChunkedGatedCache, ChunkGate, KVConfig, KVMode, KVStats, save_gate
from vla_runtime.kv.chunked_parallel import parallel_forward
from vla_runtime.models.openvla.processing_openvla import history_sequence

STEPS = 6


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_tiny_openvla(tmp_path_factory.mktemp("ckpt") / "tiny-openvla", seed=0)


def frames(n: int) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [rng.integers(0, 256, (96, 128, 3), dtype=np.uint8) for _ in range(n)]


def episode(policy, kv: KVConfig, images) -> tuple[list, object]:
    session = policy.new_session("put the red cube in the blue bowl", SessionConfig(kv=kv, history="history"))
    return [session.step(Observation(images={"primary": image})) for image in images], session


def test_untrained_chunked_history_session_matches_full_until_the_first_chunk(checkpoint):
    policy = load_policy(checkpoint)
    images = frames(STEPS)
    full, _ = episode(policy, KVConfig(KVMode.FULL), images)
    chunked, session = episode(policy, KVConfig.of(KVMode.CHUNKED, chunk=8), images)
    assert isinstance(session.cache, ChunkedGatedCache) and session.cache.gate is policy.kv_gate
    assert isinstance(policy.kv_gate, ChunkGate)  # the untrained default, owned by the policy
    before_chunks = [i for i, r in enumerate(chunked) if r.kv.chunks_retained + r.kv.chunks_dropped == 0]
    assert before_chunks == list(range(len(before_chunks))) and 1 <= len(before_chunks) < STEPS
    for i in before_chunks:
        np.testing.assert_array_equal(chunked[i].actions, full[i].actions)
    last = chunked[-1].kv
    assert isinstance(last, KVStats) and last.chunks_retained > 0 and last.chunks_dropped == 0  # keeps every chunk
    assert last.tokens_raw < full[-1].kv.tokens_raw and last.bytes < full[-1].kv.bytes
    assert last.positions_used < full[-1].kv.positions_used and last.retained_ratio == 1.0
    assert last.tokens_seen == full[-1].kv.tokens_seen
    assert all(np.isfinite(r.actions).all() for r in chunked)


def test_chunked_history_session_with_a_window_covering_the_episode_equals_full(checkpoint):
    policy = load_policy(checkpoint)
    images = frames(3)
    full, _ = episode(policy, KVConfig(KVMode.FULL), images)
    for mode in (KVMode.CHUNKED, KVMode.SINK_WINDOW):
        wide, _ = episode(policy, KVConfig.of(mode, window=400), images)
        for a, b in zip(wide, full):
            np.testing.assert_array_equal(a.actions, b.actions)
            assert a.kv.tokens_raw == b.kv.tokens_raw


def test_a_trained_gate_beside_the_checkpoint_is_loaded_and_used(checkpoint, tmp_path):
    ckpt = tmp_path / "with-gate"
    shutil.copytree(checkpoint, ckpt)
    policy = load_policy(ckpt)
    kv = KVConfig.of(KVMode.CHUNKED, chunk=4, max_chunks=3, gate_hidden=8)
    torch.manual_seed(0)
    gate = ChunkGate(kv.gate_config(policy.config.llm.geometry))
    with torch.no_grad():
        gate.tau.fill_(10.0)  # a gate that drops every chunk
    save_gate(gate, ckpt, kv)
    loaded = load_policy(ckpt)
    assert isinstance(loaded.kv_gate, ChunkGate) and loaded.kv == kv  # the gate's KVConfig is the default
    assert torch.equal(loaded.kv_gate.tau, gate.tau)
    session = loaded.new_session("open the drawer", SessionConfig(kv=loaded.kv, history="history"))
    results = [session.step(Observation(images={"primary": image})) for image in frames(4)]
    assert session.cache.gate is loaded.kv_gate
    assert results[-1].kv.chunks_retained == 0 and results[-1].kv.chunks_dropped > 0
    assert results[-1].kv.retained_ratio == 0.0
    assert load_policy(ckpt, kv=KVConfig(KVMode.FULL)).kv.mode is KVMode.FULL  # an explicit KVConfig wins


def test_history_session_equals_the_parallel_form_over_its_forwards(checkpoint):
    """The training form over contract 2's ``history_sequence`` predicts exactly the action tokens the
    streaming session generated (hard gates, a gate that drops some chunks, a budget that evicts)."""
    policy = load_policy(checkpoint)
    kv = KVConfig.of(KVMode.CHUNKED, chunk=4, max_chunks=4)
    torch.manual_seed(0)
    policy.kv_gate = gate = ChunkGate(kv.gate_config(policy.config.llm.geometry))
    with torch.no_grad():
        gate.readout_weight.normal_(0.0, 3.0)
        gate.readout_bias.zero_()
    session = policy.new_session("stack the blocks", SessionConfig(kv=kv, history="history"))
    images = frames(4)
    tokens = []
    for image in images:
        session.step(Observation(images={"primary": image}))
        tokens.append([int(t) for t in session.last_tokens[0]])
    stats = session.cache.stats()
    assert stats.chunks_retained > 0 and int(session.cache.gate_dropped.sum()) > 0 and int(session.cache.budget_dropped.sum()) > 0

    model = policy.model
    with torch.no_grad():
        image_tokens = [model.embed_image(policy.image_processor(image)[None]) for image in images]
        forwards = history_sequence(session.prompt, tokens, has_proprio=False)
        embeds = torch.cat([model.embed_forward(f, images=image_tokens) for f in forwards], dim=1)
        bounds = [f.length(policy.config.vision.num_patches) for f in forwards]
        logits, aux = parallel_forward(model.language_model, embeds, bounds, bounds[0], gate, session.kv_config, soft=False)
    ends = list(itertools.accumulate(bounds))[1:]  # every forward after the prompt predicts the next action token
    first, last = session.actions.first_id, session.actions.last_id
    predicted = logits[0, [e - 1 for e in ends], first : last + 1].argmax(-1) + first
    assert predicted.tolist() == [t for step in tokens for t in step]
    assert aux.kept.any() and (~aux.kept).any()
