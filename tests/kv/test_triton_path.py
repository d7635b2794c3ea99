"""The decoupled caches through ``vla_kernels.chunked_attention`` (Triton) equal their torch path.

Natively on CUDA. On CPU, ``test_kernel_path_under_triton_interpreter`` reruns this module in a child
process with ``TRITON_INTERPRET=1`` set from its start (Triton decides interpreted vs compiled when it is
first imported, see tests/kernels/test_interpreter.py), where the kernel runs in Triton's interpreter.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from vla_runtime.kv import ChunkGate, KVConfig, KVMode, make_cache
from vla_runtime.kv.chunked_parallel import step_boundaries
from vla_runtime.kv.rope import RopeConfig
from vla_runtime.models.llama import LlamaConfig, LlamaForCausalLM

from .cases import COMPRESSING, run_stream

ROOT = Path(__file__).resolve().parents[2]
SIZES = {KVMode.CHUNKED: dict(window=4, chunk=2, max_chunks=3, capacity=40), KVMode.SINK_WINDOW: dict(window=5, n_sink=1, capacity=40)}


def kernel_device() -> str | None:
    if torch.cuda.is_available():
        return "cuda"
    from vla_kernels.capability import interpreter_active

    return "cpu" if interpreter_active() else None


@pytest.mark.parametrize("mode", COMPRESSING)
def test_kernel_path_equals_torch_path(mode):
    device = kernel_device()
    if device is None:
        pytest.skip("needs CUDA or TRITON_INTERPRET=1 (test_kernel_path_under_triton_interpreter runs it)")
    # head dim 64: the kernels support 64 and 128; a 2-head toy keeps the interpreter fast
    cfg = LlamaConfig.from_name("tiny", dim=128, n_heads=2, n_kv_heads=1, head_dim=64, rope=RopeConfig(head_dim=64), vocab_size=512)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(device).eval()
    bounds = step_boundaries(3, [6] * 3, 2)
    x = torch.randn(1, sum(bounds), cfg.dim, device=device)
    outs = []
    for backend in ("torch", "triton"):
        kv_cfg = KVConfig.of(mode, backend=backend, **SIZES[mode])
        extra = {}
        gate_cfg = kv_cfg.gate_config(cfg.geometry)
        if gate_cfg is not None:
            torch.manual_seed(1)
            extra["gate"] = gate = ChunkGate(gate_cfg).to(device)
            with torch.no_grad():  # some chunks dropped, some evicted
                gate.readout_weight.normal_(0.0, 3.0)
                gate.readout_bias.zero_()
        cache = make_cache(kv_cfg, cfg.geometry, device=device, **extra)
        assert cache.backend.name == backend
        outs.append(run_stream(model, cache, x, bounds, pinned=3))
    torch.testing.assert_close(outs[1], outs[0], atol=1e-4, rtol=1e-4)


def test_triton_backend_where_it_cannot_run_is_a_clear_error():
    if kernel_device() is not None:
        pytest.skip("the kernels can run here")
    cfg = LlamaConfig.from_name("tiny")
    with pytest.raises(ValueError, match="'triton' cannot run"):
        make_cache(KVConfig.of(KVMode.CHUNKED, window=8, backend="triton"), cfg.geometry)


def test_kernel_path_under_triton_interpreter():
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") or torch.cuda.is_available():
        pytest.skip("this process runs the kernel path itself")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", "-k", "equals_torch_path", __file__]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    report = proc.stdout[-4000:] + proc.stderr[-2000:]
    assert proc.returncode == 0, f"interpreter run failed:\n{report}"
    passed = re.search(r"(\d+) passed", proc.stdout)
    assert passed and int(passed.group(1)) == len(COMPRESSING), f"the kernel-path tests did not run:\n{report}"
