"""The fast path, ms per call: eager vs torch.compile-d (``SessionConfig.compile``) vs weight-only int8/int4 LLM
(``--quantize``) vs fused q/k/v and gate/up projections (``--fuse``) vs linear layers prepacked for oneDNN
(``--prepack``, CPU only, eager only), side by side in one process, each against the eager float32 row of its geometry.

Geometries (``--geometry``):

- ``small``: the tiny test OpenVLA (2 LLaMA layers of 64 hidden, two 3-block ViTs): a whole ``session.step``
  (single mode, full cache: vision, prefill, 7 action tokens) and one decode forward (T=1) over the step's
  context.
- ``cogact``: the tiny test CogACT (the same VLM with a 56-px image, and its DiT): a whole ``session.step`` (single
  mode: vision, prefill, 10 DDIM steps of the DiT with classifier-free guidance), eager, compiled, fused and
  weight-only (every family row below too).
- ``hybridvla``: the tiny test HybridVLA: a whole ``session.step`` (single mode: vision, DDIM steps through the
  LLM, the AR branch's tokens, the collaborative ensemble), eager and compiled.
- ``oft``: the tiny test OpenVLA-OFT (LIBERO layout: two cameras, a proprio token, the L1 head): a whole
  ``session.step`` (single mode: both images, one bidirectional forward, the head's 8 x 7 chunk), eager and compiled.
- ``7b-layer``: ``--layers`` LLaMA-2-7B-sized decoder layers (4096 hidden, 11008 MLP, 32 heads; random
  weights): one decode forward (T=1) over a full cache holding ``--context`` tokens (an OpenVLA step's worth).

Compiled decode rows run as a compiled session's steps do after its warm-up: dynamo's guards skipped but those
that choose between graphs (``SessionConfig.compile_guards`` False); the ``compiled, every guard`` row is the
same graph with every guard evaluated (about 0.5 ms per call for 32 layers on a CPU core).

Decode forwards run inside a cache mark and are rolled back, so every timed call sees the same context. Before
timing, every variant's output is compared with eager's: compiled must decode identical action tokens (hidden
states: max difference reported); the fused and quantized models' agreement is reported, not required (small: the share of
identical action tokens and the largest action difference over ``--agreement-steps`` frames; 7b-layer: the
hidden state's difference), with the LLM's weight bytes.

``--device cuda`` runs the same questions on a GPU (default dtype bfloat16, compiled = ``reduce-overhead``: CUDA
graphs) and adds the weight-bandwidth limit of every decode row: the bytes of decoder-layer weights one decode
token reads, divided by the device's copy bandwidth measured in the same run (a ``--bandwidth-mib`` MiB buffer
copied on the device), against the measured median: ``x limit`` (1.0 = reading every weight once at the measured
bandwidth; issue 21's target: <= 1.5). On CPU the same column uses the CPU's copy bandwidth.

    python benchmarks/bench_fast.py --threads 1 --repeats 30
    vla-runtime bench fast --geometry 7b-layer --layers 2
    python benchmarks/bench_fast.py --device cuda --geometry 7b-layer --layers 32 --context 290   # a whole 7B LLM
    python benchmarks/bench_fast.py ... --profile 20   # then: wall vs device kernel time per decode call
"""

from __future__ import annotations

import argparse
import copy
import itertools
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import torch

from vla_runtime.api import Observation, load_policy
from vla_runtime.bench.decode_limits import Group, bandwidth_limits, copy_bandwidth, profile_decode_rows
from vla_runtime.bench.harness import (
    environment, plot_medians, positive_int, print_ratio_table, ratio_table, seeded_main, time_interleaved, write_json,
)  # fmt: skip
from vla_runtime.checkpoints.tiny_openvla import make_tiny_openvla
from vla_runtime.checkpoints.tiny_openvla_oft import make_tiny_openvla_oft
from vla_runtime.checkpoints.tiny_prismatic import make_tiny_cogact, make_tiny_hybridvla
from vla_runtime.config import CompileMode, SessionConfig
from vla_runtime.images import read_image
from vla_runtime.kv import KVConfig, make_cache
from vla_runtime.models.fuse import fuse_projections
from vla_runtime.models.llama import LlamaConfig, LlamaModel
from vla_runtime.models.prepack import prepack_linears
from vla_runtime.models.quantize import QuantMode, quantize_linears, weight_bytes
from vla_runtime.policies.compiled import CompiledDecoder, compile_options

ASSET = Path(__file__).resolve().parents[1] / "assets" / "demo_scene.png"
INSTRUCTION = "put the red cube in the blue bowl"
GEOMETRIES = ("small", "cogact", "hybridvla", "oft", "7b-layer")
DEFAULT_GEOMETRIES = ("small", "7b-layer")  # --geometry both
EAGER, COMPILED, GUARDED = "eager", "compiled", "compiled, every guard"
FAMILIES = {  # --geometry: the tiny checkpoint's maker and load_policy's extra arguments
    "cogact": (make_tiny_cogact, {}), "hybridvla": (make_tiny_hybridvla, {}),
    "oft": (make_tiny_openvla_oft, {"cameras": ("primary", "wrist")}),
}
QUANT_MODES = {m.value: m for m in (QuantMode.INT8, QuantMode.INT4)}  # --quantized
FUSED = "fused q/k/v, gate/up"  # --fused
PREPACKED = "prepacked (oneDNN)"  # --prepacked: eager only (a compiled graph multiplies by the weights themselves)


def weight_variants(args: argparse.Namespace) -> dict[str, dict]:
    """The rows that change the LLM's weights (``--fused``, the weight-only rows ``--quantized`` asks for, then
    ``--prepacked``), by row name -> their ``load_policy`` options."""
    fused = {FUSED: {"fuse": True}} if args.fused else {}
    prepacked = {PREPACKED: {"prepack": True}} if args.prepacked else {}
    return fused | {f"weight-only {name}": {"quantize": QUANT_MODES[name]} for name in args.quantized} | prepacked


def transformed(model: LlamaModel, options: dict) -> LlamaModel:
    """A copy of ``model`` with ``load_policy``'s ``fuse`` / ``quantize`` / ``prepack`` ``options`` applied to its
    layers."""
    out = copy.deepcopy(model)
    if options.get("fuse"):
        fuse_projections(out.layers)
    quantize_linears(out.layers, options.get("quantize", QuantMode.NONE))
    if options.get("prepack"):
        prepack_linears(out.layers)
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--geometry", choices=(*GEOMETRIES, "both", "all"), default="both",
                   help="both: small and 7b-layer; all: every geometry (default: %(default)s)")
    p.add_argument("--layers", type=int, default=2, help="7b-layer: decoder layers (default: %(default)s)")
    p.add_argument("--context", type=int, default=290, help="7b-layer: tokens in the cache (default: %(default)s)")
    p.add_argument("--image", type=Path, default=ASSET, help="small: the frame (default: the bundled test scene)")
    p.add_argument("--agreement-steps", type=int, default=20, help="small: frames the quantized actions are compared on")
    p.add_argument("--device", default="cpu", help="cpu or cuda (default: %(default)s)")
    p.add_argument("--quantized", nargs="*", choices=tuple(QUANT_MODES), default=list(QUANT_MODES),
                   help="the weight-only rows (default: %(default)s; none given: no quantized rows, e.g. to spare a GPU "
                        "lease their compilation)")
    p.add_argument("--fused", action=argparse.BooleanOptionalAction, default=True,
                   help="the fused q/k/v, gate/up rows (default: on)")
    p.add_argument("--prepacked", action=argparse.BooleanOptionalAction, default=None,
                   help="the eager row with the linear layers prepacked for oneDNN (default: on for --device cpu with "
                        "float32; CPU float32 only; 7b-layer only: the tiny model's layers are too small to prepack)")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                   help="model and cache dtype (default: float32 on CPU, bfloat16 on CUDA)")
    p.add_argument("--compile", dest="compile_mode", choices=("default", "reduce-overhead"), default=None,
                   help="the compiled rows' mode (default: default on CPU, reduce-overhead (CUDA graphs) on CUDA)")
    p.add_argument("--bandwidth-mib", type=int, default=512, help="buffer copied to measure the copy bandwidth (MiB)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (pinned)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--repeats", type=positive_int, default=30)
    p.add_argument("--block", type=int, default=1,
                   help="calls of one variant in a row per round (default: %(default)s = interleaved call by call; "
                        "e.g. 40 times consecutive steps, as a control loop runs them)")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="after timing, run N calls of every decode row under torch.profiler: wall time against the "
                        "device's kernel time per call, kernels per call, and the top ops (<out>.profile.txt)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("results/bench_fast"), help="writes <out>.json and <out>.png")
    args = p.parse_args(argv)
    args.device = torch.device(args.device)
    if args.device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device here")
    cuda = args.device.type == "cuda"
    args.dtype = getattr(torch, args.dtype or ("bfloat16" if cuda else "float32"))
    args.compile_mode = CompileMode(args.compile_mode or ("reduce-overhead" if cuda else "default"))
    cpu_float32 = not cuda and args.dtype == torch.float32
    if args.prepacked and not cpu_float32:
        raise SystemExit("--prepacked: prepacking is for float32 on the CPU")
    args.prepacked = cpu_float32 if args.prepacked is None else args.prepacked
    return args


def rolled_back(decoder: Callable[..., torch.Tensor], cache, x: torch.Tensor) -> Callable[[], torch.Tensor]:
    """One decode forward of ``x`` [1, 1, dim] over ``cache``'s context, rolled back after (the same context
    every call) -> a call returning the final hidden state [1, 1, dim]."""

    @torch.inference_mode()
    def call() -> torch.Tensor:
        mark = cache.mark()
        out = decoder(inputs_embeds=x, cache=cache)
        cache.rollback(mark)
        return out

    return call


def guards_skipped(call: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
    """``call`` (a compiled decode, already warmed up) under the stance a compiled session's steps run in after
    its warm-up (``SessionConfig.compile_guards`` False): only the guards that choose between compiled graphs."""

    def skipping() -> torch.Tensor:
        with torch.compiler.set_stance(skip_guard_eval_unsafe=True):
            return call()

    return skipping


def guards_tell_models_apart(guarded: dict[str, Callable[[], torch.Tensor]]) -> bool:
    """Whether each compiled model, called with only the guards that choose between graphs, still runs its own
    graph. The models compile the same ``layers_forward``; a torch older than the pin (the GPU image's 2.11) ran
    the bf16 model's call through the fused model's graph that way (``KeyError: 'qkv_proj'``, an H200 on
    2026-11-30). Where they do not, every compiled row evaluates its guards, and this says so."""
    for variant, call in guarded.items():
        want = call()
        try:
            got = guards_skipped(call)()
        except Exception as error:  # noqa: BLE001  the wrong graph fails in whatever way its code does
            print(f"{variant}: with guards skipped it ran another model's graph ({error!r}): every guard is evaluated")
            return False
        if not torch.equal(got, want):
            print(f"{variant}: with guards skipped it returned another model's output: every guard is evaluated")
            return False
    return True


def timed(fn: Callable[[], object]) -> tuple[object, float]:
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def hidden_agreement(want: torch.Tensor, got: torch.Tensor) -> dict:
    """Max abs difference of two hidden states, absolute and relative to ``want``'s max magnitude."""
    diff = float((got - want).abs().max())
    return {"max_abs_diff": diff, "relative": diff / float(want.abs().max())}


def small_group(args: argparse.Namespace, tmp: Path) -> Iterator[Group]:
    """The tiny OpenVLA: whole steps, then (built once the steps are timed) decode forwards over one step's
    context. Built one after the other so that the decode group's compiled graphs of the same ``layers_forward``
    are not yet there while the steps run: each adds cache entries whose guards a compiled step's call would
    then have to tell apart."""
    path = make_tiny_openvla(tmp / "tiny-openvla", seed=args.seed)
    load = dict(device=args.device, dtype=args.dtype)
    policy = load_policy(path, **load)
    obs = Observation(images={"primary": read_image(args.image)})
    eager = policy.new_session(INSTRUCTION)
    compiled, compile_s = timed(lambda: policy.new_session(INSTRUCTION, SessionConfig(compile=args.compile_mode)))
    want, got = eager.step(obs), compiled.step(obs)
    if not np.array_equal(eager.last_tokens, compiled.last_tokens):
        raise SystemExit(f"compiled tokens {compiled.last_tokens.tolist()} != eager {eager.last_tokens.tolist()}")
    sessions = {EAGER: eager, COMPILED: compiled}
    setup_s = {COMPILED: compile_s}
    agreement = {COMPILED: {"tokens_equal": True, "max_abs_action_diff": float(np.abs(got.actions - want.actions).max())}}
    decoders = {}
    for name, options in weight_variants(args).items():
        if options.get("prepack"):  # every layer of the tiny model is under MIN_PACKED_WEIGHTS: nothing to prepack
            continue
        changed, setup_s[name] = timed(lambda: load_policy(path, **options, **load))
        sessions[name] = changed.new_session(INSTRUCTION)
        agreement[name] = action_agreement(eager, sessions[name], args)
        decoders[name] = changed.vlm.language_model.model
    yield Group("small step", {name: (lambda s=s: s.step(obs)) for name, s in sessions.items()}, setup_s, agreement)
    llm = policy.vlm.language_model.model
    context = eager.cache.stats().tokens_seen
    yield decode_group("small decode", llm, context=context, args=args, variants=decoders)


def family_group(family: str, args: argparse.Namespace, tmp: Path) -> Iterator[Group]:
    """A tiny CogACT, HybridVLA or OpenVLA-OFT: whole steps, eager and compiled (the same seed: the same noise, so
    the same actions up to float rounding, checked before timing), and the fused and weight-only rows (the largest
    difference of their first step's actions from a fresh eager session's, the same noise, is reported)."""
    make, load = FAMILIES[family]
    path = make(tmp / f"tiny-{family}", seed=args.seed)
    policy = load_policy(path, device=args.device, dtype=args.dtype, **load)
    state = {"hybridvla": policy.action_dim, "oft": getattr(policy.config, "proprio_dim", None)}.get(family)
    image = read_image(args.image)
    obs = Observation(images=dict.fromkeys(load.get("cameras", ("primary",)), image),
                      state=None if state is None else np.zeros(state))  # fmt: skip
    config = SessionConfig(seed=args.seed)
    eager = policy.new_session(INSTRUCTION, config)
    compiled, compile_s = timed(lambda: policy.new_session(INSTRUCTION, replace(config, compile=args.compile_mode)))
    diff = float(np.abs(compiled.step(obs).actions - eager.step(obs).actions).max())
    if diff > 1e-3:
        raise SystemExit(f"compiled {family}'s actions differ from eager's by {diff:.3g} (robot units)")
    calls = {EAGER: lambda: eager.step(obs), COMPILED: lambda: compiled.step(obs)}
    setup_s, agreement = {COMPILED: compile_s}, {COMPILED: {"max_abs_action_diff": diff}}
    first = policy.new_session(INSTRUCTION, config).step(obs).actions  # a fresh session's first step: its noise
    for name, options in weight_variants(args).items():
        if options.get("prepack"):  # every layer of the tiny families is under MIN_PACKED_WEIGHTS: nothing to prepack
            continue
        changed, setup_s[name] = timed(lambda: load_policy(path, device=args.device, dtype=args.dtype, **options, **load))
        session = changed.new_session(INSTRUCTION, config)
        agreement[name] = {"max_abs_action_diff": float(np.abs(session.step(obs).actions - first).max())}
        calls[name] = lambda s=session: s.step(obs)
    yield Group(f"{family} step", calls, setup_s, agreement)


def action_agreement(eager, other, args: argparse.Namespace) -> dict:
    """``other`` session's actions against ``eager``'s on ``--agreement-steps`` random frames: the share of identical
    action tokens, the largest action difference (robot units), and the LLM's weight bytes of each."""
    rng = np.random.default_rng(args.seed)
    same, total, diff = 0, 0, 0.0
    for _ in range(args.agreement_steps):
        obs = Observation(images={"primary": rng.integers(0, 256, (224, 224, 3), dtype=np.uint8)})
        a, b = eager.step(obs), other.step(obs)
        same += int((eager.last_tokens == other.last_tokens).sum())
        total += eager.last_tokens.size
        diff = max(diff, float(np.abs(a.actions - b.actions).max()))
    layers = lambda s: weight_bytes(s.policy.vlm.language_model.model.layers)  # noqa: E731
    return {"identical_tokens": same / total, "steps": args.agreement_steps, "max_abs_action_diff": diff,
            "llm_layer_bytes": layers(other), "float_llm_layer_bytes": layers(eager)}  # fmt: skip


def decode_group(name: str, model: LlamaModel, *, context: int, args: argparse.Namespace,
                 variants: dict[str, LlamaModel]) -> Group:
    """Decode forwards of ``model`` (and of its fused or quantized ``variants``) over full caches filled with the
    same ``context`` random tokens (one cache per model: each holds the K/V its own weights computed)."""
    cfg = model.cfg
    gen = torch.Generator().manual_seed(args.seed)
    prompt, x = (torch.randn(1, n, cfg.dim, generator=gen).to(args.device, args.dtype) for n in (context, 1))

    def filled(m: LlamaModel):
        cache = make_cache(KVConfig(), cfg.geometry, batch=1, device=args.device, dtype=args.dtype)
        with torch.inference_mode():
            m(inputs_embeds=prompt, cache=cache)
        return cache

    options = compile_options(args.compile_mode, args.device)
    calls = {EAGER: rolled_back(model, filled(model), x)}
    compiled = {COMPILED: model} | {f"{variant} + compiled": m for variant, m in variants.items() if variant != PREPACKED}
    for variant, m in variants.items():
        calls[variant] = rolled_back(m, filled(m), x)
    setup_s, guarded = {}, {}
    for variant, m in compiled.items():
        guarded[variant] = rolled_back(CompiledDecoder(m, **options), filled(m), x)
        _, setup_s[variant] = timed(guarded[variant])  # compiles
    skip = guards_tell_models_apart(guarded)
    for variant, call in guarded.items():
        calls[variant] = guards_skipped(call) if skip else call  # as a session's steps run it, where that is safe
    if skip:
        calls[GUARDED] = guarded[COMPILED]
    want = calls[EAGER]()
    agreement = {variant: hidden_agreement(want, call()) for variant, call in calls.items() if variant != EAGER}
    for variant, m in variants.items():
        agreement[variant]["llm_layer_bytes"] = weight_bytes(m.layers)
    agreement[EAGER] = {"llm_layer_bytes": weight_bytes(model.layers)}
    read = {name: weight_bytes(model.layers) for name in (EAGER, COMPILED, GUARDED) if name in calls}
    for variant, m in variants.items():
        read[variant] = weight_bytes(m.layers)
        if f"{variant} + compiled" in calls:
            read[f"{variant} + compiled"] = read[variant]
    return Group(name, calls, setup_s, agreement, read)


def layer_group(args: argparse.Namespace) -> Iterator[Group]:
    """``--layers`` LLaMA-2-7B-sized decoder layers (random weights, a 32-row embedding: inputs are embeddings)."""
    torch.manual_seed(args.seed)
    cfg = LlamaConfig.from_name("llama2-7b", n_layers=args.layers, vocab_size=32)
    with torch.device(args.device):
        model = LlamaModel(cfg).to(args.dtype).eval()
    variants = {name: transformed(model, options) for name, options in weight_variants(args).items()}
    yield decode_group(f"7b-layer x{args.layers} decode", model, context=args.context, args=args, variants=variants)


def main(argv: list[str] | None = None) -> int:
    return seeded_main(parse_args, run, argv)


def run(args: argparse.Namespace) -> int:
    """Build each group's variants, check them against eager and time them interleaved (group by group), report."""
    geometries = {"both": DEFAULT_GEOMETRIES, "all": GEOMETRIES}.get(args.geometry, (args.geometry,))
    groups: list[Group] = []
    times, baselines = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        built = itertools.chain(
            small_group(args, Path(tmp)) if "small" in geometries else (),
            *(family_group(family, args, Path(tmp)) for family in FAMILIES if family in geometries),
            layer_group(args) if "7b-layer" in geometries else (),
        )
        for group in built:
            groups.append(group)
            measured = time_interleaved(group.calls, warmup=args.warmup, repeats=args.repeats, device=args.device,
                                        block=args.block)
            for variant, t in measured.items():
                times[f"{group.name}: {variant}"] = t
                baselines[f"{group.name}: {variant}"] = f"{group.name}: {EAGER}"
    results = ratio_table(times, baselines)
    print_ratio_table(results)
    bandwidth = copy_bandwidth(args.device, args.bandwidth_mib)
    limits = bandwidth_limits(groups, results, bandwidth)
    print(f"copy bandwidth on {args.device}: {bandwidth / 1e9:.1f} GB/s ({args.bandwidth_mib} MiB buffer, median of 10)")
    for row, limit in limits.items():
        print(f"{row}: {limit['weight_bytes'] / 2**20:.1f} MiB of layer weights per token, limit {limit['limit_ms']:.3f} ms "
              f"-> {limit['x_limit']:.2f}x the weight-bandwidth limit")
    for group in groups:
        for variant, seconds in group.setup_s.items():
            print(f"{group.name}: {variant}: prepared in {seconds:.1f} s")
        for variant, agreement in group.agreement.items():
            print(f"{group.name}: {variant}: {agreement}")
    profiled = {}
    if args.profile:
        profiled, tables = profile_decode_rows(groups, args)
        args.out.parent.mkdir(parents=True, exist_ok=True)  # write_json below makes it too; this file comes first
        args.out.with_suffix(".profile.txt").write_text(tables)
        for row, p in profiled.items():
            gemm = ""
            if p["gemm_ms"] > 0 and row in limits:  # the weights' bytes over the GEMMs' time: their own bandwidth
                gemm = f"; GEMMs {p['gemm_ms']:.3f} ms at {limits[row]['weight_bytes'] / p['gemm_ms'] / 1e6:.0f} GB/s"
            print(f"{row}: {p['wall_ms']:.3f} ms wall per call, {p['kernel_ms']:.3f} ms of device kernels "
                  f"({p['kernels_per_call']:.0f} kernels{gemm})")
    write_json(args.out.with_suffix(".json"), env=environment(device=args.device, dtype=args.dtype, threads=args.threads),
               args=args, results=results, setup_s={g.name: g.setup_s for g in groups},
               agreement={g.name: g.agreement for g in groups}, copy_bandwidth_bytes_per_s=bandwidth,
               weight_bandwidth_limits=limits, profile=profiled)  # fmt: skip
    plot_medians(results, args.out.with_suffix(".png"), title="eager vs compiled vs fused vs quantized vs prepacked", xlabel="ms per call (median, p10-p90)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
