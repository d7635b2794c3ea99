"""``vla-runtime predict``: one action from a checkpoint, an image and an instruction, printed as JSON.

    vla-runtime predict --checkpoint runs/openvla-7b --image frame.png \
        --instruction "put the cup in the drawer" --unnorm-key bridge_orig

Prints one JSON object per step: the action in robot units, its tokens, per-stage timings (ms) and
the KV cache's stats. ``--steps N`` runs N control steps on the same image (the first includes warm-up).
``--decode full`` (OpenVLA) takes the greedy argmax over the whole vocabulary, as upstream does, instead
of over the action tokens only.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from ..config import ActionDecoding
from .policy_args import add_policy_arguments, load_options, session_from_args


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "predict",
        help="predict an action from an image and an instruction",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--checkpoint", required=True, type=Path, help="checkpoint directory (e.g. an OpenVLA HF directory)")
    p.add_argument("--image", required=True, type=Path, help="RGB image file (PNG/JPEG) from the policy camera")
    p.add_argument("--instruction", required=True, help="task instruction, e.g. 'pick up the red cube'")
    add_policy_arguments(p)
    p.add_argument("--state", help="robot state as comma-separated floats (HybridVLA: x,y,z,roll,pitch,yaw,gripper)")
    p.add_argument("--steps", type=int, default=1, help="control steps to run on the image (default 1)")
    p.add_argument(
        "--decode",
        choices=[d.value for d in ActionDecoding],
        default=ActionDecoding.ACTIONS.value,
        help="OpenVLA greedy decoding: over the action tokens only (actions, default) or over the whole vocabulary "
        "as upstream (full; ids outside the action range clip to the end bins)",
    )
    p.set_defaults(func=run)


def parse_state(text: str | None) -> np.ndarray | None:
    """``"0.1,0.2,..."`` -> float64 array (or None)."""
    if text is None:
        return None
    try:
        return np.array([float(x) for x in text.split(",")], dtype=np.float64)
    except ValueError as e:
        raise ValueError(f"--state must be comma-separated numbers, got {text!r}") from e


def step_report(step: int, session, result) -> dict:
    """The JSON object printed per step (``chunk``: every predicted action, for chunk-predicting families)."""
    chunk = {"chunk": [[round(float(a), 6) for a in row] for row in result.actions]} if len(result.actions) > 1 else {}
    return {
        "step": step,
        "action": [round(float(a), 6) for a in result.actions[0]],
        **chunk,
        "action_tokens": [int(t) for t in session.last_tokens[0]] if getattr(session, "last_tokens", None) is not None else None,
        "unnorm_key": getattr(session, "unnorm_key", None),
        "timings_ms": {k: round(v, 3) for k, v in result.timings.items()},
        "kv": result.kv.as_dict(),
    }


def decoding_options(checkpoint: Path, decoding: ActionDecoding) -> dict:
    """``load_policy`` options for ``decoding``: only OpenVLA checkpoints decode action tokens greedily."""
    from .. import models  # noqa: F401  (registers the families)
    from ..api import detect_family

    if decoding is ActionDecoding.ACTIONS:
        return {}  # every family's default
    family = detect_family(checkpoint)
    if family != "openvla":
        raise ValueError(f"--decode {decoding.value} applies to OpenVLA checkpoints; {checkpoint} is a {family} checkpoint")
    return {"decoding": decoding}


def run(args: argparse.Namespace) -> int:
    from ..api import Observation, load_policy
    from ..images import read_image

    if args.steps < 1:
        raise ValueError(f"--steps must be >= 1, got {args.steps}")
    image = read_image(args.image)
    options = {**decoding_options(args.checkpoint, ActionDecoding(args.decode)), **load_options(args)}
    policy = load_policy(args.checkpoint, device=args.device, dtype=args.dtype, unnorm_key=args.unnorm_key, **options)
    session = policy.new_session(args.instruction, session_from_args(args))
    obs = Observation(images={"primary": image}, state=parse_state(args.state))
    for step in range(args.steps):
        print(json.dumps(step_report(step, session, session.step(obs))))
    return 0
