"""The prefill with memory against references that share none of its code (issue 20: is the damage
from stored KV a bug?).

* Stored unit KV equals a plain forward of ``[system prefix][context][unit]`` through an ordinary
  ``FullCache``, its keys un-rotated from the positions they were computed at.
* A KEEP prefill (segments dropped at different layers, a jointly stored group with an offset) equals
  one ordinary causal forward over the whole prompt in which, at every layer, the rows KEEP did not
  compute there have their k/v replaced by the stored ones. Rows that read stored KV at a layer read it
  at every deeper layer too, so computing them anyway changes no other row: the logits must agree.
"""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from vla_runtime.kv import FullCache, FullParams
from vla_runtime.kv.rope import apply_rope, rope_cos_sin
from vla_runtime.memory import KVStore, MemoryPrefill, PrefillConfig
from vla_runtime.memory.branches import continuation_logprobs
from vla_runtime.memory.prefill import PlanContext

from .conftest import make_prompt


def plain_unit_kv(model, prefix, unit):
    """Pre-RoPE k and v of ``unit`` prefilled right after ``prefix``: [L, Hkv, n, D] each."""
    ids = list(prefix) + list(unit)
    cache = FullCache(model.cfg.geometry, FullParams(capacity=len(ids)))
    with torch.no_grad():
        model(torch.tensor([ids]), cache=cache)
    k, v = (t[:, 0, :, len(prefix) :] for t in cache.buffers(len(ids)))  # [L, Hkv, n, D], k rotated
    cos, sin = rope_cos_sin(torch.arange(len(prefix), len(ids)), model.cfg.rope)
    return apply_rope(k, cos, -sin), v  # rotating by -angle undoes the rotation


class SubstitutingCache:
    """Causal attention over the whole prompt at positions 0..S-1; at layer l the rows where
    ``stored[l]`` is set use ``k_stored[l], v_stored[l]`` (pre-RoPE) instead of their own, and
    ``bias[l]`` ([S], or None) is added to every score of each key."""

    def __init__(self, rope, stored, k_stored, v_stored, bias=None):
        self.rope, self.stored, self.k_stored, self.v_stored, self.bias = rope, stored, k_stored, v_stored, bias

    def attend(self, layer, q, k_raw, v):
        rows = self.stored[layer]  # [S] bool
        k_raw, v = k_raw.clone(), v.clone()
        k_raw[0][:, rows] = self.k_stored[layer][:, rows]
        v[0][:, rows] = self.v_stored[layer][:, rows]
        cos, sin = rope_cos_sin(torch.arange(q.shape[2]), self.rope)
        q, k = apply_rope(q, cos, sin), apply_rope(k_raw, cos, sin)
        if self.bias is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        n = q.shape[2]
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        scores = torch.where(causal, self.bias[layer][None, :n], float("-inf"))  # [S, S]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=scores, enable_gqa=True)

    def end_forward(self, *, pin=False):
        pass


@pytest.mark.parametrize("context", [(), (501, 502, 503, 504, 505)])
def test_stored_unit_kv_equals_a_plain_forward_after_the_prefix(tiny_lm, context):
    prompt = dataclasses.replace(make_prompt(), context_ids=context)  # units (s0 s1) (s2) (s3 s4) (s5)
    store = KVStore()
    engine = MemoryPrefill(tiny_lm, store, PrefillConfig(method="keep", static_grouping=True))
    res = engine.run(prompt)
    # with a context filler no unit was prefilled where it sits, so the first one is recomputed too
    assert ("s0" in res.stats.modules_per_layer[0]) == bool(context)
    ctx = PlanContext(engine.model_tag, prompt.prefix_ids, store, context)
    for unit in prompt.units:
        # static groups are stored jointly, the others per segment
        pieces = [unit.token_ids] if unit.joint else [s.token_ids for s in unit.segments]
        for ids in pieces:
            kv = store.get(ctx.unit_key(ids))
            k, v = plain_unit_kv(tiny_lm, prompt.prefix_ids + context, ids)
            torch.testing.assert_close(kv.k, k, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(kv.v, v, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("stored_bias", [0.0, 1.5])
def test_keep_equals_a_plain_forward_with_the_stored_kv_substituted(tiny_lm, stored_bias):
    """With ``stored_bias`` the reference also subtracts it from the scores of every memory key read from
    stored KV at that layer (the exact first segment excepted), in the prefill and in what decodes after it."""
    prompt = make_prompt(lengths=(5, 7, 4, 9, 6, 3, 8, 5), joint=((0,), (1,), (2, 3), (4,), (5,), (6,), (7,)))
    cfg = tiny_lm.cfg
    config = PrefillConfig(method="keep", decay=0.6, static_grouping=True, stored_bias=stored_bias)
    res = MemoryPrefill(tiny_lm, KVStore(), config).run(prompt)
    computed = [set(m) for m in res.stats.modules_per_layer]
    assert [len(c) for c in computed] == [7, 4, 2, 1]  # s0 is exact (never computed); segments drop at every layer
    # the stored KV every segment reads, from the plain reference: per segment, or the joint unit (s2 s3)
    n = prompt.n_tokens
    k_st = torch.zeros(cfg.n_layers, cfg.n_kv_heads, n, cfg.head_dim)
    v_st = torch.zeros_like(k_st)
    stored = torch.zeros(cfg.n_layers, n, dtype=torch.bool)
    p = prompt.n_prefix
    k_st[:, :, :p], v_st[:, :, :p] = plain_unit_kv(tiny_lm, (), prompt.prefix_ids)
    stored[:, :p] = True
    for unit, start in zip(prompt.units, prompt.unit_starts()):
        k, v = plain_unit_kv(tiny_lm, prompt.prefix_ids, unit.token_ids) if unit.joint else (None, None)
        pos = start
        for seg in unit.segments:
            m = len(seg.token_ids)
            if not unit.joint:
                k, v = plain_unit_kv(tiny_lm, prompt.prefix_ids, seg.token_ids)
                off = 0
            else:
                off = pos - start
            k_st[:, :, pos : pos + m], v_st[:, :, pos : pos + m] = k[:, :, off : off + m], v[:, :, off : off + m]
            for layer in range(cfg.n_layers):
                stored[layer, pos : pos + m] = seg.id not in computed[layer]
            pos += m
    stale = stored.clone()
    stale[:, : p + len(prompt.units[0].token_ids)] = False  # the prefix and the exact first segment
    stale[:, prompt.memory_end :] = False
    bias = -stored_bias * stale.float() if stored_bias else None  # [L, S]
    with torch.no_grad():
        ref = tiny_lm(torch.tensor([prompt.token_ids()]), cache=SubstitutingCache(cfg.rope, stored, k_st, v_st, bias))[0, -1]
    torch.testing.assert_close(res.logits, ref, atol=1e-5, rtol=1e-5)
    # and the mix is neither full recomputation nor full reuse (nor, with the bias, the mix without it)
    others = [PrefillConfig(method="full"), PrefillConfig(method="reuse")]
    if stored_bias:
        others.append(dataclasses.replace(config, stored_bias=0.0))
    for other in others:
        assert (res.logits - MemoryPrefill(tiny_lm, KVStore(), other).run(prompt).logits).abs().max() > 1e-3, other
    # decoding after the prefill (the returned cache) and scoring candidates (branches on it) read the same
    # stored KV with the same bias as the prompt did: both equal the reference over the longer sequence
    tok, nxt = 11, 12
    grow = lambda t: torch.cat([t, torch.zeros_like(t[..., :1])], dim=-1)  # a computed, unbiased new row  # noqa: E731
    k_st1, v_st1 = (torch.cat([t, torch.zeros_like(t[:, :, :1])], dim=2) for t in (k_st, v_st))
    longer = SubstitutingCache(cfg.rope, grow(stored), k_st1, v_st1, None if bias is None else grow(bias))
    with torch.no_grad():
        ref_next = tiny_lm(torch.tensor([prompt.token_ids() + [tok]]), cache=longer)[0, -1].float().log_softmax(-1)
        scores = continuation_logprobs(tiny_lm, res.cache, res.logits, [[tok, nxt]])
        decoded = tiny_lm(torch.tensor([[tok]]), cache=res.cache)[0, -1]
    torch.testing.assert_close(decoded.float().log_softmax(-1), ref_next, atol=1e-5, rtol=1e-5)
    expected = res.logits.float().log_softmax(-1)[tok] + ref_next[nxt]
    torch.testing.assert_close(scores[0], expected, atol=1e-4, rtol=1e-5)
