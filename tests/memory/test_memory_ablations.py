"""KEEP's ablation flags change what they claim to change (issue 20: an ablation that changes nothing
is suspicious): ``hops=0`` changes which segments stay recomputed, ``static_grouping=False`` changes
which stored KV is loaded."""

import torch

from vla_runtime.memory import KVStore, MemoryPrefill, PrefillConfig
from vla_runtime.memory.importance import SegmentAttention, propagate_importance
from vla_runtime.memory.methods import Keep

from .conftest import make_prompt


def test_propagation_adds_the_segment_a_relevant_segment_leans_on():
    # the query looks at s0, then s1; s0's last rows look at s3, which the query ignores
    query = torch.tensor([0.6, 0.3, 0.1, 0.0])
    cross = torch.zeros(4, 4)
    cross[3, 0] = 1.0  # s3 (later) attends to s0; propagation counts the link both ways
    assert propagate_importance(SegmentAttention(query, cross), 2, hops=0, hop_weight=1.0)[0] == [0, 1]
    picked, score = propagate_importance(SegmentAttention(query, cross), 2, hops=4, hop_weight=1.0)
    assert picked == [0, 3]  # hand-computed: scores [1.225, 0.3, 0.1, 0.375] at the fixed point
    torch.testing.assert_close(score, torch.tensor([1.225, 0.3, 0.1, 0.375]))
    # without a link, hops change nothing
    assert propagate_importance(SegmentAttention(query, torch.zeros(4, 4)), 2, hops=4, hop_weight=1.0)[0] == [0, 1]


def _singletons():
    return make_prompt(lengths=(5, 7, 4, 9, 6, 3, 8, 5, 6, 4), joint=tuple((i,) for i in range(10)))


def _recomputed(tiny_lm, prompt, monkeypatch, **cfg):
    def linked(self, view):  # importance falls with the index; s9's last rows lean on s1
        ids = [int(m.id[1:]) for m in self._selected]
        cross = torch.zeros(len(ids), len(ids))
        if 1 in ids and 9 in ids:
            cross[ids.index(9), ids.index(1)] = 5.0
        return SegmentAttention(torch.tensor([10.0 - i for i in ids]), cross)

    monkeypatch.setattr(Keep, "segment_attention", linked)
    res = MemoryPrefill(tiny_lm, KVStore(), PrefillConfig(method="keep", decay=0.6, **cfg)).run(prompt)
    return [set(m) - {"<prefix>"} for m in res.stats.modules_per_layer]


def test_the_engine_honours_hops(tiny_lm, monkeypatch):
    prompt = _singletons()
    direct = _recomputed(tiny_lm, prompt, monkeypatch, hops=0)
    multihop = _recomputed(tiny_lm, prompt, monkeypatch, hops=4)
    # 9 candidates (s0 is exact), 5 stay at layer 1
    assert direct[1] == {"s1", "s2", "s3", "s4", "s5"}
    assert multihop[1] == {"s1", "s2", "s3", "s4", "s9"}


def test_keep_segment_attention_sees_links_between_segments(tiny_lm, monkeypatch):
    seen = []
    original = Keep.segment_attention

    def spy(self, view):
        seen.append(original(self, view))
        return seen[-1]

    monkeypatch.setattr(Keep, "segment_attention", spy)
    MemoryPrefill(tiny_lm, KVStore(), PrefillConfig(method="keep", decay=0.6)).run(_singletons())
    att = seen[0]
    assert att.query.shape == (9,) and att.cross.shape == (9, 9)
    assert float(att.query.sum()) > 0 and float(att.cross.sum()) > 0  # multi-hop has something to propagate
    assert float(att.cross.triu(1).sum()) == 0  # causal: a segment's rows see itself and earlier segments only


def test_static_grouping_changes_the_stored_and_loaded_kv(tiny_lm):
    prompt = make_prompt()  # units (s0 s1) (s2) (s3 s4) (s5): two static groups
    runs = {}
    for grouped in (True, False):
        store = KVStore()
        res = MemoryPrefill(tiny_lm, store, PrefillConfig(method="keep", ratios=(0.0,), static_grouping=grouped)).run(prompt)
        runs[grouped] = (store, res)
    assert len(runs[True][0].keys()) == 4 + 1  # 4 units + the system prefix
    assert len(runs[False][0].keys()) == 6 + 1  # every segment alone
    # nothing recomputed (ratio 0): the answer comes from stored KV only, and the jointly prefilled KV differs
    assert not torch.allclose(runs[True][1].logits, runs[False][1].logits, atol=1e-4)
    # the joint unit (s0 s1) right after the prefix is exact KV: grouped, s1 is never recomputed
    grouped_mods = set().union(*runs[True][1].stats.modules_per_layer)
    alone_mods = set().union(*runs[False][1].stats.modules_per_layer)
    assert "s1" not in grouped_mods
    assert "s1" not in alone_mods  # ratio 0 recomputes nothing either way
    keep_grouped = MemoryPrefill(tiny_lm, KVStore(), PrefillConfig(method="keep", static_grouping=True)).run(prompt)
    keep_alone = MemoryPrefill(tiny_lm, KVStore(), PrefillConfig(method="keep", static_grouping=False)).run(prompt)
    assert "s1" not in set(keep_grouped.stats.modules_per_layer[0]) and "s1" in set(keep_alone.stats.modules_per_layer[0])
