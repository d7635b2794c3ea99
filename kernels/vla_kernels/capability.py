"""What the Triton kernels can run: ``supports(...) -> list[str]`` (empty = usable), per STYLE §1.6.

Reasons are readable sentences, all of them at once, so a caller that falls back to the torch reference can
log why. Invalid arguments (wrong shapes, float indices) are not "unsupported": they raise ``ValueError`` here
as in every implementation.

CPU tensors are supported only in Triton's interpreter. ``triton.jit`` decides compiled vs interpreted when a
function is decorated, from ``TRITON_INTERPRET`` (Triton's own ``tl.zeros``/``tl.max``... are decorated when
``triton`` is first imported), so the interpreter is a property of the whole process: ``TRITON_INTERPRET=1``
must be set before anything imports ``triton``. The CPU tests do that in a subprocess
(``tests/kernels/test_interpreter.py``).
"""

from __future__ import annotations

import importlib.util
import os

import torch

from .checks import check_attention_args

SUPPORTED_HEAD_DIMS = (64, 128)
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def interpreted(kernel) -> bool:
    """Whether a ``@triton.jit`` function runs in Triton's interpreter rather than compiled."""
    import triton

    return not isinstance(kernel, triton.runtime.JITFunction)


def interpreter_active() -> bool:
    """Whether this process runs Triton kernels in the interpreter (``TRITON_INTERPRET=1`` before ``import triton``)."""
    if os.environ.get("TRITON_INTERPRET", "").lower() not in ("1", "true", "on", "yes"):
        return False
    import triton.language as tl

    return interpreted(tl.zeros)


def supports_config(device: torch.device | str, dtype: torch.dtype, head_dim: int) -> list[str]:
    """Reasons the Triton kernels cannot run tensors of this device, dtype and head dim (empty = they can)."""
    device = torch.device(device)
    reasons = []
    if importlib.util.find_spec("triton") is None:
        reasons.append("triton is not installed")
    elif device.type == "cuda":
        if not torch.cuda.is_available():
            reasons.append("CUDA is not available in this process")
        elif dtype == torch.bfloat16 and torch.cuda.get_device_capability(device)[0] < 8:
            major, minor = torch.cuda.get_device_capability(device)
            reasons.append(f"bfloat16 needs compute capability >= 8.0, the GPU has {major}.{minor}")
    elif device.type != "cpu" or not interpreter_active():
        reasons.append(
            f"tensors are on {device.type}: the Triton kernels run on CUDA (CPU only in Triton's interpreter, "
            "TRITON_INTERPRET=1 set before triton is imported)"
        )
    if dtype not in SUPPORTED_DTYPES:
        reasons.append(f"dtype {dtype} is not supported (float32, float16, bfloat16)")
    if head_dim not in SUPPORTED_HEAD_DIMS:
        reasons.append(f"head dim {head_dim} is not supported ({', '.join(map(str, SUPPORTED_HEAD_DIMS))})")
    return reasons


def strided_reasons(**tensors: torch.Tensor) -> list[str]:
    """Reasons for tensors whose last dimension is not contiguous (the kernels load rows as vectors)."""
    return [
        f"`{name}` has a non-contiguous last dimension (strides {t.stride()})"
        for name, t in tensors.items()
        if t.shape[-1] > 1 and t.stride(-1) != 1
    ]


def supports(
    q: torch.Tensor,
    k_store: torch.Tensor,
    v_store: torch.Tensor,
    kv_slots: torch.Tensor,
    kv_pos: torch.Tensor,
    q_pos: torch.Tensor,
    inv_freq: torch.Tensor,
) -> list[str]:
    """Reasons the Triton ``chunked_attention`` cannot run these arguments; empty list = it can.

    Same arguments as ``chunked_attention`` (shapes there). Raises ``ValueError`` for arguments no
    implementation accepts.
    """
    dims = check_attention_args(q, k_store, v_store, kv_slots, kv_pos, q_pos, inv_freq)
    return supports_config(q.device, q.dtype, dims.head_dim) + strided_reasons(q=q, k_store=k_store, v_store=v_store)
