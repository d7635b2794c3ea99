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
and the control thread; deactivate stops that thread (the running step finishes and is dropped);
cleanup and shutdown release everything, the policy included.

Threads: subscription callbacks (``input_callbacks.py``) only validate message headers and store the newest
frame. The control thread (``vla_runtime.control.DeadlineTicker``, outside the executor, as ros2_control runs
its update loop; started by activate and joined by deactivate, so it never overlaps a lifecycle transition)
owns the ``vla_runtime.control.ControlLoop`` (queued actions, scheduling, fallback), the in-flight
worker job and episode changes. It sleeps until the next tick's due time on the steady clock (the
loop's tick grid, so a phase move to meet the camera, ``align_to_frames``, applies at once) and runs the
tick there: it publishes the tick's action (or the fallback) and asks the loop when the next step should
start; a one-thread worker waits until then, takes the newest frame of that moment, decodes it and runs
``session.step`` (deadline scheduling: the step ends just before the tick it serves). A finished job
wakes the control thread, and so does a frame or joint state while no job is in flight (a job takes the
newest frame itself; none is lost, as the input is stored before the job is read and the thread looks
for frames after clearing the job): results are queued at once (``publish_mode: immediate`` publishes
them at once), and a step due now starts on the frame that just arrived. An executor timer would run
late under load (rclpy's spin thread rebuilds its wait set in Python for every callback) and rcl drops
a callback more than a period late; the thread wakes on time and a late tick is served late, named by
its due time. The executor is rclpy's ``SingleThreadedExecutor``: the callbacks are short (the reset
service waits for the control thread to apply the episode, at most a tick and the step in flight, and
the other callbacks wait meanwhile). A ``MultiThreadedExecutor``'s spin thread hands each ready callback
to its pool again and again until a pool thread starts it (ros2/rclpy#1452), holding the GIL the worker
needs: at 30 Hz with a 30 Hz camera, steps took their frames up to 23 ms after their planned start and 45 of
600 ticks went empty (1 of 600 with one thread; README, ROS section).
"""

from __future__ import annotations

if __name__ == "__main__":  # run as a program: set the process up for the pip ROS wheels before rclpy loads
    from vla_runtime_ros._env import ensure

    ensure()

import importlib  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from concurrent.futures import Future, ThreadPoolExecutor, wait  # noqa: E402
from typing import NoReturn  # noqa: E402

from diagnostic_msgs.msg import DiagnosticArray  # noqa: E402
from rcl_interfaces.msg import SetParametersResult  # noqa: E402
from rclpy.callback_groups import MutuallyExclusiveCallbackGroup  # noqa: E402
from rclpy.event_handler import SubscriptionEventCallbacks  # noqa: E402
from rclpy.lifecycle import LifecycleNode, LifecycleState, TransitionCallbackReturn  # noqa: E402
from rclpy.qos import DurabilityPolicy, QoSProfile, ReliabilityPolicy  # noqa: E402
from sensor_msgs.msg import CompressedImage, Image, JointState  # noqa: E402
from std_srvs.srv import Trigger  # noqa: E402
from vla_runtime.api import load_policy  # noqa: E402
from vla_runtime.control import ControlLoop, DeadlineTicker  # noqa: E402
from vla_runtime.device import release_cached_memory, resolve_device, set_cpu_threads  # noqa: E402
from vla_runtime.models.speed import SPEED_OPTIONS  # noqa: E402

from .episodes import EpisodeRequest, PolicyRunner  # noqa: E402
from .inputs import InputLimits, Inputs  # noqa: E402
from .instructions import LATCHED_QOS, Deduplicator, subscribe_instructions  # noqa: E402
from .outputs import ActionOutputs  # noqa: E402
from .param_specs import declare_config, read_config  # noqa: E402
from .params import PolicyNodeConfig  # noqa: E402
from .policy_control import PolicyControl  # noqa: E402
from .input_callbacks import InputCallbacks  # noqa: E402
from .runner import NodeStartError, Stop, run_node  # noqa: E402
from .telemetry import PolicyTelemetry  # noqa: E402

SENSOR_QOS = QoSProfile(depth=1, reliability=ReliabilityPolicy.BEST_EFFORT, durability=DurabilityPolicy.VOLATILE)
IMAGE_RELIABILITY = {"best_effort": ReliabilityPolicy.BEST_EFFORT, "reliable": ReliabilityPolicy.RELIABLE}
INSTRUCTION_QOS = LATCHED_QOS  # what the planner publishes with; volatile publishers are accepted too
# parameters that may change while configured; the rest are read by on_configure
RUNTIME_PARAMETERS = ("dry_run",)


class PolicyNode(InputCallbacks, PolicyControl, LifecycleNode):
    """Runs ``load_policy(checkpoint)`` sessions behind ROS topics (see the module docstring)."""

    def __init__(self, node_name: str = "vla_policy", **kwargs) -> None:
        self._cfg: PolicyNodeConfig | None = None
        self._device = ""
        self._runner: PolicyRunner | None = None  # the policy and the episode's session; touched by worker jobs only
        self._outputs: ActionOutputs | None = None
        self._worker: ThreadPoolExecutor | None = None
        self._loop: ControlLoop | None = None  # scheduling, queued actions, fallback; touched by the control thread only
        self._ready = False  # the episode's session exists (set when the worker applied an episode request)
        self._future: Future | None = None
        self._cancel = threading.Event()  # set: a step job still waiting for its start time gives up
        self._busy = False  # the worker computes a step (not waiting for its start) or its actions are not queued yet
        self._loop_view: dict[str, object] = {}  # the loop's state for diagnostics (``_sync_view``)
        self._latency_mark: tuple[int, float] | None = None  # (first tick of the newest step, its frame's receipt)
        self._episode_request: EpisodeRequest | None = None
        self._instruction_seen = Deduplicator()
        self._control_thread: DeadlineTicker | None = None  # runs the ticks (and wakes between them) while active
        self._diag_timer = None
        self._diag_pub = None
        self._reset_srv = None
        self._input_subs: list = []
        self.configure_error = ""  # why the last configure failed
        self._active = False  # before the node exists: a parameter refused at declaration still runs destroy_node
        super().__init__(node_name, **kwargs)
        declare_config(self, PolicyNodeConfig)
        self.add_on_set_parameters_callback(self._on_set_parameters)
        self._lock = threading.Lock()  # guards everything the callbacks share below
        self._frame_arrived = threading.Condition(self._lock)  # a step waiting for a frame due (``frame_wait_ms``)
        self._inputs = Inputs(InputLimits())
        self._episode_instruction: str | None = None
        self._episode_failure = ""  # why the last episode did not start ('' once one did)
        self._episode = 0
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
            set_cpu_threads(cfg.torch_threads)
            options = cfg.load_options(device)
            speed = "".join(f", {k} {getattr(v, 'value', v)}" for k, v in options.items() if k in SPEED_OPTIONS)
            self.get_logger().info(f"loading {cfg.checkpoint} on {device}{speed}")
            policy = load_policy(cfg.checkpoint, **options)
            cfg.check_action_dim(policy.action_dim)
            self._outputs = ActionOutputs(self, cfg, action_dim=policy.action_dim, chunk_size=policy.chunk_size)
        except (ValueError, KeyError, OSError, ImportError, RuntimeError) as e:
            self.configure_error = str(e)
            self.get_logger().error(f"configure failed: {e}")
            return TransitionCallbackReturn.FAILURE
        except Exception as e:  # noqa: BLE001 - e.g. a policy_modules plug-in's bug: said (rclpy's lifecycle would swallow it)
            self.configure_error = f"{type(e).__name__}: {e}"
            self.get_logger().error(f"configure failed: {self.configure_error}\n{traceback.format_exc()}")
            return TransitionCallbackReturn.FAILURE
        self._cfg, self._device = cfg, device
        self._runner = PolicyRunner(policy, cfg.session, max_image_pixels=cfg.max_image_pixels)
        with self._lock:
            self._telemetry = PolicyTelemetry()
            self._episode = 0
            self._inputs.limits = cfg.input_limits()

        inputs = MutuallyExclusiveCallbackGroup()
        image_type, image_topic = (Image, "image_raw") if cfg.image_transport == "raw" else (CompressedImage, "image_raw/compressed")
        image_qos = QoSProfile(depth=1, reliability=IMAGE_RELIABILITY[cfg.image_reliability], durability=DurabilityPolicy.VOLATILE)
        self._input_subs.append(self.create_subscription(
            image_type, image_topic, self._on_image, image_qos, callback_group=inputs,
            event_callbacks=SubscriptionEventCallbacks(incompatible_qos=self._on_incompatible_image_qos),
        ))
        self._input_subs.extend(subscribe_instructions(self, self._on_instruction, self._on_incompatible_instruction_qos, inputs))
        if cfg.use_joint_state:
            self._input_subs.append(
                self.create_subscription(JointState, "joint_states", self._on_joint_state, SENSOR_QOS, callback_group=inputs)
            )
        self._diag_pub = self.create_publisher(DiagnosticArray, "/diagnostics", 10)
        self._reset_srv = self.create_service(Trigger, "~/reset", self._on_reset, callback_group=MutuallyExclusiveCallbackGroup())
        self._diag_timer = self.create_timer(
            1.0 / cfg.diagnostics_rate_hz, self._publish_diagnostics, callback_group=MutuallyExclusiveCallbackGroup()
        )
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vla_policy_step")
        self.get_logger().info(
            f"configured: {type(policy).__name__} action_dim={policy.action_dim} chunk={policy.chunk_size} "
            f"history={cfg.session.history.value} kv={cfg.session.kv.mode.value} control={cfg.control_rate_hz} Hz dry_run={cfg.dry_run}"
        )
        return TransitionCallbackReturn.SUCCESS

    def on_activate(self, state: LifecycleState) -> TransitionCallbackReturn:
        """Start a new episode (current instruction, else ``default_instruction``) and the control thread."""
        chunked = self._runner.policy.chunk_size > 1 and self._cfg.session.execution_horizon != 1
        loop = ControlLoop(self._cfg.control_config(), t0=time.monotonic(), chunked=chunked)
        self._loop = loop
        with self._lock:
            self._active = True
            self._inputs.skip_frames_until(self._inputs.frame_seq)  # frames from before activation are not acted on
            text = self._inputs.current_instruction()
            if text:
                self._request_episode(text)
        self._control_thread = DeadlineTicker(
            next_due=lambda: loop.grid.time(loop.served + 1), period=loop.cfg.period, on_tick=self._on_control_tick,
            on_wake=self._on_frame_ready, on_error=self._on_control_error, name="vla_policy_control",
        )
        refused = self._control_thread.start(priority=self._cfg.control_thread_priority)
        if refused:
            self.get_logger().warning(refused)
        self.get_logger().info("active")
        return super().on_activate(state)

    def on_deactivate(self, state: LifecycleState) -> TransitionCallbackReturn:
        """Stop the control thread; the step in flight finishes and its action is dropped."""
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
        with self._lock:  # a wake from now on finds no thread
            thread, self._control_thread = self._control_thread, None
        if thread is not None:
            thread.stop()  # the tick running finishes first
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
        self._loop, self._ready, self._busy = None, False, False
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
        with self._lock:  # diagnostics stop reading the publishers
            outputs, self._outputs = self._outputs, None
        if outputs is not None:
            outputs.destroy()
        if self._diag_timer is not None:
            self.destroy_timer(self._diag_timer)
            self._diag_timer = None
        if self._diag_pub is not None:
            self.destroy_publisher(self._diag_pub)
            self._diag_pub = None
        if self._reset_srv is not None:
            self.destroy_service(self._reset_srv)
            self._reset_srv = None
        if self._runner is not None:
            self._runner.release()
        self._runner = self._cfg = None
        with self._lock:
            self._episode_instruction, self._episode_failure = None, ""
        release_cached_memory()

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
            return SetParametersResult(successful=False, reason=f"{fixed} are read at configure; cleanup, set, configure again")
        for p in params:  # only dry_run, typed BOOL by its descriptor
            self._cfg.dry_run = p.value
            self.get_logger().warning(f"dry_run = {p.value}")
        return SetParametersResult(successful=True)

    def _on_control_error(self, error: BaseException) -> None:
        """A control tick raised: a bug in the node, reported (log, /diagnostics); the ticks go on."""
        where = traceback.extract_tb(error.__traceback__)[-1] if error.__traceback__ else None
        at = f" at {where.filename}:{where.lineno}" if where else ""
        self._report_error(f"control tick failed: {type(error).__name__}: {error}{at}", kind="control")

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
            live = {
                "queue_len": self._loop_view.get("queue_len", 0),
                "frames_pending": int(self._inputs.pending()),
                "stepping": self._busy,
                **{k: v for k, v in self._loop_view.items() if k != "queue_len"},
                **(self._outputs.subscriber_counts() if self._outputs is not None else {}),
            }
            status = self._telemetry.status(
                name=f"{self.get_fully_qualified_name()}: policy", hardware_id=self._device,
                state="active" if self._active else "inactive", now=time.monotonic(), live=live,
            )
        msg = DiagnosticArray(status=[status])
        msg.header.stamp = self.get_clock().now().to_msg()
        self._diag_pub.publish(msg)


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
    run_node(start_policy_node, args, name="vla_policy", threads=1)


if __name__ == "__main__":
    main()
