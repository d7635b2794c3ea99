"""Layer-balanced loading on CPU: a store tier throttled to a set bandwidth and decoder layers
stretched to a set duration (a slow link and a slow device, so the schedule -- not this CPU's
speed -- decides the times). What is loaded is exactly what is needed, every schedule gives the
same numbers, and overlapping the loads with compute beats loading them serially."""

import time
from collections import Counter

import pytest
import torch

from vla_runtime.memory import KVStore, MemoryPrefill, PrefillConfig, StoreConfig, TierConfig

from .conftest import make_prompt

LOAD_S = 0.020  # one (segment, layer) load
COMPUTE_S = 0.100  # one decoder layer


@pytest.fixture
def slow_layers(tiny_lm):
    hooks = [layer.mlp.register_forward_hook(lambda *_: time.sleep(COMPUTE_S)) for layer in tiny_lm.model.layers]
    yield tiny_lm
    for h in hooks:
        h.remove()


def needed_loads(engine_result, modules):
    """(module, layer) pairs whose stored KV a layer reads: every stored module not computed there."""
    return {(m, layer) for layer, computed in enumerate(engine_result.stats.modules_per_layer) for m in modules if m not in computed}


LENGTHS = (6, 5, 7, 6, 5, 6, 7, 5, 6, 6)
RATIOS = (1.0, 0.6, 0.3, 0.1)


def throttled_store(model, load_s):
    bytes_per_load = 2 * model.cfg.n_kv_heads * 6 * model.cfg.head_dim * 4  # k and v of ~6 tokens, fp32
    return KVStore(StoreConfig([TierConfig("host", 1 << 26, bandwidth=bytes_per_load / load_s)]))


def test_loads_exactly_what_is_needed_and_overlapped_schedules_load_ahead(slow_layers):
    """A slow link (a load is a fifth of a layer): serial pays every load on the critical path; the overlapped
    schedules load while earlier layers compute. (How much wall time that saves is a measurement, not a test
    assertion: it failed a CI run on a loaded machine.)"""
    model = slow_layers
    prompt = make_prompt(lengths=LENGTHS, joint=tuple((i,) for i in range(len(LENGTHS))))
    modules = {"<prefix>", *(f"s{i}" for i in range(len(LENGTHS)))}
    store = throttled_store(model, LOAD_S)
    results = {}
    for schedule in ("serial", "next_layer", "balanced", "serial"):  # serial again: the store is warm for all
        engine = MemoryPrefill(model, store, PrefillConfig(method="keep", ratios=RATIOS, load_schedule=schedule))
        results[schedule] = engine.run(prompt)
    serial, balanced = results["serial"], results["balanced"]
    # segments drop out layer by layer: 9 candidates (s0 follows the prefix: exact), then 5, 2, 1
    assert [len(set(m) - {"<prefix>"}) for m in serial.stats.modules_per_layer] == [9, 5, 2, 1]
    for schedule, res in results.items():
        torch.testing.assert_close(res.logits, serial.logits, rtol=0, atol=0)
        assert len(res.load_log) == len(set(res.load_log)), f"{schedule} loaded something twice"
        assert set(res.load_log) == needed_loads(res, modules), f"{schedule} loaded more or less than needed"
    assert len(serial.load_log) == 27  # prefix and s0: 4 layers each; 4 drops x 3 layers, 3 x 2, 1 x 1
    # how far ahead of the computing layer each schedule may load
    assert max(serial.load_ahead) == 0
    assert max(results["next_layer"].load_ahead) == 1
    assert max(balanced.load_ahead) >= 1  # loads finished while an earlier layer computed
    # serial waits out every throttled load (a lower bound: a slower machine only waits longer)
    assert serial.stats.loader_stall_ms >= 0.9 * 27 * LOAD_S * 1e3


def test_balanced_loading_preloads_deeper_layers_when_the_link_is_idle(slow_layers):
    """A fast link: after the next layer's loads the loader does not idle but fetches deeper layers of
    segments that can no longer be recomputed (KEEP's layer-balanced loading)."""
    prompt = make_prompt(lengths=LENGTHS, joint=tuple((i,) for i in range(len(LENGTHS))))
    store = throttled_store(slow_layers, 0.002)
    engine = MemoryPrefill(slow_layers, store, PrefillConfig(method="keep", ratios=RATIOS, load_schedule="balanced"))
    engine.run(prompt)  # builds the units
    res = engine.run(prompt)
    assert max(res.load_ahead) >= 2  # (the stall this saves is a measurement: bench_keep.py --link-mb-s)


class CountingStore(KVStore):
    """Records every transfer: (layer, the units it moved)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.transfers: list[tuple[int, tuple[str, ...]]] = []

    def read_layers(self, reads, layer, *, non_blocking=False):
        self.transfers.append((layer, tuple(r.key for r in reads)))
        return super().read_layers(reads, layer, non_blocking=non_blocking)


@pytest.mark.parametrize("schedule", ["serial", "next_layer", "balanced"])
def test_segments_that_drop_out_together_load_as_one_transfer_per_layer(tiny_lm, schedule):
    """27 (segment, layer) loads in 10 transfers: the prefix and s0 (exact) at layers 0-3, the 4 segments
    dropped after layer 0 at layers 1-3, the 3 after layer 1 at layers 2-3, the last after layer 2 at 3."""
    prompt = make_prompt(lengths=LENGTHS, joint=tuple((i,) for i in range(len(LENGTHS))))
    store = CountingStore(StoreConfig([TierConfig("host", 1 << 26)]))
    engine = MemoryPrefill(tiny_lm, store, PrefillConfig(method="keep", ratios=RATIOS, load_schedule=schedule))
    engine.run(prompt)  # builds the units
    store.transfers.clear()
    res = engine.run(prompt)
    assert len(res.load_log) == 27
    assert sorted(len(units) for _, units in store.transfers) == [1] + [2] * 4 + [3] * 2 + [4] * 3
    assert sorted(layer for layer, _ in store.transfers) == [0, 1, 1, 2, 2, 2, 3, 3, 3, 3]
    # the log lists, per layer, as many (module, layer) loads as the transfers moved units, nothing twice
    per_layer = lambda pairs: sorted(Counter(layer for _, layer in pairs).items())  # noqa: E731
    assert per_layer(res.load_log) == per_layer((u, layer) for layer, units in store.transfers for u in units)
    assert len(set(res.load_log)) == 27
