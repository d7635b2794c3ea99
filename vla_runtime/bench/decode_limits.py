"""What separates a decode forward from reading its weights once: each decode row's weight-bandwidth limit (the
bytes of layer weights one token reads over the device's measured copy bandwidth) and, under ``torch.profiler``,
its wall time against its device kernels' time (``benchmarks/bench_fast.py``, issue 21's GPU target)."""

from __future__ import annotations

import argparse
import re
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from ..device import synchronize
from .harness import time_ms


@dataclass
class Group:
    """One geometry's question: ``calls`` by variant name (the first is the eager baseline), the seconds each
    variant's preparation took (compilation, quantisation) and how its output compared with eager's."""

    name: str
    calls: dict[str, Callable[[], object]]
    setup_s: dict[str, float]
    agreement: dict[str, dict]
    weight_bytes: dict[str, int] | None = None  # decode groups: decoder-layer weight bytes one token reads, per variant


def copy_bandwidth(device: torch.device, mib: int, repeats: int = 10) -> float:
    """Bytes per second a device-to-device copy of ``mib`` MiB moves (read + write counted), median of ``repeats``."""
    src = torch.empty(mib * 2**20, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    times = time_ms(lambda: dst.copy_(src), repeats=repeats, warmup=2, device=device)
    return 2 * src.numel() / (float(np.median(times)) / 1e3)


def bandwidth_limits(groups: list[Group], results: dict, bandwidth: float) -> dict[str, dict]:
    """Per decode row: the layer weights one token reads, the time reading them once takes at ``bandwidth``
    (bytes/s), and the measured median against it (``x_limit``)."""
    limits = {}
    for group in groups:
        for variant, nbytes in (group.weight_bytes or {}).items():
            row = f"{group.name}: {variant}"
            limit_ms = nbytes / bandwidth * 1e3
            limits[row] = {"weight_bytes": nbytes, "limit_ms": limit_ms, "x_limit": results[row]["median_ms"] / limit_ms}
    return limits


GEMM_KERNEL = re.compile(r"gemm|gemv|cutlass|xmma|nvjet|splitKreduce", re.IGNORECASE)  # cuBLAS / CUTLASS kernel names


def is_gemm_kernel(name: str) -> bool:
    """Whether a device kernel's name is a matrix multiply's (cuBLAS, cuBLASLt, CUTLASS): the part of a decode
    that reads the weights. The rest (norms, RoPE, attention, cache writes, copies) is what fusing would cut."""
    return bool(GEMM_KERNEL.search(name))


def profile_decode_rows(groups: list[Group], args: argparse.Namespace) -> tuple[dict[str, dict], str]:
    """``--profile N`` calls of every decode row under ``torch.profiler`` -> per row the wall time, the summed
    kernel time on the device and the kernels per call (the gap between wall and kernel time is host work and
    launch gaps: what separates a decode from its weight-bandwidth limit), and the top ops' table."""
    cuda = args.device.type == "cuda"
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    rows, tables = {}, []
    for group in groups:
        for variant, call in (group.calls.items() if group.weight_bytes is not None else ()):
            row = f"{group.name}: {variant}"
            call()
            synchronize(args.device)
            with profile(activities=activities) as prof:
                start = time.perf_counter()
                for _ in range(args.profile):
                    call()
                synchronize(args.device)
                wall_s = time.perf_counter() - start
            kernels = [e for e in prof.key_averages() if e.device_type == DeviceType.CUDA]
            gemm_us = sum(e.device_time_total for e in kernels if is_gemm_kernel(e.key))
            rows[row] = {"wall_ms": wall_s * 1e3 / args.profile,
                         "kernel_ms": sum(e.device_time_total for e in kernels) / 1e3 / args.profile,
                         "gemm_ms": gemm_us / 1e3 / args.profile,
                         "kernels_per_call": sum(e.count for e in kernels) / args.profile}  # fmt: skip
            sort = "self_device_time_total" if cuda else "self_cpu_time_total"
            tables.append(f"## {row}\n{prof.key_averages().table(sort_by=sort, row_limit=15)}")
    return rows, "\n\n".join(tables)
