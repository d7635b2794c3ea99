"""Cache-specific checks and the registry's errors; the contract every cache passes is ``test_contract.py``."""

import ast
from pathlib import Path

import pytest
import torch

import vla_runtime.kv
from vla_runtime.cli.eval import register as register_eval
from vla_runtime.kv import CACHES, FullCache, FullParams, KVConfig, KVMode, make_cache
from vla_runtime.kv.slot_cache import SlotCache

from .cases import CASES, COMPRESSING, REGISTERED, ReferenceCompactCache, build, episode, full_cache, run_stream, tiny_model


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def test_every_registered_cache_has_a_row_and_every_row_a_cache():
    assert set(CASES) == set(REGISTERED) == set(KVMode)
    assert [m.value for m in KVMode] == list(CACHES)  # the enum is the registry, in order


def test_sink_window_matches_the_reference_oracle(model):
    x, bounds = episode(6)
    got = run_stream(model, build(KVMode.SINK_WINDOW, "hard", model), x, bounds)
    c = CASES[KVMode.SINK_WINDOW].hard
    ref = run_stream(model, ReferenceCompactCache(model.cfg, window=c["window"], n_sink=c["n_sink"]), x, bounds)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


def test_make_cache_errors_name_what_is_wrong(model):
    with pytest.raises(KeyError, match="available: chunked, full, sink_window"):
        make_cache(_bad_mode(), model.cfg.geometry)
    for mode in COMPRESSING:
        with pytest.raises(ValueError, match="window"):
            make_cache(KVConfig(mode), model.cfg.geometry)
    with pytest.raises(ValueError, match="raw slots"):
        make_cache(KVConfig.of(KVMode.CHUNKED, window=30, chunk=4, capacity=64, max_chunks=32), model.cfg.geometry)


def _bad_mode() -> KVConfig:
    cfg = KVConfig()
    cfg.mode = "paged"  # bypasses __post_init__, as a hand-edited object would
    return cfg




def test_kv_config_reads_every_yaml_spelling_it_ever_wrote():
    """The flat form of configs written before the registry (every cache's keys), today's and errors."""
    legacy = {"mode": "chunked", "capacity": None, "window": 48, "n_sink": 4, "chunk": 16, "max_chunks": None,
              "aggregator_hidden": 64, "gate_hidden": 32, "backend": "auto"}  # fmt: skip
    assert KVConfig.from_dict(legacy) == KVConfig.of(KVMode.CHUNKED, window=48)
    legacy_full = {**legacy, "mode": "full", "window": None, "capacity": 90}
    assert KVConfig.from_dict(legacy_full) == KVConfig.of(KVMode.FULL, capacity=90)
    with pytest.raises(ValueError, match="`n_sink` \\(2\\) is a parameter of sink_window, not of mode 'chunked'"):
        KVConfig.from_dict({**legacy, "n_sink": 2})
    with pytest.raises(ValueError, match="unknown KVConfig field\\(s\\) \\['paging'\\]"):
        KVConfig.from_dict({"mode": "full", "paging": 1})
    with pytest.raises(ValueError, match="`mode` is 'paged'; expected one of full, sink_window, chunked"):
        KVConfig.from_dict({"mode": "paged"})
    with pytest.raises(ValueError, match="takes ChunkedGatedParams params, got FullParams"):
        KVConfig(KVMode.CHUNKED, FullParams())
    base = KVConfig.of(KVMode.CHUNKED, chunk=8)  # a default overridden key by key (FinetuneConfig's kv)
    assert KVConfig.from_dict({"window": 4}, base=base) == KVConfig.of(KVMode.CHUNKED, chunk=8, window=4)
    assert KVConfig.from_dict({"mode": "full"}, base=base) == KVConfig(KVMode.FULL)


def test_sessions_fill_in_sizes_each_cache_has():
    step = 37
    assert KVConfig(KVMode.FULL).for_step(step, whole_context=False) == KVConfig(KVMode.FULL)
    assert KVConfig(KVMode.FULL).for_step(step, whole_context=True).params.capacity == step
    chunked = KVConfig.of(KVMode.CHUNKED, window=5).for_step(step, whole_context=True)
    assert (chunked.params.window, chunked.params.capacity) == (5, step)
    assert KVConfig(KVMode.SINK_WINDOW).for_step(step, whole_context=False).params.window == step


def test_only_the_chunked_cache_asks_for_a_gate(model):
    geometry = model.cfg.geometry
    gated = {mode for mode in KVMode if KVConfig(mode).gate_config(geometry) is not None}
    assert gated == {KVMode.CHUNKED}
    g = KVConfig.of(KVMode.CHUNKED, chunk=8, gate_hidden=12).gate_config(geometry)
    assert (g.n_layers, g.head_dim, g.chunk, g.gate_hidden) == (2, 16, 8, 12)


def test_the_cli_offers_exactly_the_registered_caches():
    import argparse

    parser = argparse.ArgumentParser()
    register_eval(parser.add_subparsers())
    (eval_parser,) = parser._subparsers._group_actions[0].choices.values()
    (kv_flag,) = [a for a in eval_parser._actions if "--kv" in a.option_strings]
    assert tuple(kv_flag.choices) == tuple(CACHES)


def test_a_cache_class_must_name_its_params():
    with pytest.raises(TypeError, match="Nameless must set `params_class` to its CacheParams dataclass"):
        type("Nameless", (SlotCache,), {})
    with pytest.raises(TypeError, match="must set `params_class`"):
        type("Stringly", (SlotCache,), {"params_class": "chunked"})


def test_kv_never_imports_the_models():
    """DESIGN §1: ``kv`` knows a ``CacheGeometry``, not the models (TYPE_CHECKING imports included)."""
    offenders = []
    for path in sorted(Path(vla_runtime.kv.__file__).parent.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
                if node.level >= 2 and (node.module or "").startswith("models"):
                    offenders.append(f"{path.name}: from {'.' * node.level}{node.module}")
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            offenders += [f"{path.name}: {n}" for n in names if n.startswith("vla_runtime.models")]
    assert offenders == []


def test_full_cache_can_be_filled_from_outside(model):
    """KEEP's prefill writes a prompt's K/V itself (``buffers``) and then ``hold``s it."""
    x, bounds = episode(2)
    ref = full_cache(model)
    run_stream(model, ref, x, bounds)
    n = x.shape[1]
    filled = FullCache(model.cfg.geometry, FullParams(capacity=n + 4))
    k, v = filled.buffers(n)
    k_ref, v_ref = ref.buffers(n)
    k.copy_(k_ref)
    v.copy_(v_ref)
    filled.hold(n)
    assert filled.stats() == ref.stats()
    step = torch.randn(1, 3, model.cfg.dim)
    with torch.no_grad():
        torch.testing.assert_close(model(inputs_embeds=step, cache=filled), model(inputs_embeds=step, cache=ref), atol=0, rtol=0)
    with pytest.raises(ValueError, match="holds 0..24 tokens, asked to hold 25"):
        FullCache(model.cfg.geometry, FullParams(capacity=24)).hold(25)
