"""``vla_sim_node``: a built-in simulator (``vla_runtime.sim``) behind ROS topics, like a robot.

Interfaces (relative names; in one namespace with ``vla_policy`` they connect without remapping,
except ``action`` -> ``vla_policy/action``):

====  ===================  ==============================  =============================================
dir   name                 type                            notes
====  ===================  ==============================  =============================================
out   image_raw            sensor_msgs/Image (rgb8)        after every step, and re-sent at camera_rate_hz
out   joint_states         sensor_msgs/JointState          the simulator's proprio state (``state_names``)
out   instruction          std_msgs/String                 reliable + transient local; the task at each reset
out   ~/episode_result     diagnostic_msgs/DiagnosticStatus  one per finished episode: OK = success, WARN = not
out   /diagnostics         diagnostic_msgs/DiagnosticArray  1 Hz
in    action               std_msgs/Float32MultiArray      one policy action [7] = one simulator step
srv   ~/reset              std_srvs/Trigger                restart the current episode
cli   policy_reset_service std_srvs/Trigger                called when an episode repeats the last task
====  ===================  ==============================  =============================================

The simulator is not thread-safe: every callback runs on one thread (a one-thread executor).

A run of ``episodes`` > 0 episodes ends: the node logs a summary line (episodes, successes, mean
steps), publishes no frame after the last step, and ``main`` exits 0. ``episodes`` 0 runs until stopped.
"""

from __future__ import annotations

if __name__ == "__main__":  # run as a program: set the process up for the pip ROS wheels before rclpy loads
    from vla_runtime_ros._env import ensure

    ensure()

import dataclasses  # noqa: E402
from typing import Callable, NoReturn  # noqa: E402

import numpy as np  # noqa: E402
from diagnostic_msgs.msg import DiagnosticArray, DiagnosticStatus, KeyValue  # noqa: E402
from rclpy.duration import Duration  # noqa: E402
from rclpy.node import Node  # noqa: E402
from rclpy.qos import DurabilityPolicy, QoSProfile, ReliabilityPolicy, qos_profile_sensor_data  # noqa: E402
from sensor_msgs.msg import Image, JointState  # noqa: E402
from std_msgs.msg import Float32MultiArray, String  # noqa: E402
from std_srvs.srv import Trigger  # noqa: E402
from vla_runtime.sim import MEMORY_TASKS, SIMULATORS, SimEnv, make_env  # noqa: E402
from vla_runtime.sim.memory import MEMORY_CAMERA  # noqa: E402

from . import conversions  # noqa: E402
from .param_specs import declare_config, read_config  # noqa: E402
from .params import SimNodeConfig  # noqa: E402
from .runner import run_node  # noqa: E402

LATCHED_QOS = QoSProfile(depth=1, reliability=ReliabilityPolicy.RELIABLE, durability=DurabilityPolicy.TRANSIENT_LOCAL)
RESULT_QOS = QoSProfile(depth=10, reliability=ReliabilityPolicy.RELIABLE, durability=DurabilityPolicy.TRANSIENT_LOCAL)
ACTION_QOS = QoSProfile(depth=10, reliability=ReliabilityPolicy.RELIABLE)
RESULT_FLUSH_S = 30.0  # at exit, how long episode results may take to reach their matched subscribers (a loaded machine)


def build_env(cfg: SimNodeConfig, overrides: dict) -> SimEnv:
    """``vla_runtime.sim.make_env(cfg.sim, <its config with overrides>)``; unknown options raise ``ValueError``."""
    if cfg.sim not in SIMULATORS:
        raise KeyError(f"unknown simulator {cfg.sim!r}; available: {', '.join(sorted(SIMULATORS))}")
    config_cls = SIMULATORS[cfg.sim][1]
    fields = {f.name for f in dataclasses.fields(config_cls)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise ValueError(f"simulator {cfg.sim!r} has no option(s) {unknown}; its options: {sorted(fields)}")
    return make_env(cfg.sim, config_cls(**overrides))


class SimNode(Node):
    """Steps a ``SimEnv`` once per received action and publishes what its cameras and robot state show."""

    def __init__(self, env: SimEnv | None = None, node_name: str = "vla_sim", *,
                 on_finished: Callable[[str], object] | None = None, **kwargs) -> None:
        """``env``: a simulator to drive (default: built from the parameters, and closed with the node);
        ``on_finished(summary)`` is called when the last of ``episodes`` episodes ended."""
        self.env, self._owns_env, self._result_pub = None, False, None  # destroy_node runs even when __init__ failed
        super().__init__(node_name, **kwargs)
        declare_config(self, SimNodeConfig)
        self.cfg = read_config(self, SimNodeConfig)
        self.env = env if env is not None else build_env(self.cfg, self._env_overrides())
        self._owns_env = env is None
        self._on_finished = on_finished
        self.camera = self.cfg.camera or self.env.cameras[0]
        if self.camera not in self.env.cameras:
            raise ValueError(f"parameter `camera` is {self.camera!r}; the simulator renders {self.env.cameras}")
        self.episode = -1  # index of the running episode
        self.steps = 0
        self.running = False
        self.successes = 0
        self.episode_steps: list[int] = []  # steps of every finished episode
        self.rejected_actions = 0
        self.idle_actions = 0  # arrived while no episode was running (after the last one)
        self.last_error = ""
        self._obs = None
        self._instruction = ""
        self._image_pub = self.create_publisher(Image, "image_raw", qos_profile_sensor_data)
        self._state_pub = self.create_publisher(JointState, "joint_states", qos_profile_sensor_data)
        self._instruction_pub = self.create_publisher(String, "instruction", LATCHED_QOS)
        self._result_pub = self.create_publisher(DiagnosticStatus, "~/episode_result", RESULT_QOS)
        self._diag_pub = self.create_publisher(DiagnosticArray, "/diagnostics", 10)
        self.create_subscription(Float32MultiArray, "action", self._on_action, ACTION_QOS)
        self.create_service(Trigger, "~/reset", self._on_reset)
        self._policy_reset = (
            self.create_client(Trigger, self.cfg.policy_reset_service) if self.cfg.policy_reset_service else None
        )
        self.create_timer(1.0 / self.cfg.camera_rate_hz, self._publish_observation)
        self.create_timer(1.0, self._publish_diagnostics)
        self._start_timer = None
        if self._result_pub.get_subscription_count() >= self.cfg.result_subscribers:
            self._start_episode(self.episode + 1)
        else:  # a short run could end before a late subscriber is even discovered, and its results go with the node
            self.get_logger().info(f"waiting for {self.cfg.result_subscribers} subscriber(s) of ~/episode_result")
            self._start_timer = self.create_timer(0.05, self._start_when_heard)

    def _start_when_heard(self) -> None:
        """The first episode, once ``result_subscribers`` subscribers listen on ``~/episode_result``."""
        if self._result_pub.get_subscription_count() < self.cfg.result_subscribers:
            return
        self.destroy_timer(self._start_timer)
        self._start_timer = None
        self._start_episode(self.episode + 1)

    def _env_overrides(self) -> dict:
        """Options for the simulator's config dataclass from the parameters that are set."""
        overrides = {}
        if self.cfg.max_steps:
            overrides["max_steps"] = self.cfg.max_steps
        if self.cfg.camera:
            overrides["cameras"] = (self.cfg.camera,)
        elif self.cfg.sim == "metaworld" and self.cfg.task in MEMORY_TASKS:
            overrides["cameras"] = (MEMORY_CAMERA,)  # the camera the memory tasks' cues are made for
        if self.cfg.resolution:
            overrides["resolution"] = tuple(self.cfg.resolution)
        return overrides

    # ------------------------------------------------------------------ episodes
    def _start_episode(self, episode: int) -> None:
        self.episode, self.steps = episode, 0
        seed = self.cfg.seed + episode
        self._obs = self.env.reset(self.cfg.task, seed)
        self.running = True
        repeated = self._obs.instruction == self._instruction
        self._instruction = self._obs.instruction
        self._instruction_pub.publish(String(data=self._instruction))
        if repeated and self._policy_reset is not None:
            if self._policy_reset.service_is_ready():
                self._policy_reset.call_async(Trigger.Request())
            else:
                self.get_logger().warning(f"{self.cfg.policy_reset_service} is not available; the policy keeps its episode")
        self.get_logger().info(f"episode {episode}: task {self.cfg.task} seed {seed}: {self._instruction!r}")
        self._publish_observation()

    def _finish_episode(self, success: bool, info) -> None:
        self.running = False
        self.successes += int(success)
        self.episode_steps.append(self.steps)
        values = {
            "episode": self.episode,
            "task": self.cfg.task,
            "seed": self.cfg.seed + self.episode,
            "steps": self.steps,
            "success": success,
            "truncated": bool(getattr(info, "truncated", False)),
        }
        result = DiagnosticStatus(
            level=DiagnosticStatus.OK if success else DiagnosticStatus.WARN,
            name=f"{self.get_fully_qualified_name()}: episode",
            message=f"episode {self.episode} {'succeeded' if success else 'failed'} after {self.steps} steps",
            hardware_id=self.cfg.sim,
            values=[KeyValue(key=k, value=str(v)) for k, v in values.items()],
        )
        self._result_pub.publish(result)
        self.get_logger().info(result.message)
        if self.cfg.episodes == 0 or self.episode + 1 < self.cfg.episodes:
            self._start_episode(self.episode + 1)
        else:
            self._finish_run()

    def _finish_run(self) -> None:
        episodes = len(self.episode_steps)
        summary = (
            f"simulation finished: {episodes} episodes, {self.successes} successes, "
            f"mean steps {sum(self.episode_steps) / episodes:.1f}"
        )
        self.get_logger().info(summary)
        if self._on_finished is not None:
            self._on_finished(summary)

    # ------------------------------------------------------------------ callbacks
    def _on_action(self, msg: Float32MultiArray) -> None:
        if not self.running:
            self.idle_actions += 1
            return
        try:
            action = conversions.msg_to_actions(msg)
            if action.ndim != 1:
                raise ValueError(f"expected one action [action_dim], got a chunk of shape {action.shape}")
            obs, done, success, info = self.env.step(action.astype(np.float64))
        except ValueError as e:
            self.rejected_actions += 1
            self.last_error = str(e)
            self.get_logger().error(f"action rejected: {e}", throttle_duration_sec=1.0)
            return
        self._obs, self.steps = obs, self.steps + 1
        if done:  # the final frame is not published: no policy acts on a finished episode
            self._finish_episode(bool(success), info)
        else:
            self._publish_observation()

    def _on_reset(self, request: Trigger.Request, response: Trigger.Response) -> Trigger.Response:
        self._start_episode(max(self.episode, 0))
        response.success, response.message = True, f"episode {self.episode} restarted: {self._instruction!r}"
        return response

    def _publish_observation(self) -> None:
        if self._obs is None or not self.running:
            return
        stamp = self.get_clock().now().to_msg()
        self._image_pub.publish(conversions.array_to_image_msg(self._obs.images[self.camera], stamp=stamp, frame_id=self.cfg.frame_id))
        self._state_pub.publish(conversions.array_to_joint_state(self._obs.state, self.env.state_names, stamp=stamp))

    def _publish_diagnostics(self) -> None:
        values = {
            "episode": self.episode,
            "step": self.steps,
            "running": self.running,
            "successes": self.successes,
            "rejected_actions": self.rejected_actions,
            "idle_actions": self.idle_actions,
            "last_error": self.last_error,
        }
        status = DiagnosticStatus(
            level=DiagnosticStatus.ERROR if self.last_error else DiagnosticStatus.OK,
            name=f"{self.get_fully_qualified_name()}: simulator",
            message=self.last_error or ("running" if self.running else "idle"),
            hardware_id=self.cfg.sim,
            values=[KeyValue(key=k, value=str(v)) for k, v in values.items()],
        )
        self.last_error = ""
        msg = DiagnosticArray(status=[status])
        msg.header.stamp = self.get_clock().now().to_msg()
        self._diag_pub.publish(msg)


    def destroy_node(self) -> None:
        """Destroy the node after its episode results reached their subscribers; close a simulator it built."""
        if self._result_pub is not None:
            self._result_pub.wait_for_all_acked(Duration(seconds=RESULT_FLUSH_S))
        if self._owns_env:
            self.env.close()
        super().destroy_node()


def main(args: list[str] | None = None) -> NoReturn:
    """``python -m vla_runtime_ros.sim_node --ros-args -p task:=reach-v3``; see ``runner``."""
    run_node(lambda stop: SimNode(on_finished=stop.request), args, name="vla_sim", threads=1)


if __name__ == "__main__":
    main()
