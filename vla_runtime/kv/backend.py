"""Which attention implementation a decoupled cache uses: picked once, at construction.

``KVConfig.backend``: ``torch`` = the reference path (gather, RoPE, SDPA; ``store.attend_slots``);
``triton`` = ``vla_kernels.chunked_attention`` (contract 4: pre-RoPE store + slot list + positions,
RoPE fused), an error if it cannot run; ``auto`` = Triton on CUDA when ``vla_kernels.supports(...)``
returns no reason, else torch (the reasons are logged once).
"""

from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch

if TYPE_CHECKING:
    from ..models.llama import LlamaConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class AttentionBackend:
    """``kernel`` is ``vla_kernels.chunked_attention`` or ``None`` for the torch reference path."""

    name: str
    kernel: Callable[..., torch.Tensor] | None = None


def kernel_reasons(model_cfg: "LlamaConfig", device: torch.device, dtype: torch.dtype) -> tuple[list[str], Callable | None]:
    """Reasons the Triton kernel cannot serve this model/device/dtype (empty = it can), and the kernel."""
    try:
        kernels = importlib.import_module("vla_kernels")
        kernel, supports = kernels.chunked_attention, kernels.supports
    except (ImportError, AttributeError) as e:
        return [f"vla_kernels.chunked_attention is not available ({e})"], None
    d = model_cfg.head_dim
    probe = dict(
        q=torch.zeros(1, model_cfg.n_heads, 1, d, device=device, dtype=dtype),
        k_store=torch.zeros(1, model_cfg.n_kv_heads, 1, d, device=device, dtype=dtype),
        v_store=torch.zeros(1, model_cfg.n_kv_heads, 1, d, device=device, dtype=dtype),
        kv_slots=torch.zeros(1, device=device, dtype=torch.int32),
        kv_pos=torch.zeros(1, device=device, dtype=torch.int32),
        q_pos=torch.zeros(1, device=device, dtype=torch.int32),
        inv_freq=torch.ones(d // 2, device=device, dtype=torch.float32),
    )
    return list(supports(**probe)), kernel


def select_backend(name: str, model_cfg: "LlamaConfig", *, device: torch.device | str, dtype: torch.dtype) -> AttentionBackend:
    """Resolve ``KVConfig.backend`` for this model, device and dtype."""
    device = torch.device(device)
    if name == "torch" or (name == "auto" and device.type != "cuda"):
        return AttentionBackend("torch")
    reasons, kernel = kernel_reasons(model_cfg, device, dtype)
    if not reasons:
        return AttentionBackend("triton", kernel)
    if name == "triton":
        raise ValueError("KVConfig.backend='triton' cannot run here: " + "; ".join(reasons))
    log.info("chunked attention falls back to torch: %s", "; ".join(reasons))  # once per cache, not per call
    return AttentionBackend("torch")
