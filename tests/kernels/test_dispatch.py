"""``attention_backend``: Triton on CUDA, torch reference elsewhere, config/env overrides, readable refusals."""

from __future__ import annotations

import logging

import pytest
import torch
from kernel_cases import CASES, assert_matches, make_inputs

import vla_kernels
from vla_kernels import BACKEND_ENV, attention_backend, supports, supports_config
from vla_kernels.capability import interpreter_active

CASE = CASES[3]  # prefill, GQA 4, batch 2


@pytest.fixture(autouse=True)
def _no_backend_env(monkeypatch):
    monkeypatch.delenv(BACKEND_ENV, raising=False)


def test_torch_backend_is_the_reference():
    backend = attention_backend("torch", "cpu", dtype=torch.float32, head_dim=64)
    inputs = make_inputs(CASE, torch.float32, "cpu")
    out = torch.empty_like(inputs["q"])
    assert backend.name == "torch"
    assert backend(**inputs, scale=0.2, out=out) is out
    torch.testing.assert_close(out, vla_kernels.chunked_attention_ref(**inputs, scale=0.2), atol=0, rtol=0)
    x = torch.randn(1, 2, 3, 64)
    pos = torch.tensor([5, 1, 9], dtype=torch.int32)
    assert not torch.equal(backend.rope(x, pos, inputs["inv_freq"]), x)


def test_auto_on_cpu_is_torch_and_quiet(caplog):
    if interpreter_active():
        pytest.skip("this process interprets Triton, which makes CPU a Triton device")
    with caplog.at_level(logging.WARNING, logger="vla_kernels"):
        assert attention_backend("auto", "cpu", dtype=torch.bfloat16, head_dim=128).name == "torch"
    assert caplog.records == []


def test_auto_falls_back_and_logs_every_reason_once(caplog):
    with caplog.at_level(logging.WARNING, logger="vla_kernels"):
        backend = attention_backend("auto", "cuda", dtype=torch.float64, head_dim=96)
    assert backend.name == "torch"
    assert len(caplog.records) == 1
    message = caplog.records[0].getMessage()
    assert "head dim 96 is not supported" in message and "dtype torch.float64 is not supported" in message


def test_forced_triton_where_it_cannot_run_raises_with_reasons():
    with pytest.raises(ValueError, match="head dim 80 is not supported") as err:
        attention_backend("triton", "cuda", dtype=torch.float16, head_dim=80)
    if not torch.cuda.is_available():
        assert "CUDA is not available" in str(err.value)


def test_environment_overrides_auto_but_not_an_explicit_config(monkeypatch):
    monkeypatch.setenv(BACKEND_ENV, "torch")
    assert attention_backend("auto", "cuda", dtype=torch.bfloat16, head_dim=128).name == "torch"
    monkeypatch.setenv(BACKEND_ENV, "triton")
    assert attention_backend("torch", "cuda", dtype=torch.bfloat16, head_dim=128).name == "torch"
    if not torch.cuda.is_available() and not interpreter_active():
        with pytest.raises(ValueError, match="cannot run on cpu"):
            attention_backend("auto", "cpu", dtype=torch.float32, head_dim=64)


def test_unknown_names_list_the_valid_ones(monkeypatch):
    with pytest.raises(KeyError, match="'cuda' from the config; available: auto, torch, triton"):
        attention_backend("cuda", "cpu", dtype=torch.float32, head_dim=64)
    monkeypatch.setenv(BACKEND_ENV, "flash")
    with pytest.raises(KeyError, match=rf"'flash' from \${BACKEND_ENV}"):
        attention_backend("auto", "cpu", dtype=torch.float32, head_dim=64)


def test_supports_lists_reasons_for_tensors(monkeypatch):
    inputs = make_inputs(CASE, torch.float32, "cpu")
    strided = dict(inputs, k_store=inputs["k_store"].transpose(-1, -2).contiguous().transpose(-1, -2))
    reasons = supports(**strided)
    assert any("`k_store` has a non-contiguous last dimension" in r for r in reasons)
    if not interpreter_active():
        assert any("tensors are on cpu" in r for r in reasons)
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    assert "triton is not installed" in supports_config("cuda", torch.float16, 64)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_auto_on_cuda_runs_triton_and_matches_reference():
    backend = attention_backend("auto", "cuda", dtype=torch.bfloat16, head_dim=64)
    assert backend.name == "triton" and supports_config("cuda", torch.bfloat16, 64) == []
    inputs = make_inputs(CASE, torch.bfloat16, "cuda")
    assert_matches(backend(**inputs), vla_kernels.chunked_attention_ref(**inputs))
