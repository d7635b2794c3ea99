"""One arm's whole stack: the KEEP planner and the policy node (and the Meta-World simulator with sim:=true).

    ros2 launch vla_runtime_ros vla_bringup.launch.py namespace:=left checkpoint:=/models/openvla-7b \
        planner_model:=/models/smollm2-135m image_topic:=/left/camera/image_raw
    ros2 topic pub --once --qos-durability transient_local /left/goal std_msgs/String "data: 'put the apple in the drawer'"

The planner turns the goal (and its memory, fed on memory_update) into the next subtask and publishes
it on `instruction`, the policy node's input in the same namespace: each new subtask starts a policy
episode. Every topic is relative, so namespace:=left and namespace:=right run side by side. With
sim:=true the simulator publishes its task's instruction as the planner's goal and its state as the
policy's joint_states, and executes the policy's actions; after `episodes` episodes it exits and the launch ends. A node that fails stops
the launch with exit code 1; respawn:=true restarts it instead.
"""

from launch import LaunchDescription
from launch.actions import DeclareLaunchArgument, OpaqueFunction
from launch.substitutions import LaunchConfiguration
from vla_runtime_ros.launch_nodes import (
    SIM_STATE, planner_arguments, planner_node, policy_arguments, policy_node, sim_arguments, sim_node,
)
from vla_runtime_ros.launch_support import flag, supervision_arguments


def nodes(context):
    sim = flag(context, "sim")
    camera = (("image_raw", LaunchConfiguration("image_topic")),)
    arm = planner_node(context) + policy_node(context, parameters=SIM_STATE if sim else None, remappings=camera)
    if not sim:
        return arm
    # the task's instruction is the planner's goal; the planner's subtasks drive the policy
    return arm + sim_node(context, remappings=(("instruction", "goal"), ("action", "vla_policy/action")))


def generate_launch_description():
    return LaunchDescription([
        *policy_arguments(),
        *planner_arguments(),
        DeclareLaunchArgument("namespace", default_value="", description="the arm's namespace (left, right, ...) for every node and topic"),
        DeclareLaunchArgument("image_topic", default_value="image_raw", description="the policy's camera topic (sensor_msgs/Image)"),
        DeclareLaunchArgument("sim", default_value="false", description="also start the Meta-World simulator node as the arm"),
        *sim_arguments(),
        *supervision_arguments(),
        OpaqueFunction(function=nodes),
    ])
