"""The pip ROS wheels' environment set-up (``vla_runtime_ros._env``), in child interpreters."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("rclpy")

from vla_runtime_ros import _env  # noqa: E402

# rclpy's C extension only imports when the linker path is right: the probe fails without the re-exec
PROBE = "import os, vla_runtime_ros, rclpy; print(os.environ['LD_LIBRARY_PATH'], os.environ['AMENT_PREFIX_PATH'], sep='\\n')"


def run(env: dict) -> list[str]:
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.splitlines()


def test_a_process_without_the_library_path_is_re_executed_once_with_it():
    prefix, lib_dirs = _env.wheel_library_dirs()
    env = {k: v for k, v in os.environ.items() if k not in ("LD_LIBRARY_PATH", "_ROS_WHEELS_BOOTSTRAP_COMPLETE",
                                                              "VLA_RUNTIME_ROS_REEXEC", "AMENT_PREFIX_PATH")}
    env["_ROS_WHEELS_BOOTSTRAP_COMPLETE"] = "1"  # as if the wheels' own bootstrapper could not help (other prefix)
    ld_path, ament = run(env)
    assert [str(d) for d in lib_dirs] == ld_path.split(os.pathsep)[: len(lib_dirs)]
    assert str(prefix) in ament.split(os.pathsep)
    assert (Path(prefix) / "share" / "ament_index").is_dir()


def test_a_process_with_the_right_path_is_left_alone():
    assert not _env.needs_reexec()  # this test process: conftest already made sure
    env = dict(os.environ)
    env.pop("VLA_RUNTIME_ROS_REEXEC", None)
    ld_path, _ = run(env)
    assert ld_path == os.environ["LD_LIBRARY_PATH"]  # unchanged: no re-exec happened


def test_each_claimant_gets_a_domain_no_other_holds(tmp_path):
    from ros_domain import DOMAINS, claim_domain

    first, lock = claim_domain(tmp_path)
    second, other = claim_domain(tmp_path)  # a second run on this machine, while the first still holds its domain
    assert first in DOMAINS and second in DOMAINS and second != first
    lock.close()  # the first run ended: its domain is free again
    third, _ = claim_domain(tmp_path)
    assert third == first
    other.close()
