"""``vla-runtime eval``: closed-loop success rate and timing of a checkpoint in simulation.

    vla-runtime eval --checkpoint ckpt/ --sim metaworld --tasks reach-v3,drawer-open-v3 --episodes 10 \
        --kv chunked --history history --workers 2 --out runs/eval-mw
    # the memory suite, a sliding window holding the KV bytes of a chunked cache with 32 retained chunks:
    vla-runtime eval --checkpoint ckpt/ --sim metaworld --tasks memory --history history \
        --kv sink_window --kv-window 48 --kv-match-chunks 32

Writes ``episodes.jsonl`` (one line per finished episode, durable as it ends), ``report.json`` and
``summary.png`` (both rebuilt from ``episodes.jsonl`` alone) and ``videos/<task>.mp4`` (first episode of
each task). After a crash, the same command with ``--resume`` runs only the episodes not yet in
``episodes.jsonl``.
"""

from __future__ import annotations

import argparse
import time
from functools import partial
from pathlib import Path

from ..api import detect_family, load_policy
from ..control import Blend, ControlConfig, Fallback
from ..kv.config import KVConfig, matching_sink_window
from ..kv.gate_io import saved_gate_geometry
from ..kv.registry import KVMode
from ..sim import METAWORLD_ALL_TASKS, make_env
from ..sim.actions import POLICY_ACTION_DIM
from ..sim.base import check_task
from ..sim.evaluate import EvalConfig, evaluate
from ..sim.report import format_table, plot_summary, summarize, write_report
from ..sim.results import RESULTS_FILE, append_result, check_run, checkpoint_fingerprint, load_results, read_results
from ..sim.retention import plot_episodes
from ..sim.rlbench_env import import_rlbench
from .policy_args import add_policy_arguments, kv_from_args, load_options, session_from_args
from .sim_args import add_sim_args, parse_tasks, sim_config


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("eval", help="closed-loop evaluation of a checkpoint in simulation")
    p.add_argument("--checkpoint", required=True, help="policy checkpoint directory (anything load_policy reads)")
    add_sim_args(p, sims=("metaworld", "rlbench"))
    p.add_argument("--episodes", type=int, default=10, help="episodes per task (default: %(default)s)")
    add_policy_arguments(p)
    p.add_argument("--kv-match-chunks", type=int, default=None, metavar="M",
                   help="sink_window: size the window to hold the KV bytes of a chunked cache with M retained chunks "
                        "and the same --kv-window (printed; needs --kv-window)")
    p.add_argument("--retention-plots", action="store_true",
                   help="chunked: write OUT/retention/<task>-seed<N>.png per episode (what the gate kept, by source step)")
    p.add_argument("--cue-steps", default=None,
                   help="comma-separated control steps to mark as cues in the retention plots (default: what the task reports)")
    p.add_argument("--execution-horizon", type=int, default=None, help="actions executed per predicted chunk (default: whole chunk)")
    loop = p.add_argument_group("control loop", "run each episode on the robot's control loop in simulated time: the "
                                "simulator advances one tick per period while each policy step takes its measured time")
    loop.add_argument("--control-rate", type=float, default=None, metavar="HZ",
                      help="control ticks per second (default: off, policy and simulator in turn)")
    loop.add_argument("--blend", default="none", choices=[b.value for b in Blend], help="overlapping chunks (default: none)")
    loop.add_argument("--refill-threshold", type=int, default=1, help="chunks: refill while this many actions are queued (default 1)")
    loop.add_argument("--fallback", default="hold", choices=[f.value for f in Fallback],
                      help="a tick without an action: hold (no motion, gripper kept), zero, repeat_last (default hold)")
    loop.add_argument("--time-scale", type=float, default=1.0, metavar="X",
                      help="simulated step time = measured x X (plays a slower machine; default 1)")
    p.add_argument("--workers", type=int, default=1, help="parallel episode processes (default: %(default)s)")
    p.add_argument("--out", default=None, help="output directory (default: runs/eval-<time>)")
    p.add_argument("--no-video", action="store_true", help="skip the per-task videos")
    p.add_argument("--resume", action="store_true",
                   help="continue the interrupted run in --out: skip the episodes its episodes.jsonl already holds")
    p.set_defaults(func=run)


def control_config(args: argparse.Namespace) -> ControlConfig | None:
    """``--control-rate`` and its options as a ``ControlConfig`` (``None`` without ``--control-rate``). Frames
    come at the ticks in simulation, so there is no camera phase to align to."""
    if args.control_rate is None:
        return None
    return ControlConfig(rate_hz=args.control_rate, blend=args.blend, refill_threshold=args.refill_threshold,
                         fallback=args.fallback, fallback_keep_dims=(POLICY_ACTION_DIM - 1,),  # `zero` keeps the gripper
                         align_to_frames=False)  # fmt: skip


def run(args: argparse.Namespace) -> int:
    tasks = parse_tasks(args.tasks, args.sim)
    if args.sim == "metaworld":
        for task in tasks:
            check_task(task, METAWORLD_ALL_TASKS, "Meta-World")
    else:
        try:
            import_rlbench()
        except ImportError as e:  # a user error here: say what to install, no traceback
            raise ValueError(str(e)) from e
    family = detect_family(args.checkpoint)  # fail fast on a wrong path, before any process starts
    kv = kv_config(args)
    session = session_from_args(args, kv, execution_horizon=args.execution_horizon, seed=args.seed)
    cue_steps = parse_steps(args.cue_steps)
    out = Path(args.out) if args.out else Path("runs") / time.strftime("eval-%Y%m%d-%H%M%S")
    config = EvalConfig(tasks=tasks, episodes=args.episodes, seed=args.seed, session=session, workers=args.workers,
                        out=None if args.no_video else out, trace_retention=args.retention_plots,
                        control=control_config(args), time_scale=args.time_scale)
    env_config = sim_config(args, tasks)
    options = load_options(args)
    policy_factory = partial(load_policy, args.checkpoint, device=args.device, dtype=args.dtype, **options)
    results_path = out / RESULTS_FILE
    if results_path.exists() and not args.resume:
        raise FileExistsError(f"{results_path} exists: pass --resume to continue that run, or choose a new --out directory")
    out.mkdir(parents=True, exist_ok=True)
    identity = {"checkpoint": checkpoint_fingerprint(Path(args.checkpoint), exclude=out), "load": repr({"dtype": args.dtype, **options}),
                "sim": args.sim, "sim_config": repr(env_config), "session": repr(session),
                "control": repr(config.control), "time_scale": repr(args.time_scale)}  # fmt: skip
    check_run(out, identity, resume=args.resume)
    finished = read_results(results_path) if args.resume else {}

    def finished_episode(job: int, result) -> None:
        """Durable as it ends: its retention picture first, then its result line (what --resume skips by)."""
        if args.retention_plots:
            plot_episodes([result], out / "retention", cue_steps=cue_steps)
        append_result(results_path, job, result)

    evaluate(policy_factory, partial(make_env, args.sim, env_config), config, finished=finished, on_result=finished_episode)
    results = load_results(results_path)
    summary = summarize(results)
    meta = {
        "checkpoint": str(args.checkpoint),
        "family": family,
        "sim": args.sim,
        "sim_config": repr(env_config),
        "session": repr(session),
        "kv": {**_report_keys(kv), "matched_chunks": args.kv_match_chunks},
        "seed": args.seed,
        "workers": args.workers,
    }
    report = write_report(out / "report.json", results, summary, meta)
    plot = plot_summary(out / "summary.png", summary, f"{Path(args.checkpoint).name} on {args.sim} ({kv_label(kv)}, history={args.history})")
    print(format_table(summary))
    if "control" in summary["overall"]:
        c = summary["overall"]["control"]
        print(f"control loop at {args.control_rate:g} Hz: {c['ticks']} ticks, {c['fallbacks']} without an action of their own "
              f"({100 * c['empty_tick_share']:.1f} %), {c['steps']} steps ({c['steps_late']} late), "
              f"{c['actions_skipped']} chunk rows skipped, {c['actions_blended']} blended")
    print(f"report: {report}")
    if plot:
        print(f"plot: {plot}")
    if not args.no_video:
        print(f"videos: {out / 'videos'}")
    if args.retention_plots:
        print(f"retention pictures: {len(list((out / 'retention').glob('*.png')))} in {out / 'retention'}")
    return 0


def kv_config(args: argparse.Namespace) -> KVConfig:
    """The session's cache from the ``--kv*`` flags; ``--kv-match-chunks`` sizes a sink window (and says so)."""
    kv = kv_from_args(args)
    if args.kv_match_chunks is None:
        if _matchable(kv):
            print(f"a sink_window cache with --kv-window {matching_sink_window(kv).params.window} holds the same KV bytes")
        return kv
    if kv.mode is not KVMode.SINK_WINDOW:
        raise ValueError(f"--kv-match-chunks sizes a sink_window cache; got --kv {args.kv}")
    if args.kv_window is None:
        raise ValueError("--kv-match-chunks needs --kv-window: the raw window W (tokens) of the chunked cache to match")
    chunked = KVConfig.of(KVMode.CHUNKED, capacity=args.kv_capacity, window=args.kv_window, max_chunks=args.kv_match_chunks,
                          **saved_gate_geometry(args.checkpoint))  # the chunk size of the checkpoint's gate, if any
    kv = matching_sink_window(chunked)
    c, s = chunked.params, kv.params
    print(f"sink_window: window {s.window} tokens holds the KV bytes of chunked (window {c.window}, "
          f"chunk {c.chunk}, {c.max_chunks} chunks, n_sink {s.n_sink})")  # fmt: skip
    return kv


def _matchable(kv: KVConfig) -> bool:
    """A chunked cache whose window and budget are both set (``matching_sink_window`` can size one for it)."""
    keys = kv.to_dict()
    return kv.mode is KVMode.CHUNKED and keys["window"] is not None and keys["max_chunks"] is not None


def _report_keys(kv: KVConfig) -> dict:
    """``mode``, ``window``, ``max_chunks`` and ``chunk_mass`` of the report (``None`` where the cache has no such
    parameter)."""
    keys = kv.to_dict()
    return {"mode": keys["mode"], "window": keys.get("window"), "max_chunks": keys.get("max_chunks"),
            "chunk_mass": keys.get("chunk_mass")}  # fmt: skip


def kv_label(kv: KVConfig) -> str:
    """Short description of a cache for titles: ``kv=chunked W48 M32`` (``+mass`` with ``chunk_mass``)."""
    keys = _report_keys(kv)
    parts = [f"kv={keys['mode']}"]
    if keys["window"] is not None:
        parts.append(f"W{keys['window']}")
    if keys["max_chunks"] is not None:
        parts.append(f"M{keys['max_chunks']}")
    if keys["chunk_mass"]:
        parts.append("+mass")
    return " ".join(parts)


def parse_steps(text: str | None) -> list[int] | None:
    """``--cue-steps 3,7`` -> [3, 7]; ``None`` stays ``None``."""
    if text is None:
        return None
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError as e:
        raise ValueError(f"--cue-steps {text!r}: expected comma-separated step numbers, e.g. 2,5") from e
