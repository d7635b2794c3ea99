"""``vla-runtime`` command line: one module per command, each exposing ``register(subparsers)``.

A command module adds its parser with ``parser.set_defaults(func=run)``; ``run(args) -> int``.
Adding a command = one file + one line in ``COMMANDS``.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

COMMANDS: list[str] = [
    "predict",
    "info",
    "make_tiny",
    "demo",
    "collect",
    "eval",
    "bench",
    "convert_gguf",
    "plan",
    "finetune",
    "serve",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vla-runtime",
        description="Real-time inference runtime for vision-language-action policies.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name in COMMANDS:
        importlib.import_module(f"{__name__}.{name}").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args) or 0)
    except (FileNotFoundError, FileExistsError, ValueError, KeyError) as e:
        # user errors: one clear line, no traceback (run with -v for one)
        if args.verbose:
            raise
        msg = e.args[0] if isinstance(e, KeyError) and e.args else e
        print(f"vla-runtime {args.command}: error: {msg}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
