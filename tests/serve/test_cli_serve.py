"""``vla-runtime serve`` end to end: a real process, openpi's client, SIGTERM; flags over the YAML config."""

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
from openpi_client.websocket_client_policy import WebsocketClientPolicy

from vla_runtime.checkpoints.tiny_openvla import make_tiny_openvla
from vla_runtime.cli import build_parser
from vla_runtime.cli.serve import serve_config

ROOT = Path(__file__).resolve().parents[2]


def test_cli_serves_openpi_clients_and_stops_on_sigterm(tmp_path):
    ckpt = make_tiny_openvla(tmp_path / "tiny", seed=2)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]), "VLA_RUNTIME_API_TOKEN": "tok"}
    cmd = [sys.executable, "-c", "import sys; from vla_runtime.cli import main; sys.exit(main())", "serve",
           "--checkpoint", str(ckpt), "--port", "0", "--history", "history", "--kv", "chunked", "--threads", "1",
           "--max-sessions", "2"]  # fmt: skip
    proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True)
    try:
        lines = []
        for line in proc.stderr:  # until the server says where it listens (or the process ends)
            lines.append(line)
            if m := re.search(r"serving openvla on ws://127\.0\.0\.1:(\d+)", line):
                port = int(m.group(1))
                break
        else:
            raise AssertionError("the server never listened:\n" + "".join(lines))
        client = WebsocketClientPolicy("127.0.0.1", port, api_key="tok")  # the token came from the environment
        meta = client.get_server_metadata()
        assert (meta["history"], meta["kv"]) == ("history", "chunked")
        frame = np.random.default_rng(0).integers(0, 256, (48, 64, 3), dtype=np.uint8)
        for step in range(3):
            reply = client.infer({"observation/image": frame, "prompt": "close the drawer"})
            assert reply["actions"].shape == (1, 7) and reply["step"] == step
        proc.send_signal(signal.SIGTERM)
        rest = proc.stderr.read()
        assert proc.wait() == 0, rest
        assert "server stopped" in rest
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_flags_override_the_yaml_config(tmp_path, monkeypatch):
    path = tmp_path / "serve.yaml"
    path.write_text("port: 9000\nmax_sessions: 3\nkeys:\n  prompt: task\n  images: {primary: cam/front}\nbatch: {window_ms: 5}\n")
    monkeypatch.delenv("VLA_RUNTIME_API_TOKEN", raising=False)
    args = build_parser().parse_args(["serve", "--checkpoint", "x", "--config", str(path), "--max-sessions", "5", "--max-batch", "1"])
    cfg = serve_config(args)
    assert (cfg.port, cfg.max_sessions, cfg.api_token, cfg.host) == (9000, 5, None, "127.0.0.1")
    assert cfg.keys.prompt == "task" and cfg.keys.images == {"primary": "cam/front"} and cfg.keys.state == ["observation/state"]
    assert (cfg.batch.max_batch, cfg.batch.window_ms, cfg.batch.rejoin_fraction) == (1, 5, 0.1)
    args = build_parser().parse_args(["serve", "--checkpoint", "x", "--config", str(path), "--batch-rejoin", "0"])
    assert (serve_config(args).batch.window_ms, serve_config(args).batch.rejoin_fraction) == (5, 0.0)
    monkeypatch.setenv("VLA_RUNTIME_API_TOKEN", "from-env")
    assert serve_config(args).api_token == "from-env"
    args = build_parser().parse_args(["serve", "--checkpoint", "x", "--api-token", "flag"])
    assert serve_config(args).api_token == "flag"
