"""The contract every registered cache passes (``registry.CACHES``; one row each in ``cases.CASES``).

Parametrised over the registry, not over the rows: a cache added to ``CACHES`` without a row fails here.
Numbers are held against ``FullCache`` (the reference) at atol 1e-5, or bit for bit where nothing is dropped.
"""

import dataclasses

import pytest
import torch

from vla_runtime.kv import CACHES, AttendSeam, CacheParams, EpisodeCache, KVCache, KVConfig, KVMode, KVStats, make_cache

from .cases import PROMPT, REGISTERED, build, case, episode, full_cache, kv, run_stream, tiny_model

pytestmark = pytest.mark.parametrize("mode", REGISTERED, ids=lambda m: m.value)


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def test_the_cache_describes_itself(model, mode):
    """Registry name -> enum member -> params dataclass -> YAML keys -> the registered class, and back."""
    assert mode.value in CACHES and mode.cache_class is CACHES[mode.value]
    params_class = mode.params_class
    assert issubclass(params_class, CacheParams) and dataclasses.is_dataclass(params_class)
    assert params_class.__dataclass_params__.frozen
    cfg = kv(mode, "hard")
    assert type(cfg.params) is params_class
    flat = cfg.to_dict()
    assert flat == {"mode": mode.value, **case(mode).hard, **{k: v for k, v in flat.items() if k not in case(mode).hard and k != "mode"}}
    assert KVConfig.from_dict(flat) == cfg == KVConfig.from_dict({"mode": mode.value, **case(mode).hard})
    cache = make_cache(cfg, model.cfg.geometry)
    assert type(cache) is mode.cache_class
    assert isinstance(cache, AttendSeam) and isinstance(cache, EpisodeCache) and isinstance(cache, KVCache)
    assert cache.params == cfg.params.resolve(model.cfg.geometry)


def test_window_covering_the_episode_equals_full_cache(model, mode):
    x, bounds = episode(4)
    ref = run_stream(model, full_cache(model), x, bounds)
    cache = build(mode, "easy", model)
    got = run_stream(model, cache, x, bounds)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    stats = cache.stats()
    assert stats.tokens_raw == stats.tokens_seen == x.shape[1]
    assert stats.positions_used == x.shape[1] and stats.chunks_dropped == 0


def test_hard_row_compresses_and_stays_small_or_equals_full(model, mode):
    """Compressing rows hold fewer tokens, bounded positions and differ from full; the others equal it."""
    x, bounds = episode(6)
    cache = build(mode, "hard", model)
    got = run_stream(model, cache, x, bounds)
    ref = run_stream(model, full_cache(model), x, bounds)
    stats = cache.stats()
    assert stats.tokens_seen == x.shape[1]
    if not case(mode).compresses:
        torch.testing.assert_close(got, ref, atol=0, rtol=0)
        assert stats.tokens_raw == x.shape[1]
        return
    assert stats.tokens_raw < 30 and stats.positions_used < 40
    assert not torch.allclose(got[:, -1], ref[:, -1], atol=1e-3)
    first = PROMPT + 12  # the first step's prefill sees everything (nothing left the window yet)
    torch.testing.assert_close(got[:, :first], ref[:, :first], atol=1e-5, rtol=1e-5)


def test_changing_a_later_frame_never_changes_an_earlier_output(model, mode):
    x, bounds = episode(5)
    y = x.clone()
    cut = PROMPT + 3 * (12 + 3)  # step 3 starts here
    y[:, cut + 2 : cut + 7] += torch.randn_like(y[:, cut + 2 : cut + 7])
    a = run_stream(model, build(mode, "hard", model), x, bounds)
    b = run_stream(model, build(mode, "hard", model), y, bounds)
    assert torch.equal(a[:, : cut + 2], b[:, : cut + 2])
    assert not torch.allclose(a[:, cut + 2 :], b[:, cut + 2 :])


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


def test_rollback_across_a_layout_change_is_a_clear_error(model, mode):
    x, _ = episode(3)
    cache = build(mode, "hard", model)
    run_stream(model, cache, x[:, :PROMPT], [PROMPT])
    mark = cache.stats().tokens_seen  # a token count taken without opening a mark
    with torch.no_grad():
        model(inputs_embeds=x[:, PROMPT : PROMPT + 30], cache=cache)  # compresses (if it does): no open mark
    if not case(mode).compresses:
        cache.rollback(mark)  # nothing moved: any held count is a valid mark
        assert cache.stats().tokens_seen == PROMPT
        return
    with pytest.raises(ValueError, match="take `mark\\(\\)` before"):
        cache.rollback(mark)


def test_reset_starts_a_new_episode(model, mode):
    x, bounds = episode(3)
    cache = build(mode, "hard", model)
    first = run_stream(model, cache, x, bounds)
    cache.reset()
    assert cache.stats() == KVStats()
    torch.testing.assert_close(run_stream(model, cache, x, bounds), first, atol=0, rtol=0)


def test_stats_bytes_are_the_held_entries_of_the_stores_tensors(model, mode):
    """bytes = (K and V of one token in one layer, read off the cache's own buffers) x entries held."""
    x, bounds = episode(6)
    cache = build(mode, "hard", model)
    run_stream(model, cache, x, bounds)
    s, cfg = cache.stats(), model.cfg
    k = cache.store.k  # [L, B, Hkv, S, D]
    per_token_layer = 2 * k.shape[1] * k.shape[2] * k.shape[4] * k.element_size()
    assert per_token_layer == 2 * cfg.n_kv_heads * cfg.head_dim * 4
    assert s.bytes == per_token_layer * (s.tokens_raw * cfg.n_layers + s.chunks_retained)
    assert s.chunks_retained == s.tokens_compressed * cfg.n_layers
    prompt_only = build(mode, "hard", model)
    run_stream(model, prompt_only, x[:, :PROMPT], [PROMPT])
    assert prompt_only.stats().bytes == per_token_layer * PROMPT * cfg.n_layers


def test_a_forward_larger_than_the_cache_is_a_clear_error(model, mode):
    cache = make_cache(kv(mode, "hard", capacity=40), model.cfg.geometry)
    with pytest.raises(ValueError, match="raw ring holds|FullCache is full"):
        with torch.no_grad():
            model(inputs_embeds=torch.zeros(1, 45, model.cfg.dim), cache=cache)


def test_kv_mode_parses_its_yaml_name(mode):
    assert KVMode.parse(mode.value) is mode is KVMode.parse(mode)
    assert KVConfig(mode.value).mode is mode


class _MaskedPass:
    """Oracle seam: one forward at positions 0..T-1 with an explicit visibility mask [T, T] (True = visible)."""

    def __init__(self, rope, mask: torch.Tensor) -> None:
        self.rope, self.mask = rope, mask

    def attend(self, layer, q, k_raw, v):
        from vla_runtime.kv.attention import masked_attention
        from vla_runtime.kv.rope import apply_rope, rope_cos_sin

        cos, sin = rope_cos_sin(torch.arange(q.shape[2]), self.rope)
        return masked_attention(apply_rope(q, cos, sin), apply_rope(k_raw, cos, sin), v, self.mask)

    def end_forward(self, *, pin: bool = False) -> None:
        pass


def _boom(*args, **kwargs):
    raise AssertionError("the causal-only kernel must not run a bidirectional block")


@torch.no_grad()
def test_bidirectional_block_sees_both_ways_and_leaves_no_trace(model, mode):
    """A query block in ``bidirectional_block`` equals the flat forward whose block rows see every token (the
    history causal); afterwards the cache holds what it held and the next step's logits are unchanged. On the
    decoupled caches the kernel path's fallback (gather + rotate) gives the same block output."""
    x, bounds = episode(2)
    block = torch.randn(1, 7, x.shape[2], generator=torch.Generator().manual_seed(5))
    nxt = torch.randn(1, 9, x.shape[2], generator=torch.Generator().manual_seed(6))
    cache, plain = build(mode, "easy", model), build(mode, "easy", model)
    run_stream(model, cache, x, bounds)
    run_stream(model, plain, x, bounds)
    before = cache.stats()
    with cache.bidirectional_block() as mark:
        assert mark == before.tokens_seen
        out = model(inputs_embeds=block, cache=cache)
    n, t = x.shape[1], block.shape[1]
    mask = torch.ones(n + t, n + t).tril().bool()
    mask[n:] = True
    oracle = model(inputs_embeds=torch.cat([x, block], dim=1), cache=_MaskedPass(model.cfg.rope, mask))[:, n:]
    torch.testing.assert_close(out, oracle, atol=1e-5, rtol=1e-5)
    causal = torch.ones(n + t, n + t).tril().bool()
    wrong = model(inputs_embeds=torch.cat([x, block], dim=1), cache=_MaskedPass(model.cfg.rope, causal))[:, n:]
    assert (out - wrong).abs().max() > 1e-3  # the check tells a causal block apart
    after = cache.stats()
    assert (after.tokens_seen, after.tokens_raw, after.bytes) == (before.tokens_seen, before.tokens_raw, before.bytes)
    assert not cache.bidirectional
    torch.testing.assert_close(model(inputs_embeds=nxt, cache=cache), model(inputs_embeds=nxt, cache=plain), atol=0, rtol=0)
    if hasattr(cache, "backend"):
        backend = cache.backend
        cache.backend = dataclasses.replace(backend, kernel=_boom)
        with cache.bidirectional_block():
            gathered = model(inputs_embeds=block, cache=cache)
        cache.backend = backend
        with cache.bidirectional_block():
            viewed = model(inputs_embeds=block, cache=cache)
        torch.testing.assert_close(gathered, viewed, atol=1e-5, rtol=1e-5)
