"""Per-action latency (ms): our OpenVLA step vs upstream's inference path, same checkpoint, one process.

The reference is what upstream's HF code runs for ``predict_action``: the same image transform, the
same timm towers called through ``get_intermediate_layers(n={depth - 2})`` (every block runs), the
same projector, then transformers' ``LlamaForCausalLM.generate(inputs_embeds=..., max_new_tokens=7)``
with the same weights, and the same bin decoding. Ours is ``session.step`` in stock (``single``) mode,
once decoding over the full vocabulary (the same work as the reference, checked token-for-token) and
once restricted to the 256 action ids (the runtime default). Ratio = reference median / variant median
(> 1: ours is faster).

    python benchmarks/bench_step.py --threads 1 --repeats 30
    python benchmarks/bench_step.py --checkpoint runs/openvla-7b --device cuda --dtype bfloat16
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

from vla_runtime.api import Observation, load_policy
from vla_runtime.bench.harness import (
    environment, plot_medians, print_ratio_table, ratio_table, seeded_main, time_interleaved, write_json,
)  # fmt: skip
from vla_runtime.checkpoints.tiny_openvla import make_tiny_openvla
from vla_runtime.config import ActionDecoding
from vla_runtime.images import read_image
from vla_runtime.policies.openvla import OpenVLAPolicy
from vla_runtime.models.openvla.processing_openvla import ActionTokenizer

ASSET = Path(__file__).resolve().parents[1] / "assets" / "demo_scene.png"
INSTRUCTION = "put the red cube in the blue bowl"
BASELINE = "reference (timm + HF generate)"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", type=Path, help="OpenVLA directory (default: a tiny one made in a temp dir)")
    p.add_argument("--unnorm-key", help="dataset key of the action statistics (checkpoints with several)")
    p.add_argument("--image", type=Path, default=ASSET, help="frame to predict on (default: the bundled test scene)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None, help="default: float32 on cpu, bfloat16 on cuda")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (pinned)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("results/bench_step"), help="writes <out>.json and <out>.png")
    return p.parse_args(argv)


class UpstreamPath:
    """Upstream's inference from the same modules and weights (see module docstring)."""

    def __init__(self, policy) -> None:
        import transformers

        self.policy = policy
        cfg = policy.config
        hf_cfg = transformers.LlamaConfig(**{k: v for k, v in cfg.llm.to_hf().items() if k != "model_type"})
        with torch.device(policy.device):
            self.llm = transformers.LlamaForCausalLM(hf_cfg).to(policy.dtype)
        # the very same weight tensors as ours
        self.llm.load_state_dict(policy.model.language_model.state_dict(), strict=True, assign=True)
        self.llm.eval()
        self.actions = ActionTokenizer(cfg.n_bins, cfg.vocab_size_text, policy.action_stats(policy.unnorm_key))
        self.towers = [policy.model.vision_backbone.featurizer, policy.model.vision_backbone.fused_featurizer]
        self.towers = [t for t in self.towers if t is not None]
        self.prompt = torch.tensor([policy.tokenizer.prompt(INSTRUCTION).input_ids], device=policy.device)

    @torch.inference_mode()
    def tokens(self, image: np.ndarray, **generate_kwargs) -> np.ndarray:
        policy = self.policy
        pixels = policy.image_processor(image)[None].to(policy.device, policy.dtype)
        chunks = torch.split(pixels, 3, dim=1)
        features = torch.cat(
            [vit.get_intermediate_layers(x, n={len(vit.blocks) - 2})[0] for vit, x in zip(self.towers, chunks)], dim=2
        )
        text = self.llm.get_input_embeddings()(self.prompt)
        embeds = torch.cat([text[:, :1], policy.model.projector(features), text[:, 1:]], dim=1)
        out = self.llm.generate(
            inputs_embeds=embeds, max_new_tokens=policy.action_dim, do_sample=False, pad_token_id=policy.config.pad_token_id,
            **generate_kwargs,
        )  # fmt: skip
        return out[:, -policy.action_dim :].cpu().numpy()

    def action(self, image: np.ndarray) -> np.ndarray:
        return self.actions.decode(self.tokens(image))


def main(argv: list[str] | None = None) -> int:
    return seeded_main(parse_args, run, argv)


def run(args: argparse.Namespace) -> int:
    """Check our tokens equal the reference's, time the variants interleaved, print and write the record."""
    image = read_image(args.image)
    with tempfile.TemporaryDirectory() as tmp:
        path = args.checkpoint or make_tiny_openvla(Path(tmp) / "tiny-openvla", seed=args.seed)
        full = load_policy(
            path, device=args.device, dtype=args.dtype, unnorm_key=args.unnorm_key, decoding=ActionDecoding.FULL
        )
    device, dtype = full.device, full.dtype
    # the same loaded modules, decoding restricted to the action ids (the runtime default)
    restricted = OpenVLAPolicy(full.checkpoint, device=device, dtype=dtype, unnorm_key=args.unnorm_key)
    reference = UpstreamPath(full)
    obs = Observation(images={"primary": image})
    ours_full = full.new_session(INSTRUCTION)
    ours_restricted = restricted.new_session(INSTRUCTION)

    # outputs agree before anything is timed
    ref_tokens = reference.tokens(image)
    ours_full.step(obs)
    if not np.array_equal(ours_full.last_tokens, ref_tokens):
        raise SystemExit(f"token mismatch: ours {ours_full.last_tokens.tolist()} vs reference {ref_tokens.tolist()}")
    first, last = restricted.config.action_token_range
    suppress = [i for i in range(restricted.config.llm.vocab_size) if not first <= i <= last]
    ours_restricted.step(obs)
    if not np.array_equal(ours_restricted.last_tokens, reference.tokens(image, suppress_tokens=suppress)):
        raise SystemExit("token mismatch between restricted decoding and the reference with non-action tokens suppressed")

    variants = {
        BASELINE: lambda: reference.action(image),
        "ours (full vocabulary)": lambda: ours_full.step(obs),
        "ours (action tokens, default)": lambda: ours_restricted.step(obs),
    }
    times = time_interleaved(variants, warmup=args.warmup, repeats=args.repeats, device=device)
    results = ratio_table(times, BASELINE)
    print_ratio_table(results)
    record = {"tiny": args.checkpoint is None, "info": full.info()}
    write_json(args.out.with_suffix(".json"), env=environment(device=device, dtype=dtype, threads=args.threads), args=args,
               checkpoint=record, results=results)  # fmt: skip
    plot_medians(results, args.out.with_suffix(".png"), title="OpenVLA per-action latency", xlabel="ms per action (median, p10-p90)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
