"""Device and dtype resolution at the API boundary (strings -> torch objects, once).

Defaults (DESIGN §8): CUDA when available, else CPU; bfloat16 on CUDA, float32 on CPU (bf16 matmuls
are several times slower on CPUs).
"""

from __future__ import annotations

import torch

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def resolve_device(device: str | torch.device | None = None) -> torch.device:
    """``None`` -> ``cuda`` if available, else ``cpu``. ``"cuda"`` without CUDA raises ``ValueError``."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError as e:
        raise ValueError(f"device {device!r} is not a torch device (e.g. cpu, cuda, cuda:1)") from e
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} requested but CUDA is not available; use device='cpu'")
    return dev


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """``None`` -> bfloat16 on CUDA, float32 elsewhere; strings from ``DTYPES``."""
    if dtype is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise KeyError(f"unknown dtype {dtype!r}; known: {', '.join(sorted(DTYPES))}")
    return DTYPES[dtype]


def synchronize(device: torch.device) -> None:
    """Wait for queued kernels (timings); a no-op on CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def set_cpu_threads(threads: int) -> None:
    """Torch's intra-op CPU threads for this process (0: leave torch's default, all cores)."""
    if threads < 0:
        raise ValueError(f"threads must be >= 0 (0 = torch's default), got {threads}")
    if threads:
        torch.set_num_threads(threads)


def release_cached_memory() -> None:
    """Hand the CUDA caching allocator's free blocks back to the driver (after a model is released)."""
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
