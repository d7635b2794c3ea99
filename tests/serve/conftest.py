"""A tiny OpenVLA policy (made once per session) and servers of it on localhost, driven by the real openpi client."""

import numpy as np
import pytest

pytest.importorskip("websockets", reason="the serve extra is not installed (scripts/setup.sh installs it)")
pytest.importorskip("msgpack", reason="the serve extra is not installed (scripts/setup.sh installs it)")
pytest.importorskip("openpi_client", reason="openpi-client is not installed (scripts/setup.sh installs it with --no-deps)")

from vla_runtime.api import load_policy  # noqa: E402
from vla_runtime.checkpoints.tiny_openvla import make_tiny_openvla  # noqa: E402
from vla_runtime.serve.server import ServerThread, build_server  # noqa: E402

@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread):
    """Every test here runs torch on one thread (``one_torch_thread``, tests/conftest.py)."""


@pytest.fixture(scope="session")
def tiny_policy(tmp_path_factory):
    return load_policy(make_tiny_openvla(tmp_path_factory.mktemp("serve") / "tiny-openvla", seed=0), device="cpu")


@pytest.fixture(scope="session")
def tiny_proprio_policy(tmp_path_factory):
    path = make_tiny_openvla(tmp_path_factory.mktemp("serve") / "tiny-openvla-proprio", seed=1, proprio_dim=8)
    return load_policy(path, device="cpu")


@pytest.fixture
def frame():
    """``frame(seed, shape=(64, 64, 3))`` -> a random uint8 RGB image."""

    def make(seed: int, shape=(64, 64, 3)) -> np.ndarray:
        return np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8)

    return make


@pytest.fixture
def start_server():
    """``start_server(policy, session_config, serve_config, **build_kwargs)`` -> (ServerThread's server, port);
    every server started is stopped at teardown."""
    threads = []

    def start(policy, session_config, config, **kwargs):
        server = build_server(policy, session_config, config, **kwargs)
        thread = ServerThread(server)
        port = thread.start()
        threads.append(thread)
        return server, port

    yield start
    for thread in threads:
        thread.stop()
