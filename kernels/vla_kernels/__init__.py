"""Triton kernels for the chunked cache's attention, each with a torch reference beside it (import ``vla_kernels``).

Caches pick an implementation once with ``attention_backend(KVConfig.backend, device, dtype=..., head_dim=...)``
(``dispatch.py``). The Triton functions are loaded on first use, so ``import vla_kernels`` works without
Triton (the torch references need only torch).

- ``chunked_attention`` / ``chunked_attention_ref``: contract 4, attention over a slot-gathered store with
  RoPE applied inside (``attention.py`` / ``attention_ref.py``).
- ``vla_kernels.rope.rope`` / ``vla_kernels.rope_ref.rope``: rotate ``[B, H, T, D]`` at positions ``[T]``
  (also ``attention_backend(...).rope``; not re-exported here, where the name would shadow the module).
- ``supports(...) -> list[str]``: why the Triton kernel cannot run given arguments (empty = it can).
"""

from .attention_ref import chunked_attention as chunked_attention_ref
from .capability import SUPPORTED_DTYPES, SUPPORTED_HEAD_DIMS, supports, supports_config
from .dispatch import BACKEND_ENV, BACKEND_NAMES, AttentionBackend, attention_backend


def __getattr__(name: str):
    if name == "chunked_attention":  # the Triton kernel: imports triton on first use
        from .attention import chunked_attention

        return chunked_attention
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "BACKEND_ENV",
    "BACKEND_NAMES",
    "SUPPORTED_DTYPES",
    "SUPPORTED_HEAD_DIMS",
    "AttentionBackend",
    "attention_backend",
    "chunked_attention",
    "chunked_attention_ref",
    "supports",
    "supports_config",
]
