"""Tiny OpenVLA checkpoints in the upstream layout, made once per test session (never downloaded)."""

import numpy as np
import pytest

from vla_runtime.checkpoints.tiny_openvla import make_tiny_openvla


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread):
    """Every test here runs torch on one thread (``one_torch_thread``, tests/conftest.py)."""


@pytest.fixture(scope="session")
def tiny_openvla(tmp_path_factory):
    """Fused DINOv2 + SigLIP, bf16 on disk, one dataset (bridge_orig)."""
    return make_tiny_openvla(tmp_path_factory.mktemp("ckpt") / "tiny-openvla", seed=0)


@pytest.fixture(scope="session")
def tiny_openvla_proprio(tmp_path_factory):
    """As ``tiny_openvla`` plus a proprio projector (8-dim state)."""
    return make_tiny_openvla(tmp_path_factory.mktemp("ckpt") / "tiny-openvla-proprio", seed=1, proprio_dim=8)


@pytest.fixture
def frame():
    """``frame(seed, shape=(96, 128, 3))`` -> a random uint8 RGB image."""

    def make(seed: int, shape=(96, 128, 3)) -> np.ndarray:
        return np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8)

    return make
