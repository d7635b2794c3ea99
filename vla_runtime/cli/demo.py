"""``vla-runtime demo`` (what ``make demo`` runs): one closed-loop Meta-World episode of a shipped policy,
by default the memory policy (``assets/mw-memory-openvla``, model card beside it: a small OpenVLA-architecture
model trained from scratch on the memory suite) on ``memory-order`` with the chunked KV cache it was trained
through (frames-only history, 128 chunks per layer).

Prints success (and a memory task's chance level), the step latency and control rate, the KV the cache
holds against what the full cache would hold, and, with the chunked cache, which control steps the retained
chunks come from (a memory task's cue steps flagged); writes the episode's video and its retention picture
(what the gate kept, per step). ``--kv full`` and ``--kv sink_window`` (a window holding the chunked cache's
KV bytes) run the same episode with the other caches.
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

import numpy as np

from ..config import HISTORY_MODES, HistoryMode
from ..kv.registry import CACHES, KVMode

ASSETS = Path(__file__).resolve().parents[2] / "assets"
DEMO_MODEL = ASSETS / "mw-memory-openvla"
DEMO_TASK = "memory-order"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="closed-loop Meta-World episode of a shipped policy", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--checkpoint", type=Path, default=DEMO_MODEL, help="policy checkpoint (default: the shipped memory policy, "
                   "assets/mw-memory-openvla)")
    p.add_argument("--task", default=DEMO_TASK, help=f"Meta-World task or memory task (memory-reference, memory-tally, "
                   f"memory-order, memory-counting); default {DEMO_TASK} (the memory policy was trained on the three memory tasks only)")  # fmt: skip
    p.add_argument("--seed", type=int, default=1000, help="episode seed (default 1000; the memory policy was trained on seeds 0-199)")
    p.add_argument("--kv", choices=tuple(CACHES), default="chunked", help="KV cache (default chunked)")
    p.add_argument("--history", choices=HISTORY_MODES, default=None,
                   help="history, observations or single (default: the mode the checkpoint was trained in, else history)")
    p.add_argument("--max-steps", type=int, default=200, help="step limit (default 200, what its evaluation used)")
    p.add_argument("--out", type=Path, default=Path("runs/demo"), help="where the video and retention picture go (default runs/demo)")
    p.add_argument("--no-video", action="store_true", help="write no video")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import torch

    from ..api import load_policy
    from ..sim import MEMORY_TASKS, MetaWorldConfig, make_env
    from ..sim.evaluate import run_episode
    from ..sim.retention import describe_sources, format_steps, plot_retention

    if not (args.checkpoint / "config.json").is_file():
        raise FileNotFoundError(f"no checkpoint at {args.checkpoint} (expected a policy's config.json there)")
    torch.set_num_threads(min(2, torch.get_num_threads()))
    policy = load_policy(args.checkpoint, device="cpu")
    info = policy.info()
    size = info["vision_towers"][0]["image_size"]
    print(f"policy {args.checkpoint.name}: {info['parameters']['total']:,} parameters, {size}px images, "
          f"{info['image_tokens']} image tokens/frame, LLaMA {info['llm']['dim']}x{info['llm']['layers']}")  # fmt: skip
    history = args.history or (policy.session.history if policy.session.history.episodic else HistoryMode.HISTORY)
    session = replace(policy.session, history=history, kv=_demo_cache(policy.session.kv, args, info["image_tokens"]))
    video = None if args.no_video else args.out / f"{args.task}-seed{args.seed}.mp4"
    env_config = MetaWorldConfig(cameras=("corner",), resolution=(size, size), max_steps=args.max_steps)
    traced = KVMode.parse(args.kv) is KVMode.CHUNKED and session.history.episodic
    with make_env("metaworld", env_config) as env:
        print(f"{args.task} seed {args.seed}: {env.instruction(args.task, args.seed)!r}, kv={args.kv}, {session.history.value} mode ...", flush=True)
        result = run_episode(env, policy, args.task, args.seed, session, video_path=video, trace_retention=traced)
    ms = np.asarray(result.inference_ms)
    verdict = "SUCCESS" if result.success else "failure"
    print(f"{verdict} after {result.steps} steps")
    if args.task in MEMORY_TASKS:
        print(f"chance level of {args.task}: {MEMORY_TASKS[args.task].chance_level():.0%} (the best cue-blind answer)")
    print(f"policy step: p50 {np.median(ms):.1f} ms, p95 {np.percentile(ms, 95):.1f} ms -> {1e3 / np.median(ms):.0f} Hz control rate; "
          f"simulator {1e3 * result.env_s / max(result.steps, 1):.1f} ms/step")  # fmt: skip
    _print_kv(result.kv_final, info["llm"]["layers"])
    if result.retention is not None:
        cues = result.cue_steps or []
        cue_text = f"cue at steps {format_steps(cues)}" if cues else "no cue steps reported"  # counting: the presses
        print(f"retained chunks at the end come from ({cue_text}): {describe_sources(result.retention.held_sources(), cues)}")
        title = f"{args.task}, seed {args.seed}: {verdict.lower()} after {result.steps} steps"
        picture = plot_retention(result.retention, args.out / f"{args.task}-seed{args.seed}-retention.png", cue_steps=cues, title=title)
        if picture is not None:
            print(f"retention picture: {picture}")
    if result.video:
        print(f"video: {result.video}")
    return 0 if result.error is None else 1


def _print_kv(kv: dict, layers: int) -> None:
    """The KV held at the end, against what a full cache would hold after the same tokens."""
    held_tokens = kv.get("tokens_raw", 0) + kv.get("tokens_compressed", 0.0)
    held, seen = kv.get("bytes", 0), kv.get("tokens_seen", 0)
    line = (f"KV cache at the end: {held / 1024:.0f} KiB over {layers} layers ({kv.get('tokens_raw', 0)} raw tokens, "
            f"{kv.get('chunks_retained', 0)} chunks retained, {kv.get('chunks_dropped', 0)} dropped) after {seen} tokens seen")  # fmt: skip
    if held_tokens and seen > held_tokens:
        full = held / held_tokens * seen
        line += f"; a full cache would hold {full / 1024:.0f} KiB ({full / max(held, 1):.1f}x more)"
    print(line)


def _demo_cache(trained, args: argparse.Namespace, image_tokens: int):
    """The cache of ``--kv``: the chunked cache the policy was trained with (its budget and window), a full
    cache sized for the step limit, or the sliding window holding the chunked cache's KV bytes."""
    from ..kv import ChunkedGatedParams, KVConfig
    from ..kv.config import matching_sink_window

    mode = KVMode.parse(args.kv)
    chunked = trained if trained.mode is KVMode.CHUNKED else KVConfig(KVMode.CHUNKED)
    if mode is KVMode.CHUNKED:
        return chunked
    if mode is KVMode.FULL:  # every token of the episode: step limit x (frame + proprio + prompt suffix + actions)
        return KVConfig.of(KVMode.FULL, capacity=(args.max_steps + 1) * (image_tokens + 16))
    p: ChunkedGatedParams = chunked.params
    if p.window is not None and p.max_chunks is not None:
        return matching_sink_window(chunked)
    return KVConfig(KVMode.SINK_WINDOW)
