"""``vla_policy_node``: a lifecycle node that runs a VLA policy at a fixed control rate.

Interfaces (relative names, remap with ``-r``; ``~`` = the node's own namespace):

====  =======================  ============================  ==================================================
dir   name                     type                          notes
====  =======================  ============================  ==================================================
in    image_raw                sensor_msgs/Image             best effort, depth 1 (``image_transport:=raw``)
in    image_raw/compressed     sensor_msgs/CompressedImage   best effort, depth 1 (``image_transport:=compressed``)
in    instruction              std_msgs/String               reliable, volatile or transient local (two
                                                             subscriptions); a different text starts a new
                                                             episode
in    joint_states             sensor_msgs/JointState        best effort (``use_joint_state:=true``)
out   ~/action                 std_msgs/Float32MultiArray    one action per control tick, layout ``[action]``
out   ~/action_chunk           std_msgs/Float32MultiArray    each predicted chunk, layout ``[horizon, action]``
                                                             (chunk-predicting models only)
out   ~/twist, ~/gripper       TwistStamped, std_msgs/Float32  ``publish_twist:=true``; twist = delta x rate
out   /diagnostics             diagnostic_msgs/DiagnosticArray  ``diagnostics_rate_hz``, and at once on errors
srv   ~/reset                  std_srvs/Trigger              start a new episode with the current instruction
====  =======================  ============================  ==================================================

Lifecycle: configure loads the policy and creates the interfaces; activate starts a new episode
and the control timer; deactivate stops the timer (the running step finishes and is dropped);
cleanup and shutdown release everything, the policy included.

Threads: subscription callbacks only validate message headers and store the newest frame. The
control timer (the node's default callback group, so it never overlaps a lifecycle transition)
owns the ``vla_runtime.control.ControlLoop`` (queued actions, scheduling, fallback), the in-flight
worker job and episode changes. At each tick it publishes the tick's action (or the fallback) and
asks the loop when the next step should start; a one-thread worker waits until then, takes the
newest frame of that moment, decodes it and runs ``session.step`` (deadline scheduling: the step
ends just before the tick it serves). A frame, a joint state or a finished job wakes the same group
through a guard condition: results are queued at once (``publish_mode: immediate`` publishes them
at once), and a step due now starts on the frame that just arrived. The control timer runs on the
steady clock; each callback names its tick by when it was due (``_tick_due``), and when the loop moves
the tick phase to meet the camera (``align_to_frames``) one timer period is shortened. Diagnostics and the reset
service have callback groups of their own under a ``MultiThreadedExecutor``.
"""

from __future__ import annotations

import importlib
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import NoReturn

import numpy as np
import torch
from diagnostic_msgs.msg import DiagnosticArray
from geometry_msgs.msg import TwistStamped
from rcl_interfaces.msg import SetParametersResult
from rclpy.callback_groups import MutuallyExclusiveCallbackGroup
from rclpy.clock import Clock, ClockType
from rclpy.event_handler import SubscriptionEventCallbacks
from rclpy.lifecycle import LifecycleNode, LifecycleState, TransitionCallbackReturn
from rclpy.qos import DurabilityPolicy, QoSProfile, ReliabilityPolicy, qos_policy_name_from_kind
from sensor_msgs.msg import CompressedImage, Image, JointState
from std_msgs.msg import Float32, Float32MultiArray, String
from std_srvs.srv import Trigger
from vla_runtime.api import PRIMARY_CAMERA, Observation, Policy, StepResult, load_policy
from vla_runtime.control import ControlLoop
from vla_runtime.device import resolve_device
from vla_runtime.kv.base import KVStats

from . import conversions
from .instructions import LATCHED_QOS, Deduplicator, subscribe_instructions
from .params import PolicyNodeConfig, declare_config, read_config
from .runner import NodeStartError, Stop, end_process, run
from .telemetry import PolicyTelemetry

SENSOR_QOS = QoSProfile(depth=1, reliability=ReliabilityPolicy.BEST_EFFORT, durability=DurabilityPolicy.VOLATILE)
IMAGE_RELIABILITY = {"best_effort": ReliabilityPolicy.BEST_EFFORT, "reliable": ReliabilityPolicy.RELIABLE}
INSTRUCTION_QOS = LATCHED_QOS  # what the planner publishes with; volatile publishers are accepted too
ACTION_QOS = QoSProfile(depth=10, reliability=ReliabilityPolicy.RELIABLE)
RESET_TIMEOUT_S = 30.0
# parameters that may change while configured; the rest are read by on_configure
RUNTIME_PARAMETERS = ("dry_run",)


@dataclass
class Frame:
    """The newest camera message, not decoded yet."""

    msg: Image | CompressedImage
    received: float  # time.monotonic() at receipt
    seq: int

    @property
    def stamp(self) -> float:
        """header.stamp in seconds (0 for an unstamped message)."""
        return self.msg.header.stamp.sec + self.msg.header.stamp.nanosec * 1e-9


@dataclass
class EpisodeRequest:
    """A new episode asked for by an instruction, the reset service or activation."""

    instruction: str
    applied: threading.Event = field(default_factory=threading.Event)
    episode: int = 0  # set when applied
    error: str = ""
    frames_before: int = 0  # frames received before the episode started: never acted on in it


@dataclass
class StepOutcome:
    """What one worker step produced."""

    episode: int
    actions: np.ndarray  # [horizon, action_dim]: the chunk's first execution_horizon actions
    result: StepResult
    step_ms: float
    frame: Frame
    started: float  # time.monotonic() when the step took its frame
    turnaround_s: float  # from the planned start to the actions: waking up, decoding, the step (what a plan needs)


class BadInputError(ValueError):
    """A camera frame that cannot be decoded."""


class PolicyNode(LifecycleNode):
    """Runs ``load_policy(checkpoint)`` sessions behind ROS topics (see the module docstring)."""

    def __init__(self, node_name: str = "vla_policy", **kwargs) -> None:
        self._cfg: PolicyNodeConfig | None = None
        self._policy: Policy | None = None
        self._device: str = ""
        self._worker: ThreadPoolExecutor | None = None
        self._session = None  # EpisodeSession; touched only by worker jobs
        self._loop: ControlLoop | None = None  # scheduling, queued actions, fallback; touched by the default group only
        self._ready = False  # the episode's session exists (set when the worker applied an episode request)
        self._future: Future | None = None
        self._cancel = threading.Event()  # set: a step job still waiting for its start time gives up
        self._busy = False  # the worker computes a step (not waiting for its start) or its actions are not queued yet
        self._loop_view: dict[str, object] = {}  # the loop's state for diagnostics (``_sync_view``)
        self._latency_mark: tuple[int, float] | None = None  # (first tick of the newest step, its frame's receipt)
        self._episode_request: EpisodeRequest | None = None
        self._instruction_seen = Deduplicator()
        self._low: np.ndarray | None = None
        self._high: np.ndarray | None = None
        self._control_timer = None
        self._frame_guard = None  # wakes the control group when a frame arrives between ticks
        self._steady_clock = Clock(clock_type=ClockType.STEADY_TIME)
        self._period_restore: int | None = None  # the timer period (ns) to go back to after a phase move
        self._diag_timer = None
        self._action_pub = None
        self._chunk_pub = None
        self._twist_pub = None
        self._gripper_pub = None
        self._diag_pub = None
        self._reset_srv = None
        self._input_subs: list = []
        self.configure_error = ""  # why the last configure failed
        super().__init__(node_name, **kwargs)
        declare_config(self, PolicyNodeConfig)
        self.add_on_set_parameters_callback(self._on_set_parameters)
        self._lock = threading.Lock()  # guards everything the callbacks share below
        self._frame: Frame | None = None
        self._frame_seq = 0
        self._used_seq = 0
        self._instruction: tuple[str, float] | None = None  # (text, monotonic receipt time)
        self._episode_instruction: str | None = None
        self._state: np.ndarray | None = None
        self._state_stamp = 0.0  # header.stamp of self._state in seconds
        self._recent_states: deque[tuple[float, np.ndarray]] = deque(maxlen=64)  # (stamp, state), stamped ones
        self._state_error = ""
        self._episode = 0
        self._active = False
        self._telemetry = PolicyTelemetry()

    # ------------------------------------------------------------------ lifecycle
    def on_configure(self, state: LifecycleState) -> TransitionCallbackReturn:
        """Load the policy and create the interfaces. FAILURE (stay unconfigured) on a bad parameter
        or checkpoint, with the reason logged."""
        try:
            cfg = read_config(self, PolicyNodeConfig)
            for module in cfg.policy_modules:
                importlib.import_module(module)
            device = str(resolve_device(None if cfg.device == "auto" else cfg.device))
            if cfg.torch_threads:
                torch.set_num_threads(cfg.torch_threads)
            options = {"device": device}
            if cfg.dtype:
                options["dtype"] = cfg.dtype
            if cfg.adapter:
                options["adapter"] = cfg.adapter
            self.get_logger().info(f"loading {cfg.checkpoint} on {device}")
            policy = load_policy(cfg.checkpoint, **options)
            low, high = action_bounds(cfg, policy.action_dim)
            if cfg.publish_twist and policy.action_dim < 6:
                raise ValueError(f"publish_twist needs actions of >= 6 values (xyz, rpy); the policy's have {policy.action_dim}")
        except (ValueError, KeyError, OSError, ImportError, RuntimeError) as e:
            self.configure_error = str(e)
            self.get_logger().error(f"configure failed: {e}")
            return TransitionCallbackReturn.FAILURE
        self._cfg, self._policy, self._device, self._low, self._high = cfg, policy, device, low, high
        with self._lock:
            self._telemetry = PolicyTelemetry()
            self._episode = 0

        inputs = MutuallyExclusiveCallbackGroup()
        image_type, image_topic = (Image, "image_raw") if cfg.image_transport == "raw" else (CompressedImage, "image_raw/compressed")
        image_qos = QoSProfile(depth=1, reliability=IMAGE_RELIABILITY[cfg.image_reliability], durability=DurabilityPolicy.VOLATILE)
        self._input_subs.append(
            self.create_subscription(
                image_type, image_topic, self._on_image, image_qos, callback_group=inputs,
                event_callbacks=SubscriptionEventCallbacks(incompatible_qos=self._on_incompatible_image_qos),
            )
        )
        self._input_subs.extend(subscribe_instructions(self, self._on_instruction, self._on_incompatible_instruction_qos, inputs))
        if cfg.use_joint_state:
            self._input_subs.append(
                self.create_subscription(JointState, "joint_states", self._on_joint_state, SENSOR_QOS, callback_group=inputs)
            )
        self._action_pub = self.create_lifecycle_publisher(Float32MultiArray, "~/action", ACTION_QOS)
        if policy.chunk_size > 1:
            self._chunk_pub = self.create_lifecycle_publisher(Float32MultiArray, "~/action_chunk", ACTION_QOS)
        if cfg.publish_twist:
            self._twist_pub = self.create_lifecycle_publisher(TwistStamped, "~/twist", ACTION_QOS)
            self._gripper_pub = self.create_lifecycle_publisher(Float32, "~/gripper", ACTION_QOS)
        self._diag_pub = self.create_publisher(DiagnosticArray, "/diagnostics", 10)
        self._reset_srv = self.create_service(Trigger, "~/reset", self._on_reset, callback_group=MutuallyExclusiveCallbackGroup())
        self._diag_timer = self.create_timer(
            1.0 / cfg.diagnostics_rate_hz, self._publish_diagnostics, callback_group=MutuallyExclusiveCallbackGroup()
        )
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vla_policy_step")
        self._frame_guard = self.create_guard_condition(self._on_frame_ready)  # default group, like the control timer
        self.get_logger().info(
            f"configured: {type(policy).__name__} action_dim={policy.action_dim} chunk={policy.chunk_size} "
            f"history={cfg.history} kv={cfg.kv.mode.value} control={cfg.control_rate_hz} Hz dry_run={cfg.dry_run}"
        )
        return TransitionCallbackReturn.SUCCESS

    def on_activate(self, state: LifecycleState) -> TransitionCallbackReturn:
        """Start a new episode (current instruction, else ``default_instruction``) and the control timer."""
        with self._lock:
            self._active = True
            self._used_seq = self._frame_seq  # frames from before activation are not acted on
            text = self._instruction[0] if self._instruction else self._cfg.default_instruction
            if text:
                self._request_episode(text)
        # steady clock: the same as time.monotonic(), which the control loop plans on
        self._control_timer = self.create_timer(1.0 / self._cfg.control_rate_hz, self._on_control_tick, clock=self._steady_clock)
        chunked = self._policy.chunk_size > 1 and self._cfg.execution_horizon != 1
        self._loop = ControlLoop(self._cfg.control_config(), t0=time.monotonic(), chunked=chunked)  # tick 0: the timer's start
        self.get_logger().info("active")
        return super().on_activate(state)

    def on_deactivate(self, state: LifecycleState) -> TransitionCallbackReturn:
        """Stop the control timer; the step in flight finishes and its action is dropped."""
        self._stop_control()
        self.get_logger().info("inactive")
        return super().on_deactivate(state)

    def on_cleanup(self, state: LifecycleState) -> TransitionCallbackReturn:
        """Release interfaces, worker and policy."""
        self._release()
        return super().on_cleanup(state)

    def on_shutdown(self, state: LifecycleState) -> TransitionCallbackReturn:
        """Release everything, the policy included (the node's process is about to end)."""
        self._release()
        self.get_logger().info(f"shut down from {state.label}: policy released")
        return super().on_shutdown(state)

    def on_error(self, state: LifecycleState) -> TransitionCallbackReturn:
        self.get_logger().error(f"error while leaving state {state.label}; releasing everything")
        self._release()
        return TransitionCallbackReturn.SUCCESS

    def _stop_control(self) -> None:
        if self._control_timer is not None:
            self.destroy_timer(self._control_timer)
            self._control_timer = None
        with self._lock:
            self._active = False
            if self._episode_request is not None:
                self._episode_request.error = "node was deactivated"
                self._episode_request.applied.set()
                self._episode_request = None
        self._cancel.set()
        if self._future is not None:
            wait([self._future])
            self._future = None
        self._loop, self._ready, self._busy, self._period_restore = None, False, False, None
        with self._lock:
            self._loop_view = {}

    def _release(self) -> None:
        self._stop_control()
        if self._worker is not None:
            self._worker.shutdown(wait=True, cancel_futures=True)
            self._worker = None
        for sub in self._input_subs:
            self.destroy_subscription(sub)
        self._input_subs = []
        outputs = (self._action_pub, self._chunk_pub, self._twist_pub, self._gripper_pub)
        self._action_pub = self._chunk_pub = self._twist_pub = self._gripper_pub = None  # diagnostics stop reading them
        for pub in outputs:
            if pub is not None:
                self.destroy_lifecycle_publisher(pub)
        if self._diag_timer is not None:
            self.destroy_timer(self._diag_timer)
            self._diag_timer = None
        with self._lock:  # a worker's done-callback triggers it under the lock
            guard, self._frame_guard = self._frame_guard, None
        if guard is not None:
            self.destroy_guard_condition(guard)
        if self._diag_pub is not None:
            self.destroy_publisher(self._diag_pub)
            self._diag_pub = None
        if self._reset_srv is not None:
            self.destroy_service(self._reset_srv)
            self._reset_srv = None
        self._session = self._policy = self._cfg = None
        with self._lock:
            self._episode_instruction = None
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def destroy_node(self) -> None:
        """Leave the lifecycle first: deactivate (no more actions), then shut down (release the policy)."""
        if self._active:
            self.trigger_deactivate()
        if self._cfg is not None:
            self.trigger_shutdown()
        super().destroy_node()

    # ------------------------------------------------------------------ parameters
    def _on_set_parameters(self, params) -> SetParametersResult:
        if self._cfg is None:
            return SetParametersResult(successful=True)  # read at the next configure
        fixed = [p.name for p in params if p.name not in RUNTIME_PARAMETERS]
        if fixed:
            return SetParametersResult(
                successful=False, reason=f"{fixed} are read at configure; cleanup, set, configure again"
            )
        for p in params:  # only dry_run, typed BOOL by its descriptor
            self._cfg.dry_run = p.value
            self.get_logger().warning(f"dry_run = {p.value}")
        return SetParametersResult(successful=True)

    # ------------------------------------------------------------------ input callbacks (tiny)
    def _on_image(self, msg: Image | CompressedImage) -> None:
        now, cfg = time.monotonic(), self._cfg
        if cfg is None:  # cleanup is destroying this subscription
            return
        stamp = msg.header.stamp
        with self._lock:
            self._telemetry.frame_stamp = f"{stamp.sec}.{stamp.nanosec:09d}"
        try:
            if isinstance(msg, Image):
                conversions.check_image_msg(msg, max_pixels=cfg.max_image_pixels)
            elif len(msg.data) == 0:
                raise ValueError(f"CompressedImage data is empty (format {msg.format!r})")
        except ValueError as e:
            self._report_error(f"image rejected: {e}", kind="input")
            return
        with self._lock:
            self._telemetry.frames_received += 1
            if self._active and self._frame is not None and self._frame.seq > self._used_seq:
                self._telemetry.frames_dropped += 1
            self._frame_seq += 1
            self._frame = Frame(msg, now, self._frame_seq)
        if self._frame_guard is not None:
            self._frame_guard.trigger()

    def _on_incompatible_image_qos(self, event) -> None:
        if self._cfg is None:
            return
        policy = qos_policy_name_from_kind(event.last_policy_kind)
        self._report_error(
            f"a camera publisher's QoS is incompatible with this subscription ({policy}); its frames never arrive. "
            f"image_reliability is {self._cfg.image_reliability!r}: use best_effort for best-effort cameras",
            kind="setup",
        )

    def _on_incompatible_instruction_qos(self, event) -> None:
        if self._cfg is None:
            return
        policy = qos_policy_name_from_kind(event.last_policy_kind)
        self._report_error(
            f"an instruction publisher's QoS is incompatible with this subscription ({policy}); its instructions never "
            "arrive. Publish instructions reliable (volatile or transient local)", kind="setup",
        )

    def _on_instruction(self, msg: String, info: dict) -> None:
        if self._instruction_seen.seen(info):  # through the other subscription already, or older than one that was
            return
        try:
            text = conversions.instruction_text(msg.data)
        except ValueError as e:
            self._report_error(f"instruction rejected: {e}", kind="input")
            return
        with self._lock:
            self._instruction = (text, time.monotonic())
            if text != self._episode_instruction and self._active:
                self._request_episode(text)
        self.get_logger().info(f"instruction: {text!r}")

    def _on_joint_state(self, msg: JointState) -> None:
        cfg = self._cfg
        if cfg is None:
            return
        try:
            state = conversions.joint_state_to_array(msg, cfg.joint_names)
        except ValueError as e:
            with self._lock:
                self._state, self._state_error = None, str(e)
            self._report_error(f"joint state rejected: {e}", kind="input")
            return
        with self._lock:
            self._state, self._state_error = state, ""
            self._state_stamp = msg.header.stamp.sec + msg.header.stamp.nanosec * 1e-9
            self._telemetry.joint_state_stamp = self._state_stamp
            if self._state_stamp:
                self._recent_states.append((self._state_stamp, state))
        if self._frame_guard is not None:  # a frame may have been waiting for this state
            self._frame_guard.trigger()

    def _on_reset(self, request: Trigger.Request, response: Trigger.Response) -> Trigger.Response:
        with self._lock:
            text = self._instruction[0] if self._instruction else (self._cfg.default_instruction if self._cfg else "")
            if not self._active:
                response.success, response.message = False, "node is not active; activation starts a new episode"
                return response
            if not text:
                response.success, response.message = False, "no instruction yet; publish one on `instruction`"
                return response
            request_ = self._request_episode(text)
        if not request_.applied.wait(RESET_TIMEOUT_S):
            response.success, response.message = False, f"reset not applied within {RESET_TIMEOUT_S} s"
        elif request_.error:
            response.success, response.message = False, request_.error
        else:
            response.success, response.message = True, f"episode {request_.episode} started: {text!r}"
        return response

    def _request_episode(self, instruction: str) -> EpisodeRequest:
        """Ask the control tick for a new episode (caller holds ``_lock``); supersedes a pending request."""
        if self._episode_request is not None:
            self._episode_request.error = "superseded by a newer request"
            self._episode_request.applied.set()
        self._episode_instruction = instruction
        self._episode_request = EpisodeRequest(instruction)
        return self._episode_request

    # ------------------------------------------------------------------ control loop
    def _on_control_tick(self) -> None:
        """Publish this tick's action (queued, or the fallback) and plan the next step (``ControlLoop``)."""
        try:
            self._control_tick()
        finally:
            self._sync_view()

    def _control_tick(self) -> None:
        due = self._tick_due()
        if self._period_restore is not None:  # the one shortened interval of a phase move has begun
            self._control_timer.timer_period_ns, self._period_restore = self._period_restore, None
        now = time.monotonic()
        self._collect()
        with self._lock:
            request = self._episode_request if self._future is None else None  # applied once the worker is idle
            if request is not None:
                self._episode_request = None
                self._episode += 1
                request.episode = self._episode
            hold = self._watchdog(now)
        # every tick that publishes nothing below still passes in the loop: a step landing later serves the next
        if request is not None:  # whatever the old episode still had is dropped
            self._ready = False
            self._loop.reset()
            self._loop.skip_tick(now, due=due)
            self._future = self._worker.submit(self._start_episode, request)
            self._future.add_done_callback(self._on_job_done)
            return
        if self._episode_request is not None:  # a new episode waits for the step in flight: the old one's actions stop
            self._cancel.set()
            self._loop.reset()
            self._loop.skip_tick(now, due=due)
            return
        if not self._ready:
            self._loop.skip_tick(now, due=due)
            return
        if hold:
            pending = self._loop.queued()
            self._loop.reset()
            self._loop.skip_tick(now, due=due)
            if pending:
                with self._lock:
                    self._telemetry.actions_withheld += pending
            self.get_logger().warning(f"no action: {hold}", throttle_duration_sec=2.0)
            return
        out = self._loop.on_tick(now, due=due)
        if out.action is not None:
            self._publish(out.action, received=self._latency_of(out.tick))
        self._submit_step()
        shift = self._loop.phase_shift()
        if shift > 0:  # the next callback is scheduled already; the interval after it is shorter by `shift`
            self._period_restore = self._control_timer.timer_period_ns
            self._control_timer.timer_period_ns = self._period_restore - round(shift * 1e9)

    def _sync_view(self, *, collected: bool = False) -> None:
        """Copy the loop's state for diagnostics, which run on another thread (the loop is not thread-safe and
        changes in this callback group only); ``collected``: a worker job's outcome was just handled."""
        view = {"queue_len": self._loop.queued(), **control_values(self._loop, self._cfg)} if self._loop is not None else {}
        with self._lock:
            self._loop_view = view
            if collected:
                self._busy = False

    def _tick_due(self) -> float:
        """When the control timer scheduled the callback running now (``time.monotonic()`` seconds).

        rcl has set the next call one period on from the scheduled time when it took the callback, so a late
        callback still names its own tick; one more than a period late names the latest tick due (rcl skips
        the ones in between). Labelled by its start time instead, a late callback took the next tick's place.
        """
        now, until = time.monotonic(), self._control_timer.time_until_next_call()
        # the period rcl added when it took this callback (shorter once while the phase moves)
        return now if until is None else now + (until - self._control_timer.timer_period_ns) * 1e-9

    def _on_frame_ready(self) -> None:
        """A frame or a joint state arrived, or a worker job ended: collect it and start a step if one is due."""
        if self._control_timer is not None:
            self._collect()
            self._submit_step()
            self._sync_view()

    def _on_job_done(self, future: Future) -> None:
        with self._lock:  # _release clears the guard under the lock before destroying it
            if self._frame_guard is not None:
                self._frame_guard.trigger()

    def _latency_of(self, tick: int) -> float | None:
        """The frame receipt time of the newest step whose first action serves ``tick`` (once per step)."""
        if self._latency_mark is None or tick < self._latency_mark[0]:
            return None
        received, self._latency_mark = self._latency_mark[1], None
        return received

    def _watchdog(self, now: float) -> str:
        """Why no action may go out now ('' when inputs are fresh); caller holds ``_lock``.

        Sets the diagnostics warning; a frame that became too old before it was used counts as stale.
        """
        cfg, reason = self._cfg, ""
        if self._instruction is None and not cfg.default_instruction:
            reason = "waiting for an instruction"
        elif self._frame is None:
            reason = "waiting for an image"
        elif now - self._frame.received > cfg.max_image_age_s:
            reason = f"newest image is {now - self._frame.received:.2f} s old (max_image_age_s {cfg.max_image_age_s})"
            if self._frame.seq > self._used_seq:
                self._used_seq = self._frame.seq
                self._telemetry.frames_stale += 1
        elif cfg.max_instruction_age_s and self._instruction is not None and now - self._instruction[1] > cfg.max_instruction_age_s:
            reason = f"instruction is {now - self._instruction[1]:.2f} s old (max_instruction_age_s {cfg.max_instruction_age_s})"
        elif cfg.use_joint_state and self._state is None:
            reason = f"joint state invalid: {self._state_error}" if self._state_error else "waiting for joint states"
        elif self._state_lags(self._frame) and now - self._frame.received > max(0.1, cfg.joint_state_max_skew_s):
            lag = self._frame.stamp - self._state_stamp
            reason = f"newest joint state is {lag:.3f} s older than the image (joint_state_max_skew_s {cfg.joint_state_max_skew_s})"
        self._telemetry.warning = reason
        return reason

    def _state_lags(self, frame: Frame) -> bool:
        """True while no joint state as new as ``frame`` (less the allowed skew) has arrived (caller holds ``_lock``).

        Image and joint state arrive on separate topics; pairing them by header stamp keeps a frame from
        being acted on with the state of another moment. Unstamped messages are not paired.
        """
        cfg = self._cfg
        if not cfg.use_joint_state or self._state is None or cfg.joint_state_max_skew_s < 0:
            return False
        if frame.stamp == 0.0 or self._state_stamp == 0.0:
            return False
        return self._state_stamp < frame.stamp - cfg.joint_state_max_skew_s

    def _state_at(self, frame: Frame) -> tuple[bool, np.ndarray | None]:
        """(found, the joint state of ``frame``'s moment) once no state is missing (caller holds ``_lock``).

        The recent state stamped nearest to the frame, when it lies within ``joint_state_max_skew_s``;
        none does when the state of that moment was lost (best-effort transport): the frame is skipped.
        A state newer than the frame is no better than an older one, the robot may have moved since the
        picture was taken. Unstamped frames or states get the newest state.
        """
        cfg = self._cfg
        if self._state is None or not frame.stamp or not self._state_stamp or cfg.joint_state_max_skew_s < 0:
            return True, self._state
        stamp, state = min(self._recent_states, key=lambda item: abs(item[0] - frame.stamp))
        return abs(stamp - frame.stamp) <= cfg.joint_state_max_skew_s + 1e-6, state

    def _usable_frame(self, now: float) -> Frame | None:
        """The newest frame a step may take now, if any (caller holds ``_lock``): not used yet, inputs fresh,
        its joint state arrived."""
        if self._episode_request is not None or self._watchdog(now):
            return None
        frame = self._frame
        if frame is None or frame.seq <= self._used_seq or self._state_lags(frame):
            return None  # each frame is acted on once; a frame waits for the joint state of its moment
        return frame

    def _submit_step(self) -> None:
        """Hand the worker the next step ``ControlLoop.plan`` asks for, once its start is less than a period away.

        The job waits for its start time and takes the newest frame then. A step due now needs a frame now;
        otherwise a frame's arrival calls this again.
        """
        if self._future is not None or not self._ready or self._loop is None:
            return
        now = time.monotonic()
        plan = self._loop.plan(now)
        if plan is None or plan.start_at > now + self._loop.cfg.period:
            return
        with self._lock:
            if self._episode_request is not None or (plan.start_at <= now and self._usable_frame(now) is None):
                return  # a new episode starts first; a step due now needs a frame now
            episode = self._episode
        self._cancel = threading.Event()
        self._loop.started(plan)
        self._future = self._worker.submit(self._step, plan.start_at, self._cancel, episode)
        self._future.add_done_callback(self._on_job_done)

    def _collect(self) -> None:
        """Account for a finished worker job: a started episode, or a step's actions (into the loop)."""
        if self._future is None or not self._future.done():
            return
        future, self._future = self._future, None
        try:
            self._take_outcome(future)
        finally:
            self._sync_view(collected=True)  # `stepping` ends with its actions queued, in one step for diagnostics

    def _take_outcome(self, future: Future) -> None:
        try:
            outcome = future.result()
        except BadInputError as e:
            self._report_error(f"image rejected: {e}", kind="input")
            return
        except Exception as e:  # noqa: BLE001 - a failing policy must not take the node down; it is reported
            self._report_error(f"inference failed: {type(e).__name__}: {e}", kind="inference")
            return
        if isinstance(outcome, EpisodeRequest):
            if outcome.error:
                self._report_error(outcome.error, kind="inference")
                return
            self._ready = True
            with self._lock:
                self._used_seq = max(self._used_seq, outcome.frames_before)  # a frame of the old episode is not acted on
                self._telemetry.episode = outcome.episode
                self._telemetry.kv = KVStats()
            return
        if outcome is None or outcome.episode != self._episode or self._loop is None:
            return
        if not np.all(np.isfinite(outcome.actions)):
            self._report_error(f"policy produced non-finite actions {outcome.actions[0].tolist()}", kind="inference")
            self._loop.reset()
            return
        with self._lock:
            self._telemetry.steps += 1
            self._telemetry.step_ms.add(outcome.step_ms)
            self._telemetry.frame_age_ms.add((outcome.started - outcome.frame.received) * 1e3)
            self._telemetry.kv = outcome.result.kv
            hold = bool(self._episode_request is not None or self._watchdog(time.monotonic()))
        if self._chunk_pub is not None and not self._cfg.dry_run:
            chunk, _ = conversions.clip_actions(outcome.result.actions, self._low, self._high)
            self._chunk_pub.publish(conversions.actions_to_msg(chunk))
        now = time.monotonic()
        action = self._loop.on_result(outcome.actions, frame_time=outcome.frame.received, step_s=outcome.turnaround_s, now=now,
                                      started=outcome.started)
        self._latency_mark = (self._loop.placed_from, outcome.frame.received) if self._loop.placed_from is not None else None
        if action is not None and not hold:  # PublishMode.IMMEDIATE
            self._latency_mark = None
            self._publish(action, received=outcome.frame.received)

    def _publish(self, action: np.ndarray, *, received: float | None) -> None:
        action, clipped = conversions.clip_actions(np.asarray(action, dtype=np.float32), self._low, self._high)
        now = time.monotonic()
        with self._lock:
            self._telemetry.values_clipped += clipped
            if received is not None:
                self._telemetry.latency_ms.add((now - received) * 1e3)
            if self._cfg.dry_run:
                self._telemetry.actions_suppressed += 1
                return
            self._telemetry.actions_published += 1
            self._telemetry.action_rate.tick(now)
        self._action_pub.publish(conversions.actions_to_msg(action))
        if self._twist_pub is not None:
            stamp = self.get_clock().now().to_msg()
            twist = conversions.action_to_twist(action, scale=self._cfg.control_rate_hz, stamp=stamp, frame_id=self._cfg.twist_frame_id)
            self._twist_pub.publish(twist)
            if action.shape[0] > 6:
                self._gripper_pub.publish(Float32(data=float(action[6])))

    # ------------------------------------------------------------------ worker jobs
    def _start_episode(self, request: EpisodeRequest) -> EpisodeRequest:
        """Worker: new session, or reset the current one to ``request.instruction``."""
        try:
            if self._session is None:
                self._session = self._policy.new_session(request.instruction, self._cfg.session_config())
            else:
                self._session.reset(request.instruction)
            self.get_logger().info(f"episode {request.episode}: {request.instruction!r}")
            with self._lock:
                request.frames_before = self._frame_seq
        except Exception as e:  # noqa: BLE001 - reported to the service caller and on /diagnostics
            self._session = None
            request.error = f"could not start episode {request.episode}: {type(e).__name__}: {e}"
        request.applied.set()
        return request

    def _step(self, start_at: float, cancel: threading.Event, episode: int) -> StepOutcome | None:
        """Worker: wait until ``start_at``, take the newest usable frame, decode it and run ``session.step``.

        ``None`` when cancelled, or when no frame is usable at the start (the next tick or frame plans again).
        """
        if cancel.wait(max(0.0, start_at - time.monotonic())):
            return None
        with self._lock:
            frame = self._usable_frame(time.monotonic())
            if frame is None or episode != self._episode:
                return None
            self._used_seq = frame.seq
            found, state = self._state_at(frame)
            if not found:
                self._telemetry.frames_unpaired += 1
                return None
            self._busy = True
        started, start = time.monotonic(), time.perf_counter()
        try:
            if isinstance(frame.msg, Image):
                image = conversions.image_msg_to_array(frame.msg, max_pixels=self._cfg.max_image_pixels)
            else:
                image = conversions.compressed_msg_to_array(frame.msg, max_pixels=self._cfg.max_image_pixels)
        except ValueError as e:
            raise BadInputError(str(e)) from e
        stamp = frame.msg.header.stamp
        obs = Observation(images={PRIMARY_CAMERA: image}, state=state, t=stamp.sec + stamp.nanosec * 1e-9)
        result = self._session.step(obs)
        horizon = self._cfg.execution_horizon or len(result.actions)
        step_ms = (time.perf_counter() - start) * 1e3
        turnaround = time.monotonic() - start_at
        return StepOutcome(episode, np.asarray(result.actions[:horizon]), result, step_ms, frame, started, turnaround)

    # ------------------------------------------------------------------ diagnostics
    def _report_error(self, message: str, *, kind: str) -> None:
        self.get_logger().error(message, throttle_duration_sec=1.0)
        with self._lock:
            self._telemetry.error(message, kind=kind)
        self._publish_diagnostics()

    def _publish_diagnostics(self) -> None:
        if self._diag_pub is None:
            return
        with self._lock:
            state = "active" if self._active else "inactive"
            outputs = {"action": self._action_pub, "chunk": self._chunk_pub, "twist": self._twist_pub, "gripper": self._gripper_pub}
            live = {
                "queue_len": self._loop_view.get("queue_len", 0),
                "frames_pending": int(self._frame is not None and self._frame.seq > self._used_seq),
                "stepping": self._busy,
                **{k: v for k, v in self._loop_view.items() if k != "queue_len"},
                **{f"{topic}_subscribers": pub.get_subscription_count() for topic, pub in outputs.items() if pub is not None},
            }
            status = self._telemetry.status(
                name=f"{self.get_fully_qualified_name()}: policy",
                hardware_id=self._device,
                state=state,
                now=time.monotonic(),
                live=live,
            )
        msg = DiagnosticArray(status=[status])
        msg.header.stamp = self.get_clock().now().to_msg()
        self._diag_pub.publish(msg)


def control_values(loop: ControlLoop | None, cfg: PolicyNodeConfig | None) -> dict[str, object]:
    """The control loop's counters for /diagnostics (since activation)."""
    if loop is None or cfg is None:
        return {}
    stats = loop.stats
    return {
        "schedule": cfg.schedule, "publish_mode": cfg.publish_mode, "fallback": cfg.fallback,
        "step_plan_ms": loop.lead() * 1e3, "ticks": stats.ticks, "fallbacks": stats.fallbacks,
        "steps_late": stats.steps_late, "actions_skipped": stats.actions_skipped, "actions_blended": stats.actions_blended,
        "actions_immediate": stats.immediate, "phase_shifts": stats.phase_shifts,
    }


def action_bounds(cfg: PolicyNodeConfig, action_dim: int) -> tuple[np.ndarray | None, np.ndarray | None]:
    """``action_low`` / ``action_high`` as float32 [action_dim] arrays (``None`` = no clipping)."""
    if not cfg.action_low:
        return None, None
    if len(cfg.action_low) != action_dim:
        raise ValueError(f"`action_low`/`action_high` have {len(cfg.action_low)} values; the policy's actions have {action_dim}")
    return np.asarray(cfg.action_low, dtype=np.float32), np.asarray(cfg.action_high, dtype=np.float32)


def start_policy_node(stop: Stop) -> PolicyNode:
    """The node of ``main``: configured and activated unless ``autostart`` is off."""
    node = PolicyNode()
    if node.get_parameter("autostart").value:
        if node.trigger_configure() != TransitionCallbackReturn.SUCCESS:
            node.destroy_node()
            raise NodeStartError(f"configure failed: {node.configure_error}")
        node.trigger_activate()
    return node


def main(args: list[str] | None = None) -> NoReturn:
    """``python -m vla_runtime_ros.policy_node --ros-args --params-file FILE`` (or ``ros2 run``); see ``runner``."""
    end_process(run(start_policy_node, args, name="vla_policy", threads=4))


if __name__ == "__main__":
    main()
