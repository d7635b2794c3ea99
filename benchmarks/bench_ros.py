"""ROS overhead of the policy node, and its behaviour under a steady camera stream.

Questions:
1. How much latency does ROS add? Image publish -> action receipt over Fast DDS (node in a
   subprocess, lock-step: one frame, wait for its action), minus the step time (frame decode +
   ``session.step``) the node measured during the same run. Measured at two control rates: actions
   go out on control ticks, so part of the overhead is waiting for the tick (at most one period).
   ``session.step`` in this process on the same checkpoint and frames is printed for reference.
2. Does anything grow under a 30 Hz camera for 60 s (default 5 Hz control)? The node's reported
   queue length, frame-to-action latency early vs late, and its resident memory.

usage: python benchmarks/bench_ros.py [--checkpoint DIR] [--stream-seconds 60] [--out results/bench_ros]
Without --checkpoint it makes a tiny random OpenVLA checkpoint (``vla-runtime make-tiny``) when the
OpenVLA family is available, else it uses the ROS tests' deterministic test policy.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
TEST_DIR = REPO / "ros2_ws" / "src" / "vla_runtime_ros" / "test"
sys.path.insert(0, str(TEST_DIR))  # the ROS test harness: node subprocesses, waiting on conditions

import vla_runtime_ros  # noqa: E402,F401  (first: library path of the pip ROS wheels)
from vla_runtime.bench.harness import environment, pinned_threads, time_ms, write_json  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", type=Path, help="policy checkpoint (default: a tiny one made here)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=1, help="torch threads, here and in the node")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--repeats", type=int, default=30, help="lock-step frames per control rate")
    p.add_argument("--rates", type=float, nargs="+", default=[100.0, 10.0], help="control rates for the latency runs")
    p.add_argument("--size", type=int, nargs=2, default=[480, 640], metavar=("H", "W"), help="camera frame size")
    p.add_argument("--stream-seconds", type=float, default=60.0)
    p.add_argument("--stream-hz", type=float, default=30.0)
    p.add_argument("--stream-control-hz", type=float, default=5.0)
    p.add_argument("--warmup-seconds", type=float, default=3.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--control-rates", type=float, nargs="*", default=[5.0, 10.0, 30.0, 100.0],
                   help="issue 16 table: control rates compared old (asap) vs deadline scheduling; none = skip")
    p.add_argument("--control-seconds", type=float, default=60.0, help="camera stream per control-table cell")
    p.add_argument("--chunk-step-periods", type=float, default=3.0, help="chunk policy: step time in control periods")
    p.add_argument("--step-quantile", type=float, default=0.5, help="the new loop's step_quantile")
    p.add_argument("--margin-ms", type=float, default=1.0, help="the new loop's schedule_margin_ms")
    p.add_argument("--frame-guard-ms", type=float, default=0.0, help="the new loop's frame_guard_ms (align_to_frames)")
    p.add_argument("--align-quantile", type=float, default=0.5, help="the new loop's align_quantile (align_to_frames)")
    p.add_argument("--frame-wait-ms", type=float, default=5.0, help="the new loop's frame_wait_ms (0: off)")
    p.add_argument("--late-grace-ms", type=float, default=float("inf"),
                   help="the new loop's late_grace_ms (capped at 0.45 of a period by the loop; default inf: the cap)")
    p.add_argument("--control-thread-priority", type=int, default=0,
                   help="both loops' control_thread_priority (0, the node's default: normal scheduling; 1-99: SCHED_FIFO)")
    p.add_argument("--publish-mode", choices=("tick", "immediate"), default="tick",
                   help="the new loop's publish_mode (immediate: a step's action goes out when computed)")
    p.add_argument("--policies", nargs="+", choices=["openvla", "chunk"], default=["openvla", "chunk"],
                   help="control table: the tiny OpenVLA and/or the slow chunk test policy")
    p.add_argument("--skip-overhead", action="store_true", help="only the control table")
    p.add_argument("--out", type=Path, default=REPO / "results" / "bench_ros")
    return p.parse_args(argv)


def make_checkpoint(root: Path) -> tuple[Path, list[str]]:
    """(checkpoint, policy_modules): a tiny OpenVLA when the family exists, else the test policy."""
    import vla_runtime.models  # noqa: F401  (registers the families)
    from vla_runtime import api, cli

    if "openvla" in api.FAMILIES:
        out = root / "tiny-openvla"
        if cli.main(["make-tiny", "--family", "openvla", str(out)]) != 0:
            raise RuntimeError("vla-runtime make-tiny failed")
        return out, []
    from ros_test_policy import write_checkpoint

    return write_checkpoint(root / "ros-test-policy"), ["ros_test_policy"]


def frames(n: int, size: tuple[int, int], seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, size=(*size, 3), dtype=np.uint8) for _ in range(n)]


def step_times_ms(checkpoint: Path, modules: list[str], images: list[np.ndarray], args) -> list[float]:
    """``session.step`` wall time in this process (the model cost the ROS path also pays), a new frame per call;
    the first ``--warmup`` calls are not timed."""
    import importlib

    from vla_runtime.api import Observation, load_policy

    for module in modules:
        importlib.import_module(module)
    with pinned_threads(args.threads):
        session = load_policy(checkpoint, device=args.device).new_session("pick up the cup")
        frames_left = iter(images)

        def step():
            session.step(Observation(images={"primary": next(frames_left)}))

        return time_ms(step, warmup=args.warmup, repeats=len(images) - args.warmup, device=args.device)


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def start_node(harness, checkpoint, modules, tmp: Path, name: str, rate: float, args, **extra):
    from ros_harness import Diagnostics
    from ros_nodes import NodeProcess

    params = dict(checkpoint=str(checkpoint), policy_modules=modules, device=args.device, control_rate_hz=rate,
                  torch_threads=args.threads, diagnostics_rate_hz=2.0, max_image_age_s=2.0,
                  default_instruction="pick up the cup", **extra)
    proc = NodeProcess("policy_node", params, tmp, name="vla_policy", namespace=f"/{name}")
    diag = Diagnostics(harness, f"/{name}/vla_policy")
    diag.wait(lambda s, v: v["state"] == "active" and v["episode"] == "1", timeout=120, what=f"the node\n{proc.output()}")
    return proc, diag


def latency_run(harness, checkpoint, modules, tmp, rate, images, args) -> dict:
    from rclpy.qos import qos_profile_sensor_data
    from ros_harness import wait_for
    from sensor_msgs.msg import Image
    from std_msgs.msg import Float32MultiArray
    from vla_runtime_ros import conversions

    name = f"lat{int(rate)}"
    proc, diag = start_node(harness, checkpoint, modules, tmp, name, rate, args)
    actions = harness.subscribe(Float32MultiArray, f"/{name}/vla_policy/action", publishers=1)
    pub = harness.publisher(Image, f"/{name}/image_raw", qos_profile_sensor_data)
    msgs = [conversions.array_to_image_msg(image) for image in images]
    latencies = []
    try:
        for i, msg in enumerate(msgs):
            count = len(actions)
            sent = time.monotonic()
            pub.publish(msg)
            wait_for(lambda count=count: len(actions) > count, 30, f"the action for frame {i}")
            if i >= args.warmup:
                latencies.append((actions.items[count].t - sent) * 1e3)
        values = diag.latest()
    finally:
        proc.interrupt()
        proc.close()
    return {"control_rate_hz": rate, "latency_ms": latencies, "node_step_ms_p50": float(values["step_ms_p50"])}


def stream_run(harness, checkpoint, modules, tmp, args) -> dict:
    from rclpy.qos import qos_profile_sensor_data
    from ros_harness import camera_clock
    from sensor_msgs.msg import Image
    from std_msgs.msg import Float32MultiArray
    from vla_runtime_ros import conversions

    proc, diag = start_node(harness, checkpoint, modules, tmp, "stream", args.stream_control_hz, args)
    actions = harness.subscribe(Float32MultiArray, "/stream/vla_policy/action", publishers=1)
    pub = harness.publisher(Image, "/stream/image_raw", qos_profile_sensor_data)
    msgs = [conversions.array_to_image_msg(image) for image in frames(8, tuple(args.size), args.seed + 1)]
    n = int(args.stream_seconds * args.stream_hz)
    samples = []  # (t, queue_len, latency p50, rss)
    start = time.monotonic()
    mark = len(diag.statuses)
    try:
        for i in camera_clock(args.stream_hz, n):
            pub.publish(msgs[i % len(msgs)])
            for status in diag.statuses[mark:]:
                v = {kv.key: kv.value for kv in status.values}
                samples.append((time.monotonic() - start, int(v["queue_len"]), float(v["latency_ms_p50"]), rss_mb(proc.proc.pid)))
            mark = len(diag.statuses)
        elapsed = time.monotonic() - start
        received = len(actions)
        final = diag.latest()
    finally:
        proc.interrupt()
        proc.close()
    t = np.array([s[0] for s in samples])
    early, late = t < t[-1] * 0.25, t > t[-1] * 0.75
    return {
        "seconds": elapsed,
        "frames_sent": n,
        "frames_received": int(final["frames_received"]),
        "frames_dropped": int(final["frames_dropped"]),
        "frames_stale": int(final["frames_stale"]),
        "actions_received": received,
        "action_rate_hz": received / elapsed,
        "queue_len_max": max(s[1] for s in samples),
        "latency_p50_early_ms": float(np.median([s[2] for s, e in zip(samples, early) if e])),
        "latency_p50_late_ms": float(np.median([s[2] for s, e in zip(samples, late) if e])),
        "rss_mb_early": float(np.median([s[3] for s, e in zip(samples, early) if e])),
        "rss_mb_late": float(np.median([s[3] for s, e in zip(samples, late) if e])),
        "bad_inputs": int(final["bad_inputs"]),
        "inference_errors": int(final["inference_errors"]),
    }


def control_run(harness, checkpoint, modules, tmp, rate, schedule, args, name) -> dict:
    """A 30 Hz camera for ``--control-seconds``: frame->action latency, empty ticks and action timing jitter."""
    from rclpy.qos import qos_profile_sensor_data
    from ros_harness import camera_clock
    from sensor_msgs.msg import Image
    from std_msgs.msg import Float32MultiArray
    from vla_runtime_ros import conversions

    ns = f"{name}_{schedule}_{int(rate)}"
    tuning = ({"step_quantile": args.step_quantile, "schedule_margin_ms": args.margin_ms, "publish_mode": args.publish_mode,
               "late_grace_ms": args.late_grace_ms, "frame_guard_ms": args.frame_guard_ms,
               "align_quantile": args.align_quantile, "frame_wait_ms": args.frame_wait_ms}
              if schedule == "deadline" else {})
    proc, diag = start_node(harness, checkpoint, modules, tmp, ns, rate, args, schedule=schedule,
                            control_thread_priority=args.control_thread_priority, **tuning)
    actions = harness.subscribe(Float32MultiArray, f"/{ns}/vla_policy/action", publishers=1)
    pub = harness.publisher(Image, f"/{ns}/image_raw", qos_profile_sensor_data)
    msgs = [conversions.array_to_image_msg(image) for image in frames(8, tuple(args.size), args.seed + 1)]
    warmup, cell = int(args.warmup_seconds * args.stream_hz), int(args.control_seconds * args.stream_hz)
    first = last = None
    sent: list[float] = []
    # no garbage collection in this process while the camera streams: with it, the camera paused 240-278 ms once
    # in each of three runs (the node's ticks then had no frames to act on); without it, in none of one
    gc.collect()
    gc.freeze()
    gc.disable()
    try:
        # The cell runs from the first diagnostics status after the warm-up to the first after `cell` frames more,
        # and the camera streams until that last one arrives: every tick the two statuses count between them had a
        # steady camera (stopping at the cell's end left up to a status period of ticks, 15 at 30 Hz, without frames).
        opened = mark = None  # the frame the cell opened at; the status count the next status must pass
        for i in camera_clock(args.stream_hz, warmup + cell + int(10 * args.stream_hz)):
            pub.publish(msgs[i % len(msgs)])
            if first is not None:
                sent.append(time.monotonic())
            if i == warmup or (opened is not None and i == opened + cell):
                mark = len(diag.statuses)  # the next status from here opens (closes) the cell
            if mark is None or not (found := diag.find(lambda s, v: True, after=mark)):
                continue
            if first is None:
                first, start, opened, mark = found[1], len(actions), i, None
            else:
                last = found[1]
                break
        if last is None:
            raise RuntimeError(f"{ns}: no diagnostics status within 10 s after the cell")
    finally:
        gc.enable()
        gc.unfreeze()
        proc.interrupt()
        proc.close()
    times = np.array([r.t for r in actions.items[start:]])
    gaps = np.diff(times) * 1e3 if len(times) > 2 else np.array([np.nan])
    ticks = int(last["ticks"]) - int(first["ticks"])
    return {"rate": rate, "schedule": schedule, "ticks": ticks, "empty_ticks": int(last["fallbacks"]) - int(first["fallbacks"]),
            "late_ticks": int(last.get("ticks_late", 0)) - int(first.get("ticks_late", 0)),
            "missed_ticks": int(last.get("ticks_missed", 0)) - int(first.get("ticks_missed", 0)),
            "steps_without_frame": int(last.get("steps_without_frame", 0)) - int(first.get("steps_without_frame", 0)),
            "latency_p50": float(last["latency_ms_p50"]), "latency_p95": float(last["latency_ms_p95"]),
            "frame_age_p50": float(last["frame_age_ms_p50"]), "step_plan_ms": float(last["step_plan_ms"]),
            "step_p50": float(last["step_ms_p50"]), "step_p95": float(last["step_ms_p95"]),
            "jitter_ms": float(np.std(gaps)), "actions": len(times), **camera_gaps(sent, args.stream_hz)}


def camera_gaps(sent: list[float], hz: float) -> dict:
    """The benchmark's own camera: intervals between its publishes over 1.5 periods (a tick that needed a fresh
    frame then had none, whatever the node did) and the longest interval, ms."""
    intervals = np.diff(sent) if len(sent) > 1 else np.array([0.0])
    return {"camera_gaps": int(np.sum(intervals > 1.5 / hz)), "camera_max_gap_ms": float(intervals.max() * 1e3)}


def control_table(harness, tmp, args) -> list[dict]:
    """Old (asap) vs new (deadline) loop at each rate, for a tiny OpenVLA and a slow chunk policy."""
    from ros_test_policy import write_checkpoint

    openvla, modules = make_checkpoint(tmp)
    chunk_name = f"chunk16 step {args.chunk_step_periods:g}T"
    runs = []
    for rate in args.control_rates:
        chunk = write_checkpoint(tmp / f"chunk{int(rate)}", chunk_size=16, step_ms=args.chunk_step_periods * 1e3 / rate)
        for policy in args.policies:
            for schedule in ("asap", "deadline"):
                if policy == "openvla":
                    run = control_run(harness, openvla, modules, tmp, rate, schedule, args, "ov")
                else:
                    run = control_run(harness, chunk, ["ros_test_policy"], tmp, rate, schedule, args, "ch")
                runs.append({"policy": "openvla" if policy == "openvla" else chunk_name, **run})
    print(f"control loop: {args.stream_hz:g} Hz camera, {args.control_seconds:g} s per cell; old = the asap loop (a step "
          "as soon as a frame arrives and the queue is empty, as before issue 16), new = deadline scheduling "
          f"(step_quantile {args.step_quantile:g}, margin {args.margin_ms:g} ms, frame guard {args.frame_guard_ms:g} ms, align quantile {args.align_quantile:g}, frame wait {args.frame_wait_ms:g} ms, late_grace {args.late_grace_ms:g} ms, publish_mode {args.publish_mode}; control thread priority {args.control_thread_priority} in both). "
          "latency = frame receipt -> action published; age = frame receipt -> step start; plan = the step time "
          "the schedule plans with; empty = ticks without an action of their own; late = ticks whose step overran them "
          "by less than late_grace_ms, published when it landed; missed = ticks the node's control thread reached more "
          "than a period late (it runs the latest one due; nothing published for those before; not in ticks); jitter = std of action inter-arrival; "
          "camera gaps = the benchmark camera's publish intervals over 1.5 periods in the new loop's cell (longest interval, ms); "
          "no frame = the new loop's steps that found no new frame at their start and in their frame wait (the camera late)")
    print("policy               |  Hz | step p50/p95 ms | latency p50 old -> new | latency p95 old -> new | "
          "age p50 old -> new | plan ms | empty/ticks old -> new | late new | missed old -> new | jitter ms old -> new | camera gaps "
          "| no frame")
    for old, new in zip(runs[::2], runs[1::2]):
        print(f"{new['policy']:20s} | {new['rate']:3.0f} | {new['step_p50']:6.1f} / {new['step_p95']:6.1f} | "
              f"{old['latency_p50']:8.1f} -> {new['latency_p50']:7.1f}   | {old['latency_p95']:8.1f} -> {new['latency_p95']:7.1f}   | "
              f"{old['frame_age_p50']:6.1f} -> {new['frame_age_p50']:6.1f} | {new['step_plan_ms']:7.1f} | "
              f"{old['empty_ticks']:4d}/{old['ticks']:<4d} -> {new['empty_ticks']:4d}/{new['ticks']:<4d} | {new['late_ticks']:8d} | "
              f"{old['missed_ticks']:5d} -> {new['missed_ticks']:5d} | {old['jitter_ms']:6.2f} -> {new['jitter_ms']:6.2f} | "
              f"{new['camera_gaps']:3d} ({new['camera_max_gap_ms']:.0f}) | {new['steps_without_frame']:5d}")
    return runs


def main(argv=None) -> int:
    args = parse_args(argv)
    from ros_domain import claim_domain

    domain, _lock = claim_domain()  # a DDS domain of its own, this machine only; held until the process ends
    os.environ["ROS_DOMAIN_ID"] = str(domain)
    os.environ["ROS_AUTOMATIC_DISCOVERY_RANGE"] = "LOCALHOST"
    # VGA frames are 0.9 MB: the shipped shared-memory profile carries them best effort (see its comment)
    os.environ.setdefault("FASTDDS_DEFAULT_PROFILES_FILE", str(REPO / "ros2_ws/src/vla_runtime_ros/config/fastdds_large_frames.xml"))
    from ros_harness import Harness

    tmp = Path(tempfile.mkdtemp(prefix="bench_ros_"))
    results = {}
    if args.control_rates:
        harness = Harness("bench_ros_control")
        try:
            results["control"] = control_table(harness, tmp, args)
        finally:
            harness.close()
    if args.skip_overhead:
        write_json(f"{args.out}.json", env=environment(device=args.device, threads=args.threads), args=args, results=results)
        return 0
    checkpoint, modules = (args.checkpoint, []) if args.checkpoint else make_checkpoint(tmp)
    images = frames(args.warmup + args.repeats, tuple(args.size), args.seed)
    step = step_times_ms(checkpoint, modules, images, args)
    step_p50 = float(np.median(step))

    harness = Harness("bench_ros")
    try:
        runs = [latency_run(harness, checkpoint, modules, tmp, rate, images, args) for rate in args.rates]
        stream = stream_run(harness, checkpoint, modules, tmp, args)
    finally:
        harness.close()

    print(f"checkpoint {checkpoint}  frames {args.size[1]}x{args.size[0]} rgb8  threads {args.threads}")
    print(f"reference: session.step in this process, median {step_p50:.2f} ms (p10 {np.percentile(step, 10):.2f}, "
          f"p90 {np.percentile(step, 90):.2f})")
    print("control Hz | publish->action median ms | p10 | p90 | node step p50 ms | ROS overhead ms | tick period ms")
    results["session_step_ms"] = {"times_ms": step, "median_ms": step_p50}
    for run in runs:
        lat = run["latency_ms"]
        median = float(np.median(lat))
        overhead = median - run["node_step_ms_p50"]
        print(f"{run['control_rate_hz']:10.1f} | {median:25.2f} | {np.percentile(lat, 10):5.2f} | {np.percentile(lat, 90):6.2f} | "
              f"{run['node_step_ms_p50']:16.2f} | {overhead:15.2f} | {1e3 / run['control_rate_hz']:.1f}")
        results[f"latency_at_{run['control_rate_hz']:g}hz"] = {
            "times_ms": lat, "median_ms": median, "overhead_ms": overhead, "node_step_ms_p50": run["node_step_ms_p50"],
        }
    print(f"stream {args.stream_hz:g} Hz camera, {args.stream_control_hz:g} Hz control, {stream['seconds']:.0f} s: "
          f"{stream['frames_received']}/{stream['frames_sent']} frames received, {stream['frames_dropped']} replaced before use "
          f"(newest-frame policy), {stream['frames_stale']} stale; {stream['actions_received']} actions = "
          f"{stream['action_rate_hz']:.2f} Hz; queue max {stream['queue_len_max']}; frame->action latency p50 "
          f"{stream['latency_p50_early_ms']:.1f} ms early vs {stream['latency_p50_late_ms']:.1f} ms late; node RSS "
          f"{stream['rss_mb_early']:.0f} MB early vs {stream['rss_mb_late']:.0f} MB late; "
          f"errors {stream['bad_inputs'] + stream['inference_errors']}")
    results["stream"] = stream

    write_json(f"{args.out}.json", env=environment(device=args.device, threads=args.threads), args=args, results=results)
    print(f"wrote {args.out}.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
