"""The options every command that runs a policy shares (``predict``, ``serve``, ``eval``): one spelling,
one set of defaults, one conversion into ``SessionConfig``."""

from __future__ import annotations

import argparse

from ..config import COMPILE_MODES, HISTORY_MODES, SessionConfig
from ..device import DTYPES
from ..kv import CACHES, KVConfig, KVMode, saved_gate_geometry
from ..models.quantize import QUANT_MODES, QuantMode


def add_policy_arguments(p: argparse.ArgumentParser) -> None:
    """Device, dtype, the KV cache and the session's context, as each policy command spells them."""
    p.add_argument("--device", help="cpu, cuda, cuda:N (default: cuda if available, else cpu)")
    p.add_argument("--dtype", choices=sorted(DTYPES), help="weights/activations dtype (default: bfloat16 on cuda, float32 on cpu)")
    p.add_argument("--unnorm-key", help="dataset key of the action statistics (needed when the checkpoint has several)")
    p.add_argument("--center-crop", action="store_true", help="0.9-area centre crop (models trained with image augmentation)")
    p.add_argument("--history", choices=HISTORY_MODES, default="single",
                   help="single = a fresh context each step (stock OpenVLA); history = one cache per episode (default: %(default)s)")
    p.add_argument("--kv", choices=tuple(CACHES), default="full", help="KV cache (default: %(default)s)")
    p.add_argument("--kv-capacity", type=int, default=None,
                   help="tokens a cache holds (default: the model's max_position); a full cache in history mode needs "
                        "about steps x tokens per step")
    p.add_argument("--kv-window", type=int, default=None,
                   help="raw recent window in tokens, sink_window and chunked (default: one control step of the policy)")
    p.add_argument("--kv-max-chunks", type=int, default=None, help="chunked: retained chunks per layer (default: as many as fit)")
    p.add_argument("--quantize", choices=QUANT_MODES, default="none",
                   help="weight-only int8/int4 of the LLM's decoder layers (activations and the KV cache stay in "
                        "--dtype; default: %(default)s)")
    p.add_argument("--fuse", action="store_true",
                   help="q/k/v and gate/up of the LLM's decoder layers as one GEMM each: fewer, larger GEMMs per "
                        "decode token, the same outputs up to float rounding")
    p.add_argument("--prepack", action="store_true",
                   help="CPU, float32: linear layers of 512 x 512 weights and more multiply by a copy of their weight "
                        "prepacked for oneDNN at load: faster eager steps of batched robots and on several threads "
                        "(README, Speed), the same outputs up to float rounding, a second copy of those weights")
    p.add_argument("--compile", choices=COMPILE_MODES, default="off",
                   help="off = eager; default = torch.compile the vision towers and the decoder (compiled when the "
                        "session starts, about a minute on CPU); reduce-overhead = the same with CUDA graphs, CUDA "
                        "only (default: %(default)s)")
    p.add_argument("--compile-guards", action="store_true",
                   help="compiled steps evaluate every torch.compile guard after the warm-up (slower; default: only "
                        "the guards that pick between the compiled graphs)")


def kv_from_args(args: argparse.Namespace) -> KVConfig:
    """The cache the ``--kv*`` options describe (options of another cache left unset). ``--kv chunked`` on a
    checkpoint with a trained gate takes the gate's chunk size and widths (the only ones its weights fit)."""
    flags = {"capacity": args.kv_capacity, "window": args.kv_window, "max_chunks": args.kv_max_chunks}
    if KVMode(args.kv) is KVMode.CHUNKED:
        flags |= saved_gate_geometry(args.checkpoint)
    return KVConfig.from_dict({"mode": args.kv, **flags})


def load_options(args: argparse.Namespace) -> dict:
    """``load_policy`` options of the shared flags: ``quantize`` unless ``--quantize none``, ``fuse`` with
    ``--fuse``, ``prepack`` with ``--prepack`` (``ValueError`` naming the flag for a plug-in family whose loader
    does not take them)."""
    mode = QuantMode(args.quantize)
    spelled = {"quantize": f"--quantize {mode.value}", "fuse": "--fuse", "prepack": "--prepack"}
    options = ({} if mode is QuantMode.NONE else {"quantize": mode}) | ({"fuse": True} if args.fuse else {})
    options |= {"prepack": True} if args.prepack else {}
    if options:
        from ..api import check_speed_options

        check_speed_options(args.checkpoint, {name: spelled[name] for name in options})
    return options


def session_from_args(args: argparse.Namespace, kv: KVConfig | None = None, **fields) -> SessionConfig:
    """The session the options describe (``kv``: a cache built otherwise, e.g. sized to match another)."""
    return SessionConfig(kv=kv or kv_from_args(args), history=args.history, unnorm_key=args.unnorm_key,
                         center_crop=args.center_crop, compile=args.compile,
                         compile_guards=args.compile_guards, **fields)
