"""``vla-runtime demo`` (what ``make demo`` runs): one closed-loop Meta-World episode of the shipped demo
policy, a small OpenVLA-architecture model trained from scratch (``assets/mw-tiny-openvla``, model card
beside it), in history mode with the chunked KV cache. Prints success, steps, timings and KV use, and
writes the episode's video.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

DEMO_MODEL = Path(__file__).resolve().parents[2] / "assets" / "mw-tiny-openvla"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="closed-loop Meta-World episode of the shipped demo policy", description=__doc__)
    p.add_argument("--checkpoint", type=Path, default=DEMO_MODEL, help="policy checkpoint (default: the shipped demo policy)")
    p.add_argument("--task", default="drawer-close-v3", help="Meta-World task, or a memory task (memory-reference, "
                   "memory-counting, memory-order); default drawer-close-v3, the policy's best task; it was also trained "
                   "on reach-v3 and button-press-topdown-v3, not on the memory tasks")  # fmt: skip
    p.add_argument("--seed", type=int, default=1000, help="scene seed (default 1000; seed %% 50 picks the variation)")
    p.add_argument("--kv", choices=("full", "sink_window", "chunked"), default="chunked", help="KV cache (default chunked)")
    p.add_argument("--max-steps", type=int, default=150, help="step limit (default 150, as in the model card)")
    p.add_argument("--out", type=Path, default=Path("runs/demo"), help="where the video goes (default runs/demo)")
    p.add_argument("--no-video", action="store_true", help="write no video")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import torch

    from ..api import load_policy
    from ..config import SessionConfig
    from ..kv import KVConfig
    from ..sim import MEMORY_TASKS, MetaWorldConfig, make_env
    from ..sim.evaluate import run_episode

    if not (args.checkpoint / "config.json").is_file():
        raise FileNotFoundError(f"no checkpoint at {args.checkpoint} (expected the shipped demo policy's config.json there)")
    torch.set_num_threads(min(2, torch.get_num_threads()))
    policy = load_policy(args.checkpoint, device="cpu")
    info = policy.info()
    size = info["vision_towers"][0]["image_size"]
    print(f"policy {args.checkpoint.name}: {info['parameters']['total']:,} parameters, {size}px images, "
          f"{info['image_tokens']} image tokens/frame, LLaMA {info['llm']['dim']}x{info['llm']['layers']}")  # fmt: skip
    session = SessionConfig(history="history", kv=KVConfig(mode=args.kv))
    video = None if args.no_video else args.out / f"{args.task}-seed{args.seed}.mp4"
    env_config = MetaWorldConfig(cameras=("corner",), resolution=(size, size), max_steps=args.max_steps)
    with make_env("metaworld", env_config) as env:
        print(f"{args.task} seed {args.seed}: {env.instruction(args.task, args.seed)!r}, kv={args.kv}, history mode ...", flush=True)
        result = run_episode(env, policy, args.task, args.seed, session, video_path=video)
    ms = np.asarray(result.inference_ms)
    verdict = "SUCCESS" if result.success else "failure"
    print(f"{verdict} after {result.steps} steps ({result.steps / env_config.max_steps:.0%} of the step limit)")
    if args.task in MEMORY_TASKS:
        print(f"chance level of {args.task}: {MEMORY_TASKS[args.task].chance_level():.0%} (the best cue-blind answer)")
    print(f"policy step: p50 {np.median(ms):.1f} ms, p95 {np.percentile(ms, 95):.1f} ms -> {1e3 / np.median(ms):.0f} Hz control rate; "
          f"simulator {1e3 * result.env_s / max(result.steps, 1):.1f} ms/step")  # fmt: skip
    kv = result.kv_final
    print(f"KV cache at the end: {kv.get('bytes', 0) / 1024:.0f} KiB ({kv.get('tokens_raw', 0)} raw tokens, "
          f"{kv.get('chunks_retained', 0)} chunks retained, {kv.get('chunks_dropped', 0)} dropped, over {info['llm']['layers']} layers) after "
          f"{kv.get('tokens_seen', 0)} tokens seen")  # fmt: skip
    if result.video:
        print(f"video: {result.video}")
    return 0 if result.error is None else 1
