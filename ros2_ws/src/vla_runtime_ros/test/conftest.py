"""ROS test set-up: an isolated DDS domain on localhost, the harness node, test policy checkpoints.

Test modules that need the ROS wheels start with ``pytest.importorskip("rclpy")``; those that talk
over DDS are marked ``ros``.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

TEST_DIR = Path(__file__).resolve().parent
PACKAGE_ROOT = TEST_DIR.parent  # ros2_ws/src/vla_runtime_ros


def _import_paths() -> list[Path]:
    return [TEST_DIR] + ([PACKAGE_ROOT] if importlib.util.find_spec("vla_runtime_ros") is None else [])


# ros_harness / ros_test_policy; and, in a source checkout where scripts/setup.sh has not installed
# the package yet, the package sources (ros_harness passes the same paths to node subprocesses).
sys.path[:0] = [str(p) for p in _import_paths()]

from ros_domain import claim_domain  # noqa: E402 - from TEST_DIR, put on the path above

# One DDS domain per test run, discovery on this machine only: parallel runs (several engineers,
# CI) never see each other's nodes. Child processes inherit both.
DOMAIN, _DOMAIN_CLAIM = claim_domain()
os.environ["ROS_DOMAIN_ID"] = str(DOMAIN)
os.environ["ROS_AUTOMATIC_DISCOVERY_RANGE"] = "LOCALHOST"  # ROS_LOCALHOST_ONLY is deprecated since Jazzy
os.environ.pop("ROS_LOCALHOST_ONLY", None)
os.environ.pop("ROS_STATIC_PEERS", None)
# the shipped Fast DDS profile for frames over 0.5 MB (see config/fastdds_large_frames.xml)
os.environ["FASTDDS_DEFAULT_PROFILES_FILE"] = str(PACKAGE_ROOT / "config" / "fastdds_large_frames.xml")


def pytest_configure(config):
    """Prepare the pip ROS wheels' library path before any test module imports rclpy.

    In a venv with the wheels' bootstrapper (scripts/setup.sh's .venv) this is a no-op. Elsewhere
    (a venv layered over another one) pytest is re-executed once with the right LD_LIBRARY_PATH;
    its output capture is stopped first so the new process writes to the real terminal.
    """
    if importlib.util.find_spec("rclpy") is None:
        return
    spec = importlib.util.spec_from_file_location("_vla_runtime_ros_env", PACKAGE_ROOT / "vla_runtime_ros" / "_env.py")
    env = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(env)  # not `import vla_runtime_ros`: that would re-execute under capture
    if env.needs_reexec():
        capture = config.pluginmanager.getplugin("capturemanager")
        if capture is not None:
            capture.stop_global_capturing()
        env.ensure()


@pytest.fixture(scope="session")
def harness():
    from ros_harness import Harness

    h = Harness()
    yield h
    h.close()


@pytest.fixture(autouse=True)
def _callback_errors_fail_the_test(request):
    """An exception raised in a harness callback (or an in-process node's) fails the test it happened in."""
    yield
    if "harness" in request.fixturenames:
        errors = request.getfixturevalue("harness").errors
        if errors:
            raised, errors[:] = list(errors), []
            pytest.fail("exception in the harness spin thread:\n" + "\n".join(raised), pytrace=False)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed test that used the harness reports the harness's state with it (a stalled spin thread, a
    leak of endpoints, stale shared memory), so that a flake seen once can be told apart afterwards."""
    report = yield
    harness = getattr(item, "funcargs", {}).get("harness")
    if report.failed and harness is not None:
        report.sections.append(("harness", harness.state()))
    return report


@pytest.fixture(scope="session")
def policy_checkpoints(tmp_path_factory) -> dict[str, Path]:
    """Test-policy checkpoint directories: ``single`` (one action per step), ``chunk`` (4 per step), ``slow``."""
    from ros_test_policy import write_checkpoint

    root = tmp_path_factory.mktemp("ckpt")
    return {
        "single": write_checkpoint(root / "single"),
        "chunk": write_checkpoint(root / "chunk", chunk_size=4),
        "slow": write_checkpoint(root / "slow", step_ms=300.0),
    }


@pytest.fixture(scope="session")
def openvla_checkpoint(tmp_path_factory) -> Path:
    """A tiny random OpenVLA checkpoint in the upstream Hugging Face layout (``vla-runtime make-tiny``)."""
    from vla_runtime.checkpoints.tiny_openvla import make_tiny_openvla

    return make_tiny_openvla(tmp_path_factory.mktemp("openvla") / "tiny-openvla", seed=0)
