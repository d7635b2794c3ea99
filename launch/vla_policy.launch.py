"""Start the VLA policy node (lifecycle; configures and activates itself unless autostart:=false).

    ros2 launch vla_runtime_ros vla_policy.launch.py checkpoint:=/models/openvla-7b \
        params_file:=$(ros2 pkg prefix vla_runtime_ros)/share/vla_runtime_ros/config/openvla.yaml \
        namespace:=arm image_topic:=/camera/color/image_raw

A node that fails (a bad checkpoint, a crash) stops the launch, which exits 1 with the node's reason;
respawn:=true [respawn_delay:=S] restarts it instead (see vla_runtime_ros.launch_support).

Without a launch system: python -m vla_runtime_ros.policy_node --ros-args --params-file FILE -p checkpoint:=DIR
"""

from launch import LaunchDescription
from launch.actions import DeclareLaunchArgument, OpaqueFunction
from launch.substitutions import LaunchConfiguration
from vla_runtime_ros.launch_nodes import given, optional_argument, policy_arguments, policy_node
from vla_runtime_ros.launch_support import supervision_arguments


def nodes(context):
    return policy_node(
        context,
        parameters=given(context, {"autostart": bool, "dry_run": bool}),
        remappings=(("image_raw", LaunchConfiguration("image_topic")),),
    )


def generate_launch_description():
    return LaunchDescription([
        *policy_arguments(),
        DeclareLaunchArgument("namespace", default_value="", description="namespace of the node and its topics"),
        optional_argument("autostart", "configure and activate at start-up (the node's default: true)"),
        optional_argument("dry_run", "compute actions, publish none (the node's default: false)"),
        DeclareLaunchArgument("image_topic", default_value="image_raw", description="camera topic (sensor_msgs/Image)"),
        *supervision_arguments(),
        OpaqueFunction(function=nodes),
    ])
