"""``vla-runtime demo`` (what ``make demo`` runs): make a tiny OpenVLA checkpoint in a temporary
directory and predict actions for the bundled test scene, in stock (``single``) and ``history`` mode.

The tiny model has random weights: the actions are meaningless, the pipeline is the real one
(upstream checkpoint layout, image transform, prompt, action tokens, un-normalisation).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

ASSET = Path(__file__).resolve().parents[2] / "assets" / "demo_scene.png"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="tiny OpenVLA checkpoint + predict on the bundled test image", description=__doc__)
    p.add_argument("--image", type=Path, default=ASSET, help=f"image to predict on (default {ASSET.name} from assets/)")
    p.add_argument("--instruction", default="put the red cube in the blue bowl", help="task instruction")
    p.add_argument("--steps", type=int, default=3, help="control steps per mode (default 3)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..api import Observation, load_policy
    from ..checkpoints.tiny_openvla import make_tiny_openvla
    from ..config import SessionConfig
    from ..images import read_image
    from .predict import step_report

    image = read_image(args.image)
    with tempfile.TemporaryDirectory(prefix="vla-runtime-demo-") as tmp:
        path = make_tiny_openvla(Path(tmp) / "tiny-openvla")
        print(f"made a tiny OpenVLA checkpoint (upstream layout, random weights) in {path}")
        policy = load_policy(path, device="cpu")
        info = policy.info()
        print(f"  {info['parameters']['total']:,} parameters, {info['image_tokens']} image tokens, datasets: {info['datasets']}")
        obs = Observation(images={"primary": image})
        for history in ("single", "history"):
            session = policy.new_session(args.instruction, SessionConfig(history=history))
            print(f"{history} mode, instruction {args.instruction!r}, image {args.image.name} {image.shape[1]}x{image.shape[0]}:")
            for step in range(args.steps):
                print("  " + json.dumps(step_report(step, session, session.step(obs))))
    return 0
