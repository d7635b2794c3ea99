"""The package's programs (``ros2 run vla_runtime_ros <name>``; the console scripts of ``setup.py``).

Each prepares the process for the pip ROS 2 wheels (``_env.ensure``, which may re-execute it) before
its node module, and with it rclpy, is imported.
"""

from __future__ import annotations

import importlib
from typing import NoReturn

from ._env import ensure


def _main(module: str) -> NoReturn:
    ensure()
    importlib.import_module(f"vla_runtime_ros.{module}").main()
    raise AssertionError(f"vla_runtime_ros.{module}.main() returned")  # main ends the process


def policy_node() -> NoReturn:
    _main("policy_node")


def sim_node() -> NoReturn:
    _main("sim_node")


def planner_node() -> NoReturn:
    _main("planner_node")
