"""ChunkedGatedCache: the untrained default, the gate's decisions, the budget, long episodes."""

import pytest
import torch

from vla_runtime.kv import ChunkedGatedCache, ChunkGate, ChunkGateConfig, FullCache, KVConfig, KVMode, make_cache
from vla_runtime.kv.budget import admit, apply_admission

from .cases import CASES, ReferenceCompactCache, episode, kv, run_stream, tiny_model


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def make_gate(model, kv_cfg: KVConfig, *, seed: int = 0, spread: float = 0.0, bias: float | None = None) -> ChunkGate:
    torch.manual_seed(seed)
    gate = ChunkGate(kv_cfg.gate_config(model.cfg.geometry))
    with torch.no_grad():
        if spread:
            gate.readout_weight.normal_(0.0, spread)
        if bias is not None:
            gate.readout_bias.fill_(bias)
    return gate


def test_untrained_aggregator_is_exactly_mean_pooling():
    gate = ChunkGate(ChunkGateConfig(n_layers=3, head_dim=16, chunk=5))
    k, v = torch.randn(3, 2, 4, 6, 5, 16), torch.randn(3, 2, 4, 6, 5, 16)
    k_rep, v_rep = gate.aggregate(k, v)
    assert torch.equal(k_rep, k.mean(-2)) and torch.equal(v_rep, v.mean(-2))
    one_k, _ = gate.aggregate(k[1], v[1], layers=1)
    assert torch.equal(one_k, k[1].mean(-2))
    with torch.no_grad():  # a trained aggregator is no longer the mean
        gate.key_aggregator.fc2_weight.normal_()
    assert not torch.allclose(gate.aggregate(k, v)[0], k.mean(-2))


def test_untrained_gate_keeps_every_chunk_with_a_zero_initialised_correction():
    gate = ChunkGate(ChunkGateConfig(n_layers=2, head_dim=16, chunk=4))
    state = gate.init_state(batch=3, kv_heads=2)
    s, state = gate.score(torch.randn(2, 3, 2, 5, 16) * 50, torch.randn(2, 3, 2, 5, 16), state)  # 5 chunks
    assert torch.equal(s, gate.readout_bias[:, None, None].expand(2, 3, 5))  # the correction is exactly zero
    assert bool((s > gate.tau[:, None, None]).all())
    assert bool((gate.keep_prob(s) > 0.9).all())
    assert state[0].abs().sum() > 0  # the LSTM itself runs: a learned readout would see it


def test_lstm_scores_depend_only_on_earlier_chunks():
    gate = ChunkGate(ChunkGateConfig(n_layers=2, head_dim=16, chunk=4))
    with torch.no_grad():
        gate.readout_weight.normal_()
    k, v = torch.randn(2, 1, 2, 6, 16), torch.randn(2, 1, 2, 6, 16)
    s, _ = gate.score(k, v, gate.init_state(1, 2))
    k2 = k.clone()
    k2[..., 4, :] += 1.0
    s2, _ = gate.score(k2, v, gate.init_state(1, 2))
    torch.testing.assert_close(s2[..., :4], s[..., :4], atol=1e-6, rtol=0)
    assert not torch.allclose(s2[..., 4:], s[..., 4:])
    # chunk by chunk with the carried state = all at once
    s_a, state = gate.score(k[..., :2, :], v[..., :2, :], gate.init_state(1, 2))
    s_b, _ = gate.score(k[..., 2:, :], v[..., 2:, :], state)
    torch.testing.assert_close(torch.cat((s_a, s_b), -1), s, atol=1e-6, rtol=0)


def test_default_chunked_cache_equals_an_explicit_mean_pooled_reference(model):
    """Untrained gate: mean-pooled chunks, all kept, FIFO beyond the budget (ties evict the oldest)."""
    x, bounds = episode(6)
    c = CASES[KVMode.CHUNKED].hard
    cache = make_cache(kv(KVMode.CHUNKED, "hard"), model.cfg.geometry)
    got = run_stream(model, cache, x, bounds)
    ref = run_stream(
        model, ReferenceCompactCache(model.cfg, window=c["window"], chunk=c["chunk"], max_chunks=c["max_chunks"]), x, bounds
    )
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    stats = cache.stats()
    assert stats.chunks_retained == c["max_chunks"] * model.cfg.n_layers
    assert stats.chunks_dropped > 0  # only budget evictions: the gate dropped nothing
    assert int(cache.gate_dropped.sum()) == 0


def test_budget_is_respected_and_drop_counts_add_up(model):
    x, bounds = episode(8)
    kv_cfg = kv(KVMode.CHUNKED, "hard", max_chunks=4)
    cache = ChunkedGatedCache(model.cfg.geometry, kv_cfg.params, gate=make_gate(model, kv_cfg, spread=3.0, bias=0.0))
    start = 0
    with torch.no_grad():
        for n in bounds:
            model(inputs_embeds=x[:, start : start + n], cache=cache, pin=start + n <= 5)
            start += n
            assert max(cache.retained_per_layer()) <= 4
            assert cache.chunk_valid.sum(-1).le(4).all()
    stats = cache.stats()
    layers = model.cfg.n_layers
    assert stats.chunks_retained + stats.chunks_dropped == cache.chunks_formed * layers
    assert int(cache.gate_dropped.sum()) > 0 and int(cache.budget_dropped.sum()) > 0
    assert 0 < stats.retained_ratio < 1
    tau = cache.gate.tau.detach()[:, None].expand_as(cache.chunk_score)
    assert bool((cache.chunk_score > tau)[cache.chunk_valid].all())  # only chunks the gate kept are held


def test_keep_drop_decision_is_per_layer(model):
    x, bounds = episode(4)
    kv_cfg = kv(KVMode.CHUNKED, "hard", max_chunks=16)
    gate = make_gate(model, kv_cfg)
    with torch.no_grad():
        gate.tau[1] = 10.0  # layer 1 drops everything, layer 0 keeps everything
    cache = ChunkedGatedCache(model.cfg.geometry, kv_cfg.params, gate=gate)
    run_stream(model, cache, x, bounds)
    kept0, kept1 = cache.retained_per_layer()
    assert kept0 == cache.chunks_formed > 0 and kept1 == 0
    assert int(cache.gate_dropped[1]) == cache.chunks_formed and int(cache.gate_dropped[0]) == 0


def test_a_window_filling_the_store_needs_no_chunk_slots(model):
    """Single-mode sessions size capacity = window = the step's tokens: no chunk can form, none is reserved."""
    x, bounds = episode(1)
    n = x.shape[1]
    cache = make_cache(KVConfig.of(KVMode.CHUNKED, window=n, chunk=4, capacity=n), model.cfg.geometry)
    assert cache.params.max_chunks == 0
    torch.testing.assert_close(run_stream(model, cache, x, bounds), run_stream(model, FullCache(model.cfg.geometry), x, bounds), atol=1e-5, rtol=1e-5)
    assert cache.stats().positions_used == n


def test_raising_tau_never_keeps_more(model):
    x, bounds = episode(5)
    kv_cfg = kv(KVMode.CHUNKED, "hard", max_chunks=64, capacity=128)
    kept = []
    for tau in (-1.0, 0.0, 0.5, 1.0, 5.0):
        gate = make_gate(model, kv_cfg, spread=3.0, bias=0.0)
        with torch.no_grad():
            gate.tau.fill_(tau)
        cache = ChunkedGatedCache(model.cfg.geometry, kv_cfg.params, gate=gate)
        run_stream(model, cache, x, bounds)
        kept.append(cache.stats().chunks_retained)
    assert kept == sorted(kept, reverse=True) and kept[0] > kept[-1]


def test_admit_evicts_the_lowest_score_and_the_oldest_on_ties():
    valid = torch.tensor([[True, True, True], [True, True, True], [True, False, True]])
    scores = torch.tensor([[1.0, 0.5, 0.5], [1.0, 2.0, 3.0], [1.0, 0.0, 2.0]])
    ages = torch.tensor([[0, 5, 2], [0, 1, 2], [0, 0, 1]])
    new = torch.tensor([0.5, 0.1, 0.0])
    adm = admit(valid, scores, ages, new, keep=torch.tensor([True, True, True]))
    assert adm.slot.tolist()[0] == 2  # tie at 0.5: slot 2 is older (age 2 < 5)
    assert adm.write.tolist() == [True, False, True]  # row 1: the newcomer is the lowest -> rejected
    assert adm.budget_drop.tolist() == [True, True, False]
    assert adm.slot.tolist()[2] == 1  # row 2 has a free slot
    v, s, a = apply_admission(adm, valid, scores, ages, new, 9)
    assert v[2].tolist() == [True, True, True] and a[0].tolist() == [0, 5, 9] and s[1].tolist() == [1.0, 2.0, 3.0]
    dropped = admit(valid, scores, ages, new, keep=torch.tensor([False, False, False]))
    assert not dropped.write.any() and not dropped.budget_drop.any()


def test_surviving_kv_never_moves_when_a_chunk_is_evicted(model):
    x, bounds = episode(6)
    kv_cfg = kv(KVMode.CHUNKED, "hard")
    cache = ChunkedGatedCache(model.cfg.geometry, kv_cfg.params, gate=make_gate(model, kv_cfg, spread=3.0, bias=8.0))
    run_stream(model, cache, x, bounds[:8])
    store = cache.store
    before_valid = cache.chunk_valid.clone()
    before = store.k[:, :, :, store.raw_end :].clone()
    ages = cache.chunk_age.clone()
    run_stream(model, cache, x[:, sum(bounds[:8]) :], bounds[8:12], pinned=0)
    survived = before_valid & cache.chunk_valid & (cache.chunk_age == ages)
    assert survived.any() and (before_valid & ~survived).any()  # some evicted, some survived
    after = store.k[:, :, :, store.raw_end :]
    for layer in range(model.cfg.n_layers):
        slots = survived[layer].nonzero().flatten()
        assert torch.equal(after[layer][:, :, slots], before[layer][:, :, slots])


def test_ten_thousand_step_episode_keeps_memory_flat_and_positions_bounded():
    """10,000 control steps (one token each, 10x the model's ``max_position``) at the tiny model's geometry.

    For speed the steps drive the cache protocol directly with q/k/v that the tiny model's first layer
    projects from random frames; every 1,000 steps a real model forward runs through the same cache.
    The held bytes and the allocated tensors stop growing after warm-up, positions stay bounded."""
    model = tiny_model()
    cfg = model.cfg
    kv_cfg = KVConfig.of(KVMode.CHUNKED, window=8, chunk=8, max_chunks=8, capacity=48)
    cache = ChunkedGatedCache(cfg.geometry, kv_cfg.params, gate=make_gate(model, kv_cfg, spread=2.0, bias=0.0))
    allocated = lambda: sum(t.numel() for t in vars(cache).values() if torch.is_tensor(t)) + cache.store.k.numel()  # noqa: E731
    attn = model.model.layers[0].self_attn
    frames = torch.randn(1, 64, cfg.dim, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        q = attn.q_proj(frames).view(1, 64, cfg.n_heads, cfg.head_dim).transpose(1, 2)  # [1, Hq, 64, D]
        k = attn.k_proj(frames).view(1, 64, cfg.n_kv_heads, cfg.head_dim).transpose(1, 2)  # [1, Hkv, 64, D]
        v = attn.v_proj(frames).view(1, 64, cfg.n_kv_heads, cfg.head_dim).transpose(1, 2)
        model(inputs_embeds=frames[:, :5], cache=cache, pin=True)
        for step in range(10_000):
            i = step % 64
            for layer in range(cfg.n_layers):
                cache.attend(layer, q[:, :, i : i + 1], k[:, :, i : i + 1], v[:, :, i : i + 1])
            cache.end_forward()
            if step % 1_000 == 999:
                assert torch.isfinite(model(inputs_embeds=frames[:, i : i + 1], cache=cache)).all()
            if step == 1_000:
                warm, warm_allocated = cache.stats(), allocated()
    stats = cache.stats()
    per_token = 2 * cfg.n_kv_heads * cfg.head_dim * 4
    most = per_token * cfg.n_layers * (5 + 8 + 8 - 1 + 8)  # prompt + window + filling chunk + budget
    assert stats.tokens_seen == 5 + 10_000 + 10 > 9 * cfg.max_position
    assert warm.bytes <= most and stats.bytes <= most and allocated() == warm_allocated
    assert stats.positions_used <= kv_cfg.params.capacity < cfg.max_position
    assert stats.tokens_raw < 5 + 8 + 8 and max(cache.retained_per_layer()) <= 8
    assert stats.chunks_retained + stats.chunks_dropped == cache.chunks_formed * cfg.n_layers
    assert 0 < stats.retained_ratio < 1
