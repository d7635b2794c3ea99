"""Meta-World (MuJoCo) backend: the embedded default simulator.

Each task runs in gymnasium's ``Meta-World/MT1`` env; MuJoCo renders headless (``gl.py`` picks EGL
or OSMesa). ``seed`` selects one of MT1's 50 object/goal variations of a task (``seed % 50``), so
seeds ``s .. s+49`` are 50 distinct scenes and the same seed always gives the same scene.

Observation: the configured cameras (rotated 180 degrees by default: Meta-World's cameras render
upside down, LeRobot's Meta-World env flips them the same way) and the proprio state
``[hand_x, hand_y, hand_z, gripper_opening]`` = the first 4 entries of Meta-World's 39-D observation
(hand position in metres, finger distance normalised to [0, 1], 1 = open). Object and goal
positions stay private; only the scripted expert (``expert_action``) reads them.

Besides Meta-World's 50 tasks it runs the memory tasks (``memory/``): each is a real Meta-World env whose
episode (cue, delay, layout) comes from the seed, with the cue drawn into the render, the arm held while
the task says so, and success judged by the task (its episode ends when the answer is committed).
"""

from __future__ import annotations

import logging
import pickle
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .actions import MetaWorldActions
from .base import SimEnv, SimObservation, StepInfo, check_task
from .gl import import_triton_before_gl, select_gl_backend
from .memory import MEMORY_TASKS, MemoryTask, Outcome
from .memory.base import HOLD_ACTION, Expert
from .memory.reach import with_delay
from .memory.scene import draw_markers
from .metaworld_tasks import METAWORLD_ALL_TASKS, METAWORLD_INSTRUCTIONS

log = logging.getLogger(__name__)

METAWORLD_CAMERAS = ("corner", "corner2", "corner3", "corner4", "topview", "behindGripper", "gripperPOV")
METAWORLD_MAX_STEPS = 500  # SawyerXYZEnv.max_path_length: stepping past it raises inside Meta-World
METAWORLD_FPS = 80  # frame_skip 5 x timestep 2.5 ms = 12.5 ms per step
STATE_NAMES = ["hand_x", "hand_y", "hand_z", "gripper_opening"]


@dataclass
class MetaWorldConfig:
    """How the Meta-World backend renders and ends episodes.

    Args:
        cameras: camera names, primary first; ``()`` renders nothing (state-only episodes).
        resolution: (height, width) of every camera image.
        max_steps: step limit per episode (at most Meta-World's 500; a memory task's own limit applies too).
        stop_on_success: end the episode at the first successful step (a memory task's episode always
            ends when its answer is committed, right or wrong).
        fast_render: no shadows, reflections or multisampling (about 8x faster software rendering;
            images look flatter than Meta-World's defaults).
        flip_images: rotate images 180 degrees so the scene is upright.
        benchmark_seed: seed MT1 uses to generate each task's 50 variations.
        actions: the 7-D -> 4-D action mapping.
        memory_delays: memory tasks with a delay (reference, tally, order): draw it per seed uniform over (low, high)
            steps instead of 20..60 (``None``), the cue and layout unchanged; an evaluation under delays the
            policy was not trained on. The episode's step limit grows with a delay beyond 60.
    """

    cameras: tuple[str, ...] = ("corner2",)
    resolution: tuple[int, int] = (224, 224)
    max_steps: int = METAWORLD_MAX_STEPS
    stop_on_success: bool = True
    fast_render: bool = True
    flip_images: bool = True
    benchmark_seed: int = 0
    actions: MetaWorldActions = field(default_factory=MetaWorldActions)
    memory_delays: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        self.cameras = tuple(self.cameras)
        self.resolution = tuple(int(v) for v in self.resolution)
        bad = [c for c in self.cameras if c not in METAWORLD_CAMERAS]
        if bad:
            raise ValueError(f"unknown Meta-World camera(s) {bad}; valid cameras: {', '.join(METAWORLD_CAMERAS)}")
        if len(set(self.cameras)) != len(self.cameras):
            raise ValueError(f"`cameras` lists a camera twice: {list(self.cameras)}")
        if len(self.resolution) != 2 or min(self.resolution) < 1:
            raise ValueError(f"`resolution` must be (height, width) with both >= 1, got {self.resolution}")
        if self.memory_delays is not None:
            self.memory_delays = tuple(int(d) for d in self.memory_delays)
            if len(self.memory_delays) != 2 or not 1 <= self.memory_delays[0] <= self.memory_delays[1]:
                raise ValueError(f"`memory_delays` must be (low, high) steps with 1 <= low <= high, got {self.memory_delays}")
        if not 1 <= self.max_steps <= METAWORLD_MAX_STEPS:
            raise ValueError(f"`max_steps` must be in [1, {METAWORLD_MAX_STEPS}], got {self.max_steps}")


@dataclass
class _TaskSim:
    """The gymnasium env, its MT1 variations, renderer and expert for one task (``memory``: its episode class)."""

    task: str
    env: Any
    variations: list
    renderer: Any
    expert: Any
    memory: type[MemoryTask] | None = None


class MetaWorldEnv(SimEnv):
    """Meta-World behind the ``SimEnv`` protocol (one task's MuJoCo model alive at a time)."""

    name = "metaworld"
    fps = METAWORLD_FPS

    def __init__(self, config: MetaWorldConfig | None = None) -> None:
        self.config = config or MetaWorldConfig()
        self.gl_backend = select_gl_backend()
        import_triton_before_gl()
        self._sim: _TaskSim | None = None
        self._raw_obs: np.ndarray | None = None
        self._steps = 0
        self._done = True
        self._limit = self.config.max_steps
        self._episode: MemoryTask | None = None  # the running memory task's episode
        self._expert: Any = None  # its scripted expert

    # -- protocol -------------------------------------------------------------------------------
    @property
    def tasks(self) -> list[str]:
        return list(METAWORLD_ALL_TASKS)

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
        check_task(task, self.tasks, "Meta-World")
        return MEMORY_TASKS[task].sample(seed).instruction() if task in MEMORY_TASKS else METAWORLD_INSTRUCTIONS[task]

    def reset(self, task: str, seed: int) -> SimObservation:
        check_task(task, self.tasks, "Meta-World")
        if task in MEMORY_TASKS:
            episode = MEMORY_TASKS[task].sample(seed)
            if self.config.memory_delays is not None:
                episode = with_delay(episode, seed, self.config.memory_delays)
            return self.reset_memory(episode)
        sim = self._task_sim(task)
        sim.env.unwrapped.set_task(sim.variations[seed % len(sim.variations)])
        self._raw_obs, _ = sim.env.reset(seed=seed)
        self._start(None, None)
        return self._observe()

    def reset_memory(self, episode: MemoryTask, *, belief: MemoryTask | None = None) -> SimObservation:
        """Start the memory-task episode ``episode`` (``reset(task, seed)`` uses ``sample(seed)``'s).

        ``belief``: the episode the scripted expert acts on (default: ``episode``); the same episode with
        another cue gives the guessing expert that chance levels are checked against.
        """
        sim = self._task_sim(episode.name)
        mw = sim.env.unwrapped
        mw.set_task(_variation_for(sim.variations[0], episode))
        mw.hand_init_pos = episode.hand_start(np.array(mw.init_config["hand_init_pos"]))
        self._raw_obs, _ = sim.env.reset(seed=0)
        episode.after_reset(mw)
        if belief is None:
            belief = episode
        else:
            belief.after_reset(mw)
        self._start(episode, belief.expert())
        return self._observe()

    def _start(self, episode: MemoryTask | None, expert: Any) -> None:
        self._episode, self._expert = episode, expert
        self._limit = min(self.config.max_steps, episode.step_limit()) if episode is not None else self.config.max_steps
        self._steps = 0
        self._done = False

    def step(self, action: np.ndarray) -> tuple[SimObservation, bool, bool, StepInfo]:
        if self._done or self._sim is None:
            raise RuntimeError("the episode is over (success or step limit) or never started; call reset(task, seed)")
        native = self.config.actions.to_native(action)
        episode = self._episode
        if episode is not None and episode.frozen(self._steps):
            native = HOLD_ACTION.copy()  # the arm is held: the task ignores what the policy sends
        self._raw_obs, _, _, _, info = self._sim.env.step(native)
        self._steps += 1
        truncated = self._steps >= self._limit
        extra = {k: float(v) for k, v in info.items() if np.isscalar(v)}
        if episode is None:
            success = bool(info["success"])
            self._done = truncated or (success and self.config.stop_on_success)
        else:
            outcome = episode.observe(self._steps, self._sim.env.unwrapped)
            success = outcome is Outcome.SUCCESS
            self._done = truncated or outcome is not Outcome.RUNNING
            extra = {"success": float(success), **episode.info()}
            if episode.cue_shown():
                extra["cue_steps"] = episode.cue_shown()  # what EpisodeResult.cue_steps and retention pictures mark
        return self._observe(), self._done, success, StepInfo(self._steps, truncated, native, extra)

    def close(self) -> None:
        if self._sim is not None:
            if self._sim.renderer is not None:
                self._sim.renderer.close()
            self._sim.env.close()
            self._sim = None
        self._done = True

    # -- Meta-World specifics -------------------------------------------------------------------
    @property
    def memory_episode(self) -> MemoryTask | None:
        """The running memory-task episode (its cue and layout); ``None`` for a Meta-World task."""
        return self._episode

    def expert_action(self, expert: Expert | None = None) -> np.ndarray:
        """Meta-World's scripted expert for the current task and state, as a 7-D policy action [7]. ``expert``: in a
        memory task, another expert to ask at this state (a decoy acting on another cue; default: the episode's)."""
        if self._sim is None or self._raw_obs is None:
            raise RuntimeError("call reset(task, seed) before asking the expert")
        if expert is not None and self._episode is None:
            raise ValueError("`expert` applies to memory tasks; this episode runs Meta-World's own expert")
        if self._episode is not None:
            native = (expert or self._expert).act(self._steps, self._sim.env.unwrapped)
        else:
            native = self._sim.expert.get_action(self._raw_obs)
        return self.config.actions.from_native(native)

    def _task_sim(self, task: str) -> _TaskSim:
        if self._sim is not None and self._sim.task == task:
            return self._sim
        self.close()
        import gymnasium as gym
        import metaworld  # noqa: F401  (registers Meta-World/MT1)
        import mujoco
        from metaworld.policies import ENV_POLICY_MAP

        memory = MEMORY_TASKS.get(task)
        base = memory.base_task if memory is not None else task
        env = gym.make("Meta-World/MT1", env_name=base, seed=self.config.benchmark_seed, disable_env_checker=True)
        # variations are chosen by seed in reset(), not sampled by the wrapper
        env.get_wrapper_attr("toggle_sample_tasks_on_reset")(False)
        model = env.unwrapped.model
        names = [mujoco.mj_id2name(model, mujoco.mjtObj.mjOBJ_CAMERA, i) for i in range(model.ncam)]
        missing = [c for c in self.config.cameras if c not in names]
        if missing:
            env.close()
            raise ValueError(f"task {task!r} has no camera(s) {missing}; its cameras: {', '.join(names)}")
        renderer = None
        if self.config.cameras:
            if self.config.fast_render:
                model.vis.quality.offsamples = 0
            height, width = self.config.resolution
            model.vis.global_.offheight = max(model.vis.global_.offheight, height)
            model.vis.global_.offwidth = max(model.vis.global_.offwidth, width)
            renderer = mujoco.Renderer(model, height, width)
        variations = list(env.get_wrapper_attr("tasks"))
        if memory is not None:
            memory.configure(env.unwrapped)
        self._sim = _TaskSim(task, env, variations, renderer, ENV_POLICY_MAP[base](), memory)
        return self._sim

    def render(self) -> dict[str, np.ndarray]:
        """The configured cameras at the current state: camera -> uint8 [H, W, 3] (``{}`` without cameras)."""
        sim = self._sim
        if sim is None:
            raise RuntimeError("call reset(task, seed) before rendering")
        images = {}
        if sim.renderer is not None:
            import mujoco

            for camera in self.config.cameras:
                sim.renderer.update_scene(sim.env.unwrapped.data, camera=camera)
                if self.config.fast_render:
                    sim.renderer.scene.flags[mujoco.mjtRndFlag.mjRND_SHADOW] = False
                    sim.renderer.scene.flags[mujoco.mjtRndFlag.mjRND_REFLECTION] = False
                if self._episode is not None:
                    draw_markers(sim.renderer.scene, self._episode.markers(self._steps))
                image = sim.renderer.render()
                images[camera] = np.ascontiguousarray(image[::-1, ::-1]) if self.config.flip_images else image
        return images

    def _observe(self) -> SimObservation:
        state = self._raw_obs[: len(STATE_NAMES)].astype(np.float32)
        t = self._steps / self.fps
        instruction = self._episode.instruction() if self._episode is not None else METAWORLD_INSTRUCTIONS[self._sim.task]
        return SimObservation(images=self.render(), state=state, instruction=instruction, t=t)


def _variation_for(variation: Any, episode: MemoryTask) -> Any:
    """Meta-World ``Task`` ``variation`` with its object/goal placement vector replaced by ``episode``'s.

    Meta-World encodes a variation as a pickled dict made in this process (``metaworld._encode_task``);
    nothing here is read from disk.
    """
    import metaworld

    data = pickle.loads(variation.data)
    data["rand_vec"] = np.asarray(episode.scene_vector(data["rand_vec"]), dtype=np.float64)
    return metaworld.Task(env_name=variation.env_name, data=pickle.dumps(data))
