"""The pip ROS wheels' environment set-up (``vla_runtime_ros._env``), in child interpreters."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("rclpy")

from vla_runtime_ros import _env  # noqa: E402

# rclpy's C extension only imports when the linker path is right: the probe fails without the re-exec
PROBE = ("import os; from vla_runtime_ros._env import ensure; ensure(); import rclpy; "
         "print(os.environ['LD_LIBRARY_PATH'], os.environ['AMENT_PREFIX_PATH'], sep='\\n')")


def run(env: dict, code: str = PROBE) -> list[str]:
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.splitlines()


def without_library_path() -> dict:
    """This process's environment as another prefix's interpreter would have it: no wheels' linker path."""
    env = {k: v for k, v in os.environ.items() if k not in ("LD_LIBRARY_PATH", "_ROS_WHEELS_BOOTSTRAP_COMPLETE",
                                                              "VLA_RUNTIME_ROS_REEXEC", "AMENT_PREFIX_PATH")}
    env["_ROS_WHEELS_BOOTSTRAP_COMPLETE"] = "1"  # as if the wheels' own bootstrapper could not help (other prefix)
    return env


def test_a_process_without_the_library_path_is_re_executed_once_with_it():
    prefix, lib_dirs = _env.wheel_library_dirs()
    ld_path, ament = run(without_library_path())
    assert [str(d) for d in lib_dirs] == ld_path.split(os.pathsep)[: len(lib_dirs)]
    assert str(prefix) in ament.split(os.pathsep)
    assert (Path(prefix) / "share" / "ament_index").is_dir()


def test_a_process_with_the_right_path_is_left_alone():
    assert not _env.needs_reexec()  # this test process: conftest already made sure
    env = dict(os.environ)
    env.pop("VLA_RUNTIME_ROS_REEXEC", None)
    ld_path, _ = run(env)
    assert ld_path == os.environ["LD_LIBRARY_PATH"]  # unchanged: no re-exec happened


def test_importing_the_package_never_re_executes_the_process():
    # launch files import it inside `ros2 launch`: that process must stay as it is
    code = "import os, sys, vla_runtime_ros; print(os.environ.get('VLA_RUNTIME_ROS_REEXEC', '-'), 'torch' in sys.modules)"
    assert run(without_library_path(), code) == ["- False"]


@pytest.mark.parametrize("program", [
    ("-m", "vla_runtime_ros.policy_node"),  # as CI and the README run nodes
    ("-c", "from vla_runtime_ros.programs import policy_node; policy_node()"),  # as `ros2 run` does (console script)
])
def test_a_node_program_sets_up_its_process_before_rclpy_loads(program, tmp_path):
    # no checkpoint: the node starts (rclpy loaded), reads its parameters and stops with exit code 1 and the reason
    out = subprocess.run([sys.executable, *program, "--ros-args", "-p", "autostart:=true"], env=without_library_path(),
                         capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 1, out.stderr
    assert "parameter `checkpoint` is empty" in out.stdout + out.stderr
