"""How a node's process ends, as its supervisor (``ros2 launch``, systemd, docker, a script) sees it.

SIGINT and SIGTERM make a running policy node leave its lifecycle (deactivate, then shut down, which
releases the policy) and exit 0 within the time this machine allows (``NodeProcess.interrupt``); a
node started with ``--exit-with-parent`` (launch files and the harness pass it) does the same when its
parent dies, and ends without starting when the parent died while it was still starting; a node that cannot start
exits 1 with the reason on its last FATAL line; a crash in a callback exits 1 after the node was
released, and a node asking to end (the simulator after its run) exits 0.
"""

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("rclpy")

from rclpy.qos import qos_profile_sensor_data  # noqa: E402
from ros_harness import PATIENCE, Diagnostics, subprocess_env, wait_for  # noqa: E402
from ros_messages import solid_image  # noqa: E402
from ros_nodes import NodeProcess  # noqa: E402
from sensor_msgs.msg import Image  # noqa: E402
from std_msgs.msg import Float32MultiArray  # noqa: E402
from vla_runtime_ros import conversions  # noqa: E402

pytestmark = pytest.mark.ros

CAMERA_HZ = 20.0
# the node's parent in the parent-death test: starts the node, says its pid, waits for it
LAUNCHER = (
    sys.executable, "-c",
    "import subprocess, sys; node = subprocess.Popen(sys.argv[1:]); print(f'node pid {node.pid}', flush=True); node.wait()",
)
# a parent that dies while its node is still starting: it ends once the node has imported rclpy (the package,
# imported first, has noted its parent by then; the node arms its parent-death signal only later, in ``run``)
EARLY_DEATH_LAUNCHER = (
    sys.executable, "-c",
    "import pathlib, subprocess, sys, time; node = subprocess.Popen(sys.argv[1:]); print(f'node pid {node.pid}', flush=True)\n"
    "maps = pathlib.Path(f'/proc/{node.pid}/maps')\n"
    "while node.poll() is None and 'rclpy' not in maps.read_text(): time.sleep(0.005)",
)


class ActivePolicy:
    """A policy node process (test policy) acting on a streamed camera, and what the harness sees of it."""

    def __init__(self, harness, tmp: Path, checkpoint: Path, ns: str, modules: tuple = (), **process) -> None:
        params = dict(checkpoint=str(checkpoint), policy_modules=["ros_test_policy", *modules], default_instruction="pick up the cup",
                      control_rate_hz=20.0, diagnostics_rate_hz=10.0)
        self.harness = harness
        self.diag = Diagnostics(harness, f"{ns}/vla_policy")
        self.actions = harness.subscribe(Float32MultiArray, f"{ns}/vla_policy/action")
        self.camera = harness.stream(Image, f"{ns}/image_raw", qos_profile_sensor_data, CAMERA_HZ,
                                     conversions.array_to_image_msg(solid_image(1)))
        self.proc = NodeProcess("policy_node", params, tmp, name="vla_policy", namespace=ns, **process)

    def wait_acting(self) -> None:
        self.proc.wait_active(self.diag)
        self.actions.wait(2, what=f"actions\n{self.proc.output()}")

    def close(self) -> None:
        self.camera.close(self.harness)
        self.proc.close()


SHM = Path("/dev/shm")


def fastdds_segments_of(pid: int) -> set[Path]:
    """The Fast DDS shared-memory segments (``/dev/shm/fastdds_<16 hex digits>``) process ``pid`` maps: its own
    participant's, and those of the writers its readers receive from."""
    try:
        maps = Path(f"/proc/{pid}/maps").read_text()
    except OSError:  # gone, or not ours to read
        return set()
    return {SHM / m.group(1) for m in re.finditer(r"/dev/shm/(fastdds_[0-9a-f]{16})\b", maps)}


def in_order(text: str, *parts: str) -> bool:
    """Whether ``parts`` occur in ``text`` one after another."""
    at = 0
    for part in parts:
        at = text.find(part, at)
        if at < 0:
            return False
        at += len(part)
    return True


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=lambda s: signal.Signals(s).name)
def test_a_signal_makes_a_running_node_leave_its_lifecycle_and_exit_0(harness, tmp_path, policy_checkpoints, signum):
    name = signal.Signals(signum).name
    before = set(SHM.glob("fastdds_*"))
    node = ActivePolicy(harness, tmp_path, policy_checkpoints["single"], f"/stop_{name.lower()}")
    try:
        node.wait_acting()
        shm = fastdds_segments_of(node.proc.proc.pid) - before  # its own participant's (no other one started since)
        code, _ = node.proc.interrupt(signum=signum)  # raises unless it exits within the machine's patience
    finally:
        node.close()
    out = node.proc.output()
    assert code == 0, out
    assert in_order(out, f"stopping: {name} received", "]: inactive", "shut down from inactive: policy released"), out
    # its DDS participant was deleted: Fast DDS removed its shared memory (left, it would hold tmpfs until a reboot)
    if SHM.is_dir():
        assert shm, "the node mapped no Fast DDS shared memory of its own"
        assert not [f for f in shm if f.exists()], f"left in /dev/shm: {sorted(f.name for f in shm if f.exists())}"


def test_a_sigterm_while_a_stopped_node_ends_its_process_still_exits_0(harness, tmp_path, policy_checkpoints):
    """``ros2 launch`` stops a node with SIGINT, then SIGTERM 5 s later, then SIGKILL. Under the real launch on
    a loaded machine, the planner had stopped on SIGINT but its process was still ending (freeing its
    modules) when the SIGTERM came: killed with -15, and the launch of a clean run exited 1."""
    node = ActivePolicy(harness, tmp_path, policy_checkpoints["single"], "/slow_end", modules=("ros_test_slow_exit",))
    try:
        node.wait_acting()
        node.proc.proc.send_signal(signal.SIGINT)
        # the node stopped and its process is ending (or has ended): then launch's SIGTERM
        wait_for(lambda: not node.proc.alive() or "slow process end: started" in node.proc.output(),
                 what=f"the stopped node's process ending\n{node.proc.output()}")
        if node.proc.alive():
            node.proc.proc.send_signal(signal.SIGTERM)
        code = node.proc.wait_exit()
    finally:
        node.close()
    out = node.proc.output()
    assert code == 0, out
    assert in_order(out, "stopping: SIGINT received", "]: inactive", "shut down from inactive: policy released"), out


def _process_state(pid: int) -> str:
    """The state letter of process ``pid`` ('' once it is gone; 'Z' for a zombie nobody reaped yet)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return ""


def _kill_if_left(pid: int) -> None:
    """SIGKILL the orphan ``pid`` if a failed test left it running (it is not our child: nothing else would)."""
    if _process_state(pid) not in ("", "Z"):
        os.kill(pid, signal.SIGKILL)


def _node_pid(proc: NodeProcess) -> int:
    line = wait_for(lambda: next((x for x in proc.output().splitlines() if x.startswith("node pid ")), None),
                    what=f"the launcher's line naming its node\n{proc.output()}")
    return int(line.split()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="--exit-with-parent uses Linux's PR_SET_PDEATHSIG")
def test_a_node_whose_parent_died_stops_as_on_sigterm(harness, tmp_path, policy_checkpoints):
    # no process_args: the harness starts every node with --exit-with-parent, as the launch files do
    node = ActivePolicy(harness, tmp_path, policy_checkpoints["single"], "/orphan", launcher=LAUNCHER)
    pid = None
    try:
        node.wait_acting()
        pid = _node_pid(node.proc)
        node.proc.proc.kill()  # the parent dies without a word, as `ros2 launch` on SIGKILL (or SIGTERM) does
        node.proc.proc.wait()
        wait_for(lambda: _process_state(pid) in ("", "Z"), what=f"the orphaned node to end\n{node.proc.output()}")
    finally:
        node.close()
        if pid is not None:
            _kill_if_left(pid)
    out = node.proc.output()
    assert in_order(out, "stopping: SIGTERM (the parent process ended) received", "]: inactive", "policy released"), out


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="--exit-with-parent uses Linux's PR_SET_PDEATHSIG")
def test_a_node_whose_parent_died_while_it_started_ends_without_starting(tmp_path, policy_checkpoints):
    """The kernel's parent-death signal is armed only once the node's imports are done (seconds); a parent
    killed before that (a test run killed while it starts a node) must not leave the node running unsupervised."""
    params = dict(checkpoint=str(policy_checkpoints["single"]), policy_modules=["ros_test_policy"], default_instruction="x")
    proc = NodeProcess("policy_node", params, tmp_path, name="vla_policy", namespace="/early_orphan", launcher=EARLY_DEATH_LAUNCHER)
    pid = None
    try:
        pid = _node_pid(proc)
        wait_for(lambda: _process_state(pid) in ("", "Z"), what=f"the node orphaned while starting to end\n{proc.output()}")
    finally:
        proc.close()
        if pid is not None:
            _kill_if_left(pid)
    out = proc.output()
    # ended before its parent-death signal was armed, or (a slow launcher) by that signal: never left running
    assert "stopping: the parent process (pid " in out or "stopping: SIGTERM (the parent process ended) received" in out, out


@pytest.mark.parametrize(("module", "params", "reason"), [
    ("planner_node", {"tick_hz": 10.0}, "parameter `model` is empty; set it to an HF model directory (-p model:=DIR)"),
    ("sim_node", {"sim": "gazebo"}, "unknown simulator 'gazebo'; available: metaworld, rlbench"),
], ids=["planner", "sim"])
def test_a_node_that_cannot_start_exits_1_with_its_reason(tmp_path, module, params, reason):
    proc = NodeProcess(module, params, tmp_path, name="vla_node", namespace="/nostart")
    try:
        code = proc.wait_exit()
    finally:
        proc.close()
    out = proc.output()
    fatal = [line for line in out.splitlines() if "[FATAL]" in line]
    assert code == 1 and fatal and fatal[-1].endswith(f"could not start: {reason}"), out
    assert "Traceback" not in out


def run_ending_node(*args: str) -> dict:
    """Run ``ros_test_ending_node`` in a process of its own (one DDS participant, as a node process has);
    returns its report: ``run``'s exit code, whether the node was destroyed, whether the runner's signal
    handlers were put back."""
    done = subprocess.run([sys.executable, "-m", "ros_test_ending_node", *args], capture_output=True, text=True,
                          env=subprocess_env(), timeout=PATIENCE.timeout(120.0))
    lines = done.stdout.strip().splitlines()
    assert done.returncode == 0 and lines, f"exit {done.returncode}\n{done.stdout}\n{done.stderr}"
    return {**json.loads(lines[-1]), "stderr": done.stderr}


def test_a_node_under_a_real_time_policy_warns():
    """rclpy's MultiThreadedExecutor busy-waits for its pool threads; under SCHED_FIFO/RR that can stop every callback."""
    report = run_ending_node("done", "--pretend-fifo")
    assert report["code"] == 0
    assert "runs under the real-time policy SCHED_FIFO" in report["stderr"]


@pytest.mark.parametrize(("crash", "code"), [(True, 1), (False, 0)], ids=["crash", "done"])
def test_a_crash_exits_1_and_a_finished_node_0_both_after_releasing_it(crash, code):
    report = run_ending_node("crash" if crash else "done")
    assert report["code"] == code, report["stderr"]
    assert report["destroyed"]
    assert report["handlers_restored"]  # the runner's handlers are gone again
    if crash:
        assert "a bug in a callback" in report["stderr"]


STOP_ON_ANOTHER_THREAD = r"""
import signal, sys, threading
from vla_runtime_ros.runner import Stop

stop = Stop()
signal.signal(signal.SIGTERM, lambda signum, frame: stop.request("SIGTERM received"))
main_id, main_tid = threading.get_ident(), threading.get_native_id()
announced = threading.Event()

def asleep_in_stop_wait():
    frame = sys._current_frames()[main_id]
    in_wait = frame.f_code.co_name == "wait" and frame.f_code.co_filename.endswith("threading.py")
    state = open(f"/proc/self/task/{main_tid}/stat").read().rsplit(")", 1)[1].split()[0]
    return in_wait and state == "S"

def elsewhere():
    announced.wait()
    while not asleep_in_stop_wait():  # the main thread asleep inside Stop.wait's Event.wait
        pass
    signal.pthread_kill(threading.get_ident(), signal.SIGTERM)  # to this thread only, as the kernel may

threading.Thread(target=elsewhere, daemon=True).start()
announced.set()
stop.wait()
print(stop.reason, flush=True)
"""


def test_a_stop_signal_the_kernel_hands_to_another_thread_still_stops_the_node():
    """A process-directed SIGINT/SIGTERM may land on any thread that does not block it (DDS, torch); Python
    runs the handler in the main thread only, so a main thread asleep in ``Stop.wait`` must wake up for it."""
    done = subprocess.run([sys.executable, "-c", STOP_ON_ANOTHER_THREAD], capture_output=True, text=True,
                          env=subprocess_env(), timeout=PATIENCE.timeout(60.0))
    assert (done.returncode, done.stdout.strip()) == (0, "SIGTERM received"), done.stderr
