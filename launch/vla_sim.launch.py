"""Closed loop in simulation over ROS: the policy node and the Meta-World simulator node.

    ros2 launch vla_runtime_ros vla_sim.launch.py checkpoint:=/models/my-openvla task:=drawer-open-v3 episodes:=2

The simulator publishes image_raw / joint_states / instruction in the shared namespace, the policy
(reading the simulator's state on joint_states) answers on vla_policy/action, which the simulator executes one step per action. After `episodes`
episodes the simulator logs a summary (episodes, successes, mean steps) and exits 0, and the launch
ends with it; episodes:=0 runs until stopped. A node that fails stops the launch with exit code 1.
"""

from launch import LaunchDescription
from launch.actions import DeclareLaunchArgument, OpaqueFunction
from vla_runtime_ros.launch_nodes import SIM_STATE, policy_arguments, policy_node, sim_arguments, sim_node
from vla_runtime_ros.launch_support import supervision_arguments


def nodes(context):
    return policy_node(context, parameters=SIM_STATE) + sim_node(context, remappings=(("action", "vla_policy/action"),))


def generate_launch_description():
    return LaunchDescription([
        *policy_arguments(),
        *sim_arguments(),
        DeclareLaunchArgument("namespace", default_value="sim", description="namespace of both nodes"),
        *supervision_arguments(),
        OpaqueFunction(function=nodes),
    ])
