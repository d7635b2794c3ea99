"""Process environment for the ROS 2 wheels from PyPI (``ros-rclpy`` and friends).

Those wheels put the C++ install tree under the environment's prefix (``<prefix>/lib/*.so``,
``<prefix>/share/...``) and ship ``ros-wheels-bootstrapper``, a ``.pth`` file that re-executes
every interpreter once with ``LD_LIBRARY_PATH`` pointing there. That bootstrapper only looks at
``sys.prefix``, so it misses interpreters that see the wheels through another prefix (a venv
layered over a shared one with a ``.pth`` path line, ``--user`` installs, a ``PYTHONPATH``).
The dynamic linker reads ``LD_LIBRARY_PATH`` only at process start, so the fix is the same as
the bootstrapper's: re-execute the interpreter once with the right value. ``ensure()`` does
that from the wheels' real location and is a no-op on a sourced ROS install or when the path
is already right; it also points ``AMENT_PREFIX_PATH`` at the prefix so ``ament_index_python``
finds the wheels' packages (and this package's ``share/``).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

_GUARD = "VLA_RUNTIME_ROS_REEXEC"
_WHEELS_GUARD = "_ROS_WHEELS_BOOTSTRAP_COMPLETE"  # ros-wheels-bootstrapper's own guard


def wheel_library_dirs() -> tuple[Path, list[Path]] | None:
    """``(prefix, library dirs)`` of pip-installed ROS wheels, or ``None`` for any other install."""
    spec = importlib.util.find_spec("rclpy")
    if spec is None or spec.origin is None:
        return None
    site = Path(spec.origin).resolve().parent.parent  # <prefix>/lib/pythonX.Y/site-packages
    prefix = site.parents[2]
    repaired = sorted(p for p in site.glob("ros_*.libs") if p.is_dir())
    if not repaired or not (prefix / "lib" / "librcl.so").is_file():
        return None  # not the wheel layout (e.g. /opt/ros/<distro>, set up by its setup.bash)
    return prefix, [prefix / "lib", *repaired]


def _split(value: str | None) -> list[str]:
    return [part for part in (value or "").split(os.pathsep) if part]


def _missing_library_dirs() -> tuple[Path, list[str]] | None:
    found = wheel_library_dirs()
    if found is None:
        return None
    prefix, lib_dirs = found
    current = {os.path.realpath(p) for p in _split(os.environ.get("LD_LIBRARY_PATH"))}
    return prefix, [str(d) for d in lib_dirs if os.path.realpath(d) not in current]


def needs_reexec() -> bool:
    """Whether ``ensure()`` would re-execute this process."""
    found = _missing_library_dirs()
    return bool(found and found[1]) and not os.environ.get(_GUARD)


def ensure() -> None:
    """Make ``import rclpy`` work in this process (re-executing it once if the linker path is wrong).

    Code that redirected file descriptors (pytest's output capture) must restore them first.
    """
    found = _missing_library_dirs()
    if found is None:
        return
    prefix, missing = found
    ament = _split(os.environ.get("AMENT_PREFIX_PATH"))
    for candidate in (Path(sys.prefix), prefix):
        if str(candidate) not in ament and (candidate / "share" / "ament_index").is_dir():
            ament.append(str(candidate))
    if ament:
        os.environ["AMENT_PREFIX_PATH"] = os.pathsep.join(ament)
    if not missing or os.environ.get(_GUARD):
        return  # already right, or already re-executed once: let the import report what is wrong
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = os.pathsep.join(missing + _split(env.get("LD_LIBRARY_PATH")))
    env[_GUARD] = "1"
    env[_WHEELS_GUARD] = "1"
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, sys.orig_argv, env)
