"""The KV benchmark runs end to end on tiny settings and reports consistent numbers."""

import json

from vla_runtime.bench.kv import main, step_flops
from vla_runtime.models.llama import LlamaConfig


def test_bench_kv_smoke(tmp_path, capsys):
    out = tmp_path / "bench_kv"
    argv = ["--parts", "layer", "e2e", "--layer-model", "tiny", "--lengths", "96", "160", "--frame", "16", "--decode", "2",
            "--prompt", "4", "--chunk", "4", "--repeats", "2", "--warmup", "0", "--threads", "1", "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    report = json.loads(out.with_suffix(".json").read_text())
    assert out.with_suffix(".png").stat().st_size > 0
    assert all(v == 0.0 for v in report["agreement"].values())  # window >= episode: identical to full
    results = report["results"]
    assert len(results) == 2 * 2 * 3
    for part in ("layer", "e2e"):
        for length in (96, 160):
            full, chunked, sink = (results[f"{part}/{m}/{length}"] for m in ("full", "chunked", "sink_window"))
            assert full["ratio"] == 1.0 and full["keys_held"] == length and len(full["times_ms"]) == 2
            assert chunked["keys_held"] < length and chunked["kv_bytes"] < full["kv_bytes"]
            assert chunked["bytes_ratio"] == full["kv_bytes"] / chunked["kv_bytes"]
            assert 0.2 < chunked["retained_ratio"] < 0.8  # the calibrated gate keeps about half
            assert chunked["flops_ratio"] > 1 and sink["flops_ratio"] > 1
    assert "chunked" in capsys.readouterr().out


def test_cost_model_counts_attention_over_the_keys_each_token_sees():
    cfg = LlamaConfig.from_name("tiny")
    one = step_flops(cfg, held=10, frame=1, decode=0)
    more = step_flops(cfg, held=11, frame=1, decode=0)
    assert more - one == cfg.n_layers * 4 * cfg.n_heads * cfg.head_dim  # one more key: QK + AV
    assert step_flops(cfg, held=10, frame=2, decode=0) == one + step_flops(cfg, held=11, frame=1, decode=0)
