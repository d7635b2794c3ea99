"""A tiny OpenVLA-OFT through ``vla-runtime eval`` in Meta-World and through ``ActionQueue`` (the executor the
simulators and the ROS node share): the chunk is executed ``execution_horizon`` rows at a time."""

import importlib.util
import json

import numpy as np
import pytest

from vla_runtime import api
from vla_runtime.cli import main
from vla_runtime.config import SessionConfig
from vla_runtime.policies.base import ActionQueue, Observation


@pytest.mark.sim
@pytest.mark.skipif(importlib.util.find_spec("metaworld") is None, reason="metaworld is not installed")
def test_eval_tiny_oft_end_to_end(tmp_path, capsys):
    """7-D actions without proprio fit Meta-World; 6 steps at horizon 4 are two chunks; an 8-D proprio model is
    refused with the sizes named (Meta-World's state is 4-D)."""
    ckpt = tmp_path / "tiny-oft"
    assert main(["make-tiny", "--family", "openvla-oft", "--no-proprio", str(ckpt)]) == 0
    out = tmp_path / "eval"
    common = ["eval", "--sim", "metaworld", "--tasks", "reach-v3", "--episodes", "1", "--max-steps", "6", "--resolution", "56"]
    assert main(common + ["--checkpoint", str(ckpt), "--execution-horizon", "4", "--out", str(out)]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["family"] == "openvla-oft"
    (episode,) = report["episodes"]
    assert episode["steps"] == 6 and episode["error"] is None
    # every step is one stand-alone forward of [BOS] + 256 image tokens + prompt + 8 x 7 action slots + </s>
    assert episode["kv_final"]["tokens_seen"] > 8 * 7
    assert (out / "videos" / "reach-v3.mp4").stat().st_size > 0
    # history mode: one chunked cache for the episode, two chunks' observations kept, the query blocks not
    hist = tmp_path / "eval-history"
    assert main(common + ["--checkpoint", str(ckpt), "--execution-horizon", "4", "--history", "history", "--kv", "chunked",
                          "--no-video", "--out", str(hist)]) == 0  # fmt: skip
    (episode,) = json.loads((hist / "report.json").read_text())["episodes"]
    assert episode["steps"] == 6 and episode["error"] is None
    # tiny model: 16 image tokens per observation, no proprio; the prompt pinned once
    assert episode["kv_final"]["tokens_seen"] == episode["kv_final"]["tokens_raw"] and 2 * 16 < episode["kv_final"]["tokens_seen"] < 2 * 16 + 40

    proprio = tmp_path / "tiny-oft-proprio"
    assert main(["make-tiny", "--family", "openvla-oft", str(proprio)]) == 0
    capsys.readouterr()
    assert main(common + ["--checkpoint", str(proprio), "--no-video", "--out", str(tmp_path / "bad")]) == 2
    assert "needs `state` [8], got (4,)" in capsys.readouterr().err


def test_action_queue_executes_the_chunk_horizon_rows_at_a_time(oft_no_proprio, frame):
    """Steps 0 and 3 predict (horizon 3); the actions come out in chunk order, rows 0..2 of each chunk."""
    policy = api.load_policy(oft_no_proprio, platform="bridge")
    session = policy.new_session("pick up the cup", SessionConfig(unnorm_key="bridge_orig", execution_horizon=3))
    queue = ActionQueue(session, horizon=session.config.execution_horizon)
    obs = [Observation(images={"primary": frame(i)}) for i in range(6)]
    executed, predicted = [], []
    for i, o in enumerate(obs):
        action, result = queue.next(o)
        executed.append(action)
        if result is not None:
            predicted.append((i, result.actions))
    assert [i for i, _ in predicted] == [0, 3]
    assert all(chunk.shape == (5, 7) for _, chunk in predicted)
    np.testing.assert_array_equal(np.stack(executed), np.concatenate([chunk[:3] for _, chunk in predicted]))
