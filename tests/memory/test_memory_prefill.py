"""The per-layer prefill with memory against full prefills and hand-built references (fp32, tiny model)."""

import pytest
import torch

from vla_runtime.kv import FullCache, FullParams
from vla_runtime.kv.rope import apply_rope, rerotate, rope_cos_sin
from vla_runtime.memory import KVStore, MemoryPrefill, PrefillConfig
from vla_runtime.memory.methods import METHODS

from .conftest import make_prompt


def full_logits(model, prompt):
    with torch.no_grad():
        cache = FullCache(model.cfg.geometry, FullParams(capacity=prompt.n_tokens + 8))
        return model(torch.tensor([prompt.token_ids()]), cache=cache)[0, -1], cache


def run(model, prompt, **cfg):
    return MemoryPrefill(model, KVStore(), PrefillConfig(**cfg)).run(prompt)


@pytest.mark.parametrize("schedule", ["serial", "next_layer", "balanced"])
@pytest.mark.parametrize("method,cfg", [("full", {}), ("keep", {"ratios": (1.0,)}), ("cacheblend", {"recompute_ratio": 1.0})])
def test_recompute_all_equals_full_prefill(tiny_lm, method, cfg, schedule):
    prompt = make_prompt()
    ref, ref_cache = full_logits(tiny_lm, prompt)
    res = run(tiny_lm, prompt, method=method, load_schedule=schedule, **cfg)
    torch.testing.assert_close(res.logits, ref, atol=1e-5, rtol=1e-5)
    n = prompt.n_tokens
    for got, want in zip(res.cache.buffers(n), ref_cache.buffers(n)):  # k, v: [L, 1, Hkv, n, D]
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_decoding_continues_from_the_assembled_cache(tiny_lm):
    prompt = make_prompt()
    _, ref_cache = full_logits(tiny_lm, prompt)
    res = run(tiny_lm, prompt, method="keep", ratios=(1.0,))
    tok = torch.tensor([[17, 99, 4000]])
    with torch.no_grad():
        torch.testing.assert_close(tiny_lm(tok, cache=res.cache), tiny_lm(tok, cache=ref_cache), atol=1e-5, rtol=1e-5)


def test_prefix_caching_equals_full_and_reuses_the_shared_prefix(tiny_lm):
    engine = MemoryPrefill(tiny_lm, KVStore(), PrefillConfig(method="prefix"))
    first = make_prompt()
    engine.run(first)
    # same memory, new question; then a changed last segment
    second = make_prompt(seed=1, n_query=4)
    second = type(second)(first.prefix_ids, first.units, (11, 12, 13, 14))
    res = engine.run(second)
    torch.testing.assert_close(res.logits, full_logits(tiny_lm, second)[0], atol=1e-5, rtol=1e-5)
    assert res.stats.memory_rows_per_layer == [0] * tiny_lm.cfg.n_layers  # the whole memory came from the cache
    changed = type(second)(first.prefix_ids, first.units[:-1] + (make_prompt(seed=5).units[-1],), second.query_ids)
    res = engine.run(changed)
    torch.testing.assert_close(res.logits, full_logits(tiny_lm, changed)[0], atol=1e-5, rtol=1e-5)
    assert res.stats.memory_rows_per_layer[0] == len(changed.units[-1].token_ids)


def reuse_reference(model, prompt, units_kv):
    """Full reuse built by hand: a FullCache filled with each unit's stored KV rotated at its new
    positions (prefix exact), then one forward of the query."""
    cfg = model.cfg
    cache = FullCache(cfg.geometry, FullParams(capacity=prompt.n_tokens + 8))
    held = sum(k.shape[2] for k, _ in units_kv)
    k_held, v_held = cache.buffers(held)  # [L, 1, Hkv, held, D]
    pos = 0
    for k, v in units_kv:  # [L, Hkv, n, D]
        n = k.shape[2]
        cos, sin = rope_cos_sin(torch.arange(pos, pos + n), cfg.rope)
        k_held[:, 0, :, pos : pos + n] = apply_rope(k, cos, sin)
        v_held[:, 0, :, pos : pos + n] = v
        pos += n
    cache.hold(pos)
    with torch.no_grad():
        return model(torch.tensor([prompt.query_ids]), cache=cache)[0, -1]


def test_ratio_zero_equals_full_reuse(tiny_lm):
    prompt = make_prompt()
    store = KVStore()
    keep = MemoryPrefill(tiny_lm, store, PrefillConfig(method="keep", ratios=(0.0,), static_grouping=False)).run(prompt)
    reuse = MemoryPrefill(tiny_lm, KVStore(), PrefillConfig(method="reuse")).run(prompt)
    assert keep.stats.memory_rows_per_layer == [0] * tiny_lm.cfg.n_layers
    torch.testing.assert_close(keep.logits, reuse.logits, atol=0, rtol=0)
    # and both equal the hand-built reference from the stored unit KV
    engine = MemoryPrefill(tiny_lm, store, PrefillConfig(method="reuse"))
    from vla_runtime.memory.prefill import PlanContext

    ctx = PlanContext(engine.model_tag, prompt.prefix_ids, store)
    kvs = [store.get(ctx.prefix_key(prompt.prefix_ids))]
    kvs += [store.get(ctx.unit_key(s.token_ids)) for u in prompt.units for s in u.segments]
    torch.testing.assert_close(reuse.logits, reuse_reference(tiny_lm, prompt, [(kv.k, kv.v) for kv in kvs]), atol=1e-5, rtol=1e-5)
    # full reuse is not the full prefill: the segments miss each other
    assert (reuse.logits - full_logits(tiny_lm, prompt)[0]).abs().max() > 1e-3


def test_rerotation_round_trip_and_repositioned_kv_equals_kv_computed_there(tiny_lm):
    cfg = tiny_lm.cfg
    k = torch.randn(1, cfg.n_kv_heads, 7, cfg.head_dim)
    p0, p1 = torch.arange(3, 10), torch.arange(900, 907)
    rot0 = apply_rope(k, *rope_cos_sin(p0, cfg.rope))
    there = rerotate(rot0, p1 - p0, cfg.rope)
    back = rerotate(there, p0 - p1, cfg.rope)
    torch.testing.assert_close(back, rot0, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(there, apply_rope(k, *rope_cos_sin(p1, cfg.rope)), atol=1e-4, rtol=1e-4)
    # a segment prefilled alone at p0 and at p1: pre-RoPE keys/values agree in every layer (RoPE only
    # sees relative positions), so stored KV re-rotated at p1 is the KV computed at p1
    ids = torch.randint(3, 30000, (1, 9), generator=torch.Generator().manual_seed(2))
    kv = []
    for start in (0, 700):
        cache = OffsetCache(cfg, start)
        with torch.no_grad():
            tiny_lm.model(ids, cache=cache)
        kv.append((torch.stack(cache.k), torch.stack(cache.v)))
    torch.testing.assert_close(kv[0][0], kv[1][0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(kv[0][1], kv[1][1], atol=1e-4, rtol=1e-4)


class OffsetCache:
    """Causal attention over the new tokens only, placed at positions start, start + 1, ...;
    records every layer's pre-RoPE k and v."""

    def __init__(self, cfg, start):
        self.cfg, self.start, self.k, self.v = cfg, start, [], []

    def attend(self, layer, q, k_raw, v):
        self.k.append(k_raw[0])
        self.v.append(v[0])
        cos, sin = rope_cos_sin(torch.arange(self.start, self.start + q.shape[2]), self.cfg.rope)
        return torch.nn.functional.scaled_dot_product_attention(
            apply_rope(q, cos, sin), apply_rope(k_raw, cos, sin), v, is_causal=True, enable_gqa=True
        )

    def end_forward(self, *, pin=False):
        pass


def test_keep_selected_set_only_shrinks_and_follows_the_schedule(tiny_lm):
    prompt = make_prompt(lengths=(5, 7, 4, 9, 6, 3, 8, 5, 6, 4), joint=tuple((i,) for i in range(10)))
    res = run(tiny_lm, prompt, method="keep", decay=0.6, min_keep=1)
    sets = [set(m) - {"<prefix>"} for m in res.stats.modules_per_layer]
    for a, b in zip(sets, sets[1:]):
        assert b <= a
    # s0 sits right after the prefix (exact), so 9 candidates: 9, int(9*.6)=5, int(9*.36)=3, int(9*.216)=1
    assert [len(s) for s in sets] == [9, 5, 3, 1]
    assert "s0" not in sets[0]


def test_cacheblend_recomputes_the_most_deviating_tokens(tiny_lm):
    prompt = make_prompt(lengths=(12, 10, 14, 9), joint=((0,), (1,), (2,), (3,)))
    res = run(tiny_lm, prompt, method="cacheblend", recompute_ratio=0.15, block_tokens=0)
    rows = res.stats.memory_rows_per_layer
    assert rows[:2] == [prompt.n_memory] * 2  # layers 0 and the check layer compute everything
    assert rows[2:] == [round(0.15 * prompt.n_memory)] * (tiny_lm.cfg.n_layers - 2)
    # blending beats full reuse against the full prefill
    ref = full_logits(tiny_lm, prompt)[0]
    reuse = run(tiny_lm, prompt, method="reuse").logits
    assert (res.logits - ref).abs().max() < (reuse - ref).abs().max()


def test_epic_recomputes_the_first_k_tokens_of_every_segment(tiny_lm):
    prompt = make_prompt()
    res = run(tiny_lm, prompt, method="epic", epic_k=2)
    # six segments; s0 follows the prefix and is exact: 5 x 2 tokens at every layer
    assert res.stats.memory_rows_per_layer == [10] * tiny_lm.cfg.n_layers


def test_an_update_invalidates_only_the_changed_unit(tiny_lm):
    engine = MemoryPrefill(tiny_lm, KVStore(), PrefillConfig(method="keep", static_grouping=True))
    prompt = make_prompt()
    first = engine.run(prompt)
    assert first.stats.units_built == 4 + 1  # 4 units + the system prefix
    assert engine.run(prompt).stats.units_built == 0
    units = list(prompt.units)
    seg = units[1].segments[0]
    units[1] = type(units[1])(units[1].id, (type(seg)(seg.id, seg.token_ids[:-1] + (42,)),), False)
    changed = type(prompt)(prompt.prefix_ids, tuple(units), prompt.query_ids)
    res = engine.run(changed)
    assert (res.stats.units_built, res.stats.tokens_built) == (1, len(seg.token_ids))  # the prefix stays stored


def test_unknown_method_is_a_clear_error(tiny_lm):
    with pytest.raises(KeyError, match="available: cacheblend, epic, full, keep, prefix, reuse"):
        MemoryPrefill(tiny_lm, KVStore(), PrefillConfig(method="magic"))
    assert sorted(METHODS) == ["cacheblend", "epic", "full", "keep", "prefix", "reuse"]


def test_config_validation_names_the_field():
    with pytest.raises(ValueError, match="ratios"):
        PrefillConfig(ratios=(0.5, 0.8))
    with pytest.raises(ValueError, match="load_schedule"):
        PrefillConfig(load_schedule="eager")
    with pytest.raises(ValueError, match="decay"):
        PrefillConfig(decay=0.0)
    for bad in (-0.5, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="stored_bias"):
            PrefillConfig(stored_bias=bad)


def test_a_key_bias_must_cover_every_layer_and_only_held_tokens(tiny_lm):
    cache = FullCache(tiny_lm.cfg.geometry, FullParams(capacity=16))
    cache.hold(5)
    n_layers = tiny_lm.cfg.n_layers
    with pytest.raises(ValueError, match=f"key bias must be \\[{n_layers} layers, n <= 5 held tokens\\], got \\(1, 5\\)"):
        cache.bias_keys(torch.zeros(1, 5))
    with pytest.raises(ValueError, match="got \\(.*, 6\\)"):
        cache.bias_keys(torch.zeros(n_layers, 6))
    cache.bias_keys(torch.zeros(n_layers, 5))
    assert cache.key_bias is not None
    cache.reset()
    assert cache.key_bias is None


def test_the_context_fillers_kv_stays_while_the_units_after_it_are_built(tiny_lm):
    """A store with room for the prefix and the units but not the context filler too: the context's KV, stored
    and then read while a new unit is built after it, is pinned for the prefill (it was the one unpinned unit, so
    the put of a new unit evicted it in between: ``KeyError``)."""
    from vla_runtime.memory import MemoryPrompt, PromptSegment, PromptUnit, StoreConfig, TierConfig

    cfg = PrefillConfig(method="keep", load_schedule="serial")
    base = make_prompt(joint=((0,), (1,), (2,), (3,), (4,), (5,)))
    context = tuple(range(100, 140))
    first = MemoryPrompt(base.prefix_ids, base.units, base.query_ids, context)
    probe = KVStore()
    MemoryPrefill(tiny_lm, probe, cfg).run(first)
    context_bytes = max(probe.get(k).nbytes for k in probe.keys())
    store = KVStore(StoreConfig([TierConfig("host", budget_bytes=probe.nbytes - context_bytes)]))
    engine = MemoryPrefill(tiny_lm, store, cfg)
    engine.run(first)
    new = PromptUnit("n", (PromptSegment("s_new", make_prompt(lengths=(5,), joint=((0,),), seed=7).units[0].segments[0].token_ids),))
    second = MemoryPrompt(base.prefix_ids, base.units[:5] + (new,), base.query_ids, context)
    assert engine.run(second).stats.units_built >= 1


def test_models_that_differ_in_any_weight_store_their_kv_apart(tiny_lm):
    import copy

    other = copy.deepcopy(tiny_lm)
    with torch.no_grad():
        other.model.layers[1].self_attn.q_proj.weight[0, 0] += 1.0  # one attention weight of one layer
    store = KVStore()
    prompt = make_prompt()
    first = MemoryPrefill(tiny_lm, store, PrefillConfig(method="reuse")).run(prompt)
    second = MemoryPrefill(other, store, PrefillConfig(method="reuse")).run(prompt)
    assert first.stats.units_built > 0 and second.stats.units_built == first.stats.units_built  # none reused


def test_attention_by_runs_of_positions_equals_the_masked_attention():
    """``PrefillRun`` attends the rows it computes run by run (a run of consecutive positions sees keys up to its
    last one): the same outputs as one attention under the ``[T, S]`` causal-by-position mask, for runs at the
    start, in the middle, single rows and the end."""
    from vla_runtime.kv.attention import masked_attention
    from vla_runtime.memory.prefill_run import PrefillRun

    g = torch.Generator().manual_seed(0)
    s = 40
    k, v = torch.randn(1, 2, s, 8, generator=g), torch.randn(1, 2, s, 8, generator=g)
    for rows in ([0, 1, 2, 7, 8, 20, 33, 34, 35, 36, 37, 38, 39], [5], [39], list(range(s)), [3, 9, 10, 11, 30]):
        pos = torch.tensor(rows)
        q = torch.randn(1, 4, len(rows), 8, generator=g)
        want = masked_attention(q, k, v, torch.arange(s)[None, :] <= pos[:, None])
        torch.testing.assert_close(PrefillRun._causal_runs(q, k, v, pos), want, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("method,cfg", [("keep", {"decay": 0.5}), ("cacheblend", {}), ("epic", {})])
def test_rows_leaving_after_a_layer_skip_its_output_and_nothing_else(tiny_lm, method, cfg):
    """A row the next layer no longer computes adds its keys and values at this layer and nothing more: the
    prefill's logits and every layer's KV equal those of the same plan run through whole decoder layers (each row
    through the full layer, the hidden rows dropped afterwards)."""
    from vla_runtime.memory.prefill_run import PrefillRun

    prompt = make_prompt()
    res = run(tiny_lm, prompt, method=method, **cfg)
    shrinks = sum(a != b for a, b in zip(res.stats.memory_rows_per_layer, res.stats.memory_rows_per_layer[1:]))
    assert method == "epic" or shrinks >= 1  # the plan drops rows somewhere, or the test shows nothing

    def whole_layer(self, layer, x):  # every computed row through the whole block, then the next layer's rows
        out = layer(x, _AllRows(self))
        if self.next_computed is None:
            return out if layer.self_attn.layer < self.n_layers - 1 else out[:, -1:]
        new_rows = torch.nonzero(self.next_computed).flatten()
        idx = torch.searchsorted(self.rows, new_rows)
        self.computed, self.rows, self.next_computed = self.next_computed, new_rows, None
        return out[:, idx]

    class _AllRows:
        def __init__(self, run_):
            self.run = run_

        def attend(self, layer, q, k, v):
            r = self.run
            out = r.attend(layer, q, k, v)  # the outputs of the rows read later
            if r.out_index is None:
                return out
            full = torch.zeros(q.shape, dtype=out.dtype)  # rows not read get zeros: only their KV may matter
            full[:, :, r.out_index] = out
            return full

    mp = pytest.MonkeyPatch()
    with mp.context() as m:
        m.setattr(PrefillRun, "layer_step", whole_layer)
        ref = run(tiny_lm, prompt, method=method, **cfg)
    torch.testing.assert_close(res.logits, ref.logits, atol=1e-5, rtol=1e-5)
    n = prompt.n_tokens
    for got, want in zip(res.cache.buffers(n), ref.cache.buffers(n)):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert res.stats.memory_rows_per_layer == ref.stats.memory_rows_per_layer
