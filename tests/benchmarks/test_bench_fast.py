"""bench_fast.py keeps working: compiled decodes the eager tokens (its pre-timing check), and its JSON record holds
every variant of both questions against its own eager row, with the fused and quantized models' agreement and
weight bytes
(timings and agreement values themselves are not asserted)."""

import json
import sys

import pytest
import torch

from vla_runtime.bench.decode_limits import is_gemm_kernel
from vla_runtime.bench.registry import get_benchmark


@pytest.mark.slow
def test_bench_fast_small_geometry_writes_every_variant(tmp_path):
    threads = torch.get_num_threads()
    argv = ["--geometry", "small", "--repeats", "2", "--warmup", "1", "--agreement-steps", "2", "--bandwidth-mib", "8",
            "--profile", "2", "--out", str(tmp_path / "new" / "b")]  # a folder that does not exist yet
    assert get_benchmark("fast").run(argv) == 0  # what `vla-runtime bench fast` runs
    bench = sys.modules["bench_fast"]
    assert torch.get_num_threads() == threads
    tmp_path = tmp_path / "new"
    record = json.loads((tmp_path / "b.json").read_text())
    results = record["results"]
    quantized = ["weight-only int8", "weight-only int4"]  # the default --quantized rows
    changed = [bench.FUSED, *quantized]  # and --fused; --prepacked has nothing to pack in the tiny model
    assert set(results) == {f"small step: {v}" for v in [bench.EAGER, bench.COMPILED, *changed]} | {
        f"small decode: {v}"
        for v in [bench.EAGER, bench.COMPILED, bench.GUARDED, *changed, *(f"{q} + compiled" for q in changed)]
    }
    for name, r in results.items():
        assert r["baseline"] == f"{name.split(':')[0]}: {bench.EAGER}" and len(r["times_ms"]) == 2
    step = record["agreement"]["small step"]
    assert step[bench.COMPILED]["tokens_equal"] is True
    for q in quantized:
        assert 0 <= step[q]["identical_tokens"] <= 1 and step[q]["steps"] == 2
        assert step[q]["llm_layer_bytes"] < step[q]["float_llm_layer_bytes"] / 3
    fused = step[bench.FUSED]  # the same weights, concatenated: the same bytes and (up to rounding) the same tokens
    assert fused["llm_layer_bytes"] == fused["float_llm_layer_bytes"] and fused["identical_tokens"] > 0.9
    limits = record["weight_bandwidth_limits"]
    assert set(limits) == {name for name in results if name.startswith("small decode")}  # every decode row, no step row
    assert record["copy_bandwidth_bytes_per_s"] > 0 and all(v["x_limit"] > 0 for v in limits.values())
    assert limits["small decode: weight-only int8"]["weight_bytes"] < limits["small decode: eager"]["weight_bytes"] / 3
    profiled = record["profile"]  # --profile: every decode row, wall time per call; no device kernels on a CPU
    assert set(profiled) == set(limits) and all(p["wall_ms"] > 0 and p["kernels_per_call"] == p["gemm_ms"] == 0 for p in profiled.values())
    assert "## small decode: compiled\n" in (tmp_path / "b.profile.txt").read_text()


@pytest.mark.slow
@pytest.mark.parametrize("family", ["cogact", "hybridvla", "oft"])
def test_bench_fast_family_geometries_time_eager_compiled_fused_and_quantized_steps(tmp_path, family):
    argv = ["--geometry", family, "--repeats", "2", "--warmup", "1", "--bandwidth-mib", "8", "--out", str(tmp_path / "c")]
    assert get_benchmark("fast").run(argv) == 0
    bench = sys.modules["bench_fast"]
    record = json.loads((tmp_path / "c.json").read_text())
    rows = (bench.EAGER, bench.COMPILED, bench.FUSED, "weight-only int8", "weight-only int4")  # nothing to prepack
    assert set(record["results"]) == {f"{family} step: {v}" for v in rows}
    agreement = record["agreement"][f"{family} step"]
    assert agreement[bench.COMPILED]["max_abs_action_diff"] <= 1e-3 and agreement[bench.FUSED]["max_abs_action_diff"] <= 1e-4
    assert record["weight_bandwidth_limits"] == {}  # step rows only


def _bench_fast():
    return get_benchmark("fast").load_script()  # benchmarks/bench_fast.py as a module


def test_bench_fast_device_defaults_and_the_weight_bandwidth_limit():
    bench = _bench_fast()
    args = bench.parse_args([])
    assert (args.device.type, args.dtype, args.compile_mode.value) == ("cpu", torch.float32, "default")
    assert list(bench.weight_variants(args)) == [bench.FUSED, "weight-only int8", "weight-only int4", bench.PREPACKED]
    assert bench.PREPACKED not in bench.weight_variants(bench.parse_args(["--dtype", "bfloat16"]))  # float32 CPU only
    with pytest.raises(SystemExit, match="prepacking is for float32 on the CPU"):
        bench.parse_args(["--prepacked", "--dtype", "bfloat16"])
    assert bench.weight_variants(bench.parse_args(["--quantized", "--no-fused", "--no-prepacked"])) == {}  # eager, compiled
    assert bench.weight_variants(bench.parse_args(["--quantized", "int4", "--no-fused", "--no-prepacked"])) == {
        "weight-only int4": {"quantize": bench.QUANT_MODES["int4"]}}
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="torch sees no CUDA device"):
            bench.parse_args(["--device", "cuda"])
    group = bench.Group("g decode", {}, {}, {}, weight_bytes={"eager": 2_000_000, "weight-only int8": 500_000})
    results = {"g decode: eager": {"median_ms": 4.0}, "g decode: weight-only int8": {"median_ms": 2.0}}
    limits = bench.bandwidth_limits([group], results, bandwidth=1e9)  # 1 GB/s: 2 MB read once takes 2 ms
    assert limits["g decode: eager"] == {"weight_bytes": 2_000_000, "limit_ms": pytest.approx(2.0), "x_limit": pytest.approx(2.0)}
    assert limits["g decode: weight-only int8"]["x_limit"] == pytest.approx(4.0)
    assert bench.copy_bandwidth(torch.device("cpu"), mib=4, repeats=3) > 1e6  # bytes/s of a real copy


def test_the_profile_tells_matrix_multiply_kernels_from_the_rest():
    """``--profile`` on CUDA splits the kernel time into GEMMs (the weights' reads) and the rest, by kernel name."""
    gemms = ["sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize64x64x64", "void gemv2T_kernel_val<int, int, __nv_bfloat16>",
             "nvjet_hsh_64x32_64x16_4x1_v_bz_splitK_TNT", "void splitKreduce_kernel<32, 16, int, float>", "cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm_relu>"]
    others = ["triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0", "void at::native::elementwise_kernel<128, 2>",
              "flash_fwd_splitkv_kernel", "void at::native::(anonymous namespace)::indexFuncLargeIndex<float>"]
    assert all(is_gemm_kernel(n) for n in gemms)
    assert not any(is_gemm_kernel(n) for n in others)


def test_guards_stay_skipped_only_where_each_compiled_model_still_runs_its_own_graph(capsys):
    """On the GPU image's torch 2.11 a bf16 model's decode, called with its guards skipped, ran the fused model's
    graph (``KeyError: 'qkv_proj'``): the bench then evaluates every guard instead, and says why."""
    bench = _bench_fast()
    steady = lambda: torch.ones(2)  # noqa: E731
    assert bench.guards_tell_models_apart({"compiled": steady, "fused + compiled": steady})

    guarded_then_skipped = iter([torch.ones(2)])

    def another_models_graph():  # its own graph with every guard; with guards skipped another's, which fails
        out = next(guarded_then_skipped, None)
        if out is None:
            raise KeyError("qkv_proj")
        return out

    assert not bench.guards_tell_models_apart({"compiled": steady, "fused + compiled": another_models_graph})
    assert "fused + compiled: with guards skipped it ran another model's graph (KeyError('qkv_proj'))" in capsys.readouterr().out
    outputs = iter([torch.ones(2), torch.zeros(2)])  # guarded, then skipped: another model's output
    assert not bench.guards_tell_models_apart({"compiled": lambda: next(outputs)})
    assert "returned another model's output" in capsys.readouterr().out
