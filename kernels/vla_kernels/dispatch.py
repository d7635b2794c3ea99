"""Pick the attention implementation once, when a cache is built: Triton on CUDA, the torch reference elsewhere.

``attention_backend(name, device, dtype=..., head_dim=...)`` is the one entry point caches use:

- ``name`` comes from ``KVConfig.backend``: ``"auto"``, ``"torch"`` or ``"triton"``.
- ``"auto"`` defers to the environment variable ``VLA_KV_BACKEND`` (same three values) when it is set, so a
  user can force either implementation without editing a config; otherwise it picks Triton when
  ``supports_config`` has no objection for that device/dtype/head dim and logs the reasons once when it falls
  back to torch on a CUDA device (CPU falling back is the expected case and stays quiet).
- An explicit ``"torch"`` or ``"triton"`` in the config wins over the environment; ``"triton"`` where the
  kernels cannot run raises ``ValueError`` listing every reason instead of silently running something else.

The returned ``AttentionBackend`` is called like contract 4's ``chunked_attention`` and also carries ``rope``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from . import attention_ref, rope_ref
from .capability import supports_config

logger = logging.getLogger(__name__)

BACKEND_ENV = "VLA_KV_BACKEND"
BACKEND_NAMES = ("auto", "torch", "triton")


@dataclass(frozen=True)
class AttentionBackend:
    """One implementation of contract 4: ``chunked_attention`` and ``rope``, with the name it was chosen by.

    Calling the backend calls its ``chunked_attention`` (shapes in ``attention_ref.chunked_attention``).
    """

    name: str
    chunked_attention: Callable[..., torch.Tensor]
    rope: Callable[..., torch.Tensor]

    def __call__(self, q, k_store, v_store, kv_slots, kv_pos, q_pos, inv_freq, *, scale=None, out=None):
        return self.chunked_attention(q, k_store, v_store, kv_slots, kv_pos, q_pos, inv_freq, scale=scale, out=out)


def _torch_backend() -> AttentionBackend:
    return AttentionBackend("torch", attention_ref.chunked_attention, rope_ref.rope)


def _triton_backend() -> AttentionBackend:
    from . import attention, rope  # imports triton: only once Triton was chosen

    return AttentionBackend("triton", attention.chunked_attention, rope.rope)


BACKENDS: dict[str, Callable[[], AttentionBackend]] = {"torch": _torch_backend, "triton": _triton_backend}


def _check_name(name: str, source: str) -> str:
    if name not in BACKEND_NAMES:
        raise KeyError(f"unknown attention backend {name!r} from {source}; available: {', '.join(BACKEND_NAMES)}")
    return name


def attention_backend(
    name: str, device: torch.device | str, *, dtype: torch.dtype, head_dim: int
) -> AttentionBackend:
    """The attention implementation a cache on ``device`` with ``dtype`` and ``head_dim`` should use.

    Args:
        name: ``"auto"``, ``"torch"`` or ``"triton"`` (``KVConfig.backend``); ``"auto"`` reads ``VLA_KV_BACKEND``.
        device, dtype, head_dim: what the cache's tensors will be.

    Raises:
        KeyError: an unknown name (in the argument or the environment variable).
        ValueError: ``"triton"`` forced where the kernels cannot run (every reason listed).
    """
    name = _check_name(name, "the config")
    if name == "auto" and os.environ.get(BACKEND_ENV):
        name = _check_name(os.environ[BACKEND_ENV], f"${BACKEND_ENV}")
    device = torch.device(device)
    reasons = [] if name == "torch" else supports_config(device, dtype, head_dim)
    if name == "triton" and reasons:
        raise ValueError(f"attention backend 'triton' cannot run on {device} ({dtype}, head dim {head_dim}): "
                         + "; ".join(reasons))
    if name == "auto":
        if reasons and device.type == "cuda":
            logger.warning("attention falls back to torch on %s: %s", device, "; ".join(reasons))
        name = "torch" if reasons else "triton"
    return BACKENDS[name]()
