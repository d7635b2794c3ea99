"""ChunkGate persistence: gates.safetensors + kv_config.json round trip and its error messages."""

import json

from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file, save_file

from vla_runtime.kv import ChunkedGatedCache, ChunkGate, ChunkGateConfig, has_gate, KVConfig, KVMode, load_gate, save_gate
from vla_runtime.kv.gate_io import GATE_CONFIG, GATE_WEIGHTS

from .cases import episode, run_stream, tiny_model


def trained_looking_gate(kv_cfg: KVConfig, model) -> ChunkGate:
    torch.manual_seed(3)
    gate = ChunkGate(replace(kv_cfg.gate_config(model.cfg.geometry), keep_margin=0.5))
    with torch.no_grad():
        for p in gate.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return gate


def test_state_dict_round_trip_restores_weights_config_and_outputs(tmp_path):
    model = tiny_model()
    kv_cfg = KVConfig.of(KVMode.CHUNKED, window=8, chunk=4, max_chunks=3, capacity=64, aggregator_hidden=24, gate_hidden=12)
    gate = trained_looking_gate(kv_cfg, model)
    save_gate(gate, tmp_path / "adapter", kv_cfg)
    assert has_gate(tmp_path / "adapter") and not has_gate(tmp_path)
    assert json.loads((tmp_path / "adapter" / GATE_CONFIG).read_text())["gate"]["gate_hidden"] == 12
    loaded, loaded_kv = load_gate(tmp_path / "adapter")
    assert loaded_kv == kv_cfg and loaded.cfg == gate.cfg
    for (name, a), (name_b, b) in zip(gate.state_dict().items(), loaded.state_dict().items()):
        assert name == name_b and torch.equal(a, b)
    x, bounds = episode(5)
    outs = [run_stream(model, ChunkedGatedCache(model.cfg.geometry, kv_cfg.params, gate=g), x, bounds) for g in (gate, loaded)]
    assert torch.equal(outs[0], outs[1])
    fresh = run_stream(model, ChunkedGatedCache(model.cfg.geometry, kv_cfg.params), x, bounds)
    assert not torch.allclose(fresh, outs[0])  # the saved gate really differs from the default


def test_missing_and_mismatched_files_are_clear_errors(tmp_path):
    model = tiny_model()
    kv_cfg = KVConfig.of(KVMode.CHUNKED, window=8, chunk=4)
    gate = ChunkGate(kv_cfg.gate_config(model.cfg.geometry))
    with pytest.raises(FileNotFoundError, match=GATE_WEIGHTS):
        load_gate(tmp_path)
    save_gate(gate, tmp_path, kv_cfg)
    tensors = load_file(str(tmp_path / GATE_WEIGHTS))
    tensors["tau"] = torch.zeros(5)
    del tensors["readout_bias"]
    save_file(tensors, str(tmp_path / GATE_WEIGHTS))
    with pytest.raises(ValueError, match=r"missing \['readout_bias'\].*tau: \(5,\) != \(2,\)"):
        load_gate(tmp_path)
    (tmp_path / GATE_CONFIG).write_text("{}")
    with pytest.raises(ValueError, match="expected keys 'kv' and 'gate'"):
        load_gate(tmp_path)


def test_a_gate_for_another_geometry_is_refused():
    model = tiny_model()
    kv_cfg = KVConfig.of(KVMode.CHUNKED, window=8, chunk=4)
    wrong = ChunkGate(ChunkGateConfig(n_layers=2, head_dim=16, chunk=8))
    with pytest.raises(ValueError, match="`chunk`=8 but the cache needs 4"):
        ChunkedGatedCache(model.cfg.geometry, kv_cfg.params, gate=wrong)
    with pytest.raises(ValueError, match="gate_hidden"):
        ChunkGateConfig(n_layers=2, head_dim=16, chunk=4, gate_hidden=0)
