"""``vla-runtime make-tiny --family cogact|hybridvla``, then ``info`` and ``predict`` on the runs (in-process)."""

import json

import numpy as np
import pytest
from PIL import Image

from vla_runtime.cli import main


@pytest.fixture(scope="module")
def png(tmp_path_factory):
    path = tmp_path_factory.mktemp("img") / "frame.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (60, 80, 3), dtype=np.uint8)).save(path)
    return path


@pytest.mark.parametrize("family", ["cogact", "hybridvla"])
def test_make_tiny_info_predict(family, png, tmp_path, capsys):
    out = tmp_path / family
    assert main(["make-tiny", "--family", family, str(out)]) == 0
    assert (out / "checkpoints").is_dir() and (out / "dataset_statistics.json").is_file()
    capsys.readouterr()
    assert main(["info", str(out), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["family"] == family and info["base_vlm"] == "prism-dinosiglip-224px+7b"
    args = ["predict", "--checkpoint", str(out), "--image", str(png), "--instruction", "open the drawer", "--steps", "2"]
    if family == "hybridvla":
        assert main(args) == 2  # the robot state is required
        assert "needs the robot state" in capsys.readouterr().err
        args += ["--state", "0.28,-0.01,1.47,-3.14,0.24,3.14,1"]
    assert main([*args, "--history", "history"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["step"] for r in lines] == [0, 1]
    rows = 16 if family == "cogact" else 1
    for report in lines:
        assert len(report["action"]) == 7 and len(report.get("chunk", [report["action"]])) == rows
        assert report["kv"]["tokens_seen"] > 0
    assert lines[1]["kv"]["tokens_seen"] > lines[0]["kv"]["tokens_seen"]  # history mode keeps the episode


def test_state_must_be_numbers(tmp_path, png, capsys):
    out = tmp_path / "hv"
    main(["make-tiny", "--family", "hybridvla", str(out)])
    capsys.readouterr()
    args = ["predict", "--checkpoint", str(out), "--image", str(png), "--instruction", "x", "--state", "1,a"]
    assert main(args) == 2
    assert "--state must be comma-separated numbers" in capsys.readouterr().err
