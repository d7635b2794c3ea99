"""Shared inputs for the kernel tests: cache-shaped slot lists, awkward shapes, tolerances, devices.

A case lays out one store the way the chunked cache does: pinned prefix, retained chunk representatives,
raw tokens and the new tokens themselves, at random slots of a store that also holds unlisted slots (dropped
chunks, free ring slots). Unlisted slots hold NaN, so a kernel that reads a slot it was not given fails.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from vla_kernels.capability import interpreter_active

LAYOUTS = ("compact", "gaps", "shuffled", "renumbered", "blind")
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
# (atol, rtol) of kernel vs reference; the reference itself rounds in the storage dtype.
TOLERANCES = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (2e-2, 2e-2)}


@dataclass(frozen=True)
class AttnCase:
    """One attention call. Keys in attention order: ``prefix`` pinned, ``chunks`` retained, ``raw``, then the
    ``tokens`` new ones; ``slack`` store slots are listed nowhere.

    layout: ``compact`` positions 0..N-1 in order; ``gaps`` increasing with random gaps (original positions
    kept); ``shuffled`` compact positions, but the list permuted (neither slots nor positions ordered);
    ``renumbered`` compact shifted by 3000 (large angles); ``blind`` compact from 10, the first query at
    position 3 sees no key.
    """

    name: str
    q_heads: int
    kv_heads: int
    tokens: int
    head_dim: int
    prefix: int
    chunks: int
    raw: int
    batch: int = 1
    slack: int = 7
    layout: str = "compact"

    @property
    def keys(self) -> int:
        return self.prefix + self.chunks + self.raw + self.tokens


CASES = [
    AttnCase("decode-mha-d64", q_heads=2, kv_heads=2, tokens=1, head_dim=64, prefix=5, chunks=3, raw=20),
    AttnCase("decode-gqa4-d128-no-chunks", q_heads=8, kv_heads=2, tokens=1, head_dim=128, prefix=7, chunks=0, raw=40),
    AttnCase("decode-gqa8-d64-3-tiles", q_heads=8, kv_heads=1, tokens=1, head_dim=64, prefix=4, chunks=9, raw=150),
    AttnCase("prefill-gqa4-d64-b2", q_heads=4, kv_heads=1, tokens=13, head_dim=64, prefix=3, chunks=2, raw=17, batch=2),
    AttnCase("prefill-mha-d128-no-prefix", q_heads=2, kv_heads=2, tokens=19, head_dim=128, prefix=0, chunks=4, raw=9),
    AttnCase("prefill-gqa8-d128-no-raw", q_heads=8, kv_heads=1, tokens=9, head_dim=128, prefix=5, chunks=1, raw=0),
    AttnCase("gaps-gqa4-d64", q_heads=4, kv_heads=1, tokens=3, head_dim=64, prefix=6, chunks=5, raw=11, layout="gaps"),
    AttnCase("shuffled-mha-d128", q_heads=1, kv_heads=1, tokens=5, head_dim=128, prefix=4, chunks=6, raw=30,
             layout="shuffled"),
    AttnCase("renumbered-gqa8-d64", q_heads=8, kv_heads=1, tokens=2, head_dim=64, prefix=3, chunks=7, raw=21,
             layout="renumbered"),
    AttnCase("blind-query-gqa4-d128", q_heads=4, kv_heads=1, tokens=4, head_dim=128, prefix=2, chunks=2, raw=6,
             layout="blind"),
    AttnCase("first-forward-only-new-tokens", q_heads=4, kv_heads=2, tokens=6, head_dim=64, prefix=0, chunks=0, raw=0),
]


def make_inputs(case: AttnCase, dtype: torch.dtype, device: str, *, seed: int = 0) -> dict:
    """Tensors for ``chunked_attention(**inputs)``; unlisted store slots are NaN."""
    gen = torch.Generator().manual_seed(seed)
    n, t, d = case.keys, case.tokens, case.head_dim
    slots_total = n + case.slack
    k = torch.randn(case.batch, case.kv_heads, slots_total, d, generator=gen)
    v = torch.randn(case.batch, case.kv_heads, slots_total, d, generator=gen)
    q = torch.randn(case.batch, case.q_heads, t, d, generator=gen)
    slots = torch.randperm(slots_total, generator=gen)[:n]
    pos = torch.arange(n)
    if case.layout == "gaps":
        pos = torch.cumsum(torch.randint(1, 6, (n,), generator=gen), 0)
    elif case.layout == "renumbered":
        pos = pos + 3000
    elif case.layout == "blind":
        pos = pos + 10
    q_pos = pos[n - t:].clone()  # the new tokens are the last listed keys
    if case.layout == "blind":
        q_pos[0] = 3
    if case.layout == "shuffled":
        order = torch.randperm(n, generator=gen)
        slots, pos = slots[order], pos[order]
    unlisted = torch.ones(slots_total, dtype=torch.bool)
    unlisted[slots] = False
    k[:, :, unlisted] = float("nan")
    v[:, :, unlisted] = float("nan")
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    as_dev = dict(device=device)
    return dict(
        q=q.to(dtype=dtype, **as_dev), k_store=k.to(dtype=dtype, **as_dev), v_store=v.to(dtype=dtype, **as_dev),
        kv_slots=slots.to(torch.int32).to(**as_dev), kv_pos=pos.to(torch.int32).to(**as_dev),
        q_pos=q_pos.to(torch.int32).to(**as_dev), inv_freq=inv_freq.to(**as_dev),
    )


def assert_matches(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Same dtype/shape, all finite, equal within the dtype's tolerance."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    assert torch.isfinite(actual).all(), "non-finite output"
    atol, rtol = TOLERANCES[expected.dtype]
    torch.testing.assert_close(actual.float().cpu(), expected.float().cpu(), atol=atol, rtol=rtol)


def kernel_devices() -> list:
    """Devices the Triton kernels can be tested on in this process; skips the calling module if none.

    ``cpu`` when Triton runs interpreted here (``TRITON_INTERPRET=1`` from the start: ``test_interpreter.py``
    runs the kernel modules that way in a child process); ``cuda`` (marked ``gpu``) when CUDA is available.
    """
    devices = []
    if interpreter_active():
        devices.append("cpu")
    if torch.cuda.is_available():
        devices.append(pytest.param("cuda", marks=pytest.mark.gpu))
    if not devices:
        pytest.skip(
            "no CUDA, and Triton is not interpreted in this process: tests/kernels/test_interpreter.py runs this "
            "module under TRITON_INTERPRET=1 in a child process",
            allow_module_level=True,
        )
    return devices
