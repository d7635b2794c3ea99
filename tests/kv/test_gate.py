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


def loop_lstm_scores(gate: ChunkGate, k_rep, v_rep, state):
    """The gate's recurrence written out chunk by chunk (all layers): [L, B, Hkv, n, D] -> scores [L, B, n], (h, c)."""
    h, c = state
    n_l, b, hkv, n, _ = k_rep.shape
    x = torch.cat((k_rep, v_rep), dim=-1).permute(0, 3, 1, 2, 4).reshape(n_l, n, b * hkv, -1)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    hs = []
    for j in range(n):
        z = x[:, j] @ gate.lstm_weight_ih + gate.lstm_bias[:, None] + h @ gate.lstm_weight_hh
        i, f, g, o = z.chunk(4, dim=-1)
        c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
        h = torch.sigmoid(o) * torch.tanh(c)
        hs.append(h)
    per_head = (torch.stack(hs, 1) * gate.readout_weight[:, None, None]).sum(-1).view(n_l, n, b, hkv)
    return (gate.readout_bias[:, None, None] + per_head.mean(-1)).transpose(1, 2), (h, c)


def test_fused_lstm_scores_equal_the_chunk_by_chunk_recurrence_with_gradients():
    cfg = ChunkGateConfig(n_layers=3, head_dim=8, chunk=4, gate_hidden=6)
    torch.manual_seed(0)
    gate = ChunkGate(cfg).double()
    with torch.no_grad():
        gate.readout_weight.normal_()
    k = torch.randn(3, 2, 2, 5, 8, dtype=torch.float64, requires_grad=True)  # [L, B, Hkv, n, D]
    v = torch.randn(3, 2, 2, 5, 8, dtype=torch.float64, requires_grad=True)
    start = tuple(torch.randn(3, 4, 6, dtype=torch.float64) for _ in range(2))
    got, (h, c) = gate.score(k, v, start)
    ref, (h_ref, c_ref) = loop_lstm_scores(gate, k, v, start)
    torch.testing.assert_close(got, ref)
    torch.testing.assert_close(h, h_ref)
    torch.testing.assert_close(c, c_ref)
    weights = torch.randn_like(got)  # a random weighting of the scores, the same for both
    g1 = torch.autograd.grad((gate.score(k, v, start)[0] * weights).sum(), [k, gate.lstm_weight_ih, gate.lstm_bias])
    g2 = torch.autograd.grad((loop_lstm_scores(gate, k, v, start)[0] * weights).sum(), [k, gate.lstm_weight_ih, gate.lstm_bias])
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b)
    # one layer at a time, and chunks fed in two parts carrying the state, give the same scores
    one, _ = gate.score(k[1], v[1], (start[0][1], start[1][1]), layers=1)
    torch.testing.assert_close(one, ref[1])
    first, mid = gate.score(k[:, :, :, :2], v[:, :, :, :2], start)
    rest, _ = gate.score(k[:, :, :, 2:], v[:, :, :, 2:], mid)
    torch.testing.assert_close(torch.cat((first, rest), -1), ref)
    empty, same = gate.score(k[:, :, :, :0], v[:, :, :, :0], start)  # no chunks: no scores, state unchanged
    assert empty.shape == (3, 2, 0) and torch.equal(same[0], start[0])
