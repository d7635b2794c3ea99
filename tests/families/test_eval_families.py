"""``vla-runtime eval`` with tiny CogACT and HybridVLA runs in Meta-World (closed loop, through load_policy)."""

import importlib.util
import json

import pytest

from vla_runtime.cli import main

pytestmark = [
    pytest.mark.sim,
    pytest.mark.skipif(importlib.util.find_spec("metaworld") is None, reason="metaworld is not installed"),
]


def eval_report(ckpt, out, *extra) -> dict:
    args = ["eval", "--checkpoint", str(ckpt), "--sim", "metaworld", "--tasks", "button-press-v3", "--episodes", "1",
            "--max-steps", "6", "--resolution", "56", "--no-video", "--out", str(out), *extra]  # fmt: skip
    assert main(args) == 0
    return json.loads((out / "report.json").read_text())


def test_cogact_executes_k_of_each_chunk_in_closed_loop(tiny_cogact, tmp_path):
    seen = {}
    for k in (1, 2, 4):  # 6 control steps: 6, 3 and 2 predictions, each adding one frame to the history
        report = eval_report(tiny_cogact, tmp_path / f"eval-{k}", "--execution-horizon", str(k), "--history", "history")
        assert report["family"] == "cogact"
        (episode,) = report["episodes"]
        assert episode["steps"] == 6 and episode["error"] is None
        seen[k] = episode["kv_final"]["tokens_seen"]
    frame = seen[2] - seen[4]  # one frame's tokens
    assert frame > 16 and seen[1] - seen[4] == 4 * frame


def test_hybridvla_runs_on_metaworlds_state(tiny_hybridvla, tmp_path):
    report = eval_report(tiny_hybridvla, tmp_path / "eval")  # state [hand xyz, gripper opening] -> 7-D proprio
    assert report["family"] == "hybridvla"
    (episode,) = report["episodes"]
    assert episode["steps"] == 6 and episode["error"] is None
