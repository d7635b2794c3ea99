"""Every cache in ``CASES`` against ``FullCache`` and the protocol's promises (causality, rollback, stats)."""

import pytest
import torch

from vla_runtime.kv import CACHES, KVConfig, KVStats, make_cache

from .cases import CASES, COMPRESSING, PROMPT, ReferenceCompactCache, build, episode, full_cache, kv, run_stream, tiny_model


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def test_every_registered_cache_is_in_the_matrix():
    assert set(CASES) == set(CACHES)


@pytest.mark.parametrize("mode", sorted(CASES))
def test_window_covering_the_episode_equals_full_cache(model, mode):
    x, bounds = episode(4)
    ref = run_stream(model, full_cache(model), x, bounds)
    cache = build(mode, "easy", model)
    got = run_stream(model, cache, x, bounds)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    stats = cache.stats()
    assert stats.tokens_raw == stats.tokens_seen == x.shape[1]
    assert stats.positions_used == x.shape[1] and stats.chunks_dropped == 0


@pytest.mark.parametrize("mode", COMPRESSING)
def test_compressing_cache_differs_from_full_and_stays_small(model, mode):
    """The hard rows really compress: fewer raw tokens, bounded positions, different outputs."""
    x, bounds = episode(6)
    cache = build(mode, "hard", model)
    got = run_stream(model, cache, x, bounds)
    ref = run_stream(model, full_cache(model), x, bounds)
    stats = cache.stats()
    assert stats.tokens_seen == x.shape[1]
    assert stats.tokens_raw < 30 and stats.positions_used < 40
    assert not torch.allclose(got[:, -1], ref[:, -1], atol=1e-3)
    # identical up to the first compression
    first = PROMPT + 12  # the first step's prefill sees everything (nothing left the window yet)
    torch.testing.assert_close(got[:, :first], ref[:, :first], atol=1e-5, rtol=1e-5)


def test_sink_window_matches_the_reference_oracle(model):
    x, bounds = episode(6)
    got = run_stream(model, build("sink_window", "hard", model), x, bounds)
    c = CASES["sink_window"]["hard"]
    ref = run_stream(model, ReferenceCompactCache(model.cfg, window=c["window"], n_sink=c["n_sink"]), x, bounds)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("mode", sorted(CASES))
def test_changing_a_later_frame_never_changes_an_earlier_output(model, mode):
    x, bounds = episode(5)
    y = x.clone()
    cut = PROMPT + 3 * (12 + 3)  # step 3 starts here
    y[:, cut + 2 : cut + 7] += torch.randn_like(y[:, cut + 2 : cut + 7])
    a = run_stream(model, build(mode, "hard", model), x, bounds)
    b = run_stream(model, build(mode, "hard", model), y, bounds)
    assert torch.equal(a[:, : cut + 2], b[:, : cut + 2])
    assert not torch.allclose(a[:, cut + 2 :], b[:, cut + 2 :])


@pytest.mark.parametrize("mode", sorted(CASES))
def test_rollback_restores_outputs_and_stats_exactly(model, mode):
    """HybridVLA's pattern: mark, append tokens (enough to trigger compression), roll back, repeat."""
    x, bounds = episode(5)
    detour = torch.randn(1, 20, model.cfg.dim, generator=torch.Generator().manual_seed(9))
    straight = build(mode, "hard", model)
    ref = run_stream(model, straight, x, bounds)
    cache = build(mode, "hard", model)
    out, start = [], 0
    with torch.no_grad():
        for i, n in enumerate(bounds):
            out.append(model(inputs_embeds=x[:, start : start + n], cache=cache, pin=start + n <= PROMPT))
            start += n
            if i % 4 == 1:  # after some forwards: two denoising-like detours, each rolled back
                for _ in range(2):
                    before = cache.stats()
                    mark = cache.mark()
                    model(inputs_embeds=detour[:, :12], cache=cache)
                    model(inputs_embeds=detour[:, 12:], cache=cache)
                    cache.rollback(mark)
                    assert cache.stats().tokens_raw == before.tokens_raw
                    assert cache.stats().chunks_retained == before.chunks_retained
    assert torch.equal(torch.cat(out, dim=1), ref)
    after, expected = cache.stats(), straight.stats()
    assert (after.tokens_raw, after.chunks_retained, after.chunks_dropped, after.bytes) == (
        expected.tokens_raw, expected.chunks_retained, expected.chunks_dropped, expected.bytes,
    )  # fmt: skip


@pytest.mark.parametrize("mode", COMPRESSING)
def test_rollback_across_a_compression_is_a_clear_error(model, mode):
    x, bounds = episode(3)
    cache = build(mode, "hard", model)
    run_stream(model, cache, x[:, :PROMPT], [PROMPT])
    mark = cache.stats().tokens_seen  # a token count taken without opening a mark
    with torch.no_grad():
        model(inputs_embeds=x[:, PROMPT : PROMPT + 30], cache=cache)  # compresses: no open mark
    with pytest.raises(ValueError, match="take `mark\\(\\)` before"):
        cache.rollback(mark)


@pytest.mark.parametrize("mode", sorted(CASES))
def test_reset_starts_a_new_episode(model, mode):
    x, bounds = episode(3)
    cache = build(mode, "hard", model)
    first = run_stream(model, cache, x, bounds)
    cache.reset()
    assert cache.stats() == KVStats()
    torch.testing.assert_close(run_stream(model, cache, x, bounds), first, atol=0, rtol=0)


@pytest.mark.parametrize("mode", COMPRESSING)
def test_stats_bytes_follow_the_tokens_held(model, mode):
    x, bounds = episode(6)
    cache = build(mode, "hard", model)
    run_stream(model, cache, x, bounds)
    s, cfg = cache.stats(), model.cfg
    per_token_layer = 2 * cfg.n_kv_heads * cfg.head_dim * 4
    assert s.bytes == per_token_layer * (s.tokens_raw * cfg.n_layers + s.chunks_retained)
    assert s.chunks_retained == s.tokens_compressed * cfg.n_layers


def test_make_cache_errors_name_what_is_wrong(model):
    with pytest.raises(KeyError, match="available: chunked, full, sink_window"):
        make_cache(_bad_mode(), model.cfg)
    for mode in COMPRESSING:
        with pytest.raises(ValueError, match="window"):
            make_cache(KVConfig(mode=mode), model.cfg)
    with pytest.raises(ValueError, match="raw slots"):
        make_cache(KVConfig(mode="chunked", window=30, chunk=4, capacity=64, max_chunks=32), model.cfg)


def _bad_mode() -> KVConfig:
    cfg = KVConfig()
    cfg.mode = "paged"  # bypasses __post_init__, as a hand-edited object would
    return cfg


@pytest.mark.parametrize("mode", COMPRESSING)
def test_a_forward_too_large_for_the_raw_ring_is_a_clear_error(model, mode):
    cache = make_cache(kv(mode, "hard", capacity=40), model.cfg)
    with pytest.raises(ValueError, match="raw ring holds"):
        with torch.no_grad():
            model(inputs_embeds=torch.zeros(1, 45, model.cfg.dim), cache=cache)
