"""``vla-runtime serve``: serve a checkpoint to robots over websocket, wire-compatible with openpi's client.

    vla-runtime serve --checkpoint runs/openvla-7b --unnorm-key bridge_orig --history history --kv chunked \\
        --host 0.0.0.0 --port 8000 --api-token "$TOKEN" --max-sessions 8 --idle-timeout 300

    # on the robot (pip install openpi-client):
    from openpi_client.websocket_client_policy import WebsocketClientPolicy
    policy = WebsocketClientPolicy("gpu-box", 8000, api_key=TOKEN)
    actions = policy.infer({"observation/image": frame, "prompt": "pick up the cup"})["actions"]

Each connection is one robot with its own episode (cache, history); a new prompt or ``{"reset": True}``
starts a new episode. ``--config FILE`` reads a ``ServeConfig`` YAML (observation keys, limits, batching);
flags given on the command line override it. The token may also come from ``VLA_RUNTIME_API_TOKEN``.
``--compile default`` (or ``reduce-overhead`` on CUDA) serves compiled sessions one robot at a time: it needs
``--max-batch 1`` (the batched forward runs eager).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
from dataclasses import replace
from pathlib import Path

from .policy_args import add_policy_arguments, load_options, session_from_args

log = logging.getLogger(__name__)

TOKEN_ENV = "VLA_RUNTIME_API_TOKEN"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve",
        help="serve a policy to robots over websocket (openpi-compatible)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--checkpoint", required=True, type=Path, help="checkpoint directory")
    p.add_argument("--config", type=Path, help="ServeConfig YAML (keys, limits, batch, ...); flags override it")
    p.add_argument("--host", help="interface to listen on (default 127.0.0.1; 0.0.0.0 = every interface)")
    p.add_argument("--port", type=int, help="TCP port (default 8000; 0 = any free port)")
    p.add_argument("--api-token", help=f"require 'Authorization: Api-Key <token>' (default: ${TOKEN_ENV} if set)")
    p.add_argument("--max-sessions", type=int, help="robots served at once (default 8)")
    p.add_argument("--idle-timeout", type=float, help="seconds without a message before a session is closed (default 300)")
    p.add_argument("--max-batch", type=int, help="most steps of different robots run as one batch (default 8; 1 = off)")
    p.add_argument("--batch-window-ms", type=float, help="wait this long for more robots' steps (default 2)")
    p.add_argument("--batch-rejoin", type=float, metavar="FRACTION",
                   help="also wait for robots expected back, up to this fraction of the batch time (default 0.1; 0 = off)")
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's)")
    add_policy_arguments(p)
    p.set_defaults(func=run)


def serve_config(args: argparse.Namespace):
    """The ``ServeConfig`` of ``--config`` with the flags given on the command line applied."""
    from ..config import load_yaml
    from ..serve.config import ServeConfig

    cfg = load_yaml(ServeConfig, args.config) if args.config else ServeConfig()
    token = args.api_token if args.api_token is not None else os.environ.get(TOKEN_ENV) or cfg.api_token
    flags = {"host": args.host, "port": args.port, "max_sessions": args.max_sessions, "idle_timeout_s": args.idle_timeout}
    cfg = replace(cfg, api_token=token, **{k: v for k, v in flags.items() if v is not None})
    batch = {"max_batch": args.max_batch, "window_ms": args.batch_window_ms, "rejoin_fraction": args.batch_rejoin}
    return replace(cfg, batch=replace(cfg.batch, **{k: v for k, v in batch.items() if v is not None}))


def run(args: argparse.Namespace) -> int:
    import torch

    from ..api import load_policy
    from ..serve.server import build_server

    cfg = serve_config(args)
    if args.threads is not None:
        if args.threads < 1:
            raise ValueError(f"--threads must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    policy = load_policy(args.checkpoint, device=args.device, dtype=args.dtype, unnorm_key=args.unnorm_key, **load_options(args))
    server = build_server(policy, session_from_args(args), cfg)

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await server.serve(stop)

    asyncio.run(main())
    log.info("server stopped")
    return 0
