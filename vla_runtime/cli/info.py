"""``vla-runtime info DIR``: what a checkpoint holds (family, sizes, parameter count, dataset keys).

Reads the configuration and the weight-file headers only; no tensor data is loaded.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("info", help="describe a checkpoint directory", description=__doc__)
    p.add_argument("checkpoint", type=Path, help="checkpoint directory")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.set_defaults(func=run)


def _lines(info: dict, indent: str = "") -> list[str]:
    out = []
    for key, value in info.items():
        if isinstance(value, dict):
            out += [f"{indent}{key}:", *_lines(value, indent + "  ")]
        elif isinstance(value, list) and value and isinstance(value[0], dict):
            out.append(f"{indent}{key}:")
            for item in value:
                out.append(f"{indent}  - " + ", ".join(f"{k}={v}" for k, v in item.items()))
        elif isinstance(value, list):
            out.append(f"{indent}{key}: " + (", ".join(map(str, value)) or "(none)"))
        else:
            out.append(f"{indent}{key}: {value:,}" if isinstance(value, int) and not isinstance(value, bool) else f"{indent}{key}: {value}")
    return out


def run(args: argparse.Namespace) -> int:
    from ..api import load_policy

    info = load_policy(args.checkpoint, device="meta").info()
    info.pop("device", None)  # structure only: nothing was placed anywhere
    print(json.dumps(info, indent=2) if args.json else "\n".join(_lines(info)))
    return 0
