"""Tiny OpenVLA-OFT checkpoints in upstream's layout, made once per test session (never downloaded)."""

import numpy as np
import pytest
import torch

from vla_runtime.checkpoints.tiny_openvla_oft import make_tiny_openvla_oft
from vla_runtime.models.openvla_oft.configuration_oft import OFTPlatform


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread):
    """Every test here runs torch on one thread (``one_torch_thread``, tests/conftest.py)."""


@pytest.fixture(scope="session")
def oft_libero(tmp_path_factory):
    """LIBERO sizes (chunk 8 x 7 actions, 8-D proprio projector), float32 on disk so references are exact."""
    return make_tiny_openvla_oft(tmp_path_factory.mktemp("oft") / "libero", seed=0, dtype=torch.float32)


@pytest.fixture(scope="session")
def oft_diffusion(tmp_path_factory):
    """LIBERO sizes (8 x 7, proprio 8), the diffusion variant, float32 on disk."""
    return make_tiny_openvla_oft(tmp_path_factory.mktemp("oft") / "diffusion", seed=5, dtype=torch.float32, diffusion=True)


@pytest.fixture(scope="session")
def oft_no_proprio(tmp_path_factory):
    """7-D actions, no proprio projector (LIBERO and Bridge both fit), bf16 on disk as upstream."""
    return make_tiny_openvla_oft(tmp_path_factory.mktemp("oft") / "noproprio", seed=2, platform=OFTPlatform.BRIDGE, proprio=False)


@pytest.fixture
def frame():
    """``frame(seed, shape=(64, 80, 3))`` -> a random uint8 RGB image."""

    def make(seed: int, shape=(64, 80, 3)) -> np.ndarray:
        return np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8)

    return make
