"""launch_testing test of launch/vla_policy.launch.py, for machines with a ROS 2 install.

The launch system (launch, launch_ros, launch_testing) is not on PyPI, so this module skips in the
project's CI; on a robot: ``colcon test --packages-select vla_runtime_ros`` or
``launch_test test/test_launch_testing.py``. It starts the launch file with the test policy,
waits for the node to report itself active on /diagnostics, sends a frame and expects an action.
"""

import os
import sys
import tempfile
import time
import unittest
from pathlib import Path

import pytest

pytest.importorskip("launch_testing")
pytest.importorskip("launch_ros")

import launch  # noqa: E402
import launch_testing  # noqa: E402
import launch_testing.actions  # noqa: E402
import launch_testing.asserts  # noqa: E402
import numpy as np  # noqa: E402
import rclpy  # noqa: E402
from diagnostic_msgs.msg import DiagnosticArray  # noqa: E402
from launch.launch_description_sources import PythonLaunchDescriptionSource  # noqa: E402
from launch_ros.substitutions import FindPackageShare  # noqa: E402
from sensor_msgs.msg import Image  # noqa: E402
from std_msgs.msg import Float32MultiArray, String  # noqa: E402

TEST_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(TEST_DIR))

from ros_harness import PATIENCE  # noqa: E402
from ros_test_policy import write_checkpoint  # noqa: E402
from vla_runtime_ros import conversions  # noqa: E402
from vla_runtime_ros.policy_node import INSTRUCTION_QOS  # noqa: E402


@pytest.mark.launch_test
def generate_test_description():
    checkpoint = write_checkpoint(Path(tempfile.mkdtemp()) / "ros_test_policy")
    params = Path(tempfile.mkdtemp()) / "params.yaml"
    params.write_text("/**:\n  ros__parameters:\n    policy_modules: [ros_test_policy]\n    control_rate_hz: 10.0\n")
    policy_launch = launch.actions.IncludeLaunchDescription(
        PythonLaunchDescriptionSource(
            launch.substitutions.PathJoinSubstitution([FindPackageShare("vla_runtime_ros"), "launch", "vla_policy.launch.py"])
        ),
        launch_arguments={"checkpoint": str(checkpoint), "params_file": str(params), "namespace": "launch_test"}.items(),
    )
    return launch.LaunchDescription([
        launch.actions.SetEnvironmentVariable("PYTHONPATH", os.pathsep.join([str(TEST_DIR), os.environ.get("PYTHONPATH", "")])),
        policy_launch,
        launch_testing.actions.ReadyToTest(),
    ])


class TestPolicyLaunch(unittest.TestCase):
    def test_node_comes_up_and_answers_a_frame(self, proc_output):
        rclpy.init()
        node = rclpy.create_node("launch_test_probe")
        try:
            statuses, actions = [], []
            node.create_subscription(DiagnosticArray, "/diagnostics", lambda m: statuses.extend(m.status), 10)
            node.create_subscription(Float32MultiArray, "/launch_test/vla_policy/action", actions.append, 10)
            images = node.create_publisher(Image, "/launch_test/image_raw", 10)
            instructions = node.create_publisher(String, "/launch_test/instruction", INSTRUCTION_QOS)
            def active():
                return any("launch_test/vla_policy" in s.name and any(kv.key == "state" and kv.value == "active"
                                                                      for kv in s.values) for s in statuses)  # fmt: skip

            deadline = time.monotonic() + PATIENCE.timeout(120)  # scaled to this machine's slowness
            while time.monotonic() < deadline and not active():
                rclpy.spin_once(node, timeout_sec=0.1)
            self.assertTrue(active(), "the node never reported itself active on /diagnostics")
            instructions.publish(String(data="pick up the cup"))
            frame = conversions.array_to_image_msg(np.full((32, 32, 3), 128, np.uint8))
            deadline = time.monotonic() + PATIENCE.timeout(120)
            while time.monotonic() < deadline and not actions:
                images.publish(frame)
                rclpy.spin_once(node, timeout_sec=0.1)
            self.assertTrue(actions, "no action arrived")
            self.assertEqual(conversions.msg_to_actions(actions[0]).shape, (7,))
        finally:
            node.destroy_node()
            rclpy.shutdown()


@launch_testing.post_shutdown_test()
class TestShutdown(unittest.TestCase):
    def test_exit_codes(self, proc_info):
        launch_testing.asserts.assertExitCodes(proc_info, allowable_exit_codes=[0, -2])
