"""make-tiny --family openvla-oft -> info -> predict, through the CLI in-process."""

import json

import numpy as np
from PIL import Image

from vla_runtime.cli import main


def test_make_tiny_info_predict_round_trip(tmp_path, capsys):
    out = tmp_path / "oft"
    assert main(["make-tiny", "--family", "openvla-oft", str(out), "--seed", "1"]) == 0
    assert sorted(p.name for p in out.glob("*checkpoint.pt")) == [
        "action_head--150000_checkpoint.pt", "proprio_projector--150000_checkpoint.pt"
    ]
    capsys.readouterr()
    assert main(["info", str(out), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["family"] == "openvla-oft" and info["platform"] == "libero"
    assert (info["chunk_size"], info["action_dim"], info["proprio_dim"]) == (8, 7, 8)
    assert info["datasets"] == ["libero_spatial_no_noops"] and info["normalization"] == "bounds_q99"
    p = info["parameters"]
    assert p["total"] == p["vision"] + p["projector"] + p["llm"] + p["action_head"]

    png = tmp_path / "frame.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (60, 80, 3), dtype=np.uint8)).save(png)
    args = ["predict", "--checkpoint", str(out), "--image", str(png), "--instruction", "open the drawer",
            "--state", ",".join(["0.1"] * 8), "--steps", "2"]  # fmt: skip
    assert main(args) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(lines) == 2 and len(lines[0]["chunk"]) == 8 and all(len(a) == 7 for a in lines[0]["chunk"])
    assert lines[0]["chunk"] == lines[1]["chunk"] and lines[0]["action"] == lines[0]["chunk"][0]
    assert lines[0]["unnorm_key"] == "libero_spatial_no_noops" and lines[0]["action_tokens"] is None
    assert main(args + ["--history", "history"]) == 0  # one cache for the episode: step 2 sees step 1's frame
    steps = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(steps) == 2 and len(steps[1]["chunk"]) == 8 and steps[0]["chunk"] != steps[1]["chunk"]

    aloha = tmp_path / "aloha"
    assert main(["make-tiny", "--family", "openvla-oft", str(aloha), "--oft-platform", "aloha"]) == 0
    capsys.readouterr()
    assert main(["info", str(aloha), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert (info["platform"], info["chunk_size"], info["action_dim"], info["normalization"]) == ("aloha", 25, 14, "bounds")

    film = tmp_path / "film"
    assert main(["make-tiny", "--family", "openvla-oft", str(film), "--film"]) == 0
    assert (film / "vision_backbone--150000_checkpoint.pt").is_file()
    capsys.readouterr()
    assert main(["info", str(film), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    p = info["parameters"]
    assert info["film"] is True and info["components"]["vision_backbone"] == "vision_backbone--150000_checkpoint.pt"
    assert p["total"] == p["vision"] + p["projector"] + p["llm"] + p["action_head"]
    film_args = ["predict", "--checkpoint", str(film), "--image", str(png), "--state", ",".join(["0.1"] * 8), "--steps", "1"]
    chunks = []
    for instruction in ("open the drawer", "close the drawer"):  # FiLM: the instruction reaches the vision towers
        assert main(film_args + ["--instruction", instruction]) == 0
        chunks.append(json.loads(capsys.readouterr().out.splitlines()[0])["chunk"])
    assert chunks[0] != chunks[1]

    diffusion = tmp_path / "diffusion"
    assert main(["make-tiny", "--family", "openvla-oft", str(diffusion), "--diffusion"]) == 0
    assert (diffusion / "noisy_action_projector--150000_checkpoint.pt").is_file()
    capsys.readouterr()
    assert main(["info", str(diffusion), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    p = info["parameters"]
    assert info["diffusion"] == {"train_steps": 50, "steps": 50} and info["film"] is False
    assert p["total"] == p["vision"] + p["projector"] + p["llm"] + p["action_head"]
    assert main(["predict", "--checkpoint", str(diffusion), "--image", str(png), "--instruction", "open the drawer",
                 "--state", ",".join(["0.1"] * 8), "--steps", "2"]) == 0  # fmt: skip
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(lines) == 2 and len(lines[0]["chunk"]) == 8 and lines[0]["chunk"] != lines[1]["chunk"]  # a new draw per step
