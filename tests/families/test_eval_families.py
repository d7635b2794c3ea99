"""``vla-runtime eval`` with tiny CogACT and HybridVLA runs in Meta-World (closed loop, through load_policy)."""

import importlib.util
import json

import numpy as np
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


def test_hybridvla_runs_on_metaworlds_state(tiny_hybridvla, tmp_path, monkeypatch):
    import vla_runtime.policies.hybridvla as hybridvla
    from vla_runtime.sim import make_env

    seen = []  # (the observation's state, the proprio the policy made of it) at every prediction

    def recording(state, layout=None):
        proprio = to_proprio(state, layout)
        seen.append((np.array(state, dtype=np.float64), proprio))
        return proprio

    to_proprio = hybridvla.to_proprio
    monkeypatch.setattr(hybridvla, "to_proprio", recording)
    report = eval_report(tiny_hybridvla, tmp_path / "eval", "--execution-horizon", "1")  # a prediction every step
    assert report["family"] == "hybridvla"
    (episode,) = report["episodes"]
    assert episode["steps"] == 6 and episode["error"] is None
    assert len(seen) == 6
    # the simulator's state [hand xyz, gripper opening] reached the policy: the first is the reset state, later ones
    # follow the arm, and each became the 7-D proprio [xyz, rpy = 0, gripper]
    with make_env("metaworld") as env:
        first = env.reset("button-press-v3", episode["seed"]).state
    np.testing.assert_allclose(seen[0][0], first)
    assert not all(np.allclose(s, seen[0][0]) for s, _ in seen[1:]), "the state never changed"
    for state, proprio in seen:
        assert state.shape == (4,) and proprio.shape == (7,)
        np.testing.assert_allclose(proprio[[0, 1, 2, 6]], state)
        np.testing.assert_allclose(proprio[3:6], 0.0)
