"""Per-step latency of the three families, and HybridVLA's denoising on the cached prefix.

1. OpenVLA, CogACT, HybridVLA in ``history`` mode after ``--history-steps`` control steps: ms per step
   with the ``full`` cache vs the ``chunked`` cache (ratio = full / chunked; > 1: chunked is faster).
2. HybridVLA ``diff`` mode (upstream's HybridVLA-dif), stock single mode: DDIM on the cached prefix
   (one prefill, then ``[t, x]`` appended and rolled back per step) vs re-prefilling ``prefix + [t, x]``
   at every DDIM step, as upstream does without its KV trick. Upstream reports 9.4 vs 5.0 Hz
   (ratio 1.88) on an RTX 4090D for the 7B model.
3. HybridVLA ``diff+ar``: one prefix shared by both branches vs upstream's structure (the diffusion
   branch re-prefilled per DDIM step and a separate prefill for the AR branch).

Every model is a random checkpoint in its real on-disk layout, built in a temp dir (``--llm small``:
a 512-wide, 8-layer decoder so the LLM dominates; ``tiny``: the test geometry). Outputs are checked
to agree before anything is timed; timed rounds interleave the variants.

    python benchmarks/bench_families.py --threads 2 --repeats 20
    python benchmarks/bench_families.py --llm tiny --history-steps 16 --repeats 5   # a quick look
"""

from __future__ import annotations

import argparse
import itertools
import logging
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

from vla_runtime.api import Observation, load_policy
from vla_runtime.bench.harness import (
    environment, plot_medians, positive_int, print_ratio_table, ratio_table, seeded_main, time_interleaved, write_json,
)  # fmt: skip
from vla_runtime.checkpoints.tiny_openvla import make_tiny_openvla
from vla_runtime.checkpoints.tiny_prismatic import make_tiny_cogact, make_tiny_hybridvla
from vla_runtime.config import SessionConfig
from vla_runtime.device import resolve_device, resolve_dtype
from vla_runtime.kv import FullCache, FullParams, KVConfig, KVMode
from vla_runtime.kv.rope import RopeConfig
from vla_runtime.models.action_postprocess import postprocess_actions
from vla_runtime.models.hybridvla.configuration_hybridvla import EOD_TOKEN_ID
from vla_runtime.models.hybridvla.modeling_hybridvla import decode_ar_actions, denoise_by_reprefill
from vla_runtime.models.hybridvla.processing_hybridvla import collaborative_ensemble
from vla_runtime.models.llama import LLAMA_CONFIGS, LlamaConfig

log = logging.getLogger("bench_families")
INSTRUCTION = "put the red cube in the blue bowl"
STATE = np.array([0.2785, -0.0082, 1.4719, -3.1416, 0.2423, 3.1416, 1.0])
LLMS = {
    "tiny": LLAMA_CONFIGS["tiny"],
    "small": LlamaConfig(
        dim=512, n_layers=8, n_heads=8, n_kv_heads=8, head_dim=64, ffn_dim=1376, vocab_size=32064, max_position=8192,
        rope=RopeConfig(head_dim=64, original_max_position=8192),
    ),
}  # fmt: skip
FAMILIES = ("openvla", "cogact", "hybridvla")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--llm", choices=sorted(LLMS), default="small", help="decoder geometry of the random checkpoints")
    p.add_argument("--history-steps", type=int, default=48, help="control steps in the cache before timing (question 1)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None, help="default: float32 on cpu, bfloat16 on cuda")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (pinned)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=positive_int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("results/bench_families"), help="writes <out>.json and <out>.png")
    return p.parse_args(argv)


def frames(seed: int, n: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, (96, 128, 3), dtype=np.uint8) for _ in range(n)]


def obs(image: np.ndarray, family: str) -> Observation:
    return Observation(images={"primary": image}, state=STATE if family == "hybridvla" else None)


def make_checkpoints(root: Path, llm: LlamaConfig, seed: int) -> dict[str, Path]:
    return {
        "openvla": make_tiny_openvla(root / "openvla", seed=seed, llm=llm, dtype=torch.float32),
        "cogact": make_tiny_cogact(root / "cogact", seed=seed, llm=llm),
        "hybridvla": make_tiny_hybridvla(root / "hybridvla", seed=seed, llm=llm),
    }


# ---- question 1: full vs chunked cache in history mode ------------------------------------------


def cache_variants(
    paths: dict[str, Path], args: argparse.Namespace, images: list[np.ndarray], sessions_out: dict
) -> dict[str, tuple]:
    """(baseline name, fn) per variant; sessions filled with ``--history-steps`` steps of history
    (collected in ``sessions_out`` by variant name, for their KV stats)."""
    modes = [KVMode.FULL, KVMode.CHUNKED]
    capacity = 64 * (args.history_steps + args.warmup + args.repeats + 8)  # full cache: every token, no wrap
    out = {}
    for family in FAMILIES:
        policy = load_policy(paths[family], device=args.device, dtype=args.dtype)
        sessions = {}
        for mode in modes:
            kv = KVConfig.of(KVMode.FULL, capacity=capacity) if mode is KVMode.FULL else KVConfig(mode)
            sessions[mode] = policy.new_session(INSTRUCTION, SessionConfig(kv=kv, history="history", seed=args.seed))
        first = {mode: s.step(obs(images[0], family)).actions for mode, s in sessions.items()}
        if any(not np.allclose(a, first[KVMode.FULL], atol=1e-5) for a in first.values()):
            raise SystemExit(f"{family}: the first step differs between caches before anything was compressed")
        for image in images[1 : args.history_steps]:
            for s in sessions.values():
                s.step(obs(image, family))
        for mode, s in sessions.items():
            stats = s.cache.stats()
            log.info("%s %s: %d tokens seen, %d raw held, %.0f chunks", family, mode.value, stats.tokens_seen,
                     stats.tokens_raw, stats.tokens_compressed)  # fmt: skip
            it = itertools.cycle(images[args.history_steps :])
            sessions_out[f"{family} history, {mode.value} cache"] = s
            out[f"{family} history, {mode.value} cache"] = (
                f"{family} history, full cache",
                lambda s=s, it=it, family=family: s.step(obs(next(it), family)),
            )
    return out


# ---- questions 2 and 3: HybridVLA prefix reuse ---------------------------------------------------


class UpstreamHybrid:
    """HybridVLA's step as upstream structures it, on our modules and weights: the diffusion branch runs
    ``prefix + [t, x]`` through the LLM at every DDIM step; the AR branch prefills the prefix again."""

    def __init__(self, policy, session) -> None:
        self.policy, self.session = policy, session
        capacity = session.kv_config.params.capacity  # single mode: one step's tokens
        self.cache = FullCache(policy.vlm.cfg.llm.geometry, FullParams(capacity=capacity), device=policy.device,
                               dtype=policy.dtype)  # fmt: skip
        self.generator = torch.Generator()

    def prefix(self, image: np.ndarray) -> torch.Tensor:
        p, s = self.policy, self.session
        pixels = p.image_processor(image)[None].to(p.device, p.dtype)
        state = torch.as_tensor(s.proprio_stats.normalize(STATE), dtype=p.dtype, device=p.device)[None]
        proprio = [p.model.head.embed_proprio(state)]
        return p.vlm.embed_forward(s.frame, images=[p.vlm.embed_image(pixels)], proprio=proprio)

    def noise(self) -> torch.Tensor:
        head = self.policy.model.head.cfg
        return torch.randn((1, head.chunk, head.action_dim), generator=self.generator).to(self.policy.device, self.policy.dtype)

    @torch.inference_mode()
    def step(self, image: np.ndarray, *, seed: int, ar: bool) -> np.ndarray:
        p, s = self.policy, self.session
        self.generator.manual_seed(seed)
        prefix = self.prefix(image)
        self.cache.reset()
        normalized = denoise_by_reprefill(p.model.lm, p.model.head, self.cache, p.diffusion, self.noise(), prefix)
        diff = postprocess_actions(normalized[0].float().cpu().numpy(), s.action_stats)
        if not ar:
            return diff
        t = torch.randint(0, p.diffusion.num_timesteps, (1,), generator=self.generator).to(p.device)
        self.cache.reset()
        p.model.lm.model(inputs_embeds=prefix, cache=self.cache)  # the AR branch's own prefill
        ids, conf = decode_ar_actions(
            p.model.lm, p.model.head, self.cache, noise=self.noise(), t=t,
            tail_ids=(EOD_TOKEN_ID, s.prompt.empty), n_tokens=p.action_dim,
        )  # fmt: skip
        ar_action = postprocess_actions(p.ar_tokens.normalized(ids[0].cpu().numpy()), s.action_stats)
        diff[0], _ = collaborative_ensemble(diff[0], ar_action, conf[0].float().cpu().numpy(), p.config.sampling.ensemble)
        return diff


def hybrid_variants(path: Path, args: argparse.Namespace, image: np.ndarray) -> dict[str, tuple]:
    out = {}
    for mode, label in (("diff", "HybridVLA-dif"), ("diff+ar", "HybridVLA diff+ar")):
        policy = load_policy(path, device=args.device, dtype=args.dtype, mode=mode)
        session = policy.new_session(INSTRUCTION, SessionConfig(seed=args.seed))
        upstream = UpstreamHybrid(policy, session)
        ours = session.step(obs(image, "hybridvla")).actions
        ref = upstream.step(image, seed=args.seed, ar=mode == "diff+ar")
        if not np.allclose(ours, ref, atol=1e-4):
            raise SystemExit(f"{label}: prefix reuse and re-prefill disagree:\n{ours}\nvs\n{ref}")
        baseline = f"{label}: re-prefill (upstream structure)"
        out[baseline] = (baseline, lambda u=upstream, ar=mode == "diff+ar": u.step(image, seed=args.seed, ar=ar))
        out[f"{label}: prefix reuse (ours)"] = (baseline, lambda s=session: s.step(obs(image, "hybridvla")))
    return out


# ---- run ----------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    return seeded_main(parse_args, run, argv)


def run(args: argparse.Namespace) -> int:
    """Build the checkpoints and variants (checking agreement), time them interleaved, print and write the record."""
    images = frames(args.seed, args.history_steps + 8)
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    with tempfile.TemporaryDirectory() as tmp:
        paths = make_checkpoints(Path(tmp), LLMS[args.llm], args.seed)
        sessions: dict = {}
        variants = {**cache_variants(paths, args, images, sessions), **hybrid_variants(paths["hybridvla"], args, images[0])}
        fns = {name: fn for name, (_, fn) in variants.items()}
        times = time_interleaved(fns, warmup=args.warmup, repeats=args.repeats, device=device)
        kv = {name: session.cache.stats().as_dict() for name, session in sessions.items()}

    results = ratio_table(times, {name: baseline for name, (baseline, _) in variants.items()})
    for name, stats in kv.items():
        results[name]["kv"] = stats
    print_ratio_table(results)
    for name, stats in kv.items():
        print(f"{name:52s} | KV held {stats['bytes'] / 2**20:8.2f} MiB | {stats['tokens_raw']} raw tokens, "
              f"{stats['tokens_compressed']:.0f} chunks per layer, {stats['tokens_seen']} tokens seen")  # fmt: skip
    upstream = 9.4 / 5.0
    ours = results.get("HybridVLA-dif: prefix reuse (ours)", {}).get("ratio")
    print(f"HybridVLA-dif prefix reuse: x{ours:.2f} here; upstream reports x{upstream:.2f} (9.4 vs 5.0 Hz, 7B, RTX 4090D)")
    write_json(
        args.out.with_suffix(".json"), env=environment(device=device, dtype=dtype, threads=args.threads), args=args,
        llm=LLMS[args.llm].to_hf(), upstream_reference={"hybridvla_dif_hz_with_cache": 9.4, "hybridvla_dif_hz_without_cache": 5.0},
        results=results,
    )  # fmt: skip
    plot_medians(results, args.out.with_suffix(".png"), title="vla-runtime families: step latency",
                 xlabel="ms per control step (median, p10-p90); grey = baseline of its group")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
