"""The package's nodes as launch building blocks: the launch arguments each node reads, and the node
itself, supervised (``launch_support``). The launch files in ``launch/`` combine them; every node
gets the launch argument ``namespace``, so one file starts one arm (or one simulation) in it.

The node functions run in a launch file's ``OpaqueFunction``: ``nodes(context)`` returns
``policy_node(context) + sim_node(context, ...)``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from launch.actions import DeclareLaunchArgument
from launch.substitutions import LaunchConfiguration, PathJoinSubstitution
from launch_ros.parameter_descriptions import ParameterValue
from launch_ros.substitutions import FindPackageShare

from .launch_support import PACKAGE, supervised_node

if TYPE_CHECKING:
    from launch import LaunchContext


# The policy's parameters when the simulator is the arm: it reads the simulator's proprio state on
# joint_states (a checkpoint with a proprio projector fails every step without it, so the sim never
# steps and its run never ends; one without ignores the state).
SIM_STATE = {"use_joint_state": True}


def config_argument(name: str, config: str, description: str) -> DeclareLaunchArgument:
    """Launch argument ``name``: a parameter file, by default ``config/<config>`` of this package."""
    default = PathJoinSubstitution([FindPackageShare(PACKAGE), "config", config])
    return DeclareLaunchArgument(name, default_value=default, description=description)


def policy_arguments() -> list[DeclareLaunchArgument]:
    """What ``policy_node`` reads (besides ``namespace``)."""
    return [
        DeclareLaunchArgument("checkpoint", description="checkpoint directory (OpenVLA HF dir, CogACT/HybridVLA run dir)"),
        config_argument("params_file", "openvla.yaml", "policy node parameters (config/openvla.yaml, cogact.yaml, hybridvla.yaml)"),
        optional_argument("device", "auto, cpu or cuda[:N]"),
    ]


def optional_argument(name: str, description: str) -> DeclareLaunchArgument:
    """A launch argument that sets a parameter only when given: left empty, the parameter file's value (or the
    node's default) stands. (With a default of its own, the argument would override the file: a file's
    ``dry_run: true`` silently became false.)"""
    return DeclareLaunchArgument(name, default_value="", description=f"{description} (empty: the parameter file's, or the node's default)")


def given(context: LaunchContext, arguments: dict[str, type | None]) -> dict:
    """Parameters for the optional launch arguments that were given: name -> its value (typed with
    ``ParameterValue`` when a type is named)."""
    out = {}
    for name, value_type in arguments.items():
        if context.launch_configurations[name] != "":
            value = LaunchConfiguration(name)
            out[name] = value if value_type is None else ParameterValue(value, value_type=value_type)
    return out


def policy_node(context: LaunchContext, *, parameters: dict | None = None, remappings: tuple = ()) -> list:
    """``vla_policy``: the checkpoint (and the device, when given) from the launch arguments, plus ``parameters``."""
    values = {"checkpoint": LaunchConfiguration("checkpoint"), **given(context, {"device": None}), **(parameters or {})}
    return _node(context, "policy_node", "vla_policy", "params_file", values, remappings=remappings)


def sim_arguments() -> list[DeclareLaunchArgument]:
    """What ``sim_node`` reads (besides ``namespace``)."""
    return [
        config_argument("sim_params_file", "sim.yaml", "simulator node parameters"),
        optional_argument("task", "Meta-World task (the node's default: reach-v3)"),
        optional_argument("episodes", "episodes to run, then exit; 0 = until stopped (the node's default: 1)"),
    ]


def sim_node(context: LaunchContext, *, remappings: tuple) -> list:
    """``vla_sim``, whose exit ends the launch even with ``respawn:=true`` (its run is over)."""
    values = given(context, {"task": None, "episodes": int})
    return _node(context, "sim_node", "vla_sim", "sim_params_file", values, remappings=remappings, respawnable=False)


def planner_arguments() -> list[DeclareLaunchArgument]:
    """What ``planner_node`` reads (besides ``namespace`` and ``device``)."""
    return [
        DeclareLaunchArgument("planner_model", description="planner LLM directory (HF LLaMA/Qwen2, e.g. from `vla-runtime convert-gguf`)"),
        config_argument("planner_params_file", "planner.yaml", "planner node parameters"),
    ]


def planner_node(context: LaunchContext) -> list:
    """``vla_planner``, publishing its subtasks on ``instruction`` in the namespace."""
    values = {"model": LaunchConfiguration("planner_model"), **given(context, {"device": None})}
    return _node(context, "planner_node", "vla_planner", "planner_params_file", values)


def _node(context: LaunchContext, executable: str, name: str, params_file: str, values: dict, *,
          remappings: tuple = (), respawnable: bool = True) -> list:
    """Node ``name`` in the launch argument ``namespace``: the parameter file in launch argument
    ``params_file``, then ``values``."""
    return supervised_node(
        context,
        respawnable=respawnable,
        executable=executable,
        name=name,
        namespace=LaunchConfiguration("namespace"),
        parameters=[LaunchConfiguration(params_file), values],
        remappings=list(remappings),
    )
