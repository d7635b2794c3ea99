"""How this package's launch files start nodes: supervised, so that what happens to a node reaches
whoever runs ``ros2 launch`` (a shell script, systemd, docker, CI).

A node started with ``supervised_node``

- exits non-zero (a configure failure, a crash): the launch shuts everything down and ``ros2 launch``
  exits 1, its last line naming the node, the exit code and the node's last FATAL/ERROR line.
  Upstream ``ros2 launch`` exits 0 whatever its processes did unless an event handler raises, so
  the exit handler raises ``NodeFailed``;
- exits 0 by itself (the simulator after its last episode), or was interrupted by SIGINT before it
  could handle it (still importing): the launch shuts down and exits 0;
- with ``respawn:=true`` is started again ``respawn_delay`` seconds after it exits, instead;
- runs with ``--exit-with-parent``: a ``ros2 launch`` killed by SIGTERM or SIGKILL (which upstream
  launch does not forward) takes its nodes with it instead of leaving them publishing;
- emulates a terminal only when launch's own output is one: redirected logs carry no colour codes.

Launch files build their nodes in an ``OpaqueFunction`` (``respawn_delay`` must be a number when
the node is made) and read arguments from ``context.launch_configurations``.
"""

from __future__ import annotations

import re
import signal
import sys
from typing import TYPE_CHECKING

from launch.actions import DeclareLaunchArgument, RegisterEventHandler, Shutdown
from launch.event_handlers import OnProcessIO
from launch_ros.actions import Node

if TYPE_CHECKING:
    from launch import LaunchContext
    from launch.events.process import ProcessExited, ProcessIO

PACKAGE = "vla_runtime_ros"
TRUE = ("true", "1", "yes", "on")
FALSE = ("false", "0", "no", "off")
ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*m")
PROBLEM = re.compile(r"\[(FATAL|ERROR)\]")
RCUTILS_PREFIX = re.compile(r"^\[(FATAL|ERROR)\] \[[0-9.]+\] \[[^\]]*\]: ")  # rcutils' default console format


class NodeFailed(RuntimeError):
    """A supervised node exited non-zero; raised in launch's event loop to make ``ros2 launch`` exit 1."""


def flag(context: LaunchContext, name: str) -> bool:
    """Launch argument ``name`` as a bool (``ValueError`` for anything but true/false spellings)."""
    value = context.launch_configurations[name]
    if value.lower() in TRUE + FALSE:
        return value.lower() in TRUE
    raise ValueError(f"launch argument {name} is {value!r}; expected true or false")


def supervision_arguments() -> list[DeclareLaunchArgument]:
    """The launch arguments ``supervised_node`` reads."""
    return [
        DeclareLaunchArgument(
            "respawn", default_value="false",
            description="restart a node that exits (after respawn_delay) instead of stopping the launch with its exit code",
        ),
        DeclareLaunchArgument("respawn_delay", default_value="0.0", description="seconds before a node is restarted"),
    ]


class LastProblem:
    """Keeps the last FATAL or ERROR line a process wrote (an ``OnProcessIO`` callback)."""

    def __init__(self) -> None:
        self.line = ""

    def __call__(self, event: ProcessIO) -> None:
        for line in event.text.decode(errors="replace").splitlines():
            line = ANSI_ESCAPE.sub("", line).strip()
            if PROBLEM.search(line):
                self.line = RCUTILS_PREFIX.sub("", line)


def supervised_node(context: LaunchContext, *, respawnable: bool = True, **node_kwargs) -> list:
    """A ``launch_ros`` ``Node(**node_kwargs)`` with the supervision above, plus its output watcher.

    ``respawnable=False`` for a node whose exit ends the launch even with ``respawn:=true`` (the
    simulator: its run is over).
    """
    args = context.launch_configurations
    respawn = respawnable and flag(context, "respawn")
    try:
        delay = float(args["respawn_delay"])
    except ValueError as e:
        raise ValueError(f"launch argument respawn_delay is {args['respawn_delay']!r}; expected seconds") from e
    problem = LastProblem()

    def on_exit(event: ProcessExited, context: LaunchContext) -> list | None:
        if respawn:
            return None  # launch starts it again
        name = event.action.node_name
        if event.returncode in (0, -signal.SIGINT):
            return [Shutdown(reason=f"{name} ended")]
        raise NodeFailed(f"{name} exited with code {event.returncode}: {problem.line or 'no error line; see its output above'}")

    node = Node(
        package=PACKAGE,
        arguments=["--exit-with-parent"],
        output="screen",
        emulate_tty=sys.stdout.isatty(),
        respawn=respawn,
        respawn_delay=delay,
        on_exit=on_exit,
        **node_kwargs,
    )
    return [node, RegisterEventHandler(OnProcessIO(target_action=node, on_stdout=problem, on_stderr=problem))]
