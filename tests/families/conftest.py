"""Tiny CogACT / HybridVLA runs in the upstream run-directory layout, made once per test session."""

import numpy as np
import pytest

from vla_runtime.checkpoints.tiny_prismatic import make_tiny_cogact, make_tiny_hybridvla


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread):
    """Every test here runs torch on one thread (``one_torch_thread``, tests/conftest.py)."""


@pytest.fixture(scope="session")
def tiny_cogact(tmp_path_factory):
    return make_tiny_cogact(tmp_path_factory.mktemp("runs") / "tiny-cogact", seed=0)


@pytest.fixture(scope="session")
def tiny_hybridvla(tmp_path_factory):
    return make_tiny_hybridvla(tmp_path_factory.mktemp("runs") / "tiny-hybridvla", seed=1)


@pytest.fixture(scope="session")
def tiny_hybridvla_window3(tmp_path_factory):
    """future_action_window_size = 3: four noisy-action tokens per diffusion step."""
    return make_tiny_hybridvla(tmp_path_factory.mktemp("runs") / "tiny-hybridvla-w3", seed=2, future_window=3)


@pytest.fixture
def frame():
    """``frame(seed, shape=(96, 128, 3))`` -> a random uint8 RGB image."""

    def make(seed: int, shape=(96, 128, 3)) -> np.ndarray:
        return np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8)

    return make
