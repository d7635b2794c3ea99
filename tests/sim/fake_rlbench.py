"""FAKE of RLBench's Python API -- not RLBench. CoppeliaSim cannot run here, so this module tree
reproduces the part of RLBench's surface the adapter uses, at the same import paths (stepjam/RLBench
1.2.0): ``rlbench.environment.Environment`` (constructor keywords, ``launch``, ``get_task``,
``shutdown``), ``TaskEnvironment`` (``set_variation``, ``variation_count``, ``reset -> (descriptions,
obs)``, ``step(action) -> (obs, reward, terminate)``, ``get_demos(amount, live_demos=...)``),
``ObservationConfig``/``CameraConfig`` (attributes, ``set_all``, ``set_all_low_dim``), the
``Observation`` fields (``<camera>_rgb`` or ``None`` when disabled, ``gripper_pose`` xyzw,
``gripper_open``), ``MoveArmThenGripper(EndEffectorPoseViaPlanning(), Discrete())`` with RLBench's
checks (8-D action, unit quaternion, gripper > 0.5 = open), ``InvalidActionError``,
``rlbench.utils.name_to_task_class`` (raises ``InvalidTaskName``) and task classes in
``rlbench.tasks``.

Behind the surface is a toy world: the gripper moves exactly to the commanded pose; a task
succeeds when the gripper is within 2 cm of the task's target; targets outside the workspace make
the planner raise ``InvalidActionError`` as RLBench's does.
"""

from __future__ import annotations

import sys
import types

import numpy as np

CAMERAS = ("left_shoulder", "right_shoulder", "overhead", "wrist", "front")
HOME = np.array([0.3, 0.0, 1.0, 0.0, 0.0, 0.0, 1.0])  # x, y, z, qx, qy, qz, qw


class InvalidActionError(Exception):
    pass


class TaskEnvironmentError(Exception):
    pass


class InvalidTaskName(Exception):
    pass


class CameraConfig:
    def __init__(self, rgb=True, rgb_noise=None, depth=True, depth_noise=None, point_cloud=True, mask=True,
                 image_size=(128, 128), render_mode=None, masks_as_one_channel=True, depth_in_meters=False):
        self.rgb, self.depth, self.point_cloud, self.mask = rgb, depth, point_cloud, mask
        self.image_size = image_size

    def set_all(self, value: bool):
        self.rgb = self.depth = self.point_cloud = self.mask = value


class ObservationConfig:
    def __init__(self, left_shoulder_camera=None, right_shoulder_camera=None, overhead_camera=None, wrist_camera=None,
                 front_camera=None, joint_velocities=True, joint_positions=True, joint_forces=True, gripper_open=True,
                 gripper_pose=True, gripper_matrix=False, gripper_joint_positions=False, gripper_touch_forces=False,
                 wrist_camera_matrix=False, record_gripper_closing=False, task_low_dim_state=False):
        for name, cam in zip(CAMERAS, (left_shoulder_camera, right_shoulder_camera, overhead_camera, wrist_camera, front_camera)):
            setattr(self, f"{name}_camera", cam if cam is not None else CameraConfig())
        self.joint_velocities, self.joint_positions, self.joint_forces = joint_velocities, joint_positions, joint_forces
        self.gripper_open, self.gripper_pose, self.gripper_matrix = gripper_open, gripper_pose, gripper_matrix
        self.gripper_joint_positions, self.gripper_touch_forces = gripper_joint_positions, gripper_touch_forces
        self.wrist_camera_matrix, self.task_low_dim_state = wrist_camera_matrix, task_low_dim_state

    def set_all_low_dim(self, value: bool):
        for name in ("joint_velocities", "joint_positions", "joint_forces", "gripper_open", "gripper_pose", "gripper_matrix",
                     "gripper_joint_positions", "gripper_touch_forces", "wrist_camera_matrix", "task_low_dim_state"):
            setattr(self, name, value)


class Observation:
    def __init__(self, config: ObservationConfig, pose: np.ndarray, gripper_open: float, step: int):
        for cam in CAMERAS:
            cc = getattr(config, f"{cam}_camera")
            image = None
            if cc.rgb:
                w, h = cc.image_size  # PyRep: set_resolution([x, y]), images [y, x, 3]
                image = np.full((h, w, 3), (step * 10 + CAMERAS.index(cam)) % 256, dtype=np.uint8)
            setattr(self, f"{cam}_rgb", image)
            setattr(self, f"{cam}_depth", None)
        self.gripper_pose = pose.copy() if config.gripper_pose else None
        self.gripper_open = float(gripper_open) if config.gripper_open else None
        self.joint_positions = np.zeros(7) if config.joint_positions else None


class EndEffectorPoseViaPlanning:
    def __init__(self, absolute_mode=True, frame="world", collision_checking=False):
        self.absolute_mode = absolute_mode


class Discrete:
    def __init__(self, attach_grasped_objects=True, detach_before_open=True):
        pass


class MoveArmThenGripper:
    def __init__(self, arm_action_mode, gripper_action_mode):
        self.arm_action_mode, self.gripper_action_mode = arm_action_mode, gripper_action_mode


class Demo:
    def __init__(self, observations):
        self._observations = observations

    def __len__(self):
        return len(self._observations)

    def __getitem__(self, i):
        return self._observations[i]


class Task:
    variations = 3
    descriptions = ["task"]

    def __init__(self, pyrep=None, robot=None):
        pass

    @staticmethod
    def target(variation: int) -> np.ndarray:
        return np.array([0.3 + 0.05 * variation, 0.1, 0.9])


class OpenDrawer(Task):
    descriptions = ["open the bottom drawer", "grip the bottom handle and pull the bottom drawer open"]


class CloseJar(Task):
    descriptions = ["close the jar"]


class TaskEnvironment:
    def __init__(self, task: Task, action_mode, obs_config):
        self._task, self._action_mode, self._obs_config = task, action_mode, obs_config
        self._variation = 0
        self._reset_called = False
        self.actions = []  # every action step() received, for the contract test

    def set_variation(self, v: int):
        if v >= self.variation_count():
            raise TaskEnvironmentError(f"Requested variation {v}, but there are only {self.variation_count()} variations.")
        self._variation = v

    def variation_count(self) -> int:
        return self._task.variations

    def reset(self):
        self._pose, self._open, self._step = HOME.copy(), 1.0, 0
        self._reset_called = True
        return list(self._task.descriptions), self._obs()

    def _obs(self):
        return Observation(self._obs_config, self._pose, self._open, self._step)

    def step(self, action):
        if not self._reset_called:
            raise RuntimeError("Call 'reset' before calling 'step' on a task.")
        action = np.asarray(action)
        self.actions.append(action.copy())
        if action.shape != (8,):
            raise InvalidActionError(f"Expected the action shape to be: (8,), but was shape: {action.shape}")
        if not np.isclose(np.linalg.norm(action[3:7]), 1.0):
            raise InvalidActionError("Action contained non unit quaternion!")
        if not 0.0 <= action[7] <= 1.0:
            raise InvalidActionError("Gripper action expected to be within 0 and 1.")
        if np.any(np.abs(action[:3] - HOME[:3]) > 0.5):
            raise InvalidActionError("A path could not be found because the target is outside of workspace.")
        self._pose = action[:7].copy()
        self._open = float(action[7] > 0.5)
        self._step += 1
        success = bool(np.linalg.norm(self._pose[:3] - self._task.target(self._variation)) < 0.02)
        return self._obs(), float(success), success

    def get_demos(self, amount, live_demos=False, image_paths=False, callable_each_step=None, max_attempts=10,
                  random_selection=True, from_episode_number=0):
        if not live_demos:
            raise RuntimeError("Can't ask for a stored demo when no dataset root provided.")
        demos = []
        target = self._task.target(self._variation)
        for _ in range(amount):
            poses = [HOME.copy()]
            for k in range(1, 5):  # a straight approach while rotating about z, closing the gripper at the end
                p = HOME.copy()
                p[:3] = HOME[:3] + (target - HOME[:3]) * k / 4
                angle = 0.2 * k
                p[3:7] = [0.0, 0.0, np.sin(angle / 2), np.cos(angle / 2)]
                poses.append(p)
            opens = [1.0, 1.0, 1.0, 1.0, 0.0]
            demos.append(Demo([Observation(self._obs_config, p, o, i) for i, (p, o) in enumerate(zip(poses, opens))]))
        return demos


class Environment:
    instances: list["Environment"] = []

    def __init__(self, action_mode, dataset_root="", obs_config=None, headless=False, static_positions=False,
                 robot_setup="panda", randomize_every=None, frequency=1, visual_randomization_config=None,
                 dynamics_randomization_config=None, attach_grasped_objects=True, shaped_rewards=False,
                 arm_max_velocity=1.0, arm_max_acceleration=4.0):
        self.action_mode, self.obs_config, self.headless, self.robot_setup = action_mode, obs_config or ObservationConfig(), headless, robot_setup
        self.launched = False
        self.task_envs = []
        Environment.instances.append(self)

    def launch(self):
        if self.launched:
            raise RuntimeError("Already called launch!")
        self.launched = True

    def get_task(self, task_class):
        if not self.launched:
            self.launch()
        task_env = TaskEnvironment(task_class(), self.action_mode, self.obs_config)
        self.task_envs.append(task_env)
        return task_env

    def shutdown(self):
        self.launched = False


def name_to_task_class(task_file: str):
    name = task_file.replace(".py", "")
    class_name = "".join(w[0].upper() + w[1:] for w in name.split("_"))
    if not hasattr(sys.modules["rlbench.tasks"], class_name):
        raise InvalidTaskName(f"The task file '{name}' does not exist or cannot be compiled.")
    return getattr(sys.modules["rlbench.tasks"], class_name)


def install(monkeypatch) -> None:
    """Put the fake ``rlbench`` package tree into ``sys.modules`` for one test."""
    modules = {
        "rlbench": {"Environment": Environment, "ObservationConfig": ObservationConfig, "CameraConfig": CameraConfig},
        "rlbench.environment": {"Environment": Environment},
        "rlbench.task_environment": {"TaskEnvironment": TaskEnvironment},
        "rlbench.observation_config": {"ObservationConfig": ObservationConfig, "CameraConfig": CameraConfig},
        "rlbench.action_modes": {},
        "rlbench.action_modes.action_mode": {"MoveArmThenGripper": MoveArmThenGripper},
        "rlbench.action_modes.arm_action_modes": {"EndEffectorPoseViaPlanning": EndEffectorPoseViaPlanning},
        "rlbench.action_modes.gripper_action_modes": {"Discrete": Discrete},
        "rlbench.backend": {},
        "rlbench.backend.exceptions": {"InvalidActionError": InvalidActionError, "TaskEnvironmentError": TaskEnvironmentError},
        "rlbench.backend.observation": {"Observation": Observation},
        "rlbench.utils": {"name_to_task_class": name_to_task_class, "InvalidTaskName": InvalidTaskName},
        "rlbench.tasks": {"OpenDrawer": OpenDrawer, "CloseJar": CloseJar},
    }
    for name, attrs in modules.items():
        module = types.ModuleType(name)
        module.__dict__.update(attrs)
        if "." not in name or name.count(".") == 1 and name.endswith(("action_modes", "backend")):
            module.__path__ = []  # packages
        monkeypatch.setitem(sys.modules, name, module)
    Environment.instances.clear()
