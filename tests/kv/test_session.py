"""OpenVLA ``history`` sessions on the decoupled caches: the runtime API end to end on a tiny checkpoint."""

import shutil

import numpy as np
import pytest
import torch

from vla_runtime.api import Observation, load_policy
from vla_runtime.checkpoints.tiny_openvla import make_tiny_openvla
from vla_runtime.config import SessionConfig
from vla_runtime.kv import ChunkedGatedCache, ChunkGate, ChunkGateConfig, KVConfig, KVStats, save_gate

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
    full, _ = episode(policy, KVConfig(mode="full"), images)
    chunked, session = episode(policy, KVConfig(mode="chunked", chunk=8), images)
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
    full, _ = episode(policy, KVConfig(mode="full"), images)
    for mode in ("chunked", "sink_window"):
        wide, _ = episode(policy, KVConfig(mode=mode, window=400), images)
        for a, b in zip(wide, full):
            np.testing.assert_array_equal(a.actions, b.actions)
            assert a.kv.tokens_raw == b.kv.tokens_raw


def test_a_trained_gate_beside_the_checkpoint_is_loaded_and_used(checkpoint, tmp_path):
    ckpt = tmp_path / "with-gate"
    shutil.copytree(checkpoint, ckpt)
    policy = load_policy(ckpt)
    kv = KVConfig(mode="chunked", chunk=4, max_chunks=3, gate_hidden=8)
    torch.manual_seed(0)
    gate = ChunkGate(ChunkGateConfig.from_configs(kv, policy.config.llm))
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
    assert load_policy(ckpt, kv=KVConfig(mode="full")).kv.mode == "full"  # an explicit KVConfig wins
