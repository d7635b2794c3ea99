"""One arm's whole stack: the KEEP planner and the policy node (and the Meta-World simulator with sim:=true).

    ros2 launch vla_runtime_ros vla_bringup.launch.py namespace:=left checkpoint:=/models/openvla-7b \
        planner_model:=/models/smollm2-135m image_topic:=/left/camera/image_raw
    ros2 topic pub --once --qos-durability transient_local /left/goal std_msgs/String "data: 'put the apple in the drawer'"

The planner turns the goal (and its memory, fed on memory_update) into the next subtask and publishes
it on `instruction`, the policy node's input in the same namespace: each new subtask starts a policy
episode. Every topic is relative, so namespace:=left and namespace:=right run side by side. With
sim:=true the simulator publishes its task's instruction as the planner's goal and executes the
policy's actions; after `episodes` episodes it exits and the launch ends. A node that fails stops
the launch with exit code 1; respawn:=true restarts it instead.
"""

from launch import LaunchDescription
from launch.actions import DeclareLaunchArgument, OpaqueFunction
from launch.substitutions import LaunchConfiguration, PathJoinSubstitution
from launch_ros.parameter_descriptions import ParameterValue
from launch_ros.substitutions import FindPackageShare
from vla_runtime_ros.launch_support import flag, supervised_node, supervision_arguments


def nodes(context):
    namespace = LaunchConfiguration("namespace")
    planner = supervised_node(
        context,
        executable="planner_node",
        name="vla_planner",
        namespace=namespace,
        parameters=[
            LaunchConfiguration("planner_params_file"),
            {"model": LaunchConfiguration("planner_model"), "device": LaunchConfiguration("device")},
        ],
    )
    policy = supervised_node(
        context,
        executable="policy_node",
        name="vla_policy",
        namespace=namespace,
        parameters=[
            LaunchConfiguration("params_file"),
            {"checkpoint": LaunchConfiguration("checkpoint"), "device": LaunchConfiguration("device")},
        ],
        remappings=[("image_raw", LaunchConfiguration("image_topic"))],
    )
    if not flag(context, "sim"):
        return planner + policy
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
        # the task's instruction is the planner's goal; the planner's subtasks drive the policy
        remappings=[("instruction", "goal"), ("action", "vla_policy/action")],
    )
    return planner + policy + sim


def generate_launch_description():
    share = FindPackageShare("vla_runtime_ros")
    return LaunchDescription([
        DeclareLaunchArgument("checkpoint", description="policy checkpoint directory"),
        DeclareLaunchArgument(
            "params_file",
            default_value=PathJoinSubstitution([share, "config", "openvla.yaml"]),
            description="policy node parameters (config/openvla.yaml, cogact.yaml, hybridvla.yaml)",
        ),
        DeclareLaunchArgument("planner_model", description="planner LLM directory (HF LLaMA/Qwen2, e.g. from `vla-runtime convert-gguf`)"),
        DeclareLaunchArgument(
            "planner_params_file",
            default_value=PathJoinSubstitution([share, "config", "planner.yaml"]),
            description="planner node parameters",
        ),
        DeclareLaunchArgument("namespace", default_value="", description="the arm's namespace (left, right, ...) for every node and topic"),
        DeclareLaunchArgument("device", default_value="auto", description="planner and policy device: auto, cpu or cuda[:N]"),
        DeclareLaunchArgument("image_topic", default_value="image_raw", description="the policy's camera topic (sensor_msgs/Image)"),
        DeclareLaunchArgument("sim", default_value="false", description="also start the Meta-World simulator node as the arm"),
        DeclareLaunchArgument(
            "sim_params_file",
            default_value=PathJoinSubstitution([share, "config", "sim.yaml"]),
            description="simulator node parameters (sim:=true)",
        ),
        DeclareLaunchArgument("task", default_value="reach-v3", description="Meta-World task (sim:=true)"),
        DeclareLaunchArgument("episodes", default_value="1", description="episodes to run, then exit (sim:=true; 0 = until stopped)"),
        *supervision_arguments(),
        OpaqueFunction(function=nodes),
    ])
