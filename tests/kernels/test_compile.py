"""The Triton kernels compile for real GPUs without one: sm_90 (H100) and sm_80 (A100) builds, no spills.

The interpreter runs kernels as numpy and checks neither what the GPU compiler accepts (dot operand types,
libdevice calls) nor register pressure. Triton's wheel ships ``ptxas``, so each launch configuration
``plan_launch`` can pick is compiled here to a cubin and its resource usage read with the bundled
``cuobjdump``: a stack frame means registers spilled to local memory, which would make the memory-bound
decode kernel several times slower.
"""

from __future__ import annotations

import re
import subprocess
import tempfile
from pathlib import Path

import pytest
import torch

triton = pytest.importorskip("triton")
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from vla_kernels.attention import _attention_kernel, _combine_kernel, plan_launch  # noqa: E402
from vla_kernels.capability import interpreted  # noqa: E402
from vla_kernels.checks import AttentionDims  # noqa: E402
from vla_kernels.rope import _rope_kernel  # noqa: E402

BIN = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
pytestmark = [
    pytest.mark.skipif(interpreted(_attention_kernel), reason="kernels are interpreted in this process"),
    pytest.mark.skipif(not (BIN / "ptxas").exists() or not (BIN / "cuobjdump").exists(), reason="no ptxas in triton"),
]
TYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


def _resources(kernel, signature: dict, constexprs: dict, aligned: list[str], *, cc: int, **options) -> dict:
    """Compile ``kernel`` for compute capability ``cc`` and return cuobjdump's REG/STACK/SHARED numbers."""
    names = kernel.arg_names
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}  # what a launch specialises on
    sig = {**signature, **{k: "constexpr" for k in constexprs}}
    src = ASTSource(fn=kernel, signature=sig, constexprs=constexprs, attrs=attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", cc, 32), options=options)
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "k.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        usage = subprocess.run([str(BIN / "cuobjdump"), "--dump-resource-usage", str(cubin)],
                               capture_output=True, text=True, check=True).stdout
    return {k: int(v) for k, v in re.findall(r"(REG|STACK|SHARED):(\d+)", usage)}


def _attention_resources(dims: AttentionDims, dtype: torch.dtype, *, cc: int, splits: int | None) -> dict:
    plan = plan_launch(dims, torch.device("cpu"), dtype, num_splits=splits)
    ptr = "*" + TYPES[dtype]
    strides = ["stride_qb", "stride_qh", "stride_qt", "stride_kb", "stride_kh", "stride_ks",
               "stride_vb", "stride_vh", "stride_vs"]
    signature = {"Q": ptr, "K": ptr, "V": ptr, "SLOTS": "*i32", "KV_POS": "*i32", "Q_POS": "*i32",
                 "INV_FREQ": "*fp32", "OUT": "*fp32" if plan.splits > 1 else ptr, "LSE": "*fp32",
                 **{s: "i32" for s in strides},
                 "n_kv_heads": "i32", "n_tokens": "i32", "n_keys": "i32", "keys_per_split": "i32", "qk_scale": "fp32"}
    constexprs = dict(GROUP=dims.group, HALF=dims.head_dim // 2, BLOCK_M=plan.block_m, BLOCK_N=plan.block_n,
                      SPLIT=plan.splits > 1, DOT_F32=False,
                      PRECISION="ieee" if dtype == torch.float32 else "tf32", FAST_TRIG=True)
    aligned = ["Q", "K", "V", "SLOTS", "KV_POS", "Q_POS", "INV_FREQ", "OUT", "LSE", *strides]
    return _resources(_attention_kernel, signature, constexprs, aligned, cc=cc,
                      num_warps=plan.num_warps, num_stages=plan.num_stages)


# (name, dims, dtype, cc, forced splits): decode and prefill at both head dims, every dtype, both GPU generations;
# the float32 prefill tile is the one closest to spilling.
CONFIGS = [
    ("decode-gqa8-d128-bf16-sm90", AttentionDims(1, 32, 4, 1, 128, 32768, 32768), torch.bfloat16, 90, 8),
    ("decode-mha-d64-fp16-sm90", AttentionDims(1, 8, 8, 1, 64, 4096, 4096), torch.float16, 90, 4),
    ("prefill-gqa4-d128-bf16-sm90", AttentionDims(1, 32, 8, 256, 128, 4096, 4096), torch.bfloat16, 90, 1),
    ("prefill-32rows-d64-fp16-sm80", AttentionDims(1, 16, 4, 8, 64, 4096, 4096), torch.float16, 80, 1),
    ("prefill-d128-fp32-sm90", AttentionDims(1, 8, 8, 100, 128, 2048, 2048), torch.float32, 90, 1),
]  # every entry of attention.TILES was checked the same way on sm_80 and sm_90 when the table was written


@pytest.mark.parametrize("name,dims,dtype,cc,splits", CONFIGS, ids=[c[0] for c in CONFIGS])
def test_attention_kernel_compiles_without_spills(name, dims, dtype, cc, splits):
    res = _attention_resources(dims, dtype, cc=cc, splits=splits)
    assert res["STACK"] == 0, f"{name}: registers spill to local memory: {res}"
    assert res["REG"] <= 255, res


def test_combine_and_rope_kernels_compile():
    combine = _resources(
        _combine_kernel, {"PART": "*fp32", "LSE": "*fp32", "OUT": "*bf16", "n_rows": "i32", "n_splits": "i32"},
        dict(HEAD_DIM=128, SPLITS_P2=64), ["PART", "LSE", "OUT"], cc=90, num_warps=4, num_stages=1,
    )
    rope = _resources(
        _rope_kernel, {"X": "*bf16", "POS": "*i32", "INV_FREQ": "*fp32", "OUT": "*bf16", "stride_xb": "i32",
                       "stride_xh": "i32", "stride_xt": "i32", "n_heads": "i32", "n_tokens": "i32"},
        dict(HALF=64, BLOCK_T=64, FAST_TRIG=True), ["X", "POS", "INV_FREQ", "OUT", "stride_xb", "stride_xh", "stride_xt"],
        cc=90, num_warps=4, num_stages=1,
    )
    assert combine["STACK"] == 0 and rope["STACK"] == 0, (combine, rope)
