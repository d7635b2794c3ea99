"""Closed loop in simulation over ROS: the policy node and the Meta-World simulator node.

    ros2 launch vla_runtime_ros vla_sim.launch.py checkpoint:=/models/my-openvla task:=drawer-open-v3 episodes:=2

The simulator publishes image_raw / joint_states / instruction in the shared namespace, the policy
answers on vla_policy/action, which the simulator executes one step per action. After `episodes`
episodes the simulator logs a summary (episodes, successes, mean steps) and exits 0, and the launch
ends with it; episodes:=0 runs until stopped. A node that fails stops the launch with exit code 1.
"""

from launch import LaunchDescription
from launch.actions import DeclareLaunchArgument, OpaqueFunction
from launch.substitutions import LaunchConfiguration, PathJoinSubstitution
from launch_ros.parameter_descriptions import ParameterValue
from launch_ros.substitutions import FindPackageShare
from vla_runtime_ros.launch_support import supervised_node, supervision_arguments


def nodes(context):
    namespace = LaunchConfiguration("namespace")
    policy = supervised_node(
        context,
        executable="policy_node",
        name="vla_policy",
        namespace=namespace,
        parameters=[
            LaunchConfiguration("params_file"),
            {"checkpoint": LaunchConfiguration("checkpoint"), "device": LaunchConfiguration("device")},
        ],
    )
    sim = supervised_node(
        context,
        respawnable=False,  # its exit is the end of the run
        executable="sim_node",
        name="vla_sim",
        namespace=namespace,
        parameters=[
            LaunchConfiguration("sim_params_file"),
            {
                "task": LaunchConfiguration("task"),
                "episodes": ParameterValue(LaunchConfiguration("episodes"), value_type=int),
            },
        ],
        remappings=[("action", "vla_policy/action")],
    )
    return policy + sim


def generate_launch_description():
    share = FindPackageShare("vla_runtime_ros")
    return LaunchDescription([
        DeclareLaunchArgument("checkpoint", description="policy checkpoint directory"),
        DeclareLaunchArgument(
            "params_file",
            default_value=PathJoinSubstitution([share, "config", "openvla.yaml"]),
            description="policy node parameters",
        ),
        DeclareLaunchArgument(
            "sim_params_file",
            default_value=PathJoinSubstitution([share, "config", "sim.yaml"]),
            description="simulator node parameters",
        ),
        DeclareLaunchArgument("namespace", default_value="sim", description="namespace of both nodes"),
        DeclareLaunchArgument("device", default_value="auto", description="policy device: auto, cpu or cuda[:N]"),
        DeclareLaunchArgument("task", default_value="reach-v3", description="Meta-World task"),
        DeclareLaunchArgument("episodes", default_value="1", description="episodes to run, then exit (0 = until stopped)"),
        *supervision_arguments(),
        OpaqueFunction(function=nodes),
    ])
