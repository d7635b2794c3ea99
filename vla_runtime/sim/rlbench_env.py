"""RLBench (CoppeliaSim) adapter, for users who have CoppeliaSim; imported lazily.

RLBench is not on PyPI and needs CoppeliaSim 4.1, so it is never a dependency: building an
``RLBenchEnv`` imports it and fails with what to install. The adapter uses:

- observation: the configured RGB cameras (``front``/``wrist`` by default; depth, masks and point
  clouds off since rendering dominates step time), ``gripper_pose`` [x, y, z, qx, qy, qz, qw] and
  ``gripper_open`` (1.0 open) -> state [8];
- action mode ``MoveArmThenGripper(EndEffectorPoseViaPlanning(), Discrete())``: an absolute pose with
  an **xyzw** unit quaternion, then the gripper (> 0.5 = open);
- the policy's 7-D delta [dx, dy, dz, droll, dpitch, dyaw, gripper] becomes that absolute action
  with ``ee_delta_to_pose``: position += delta; orientation = R(droll, dpitch, dyaw) * current, the
  delta rotation being extrinsic x-y-z Euler angles in the world frame; gripper passes through
  ([0, 1], 1 = open). ``pose_to_ee_delta`` is its inverse, used to turn demos into training actions;
- tasks by their file name (``open_drawer``) via ``rlbench.utils.name_to_task_class``;
  ``seed`` picks the variation (``seed % variation_count``) and seeds numpy's global RNG, which
  RLBench uses to place objects;
- a planner failure (``InvalidActionError``) ends the episode as a failure with the message in
  ``info.extra["error"]`` instead of killing an evaluation.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np

from .actions import check_policy_action
from .base import SimEnv, SimObservation, StepInfo, check_task

log = logging.getLogger(__name__)

RLBENCH_CAMERAS = ("front", "wrist", "left_shoulder", "right_shoulder", "overhead")
STATE_NAMES = ["x", "y", "z", "qx", "qy", "qz", "qw", "gripper_open"]
RLBENCH_FPS = 20  # RLBench's scene dt is 0.05 s
RLBENCH_INSTALL_HINT = (
    "the RLBench backend needs RLBench, which is not on PyPI: install CoppeliaSim 4.1 (set COPPELIASIM_ROOT, "
    "add it to LD_LIBRARY_PATH and QT_QPA_PLATFORM_PLUGIN_PATH), then pip-install PyRep and RLBench from their "
    "GitHub repositories (stepjam/PyRep, stepjam/RLBench; the PyPI package named `pyrep` is unrelated). "
    "Headless machines also need an X server (e.g. xvfb-run). Meta-World (`--sim metaworld`) needs none of this."
)


def import_rlbench() -> SimpleNamespace:
    """The RLBench names the adapter uses; ``ImportError`` saying what to install when it is missing."""
    try:
        import rlbench.tasks as tasks
        from rlbench.action_modes.action_mode import MoveArmThenGripper
        from rlbench.action_modes.arm_action_modes import EndEffectorPoseViaPlanning
        from rlbench.action_modes.gripper_action_modes import Discrete
        from rlbench.backend.exceptions import InvalidActionError
        from rlbench.environment import Environment
        from rlbench.observation_config import CameraConfig, ObservationConfig
        from rlbench.utils import name_to_task_class
    except (ImportError, OSError) as e:  # OSError: PyRep present but libcoppeliaSim not found
        raise ImportError(f"{RLBENCH_INSTALL_HINT} (import failed: {e})") from e
    return SimpleNamespace(
        Environment=Environment,
        ObservationConfig=ObservationConfig,
        CameraConfig=CameraConfig,
        MoveArmThenGripper=MoveArmThenGripper,
        EndEffectorPoseViaPlanning=EndEffectorPoseViaPlanning,
        Discrete=Discrete,
        InvalidActionError=InvalidActionError,
        name_to_task_class=name_to_task_class,
        tasks=tasks,
    )


def task_names(tasks_module) -> list[str]:
    """Task file names (``open_drawer``) of the task classes ``rlbench.tasks`` exports (``OpenDrawer``)."""
    names = [n for n, v in vars(tasks_module).items() if isinstance(v, type) and n[:1].isupper()]
    return sorted(re.sub(r"(?<!^)(?=[A-Z])", "_", n).lower() for n in names)


def _canonical_xyzw(quat: np.ndarray) -> np.ndarray:
    q = np.asarray(quat, dtype=np.float64)
    q = q / np.linalg.norm(q)
    return -q if q[3] < 0 else q


def ee_delta_to_pose(pose: np.ndarray, action: np.ndarray) -> np.ndarray:
    """pose: [7] x, y, z, qx, qy, qz, qw; action: [7] policy delta -> [8] absolute RLBench action.

    The quaternion comes out unit-norm with qw >= 0 (xyzw, as PyRep and RLBench expect).
    """
    from scipy.spatial.transform import Rotation

    pose = np.asarray(pose, dtype=np.float64)
    out = np.empty(8)
    out[:3] = pose[:3] + action[:3]
    rotation = Rotation.from_euler("xyz", action[3:6]) * Rotation.from_quat(pose[3:7])  # scipy quats are xyzw
    out[3:7] = _canonical_xyzw(rotation.as_quat())
    out[7] = np.clip(action[6], 0.0, 1.0)
    return out


def pose_to_ee_delta(pose: np.ndarray, next_pose: np.ndarray, gripper_open: float) -> np.ndarray:
    """The 7-D policy delta that moves ``pose`` [7] to ``next_pose`` [7] with the gripper ``gripper_open``."""
    from scipy.spatial.transform import Rotation

    pose, next_pose = np.asarray(pose, dtype=np.float64), np.asarray(next_pose, dtype=np.float64)
    out = np.empty(7)
    out[:3] = next_pose[:3] - pose[:3]
    delta = Rotation.from_quat(next_pose[3:7]) * Rotation.from_quat(pose[3:7]).inv()
    out[3:6] = delta.as_euler("xyz")
    out[6] = float(gripper_open)
    return out


@dataclass
class RLBenchConfig:
    """How the RLBench adapter observes and ends episodes.

    Args:
        cameras: RGB cameras, primary first (``front``, ``wrist``, ``left_shoulder``, ``right_shoulder``, ``overhead``).
        resolution: (height, width) of every camera.
        max_steps: step limit per episode (each step is one planned end-effector move).
        stop_on_success: end the episode at the first successful step.
        headless: run CoppeliaSim without a window (it still needs an X display for its vision sensors).
        robot_setup: RLBench robot (``panda`` is the benchmark's).
    """

    cameras: tuple[str, ...] = ("front", "wrist")
    resolution: tuple[int, int] = (128, 128)
    max_steps: int = 200
    stop_on_success: bool = True
    headless: bool = True
    robot_setup: str = "panda"

    def __post_init__(self) -> None:
        self.cameras = tuple(self.cameras)
        self.resolution = tuple(int(v) for v in self.resolution)
        bad = [c for c in self.cameras if c not in RLBENCH_CAMERAS]
        if bad or not self.cameras:
            raise ValueError(f"`cameras` must name RLBench cameras, got {list(self.cameras)}; valid: {', '.join(RLBENCH_CAMERAS)}")
        if len(self.resolution) != 2 or min(self.resolution) < 1:
            raise ValueError(f"`resolution` must be (height, width) with both >= 1, got {self.resolution}")
        if self.max_steps < 1:
            raise ValueError(f"`max_steps` must be >= 1, got {self.max_steps}")


class RLBenchEnv(SimEnv):
    """RLBench behind the ``SimEnv`` protocol (launches CoppeliaSim on construction)."""

    name = "rlbench"
    fps = RLBENCH_FPS

    def __init__(self, config: RLBenchConfig | None = None) -> None:
        self.config = config or RLBenchConfig()
        self._rl = import_rlbench()
        self._task_names = task_names(self._rl.tasks)
        action_mode = self._rl.MoveArmThenGripper(self._rl.EndEffectorPoseViaPlanning(), self._rl.Discrete())
        self._env = self._rl.Environment(
            action_mode,
            obs_config=self.observation_config(),
            headless=self.config.headless,
            robot_setup=self.config.robot_setup,
        )
        self._env.launch()
        self._task = None
        self._task_env = None
        self._instruction = ""
        self._last_obs = None
        self._steps = 0
        self._done = True

    def observation_config(self):
        """RLBench ``ObservationConfig``: RGB of the configured cameras, gripper pose and open state, nothing else."""
        cameras = {}
        for camera in RLBENCH_CAMERAS:
            height, width = self.config.resolution
            cam = self._rl.CameraConfig(image_size=(width, height))  # PyRep's set_resolution takes [x, y]
            cam.set_all(False)
            cam.rgb = camera in self.config.cameras
            cameras[f"{camera}_camera"] = cam
        obs_config = self._rl.ObservationConfig(**cameras)
        obs_config.set_all_low_dim(False)
        obs_config.gripper_pose = True
        obs_config.gripper_open = True
        return obs_config

    @property
    def tasks(self) -> list[str]:
        return list(self._task_names)

    @property
    def cameras(self) -> list[str]:
        return list(self.config.cameras)

    @property
    def state_names(self) -> list[str]:
        return list(STATE_NAMES)

    @property
    def max_steps(self) -> int:
        return self.config.max_steps

    def instruction(self, task: str, seed: int = 0) -> str:
        check_task(task, self._task_names, "RLBench")
        if task == self._task and self._instruction:
            return self._instruction
        return task.replace("_", " ")

    def reset(self, task: str, seed: int) -> SimObservation:
        self._select_task(task)
        np.random.seed(seed)  # RLBench places objects with numpy's global RNG
        self._task_env.set_variation(seed % self._task_env.variation_count())
        descriptions, obs = self._task_env.reset()
        self._instruction = descriptions[0] if descriptions else task.replace("_", " ")
        self._last_obs = obs
        self._steps = 0
        self._done = False
        return self._observe(obs)

    def step(self, action: np.ndarray) -> tuple[SimObservation, bool, bool, StepInfo]:
        if self._done or self._task_env is None:
            raise RuntimeError("the episode is over (success, failure or step limit) or never started; call reset(task, seed)")
        a = check_policy_action(action, "RLBench")
        native = ee_delta_to_pose(self._last_obs.gripper_pose, a)
        self._steps += 1
        truncated = self._steps >= self.config.max_steps
        try:
            obs, reward, terminate = self._task_env.step(native)
        except self._rl.InvalidActionError as e:
            log.info("RLBench rejected action %s: %s", np.round(native, 4).tolist(), e)
            self._done = True
            return self._observe(self._last_obs), True, False, StepInfo(self._steps, truncated, native, {"error": str(e)})
        success = reward >= 1.0
        self._last_obs = obs
        self._done = truncated or bool(terminate) or (success and self.config.stop_on_success)
        return self._observe(obs), self._done, success, StepInfo(self._steps, truncated, native, {"reward": float(reward)})

    def get_demos(self, task: str, amount: int, seed: int = 0) -> list[dict[str, np.ndarray]]:
        """Live expert demos of ``task`` as policy-convention arrays.

        Returns one dict per demo: ``images`` {camera: [T, H, W, 3] uint8}, ``state`` [T, 8] float32,
        ``action`` [T, 7] float32 (the delta from frame t to t+1; the last frame repeats a zero move
        that keeps the gripper as it is), ``instruction`` str.
        """
        self._select_task(task)
        np.random.seed(seed)
        self._task_env.set_variation(seed % self._task_env.variation_count())
        descriptions, _ = self._task_env.reset()
        demos = self._task_env.get_demos(amount, live_demos=True)
        out = []
        for demo in demos:
            frames = [demo[i] for i in range(len(demo))]
            states = np.stack([self._state(o) for o in frames])
            actions = [pose_to_ee_delta(a.gripper_pose, b.gripper_pose, b.gripper_open) for a, b in zip(frames[:-1], frames[1:])]
            actions.append(pose_to_ee_delta(frames[-1].gripper_pose, frames[-1].gripper_pose, frames[-1].gripper_open))
            images = {c: np.stack([getattr(o, f"{c}_rgb") for o in frames]) for c in self.config.cameras}
            instruction = descriptions[0] if descriptions else task.replace("_", " ")
            out.append({"images": images, "state": states, "action": np.asarray(actions, np.float32), "instruction": instruction})
        return out

    def close(self) -> None:
        if self._env is not None:
            self._env.shutdown()
            self._env = None
        self._done = True

    def _select_task(self, task: str) -> None:
        check_task(task, self._task_names, "RLBench")
        if task != self._task:
            self._task_env = self._env.get_task(self._rl.name_to_task_class(task))
            self._task = task

    @staticmethod
    def _state(obs) -> np.ndarray:
        return np.concatenate([np.asarray(obs.gripper_pose, np.float32), [np.float32(obs.gripper_open)]])

    def _observe(self, obs) -> SimObservation:
        images = {}
        for camera in self.config.cameras:
            image = getattr(obs, f"{camera}_rgb")
            if image is None:
                raise RuntimeError(f"RLBench returned no {camera}_rgb although the observation config enables it")
            images[camera] = np.asarray(image, dtype=np.uint8)
        return SimObservation(images=images, state=self._state(obs), instruction=self._instruction, t=self._steps / self.fps)
