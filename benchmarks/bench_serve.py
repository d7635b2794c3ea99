"""Load on ``vla-runtime serve``: N robots (openpi's own client) at a fixed control rate, micro-batched
steps vs one step at a time, measured in the same run.

For each number of clients (``--clients 1 2 4 8``) and each round (``--repeats``), the same client load is
driven against two servers of the same policy, in turn: ``batched`` (``--max-batch``, default 8) and
``one-at-a-time`` (``max_batch=1``). Clients run in a child process (``--client`` mode; results come back
as JSON on stdout), each a thread with its own connection, its own episode (history mode by default) and
prompts of different lengths; a client sends a step every ``1 / --rate-hz`` s (at once when its previous
reply came late; ``--rate-hz 0``: as fast as replies come). Reported per variant: aggregate actions/s and
p50/p95 step latency (send -> reply, milliseconds), each the median over rounds; ratios batched /
one-at-a-time. The issue's targets (CPU, small geometry): 8 robots at >= 3x the aggregate actions/s of
one-at-a-time, with p95 latency <= 2x a single robot's. ``--compile default`` (or ``reduce-overhead`` on CUDA)
adds a third server, one at a time with compiled sessions (``serve --compile ... --max-batch 1``; each robot's
session compiles and warms up when it connects, in its untimed steps).

    python benchmarks/bench_serve.py --threads 1 --repeats 3                   # small decoder (512 x 8)
    python benchmarks/bench_serve.py --llm tiny --steps 20 --repeats 3         # the test geometry, a quick look
    python benchmarks/bench_serve.py --llm tiny --soak 600 --clients 8         # soak: RSS over time, errors

``--soak SECONDS``: instead, ``max(--clients)`` robots connect, run 1..10 steps (one in five also sends a
malformed message, which must be answered with an error text), disconnect and reconnect, for that long,
against the batched server; the server's RSS is sampled every 5 s. Reported: RSS at the first and last
sample and its maximum (MiB), steps, connections, unexpected errors, sessions left open.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from vla_runtime.bench.harness import environment, pinned_threads, positive_int, write_json

COMPILED = "one at a time, compiled"  # the third server of --compile
PROMPTS = ["pick up the red cube", "open the top drawer", "put the blue block on the green plate near the bowl",
           "close it", "push the button", "stack the cups on the left side of the table", "reach the goal", "wipe"]  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--llm", choices=["tiny", "small"], default="small", help="decoder geometry of the random checkpoint")
    p.add_argument("--clients", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--rate-hz", type=float, default=10.0, help="steps per second each client asks for (0: closed loop)")
    p.add_argument("--steps", type=int, default=30, help="timed steps per client per round")
    p.add_argument("--phases", choices=["lockstep", "spread"], default="lockstep",
                   help="lockstep: every client's first timed step at once (the worst case); spread: client i starts "
                        "i/N of a period later, as robots whose controllers are not synchronised")  # fmt: skip
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per client per round (the episode's start)")
    p.add_argument("--repeats", type=positive_int, default=3, help="rounds; each variant's figures are medians over rounds")
    p.add_argument("--history", choices=["single", "history"], default="history")
    p.add_argument("--kv", choices=["full", "sink_window", "chunked"], default="chunked")
    p.add_argument("--max-batch", type=int, default=8)
    p.add_argument("--window-ms", type=float, default=2.0)
    p.add_argument("--rejoin-fraction", type=float, default=0.1,
                   help="the batched server's wait for robots expected back, as a fraction of its batch time (0: off)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads of the server (pinned)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--prepack", action="store_true",
                   help="every server's policy with its linear layers prepacked for oneDNN (`serve --prepack`; CPU)")
    p.add_argument("--compile", dest="compile_mode", choices=["default", "reduce-overhead"],
                   help="also a third server, one at a time with compiled sessions (`serve --compile ... --max-batch 1`)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--soak", type=float, default=0.0, help="seconds of connect/step/disconnect churn instead (see above)")
    p.add_argument("--out", type=Path, default=Path("results/bench_serve.json"))
    p.add_argument("--client", action="store_true", help=argparse.SUPPRESS)  # child mode: drive clients, print JSON
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    p.add_argument("--n", type=int, help=argparse.SUPPRESS)
    return p.parse_args(argv)


# ---- client side (child process) ----------------------------------------------------------------


def drive_clients(args: argparse.Namespace) -> dict:
    """``args.n`` openpi clients on ``args.port``; per client the latencies (ms) of its timed steps and the
    timed window (perf_counter seconds) of all clients together."""
    from openpi_client.websocket_client_policy import WebsocketClientPolicy

    n = args.n
    clients = [WebsocketClientPolicy("127.0.0.1", args.port) for _ in range(n)]
    rng = np.random.default_rng(args.seed)
    images = [rng.integers(0, 256, (96, 128, 3), dtype=np.uint8) for _ in range(8)]
    period = 1.0 / args.rate_hz if args.rate_hz > 0 else 0.0
    ready = threading.Barrier(n)
    latencies: list[list[float]] = [[] for _ in range(n)]
    actions = [0] * n
    window: list[float] = []
    errors: list[str] = []

    def robot(i: int) -> None:
        try:
            client, prompt = clients[i], PROMPTS[i % len(PROMPTS)]
            for k in range(args.warmup):
                client.infer({"observation/image": images[(i + k) % 8], "prompt": prompt})
            ready.wait()
            start = time.perf_counter()
            window.append(start)
            due = start + (i * period / n if args.phases == "spread" else 0.0)
            for k in range(args.steps):
                now = time.perf_counter()
                if now < due:
                    time.sleep(due - now)
                sent = time.perf_counter()
                reply = client.infer({"observation/image": images[(i + k) % 8], "prompt": prompt})
                latencies[i].append((time.perf_counter() - sent) * 1e3)
                actions[i] += len(reply["actions"])
                due = max(due + period, time.perf_counter()) if period else time.perf_counter()
            window.append(time.perf_counter())
        except Exception as e:  # noqa: BLE001 - reported to the parent, which fails the run
            errors.append(f"client {i}: {type(e).__name__}: {e}")
            ready.abort()

    threads = [threading.Thread(target=robot, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {"latencies_ms": latencies, "actions": sum(actions), "seconds": max(window) - min(window) if window else 0.0,
            "errors": errors}  # fmt: skip


def soak_clients(args: argparse.Namespace) -> dict:
    """``args.n`` robots reconnecting for ``args.soak`` seconds; counts of steps, connections and errors."""
    from openpi_client.websocket_client_policy import WebsocketClientPolicy

    rng = np.random.default_rng(args.seed)
    images = [rng.integers(0, 256, (96, 128, 3), dtype=np.uint8) for _ in range(8)]
    end = time.perf_counter() + args.soak
    counts = {"steps": 0, "connections": 0, "error_replies": 0}
    errors: list[str] = []
    lock = threading.Lock()

    def robot(i: int) -> None:
        r = np.random.default_rng(args.seed + i)
        while time.perf_counter() < end and len(errors) < 10:
            try:
                client = WebsocketClientPolicy("127.0.0.1", args.port)
                n_steps, bad = int(r.integers(1, 11)), r.random() < 0.2
                for k in range(n_steps):
                    client.infer({"observation/image": images[(i + k) % 8], "prompt": PROMPTS[(i + k) % len(PROMPTS)]})
                if bad:
                    try:
                        client.infer({"observation/image": images[0].astype(np.float32)})
                    except RuntimeError:
                        with lock:
                            counts["error_replies"] += 1
                    else:
                        errors.append(f"client {i}: a float image was accepted")
                client._ws.close()  # openpi's client has no close(); its connection does
                with lock:
                    counts["steps"] += n_steps
                    counts["connections"] += 1
            except Exception as e:  # noqa: BLE001 - counted; the run fails on any
                errors.append(f"client {i}: {type(e).__name__}: {e}")

    threads = [threading.Thread(target=robot, args=(i,)) for i in range(args.n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {**counts, "errors": errors}


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def soak(server, port: int, args: argparse.Namespace) -> dict:
    """The soak run against ``server``: the child's counts and the server's RSS samples."""
    samples, done = [], threading.Event()

    def sample() -> None:
        while not done.wait(5.0):
            samples.append(rss_mib())

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    cmd = [sys.executable, __file__, "--client", "--soak", str(args.soak), "--port", str(port), "--n", str(max(args.clients)),
           "--seed", str(args.seed)]  # fmt: skip
    out = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, check=False)
    done.set()
    sampler.join()
    if out.returncode != 0:
        raise SystemExit(f"client process failed ({out.returncode}):\n{out.stderr[-3000:]}")
    result = json.loads(out.stdout.strip().splitlines()[-1])
    server.registry.wait_for(lambda k: k == 0, 60.0)
    return {**result, "rss_mib": samples, "sessions_left": len(server.registry)}


# ---- server side --------------------------------------------------------------------------------


def make_policy(args: argparse.Namespace, root: Path):
    import torch

    from vla_runtime.api import load_policy
    from vla_runtime.checkpoints.tiny_openvla import make_tiny_openvla
    from vla_runtime.kv.rope import RopeConfig
    from vla_runtime.models.llama import LLAMA_CONFIGS, LlamaConfig

    llm = LLAMA_CONFIGS["tiny"] if args.llm == "tiny" else LlamaConfig(
        dim=512, n_layers=8, n_heads=8, n_kv_heads=8, head_dim=64, ffn_dim=1376, vocab_size=32064, max_position=8192,
        rope=RopeConfig(head_dim=64, original_max_position=8192),
    )  # fmt: skip  (the small geometry of bench_families.py)
    path = make_tiny_openvla(root / "ckpt", seed=args.seed, llm=llm, dtype=torch.float32)
    return load_policy(path, device=args.device, dtype="float32" if args.device == "cpu" else None, prepack=args.prepack)


def run_round(server, port: int, n: int, args: argparse.Namespace) -> dict:
    """One client load against one server: the child's measurements, checked for errors."""
    cmd = [sys.executable, __file__, "--client", "--port", str(port), "--n", str(n), "--steps", str(args.steps),
           "--warmup", str(args.warmup), "--rate-hz", str(args.rate_hz), "--seed", str(args.seed), "--phases", args.phases]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise SystemExit(f"client process failed ({out.returncode}):\n{out.stderr[-3000:]}")
    result = json.loads(out.stdout.strip().splitlines()[-1])
    if result["errors"]:
        raise SystemExit("client errors:\n" + "\n".join(result["errors"]))
    server.registry.wait_for(lambda k: k == 0)  # every session closed before the next round
    return result


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.client:
        print(json.dumps(soak_clients(args) if args.soak else drive_clients(args)))
        return 0
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    with pinned_threads(args.threads):
        return run(args)


def run(args: argparse.Namespace) -> int:
    """Both servers of one policy in this process, the client rounds (or the soak) against them, the report."""
    from vla_runtime.config import SessionConfig
    from vla_runtime.kv import KVConfig
    from vla_runtime.serve import BatchConfig, ServeConfig
    from vla_runtime.serve.server import ServerThread, build_server

    # the load average matters on a shared machine
    env = environment(device=args.device, threads=args.threads, cpus=os.cpu_count(), loadavg_start=os.getloadavg())
    session = SessionConfig(history=args.history, kv=KVConfig(mode=args.kv))
    variants = {"batched": (session, BatchConfig(max_batch=args.max_batch, window_ms=args.window_ms, rejoin_fraction=args.rejoin_fraction)),
                "one-at-a-time": (session, BatchConfig(max_batch=1))}  # fmt: skip
    if args.compile_mode:  # each robot's session compiles (and warms up) when it connects: in the untimed steps
        variants[COMPILED] = (replace(session, compile=args.compile_mode), BatchConfig(max_batch=1))
    with tempfile.TemporaryDirectory() as tmp:
        policy = make_policy(args, Path(tmp))
        servers = {}
        for name, (config, batch) in variants.items():
            server = build_server(policy, config, ServeConfig(port=0, max_sessions=max(args.clients), batch=batch))
            thread = ServerThread(server)
            servers[name] = (server, thread, thread.start())
        if args.soak:
            try:
                result = soak(*servers["batched"][::2], args)
            finally:
                for _, thread, _ in servers.values():
                    thread.stop()
            rss = result["rss_mib"]
            print(f"soak {args.soak:g} s, {max(args.clients)} robots: {result['connections']} connections, {result['steps']} steps, "
                  f"{result['error_replies']} malformed messages answered, {len(result['errors'])} unexpected errors, "
                  f"{result['sessions_left']} sessions left; RSS first {rss[0]:.0f} MiB, last {rss[-1]:.0f}, max {max(rss):.0f}"
                  if rss else "soak too short for an RSS sample")  # fmt: skip
            for e in result["errors"]:
                print(e)
            env["loadavg_end"] = os.getloadavg()
            write_json(args.out, env=env, args=args, soak=result)
            return 1 if result["errors"] or result["sessions_left"] else 0
        try:
            rounds: dict[tuple[int, str], list[dict]] = {}
            for n in args.clients:
                for rep in range(args.repeats):  # interleaved, order alternating: load drift hits both variants alike
                    for name, (server, _, port) in list(servers.items())[:: 1 if rep % 2 == 0 else -1]:
                        r = run_round(server, port, n, args)
                        lat = np.concatenate([np.asarray(x) for x in r["latencies_ms"]])
                        rounds.setdefault((n, name), []).append({
                            "actions_per_s": r["actions"] / r["seconds"], "p50_ms": float(np.percentile(lat, 50)),
                            "p95_ms": float(np.percentile(lat, 95)),
                        })  # fmt: skip
                        logging.warning("%d clients, %s: %.1f actions/s, p50 %.1f ms", n, name, *list(rounds[(n, name)][-1].values())[:2])
            engine = servers["batched"][0].engine
            batch_sizes, rejoin = engine.batch_sizes, {"waits": engine.rejoin_waits, "rejoined": engine.rejoined}
            step_ms = {name: {n: float(np.median(ms)) for n, ms in sorted(s.engine.step_ms.items())}
                       for name, (s, _, _) in servers.items()}  # fmt: skip
        finally:
            for _, thread, _ in servers.values():
                thread.stop()

    summary = {f"{n}|{name}": {k: float(np.median([r[k] for r in rs])) for k in rs[0]} for (n, name), rs in rounds.items()}
    print(f"{args.llm} geometry, {args.history} mode, {args.kv} cache, {args.threads} thread(s), {args.rate_hz:g} Hz per client ({args.phases}), "
          f"{args.steps} steps x {args.repeats} rounds (medians)")  # fmt: skip
    print(f"{'clients':>7} | {'variant':23} | {'actions/s':>9} | {'p50 ms':>8} | {'p95 ms':>8} | batched/one-at-a-time actions/s")
    for n in args.clients:
        for name in variants:
            s = summary[f"{n}|{name}"]
            ratio = s["actions_per_s"] / summary[f"{n}|one-at-a-time"]["actions_per_s"]
            print(f"{n:7d} | {name:23} | {s['actions_per_s']:9.1f} | {s['p50_ms']:8.1f} | {s['p95_ms']:8.1f} |"
                  + {"batched": f" {ratio:.2f}", COMPILED: f" ({ratio:.2f} of one-at-a-time eager)"}.get(name, ""))  # fmt: skip
    targets = {}
    if 1 in args.clients and 8 in args.clients:
        b8, o8, b1 = summary["8|batched"], summary["8|one-at-a-time"], summary["1|batched"]
        targets = {"throughput_ratio_8": b8["actions_per_s"] / o8["actions_per_s"], "p95_ratio_8_vs_1": b8["p95_ms"] / b1["p95_ms"],
                   "single_robot_p50_batched_vs_one": b1["p50_ms"] / summary["1|one-at-a-time"]["p50_ms"]}  # fmt: skip
        print(f"target 8 robots >= 3x one-at-a-time: {targets['throughput_ratio_8']:.2f}x "
              f"({'met' if targets['throughput_ratio_8'] >= 3 else 'missed'}); "
              f"p95 <= 2x a single robot's: {targets['p95_ratio_8_vs_1']:.2f}x ({'met' if targets['p95_ratio_8_vs_1'] <= 2 else 'missed'}); "
              f"a robot alone, batched server p50 / one-at-a-time p50: {targets['single_robot_p50_batched_vs_one']:.2f}")  # fmt: skip
    print(f"batch sizes run by the batched server (size: forwards): {dict(sorted(batch_sizes.items()))}; "
          f"waits for robots expected back: {rejoin['waits']}, steps that joined in them: {rejoin['rejoined']}")
    print("server forward ms by batch size (median): " + "; ".join(
        f"{name} {', '.join(f'{n}: {ms:.1f}' for n, ms in sizes.items())}" for name, sizes in step_ms.items()))
    largest = max(step_ms["batched"])
    if largest > 1 and 1 in step_ms["one-at-a-time"]:  # n robots batched at most n x (one step) / (n-row step)
        cost = step_ms["batched"][largest] / step_ms["one-at-a-time"][1]
        print(f"a {largest}-row forward costs {cost:.2f}x one step alone: batching {largest} robots can give at most "
              f"{largest / cost:.2f}x the one-at-a-time throughput")
    env["loadavg_end"] = os.getloadavg()
    print(f"load average at start / end: {env['loadavg_start'][0]:.1f} / {env['loadavg_end'][0]:.1f} on {env['cpus']} CPUs")
    write_json(args.out, env=env, args=args, summary=summary, targets=targets, batch_sizes=batch_sizes, rejoin=rejoin,
               step_ms=step_ms, rounds={f"{n}|{name}": rs for (n, name), rs in rounds.items()})  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
