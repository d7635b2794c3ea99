"""Linear layers prepacked for oneDNN (``--prepack``, ``models.prepack``) vs ATen's ``F.linear``, ms per pass over
every weight of a geometry's decoder layers, by the number of rows multiplied at once, side by side in one process
(interleaved call by call, medians; threads pinned).

Rows: 1 = one robot's decode token; 8 = eight robots' decode tokens batched by ``vla-runtime serve``; 21 = one
frame's prefill (the serve bench's geometry); 168 = eight frames' prefill. Geometries (``--geometry``):

- ``small``: the serve bench's decoder (512 hidden, 1376 MLP, 8 layers: 56 weight matrices, 101 MB float32);
- ``7b-layer``: ``--layers`` LLaMA-2-7B decoder layers (4096 hidden, 11008 MLP; 7 matrices per layer).

Both kernels' outputs are compared before timing (max relative difference).

``--policy-steps`` adds whole steps of ``bench_serve.py``'s policy (that decoder, 56-px towers, history mode,
chunked cache), one ATen and one prepacked copy in this process: one robot's ``session.step`` and eight robots'
``step_batch``, interleaved step by step after ``--warmup`` steps of the episode; afterwards each pair's last
action tokens are compared (the same frames stepped as often).

    python benchmarks/bench_prepack.py --threads 1 --policy-steps
    python benchmarks/bench_prepack.py --threads 2 --geometry 7b-layer --layers 1
"""

from __future__ import annotations

import argparse
import itertools
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F
from bench_serve import make_policy  # a sibling script: the serve bench's policy (--policy-steps)

from vla_runtime.bench.harness import environment, print_ratio_table, ratio_table, seeded_main, time_interleaved, write_json
from vla_runtime.models.prepack import PACK_ROWS_HINT

GEOMETRIES = {"small": (512, 1376, 8), "7b-layer": (4096, 11008, None)}  # hidden, MLP, layers (None: --layers)
ATEN, PACKED = "ATen F.linear", "prepacked"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--geometry", choices=(*GEOMETRIES, "both"), default="both")
    p.add_argument("--layers", type=int, default=1, help="7b-layer: decoder layers (default: %(default)s)")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 8, 21, 168], help="rows per call")
    p.add_argument("--policy-steps", action="store_true", help="also whole steps of bench_serve.py's policy (above)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (pinned)")
    p.add_argument("--warmup", type=int, default=3, help="untimed calls of each row (policy steps: at least 20)")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("results/bench_prepack"), help="writes <out>.json")
    return p.parse_args(argv)


def weights(geometry: str, layers: int) -> list[torch.Tensor]:
    """Every [out, in] weight of the geometry's decoder layers: q, k, v, o, gate, up, down per layer."""
    dim, ffn, n = GEOMETRIES[geometry]
    shapes = [(dim, dim)] * 4 + [(ffn, dim)] * 2 + [(dim, ffn)]
    return [torch.randn(o, i) / i**0.5 for _ in range(n or layers) for o, i in shapes]


def passes(ws: list[torch.Tensor], rows: int, gen: torch.Generator) -> tuple[dict, float]:
    """Both kernels' pass over ``ws`` on ``rows`` random rows, and their largest relative output difference."""
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, PACK_ROWS_HINT) for w in ws]
    xs = {w.shape[1]: torch.randn(rows, w.shape[1], generator=gen) for w in ws}

    def aten() -> list[torch.Tensor]:
        return [F.linear(xs[w.shape[1]], w) for w in ws]

    def prepacked() -> list[torch.Tensor]:
        return [torch.ops.mkldnn._linear_pointwise(xs[w.shape[1]], p, None, "none", [], "") for w, p in zip(ws, packed)]

    diff = max(float((b - a).abs().max() / a.abs().max()) for a, b in zip(aten(), prepacked()))
    return {ATEN: aten, PACKED: prepacked}, diff


def policy_steps(args: argparse.Namespace, root: Path) -> tuple[dict, dict]:
    """Steps of one robot and of eight batched, ATen and prepacked policies of ``bench_serve.py`` (module doc) ->
    the calls, and per robot count whether the two policies' last action tokens are equal after them."""
    import numpy as np

    from vla_runtime.api import Observation
    from vla_runtime.config import SessionConfig
    from vla_runtime.kv import KVConfig

    config = SessionConfig(history="history", kv=KVConfig(mode="chunked"))
    rng = np.random.default_rng(args.seed)
    frames = [rng.integers(0, 256, (96, 128, 3), dtype=np.uint8) for _ in range(8)]
    calls, sessions = {}, {}
    for name, prepack in ((ATEN, False), (PACKED, True)):
        options = argparse.Namespace(llm="small", seed=args.seed, device="cpu", prepack=prepack)
        policy = make_policy(options, root / name.replace(" ", "_"))
        for robots in (1, 8):
            group = [policy.new_session("pick up the red block", config) for _ in range(robots)]
            sessions[robots, name] = group
            counter = itertools.count()

            def step(policy=policy, group=group, counter=counter) -> None:
                k = next(counter)
                obs = [Observation(images={"primary": frames[(k + i) % 8]}) for i in range(len(group))]
                policy.step_batch(group, obs) if len(group) > 1 else group[0].step(obs[0])

            calls[f"policy, {robots} robot{'s' * (robots > 1)}: {name}"] = step

    def tokens_equal() -> dict:
        return {robots: all(np.array_equal(a.last_tokens, b.last_tokens)
                            for a, b in zip(sessions[robots, ATEN], sessions[robots, PACKED])) for robots in (1, 8)}  # fmt: skip

    return calls, tokens_equal


def main(argv: list[str] | None = None) -> int:
    return seeded_main(parse_args, run, argv)


def run(args: argparse.Namespace) -> int:
    if not torch.backends.mkldnn.is_available():
        raise SystemExit("this torch has no oneDNN: nothing to prepack for")
    gen = torch.Generator().manual_seed(args.seed)
    times, baselines, diffs = {}, {}, {}
    for geometry in GEOMETRIES if args.geometry == "both" else (args.geometry,):
        ws = weights(geometry, args.layers)
        mib = sum(w.numel() * w.element_size() for w in ws) / 2**20
        for rows in args.rows:
            calls, diffs[f"{geometry} x{rows}"] = passes(ws, rows, gen)
            measured = time_interleaved(calls, warmup=args.warmup, repeats=args.repeats)
            for name, t in measured.items():
                times[f"{geometry} ({mib:.0f} MiB), {rows} rows: {name}"] = t
                baselines[f"{geometry} ({mib:.0f} MiB), {rows} rows: {name}"] = f"{geometry} ({mib:.0f} MiB), {rows} rows: {ATEN}"
    tokens = {}
    if args.policy_steps:
        with tempfile.TemporaryDirectory() as tmp:
            calls, tokens_equal = policy_steps(args, Path(tmp))
            times |= time_interleaved(calls, warmup=max(args.warmup, 20), repeats=args.repeats)
            baselines |= {name: name.replace(PACKED, ATEN) for name in calls}
            tokens = tokens_equal()
    results = ratio_table(times, baselines)
    print(f"{args.threads} thread(s); ratio > 1: prepacked is faster")
    print_ratio_table(results)
    print("largest relative difference of the outputs: " + ", ".join(f"{k} {v:.1e}" for k, v in diffs.items()))
    if tokens:
        print("policy steps, last action tokens equal, ATen vs prepacked: "
              + ", ".join(f"{robots} robot(s) {same}" for robots, same in tokens.items()))  # fmt: skip
    write_json(args.out.with_suffix(".json"), env=environment(threads=args.threads), args=args, results=results,
               max_relative_diff=diffs, policy_tokens_equal=tokens)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
