"""The CLI commands of the OpenVLA work: predict, info, make-tiny, demo (run in-process)."""

import json

import pytest

from vla_runtime.cli import COMMANDS, build_parser, main


@pytest.mark.parametrize("command", ["predict", "info", "make-tiny", "demo"])
def test_help_on_every_command(command, capsys):
    with pytest.raises(SystemExit) as e:
        main([command, "--help"])
    assert e.value.code == 0
    assert f"usage: vla-runtime {command}" in capsys.readouterr().out


def test_every_listed_command_registers():
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    assert {"predict", "info", "make-tiny", "demo"} <= set(sub.choices) and len(sub.choices) == len(COMMANDS)


def test_predict_prints_action_json_and_is_deterministic(ckpt, png, capsys):
    args = ["predict", "--checkpoint", str(ckpt), "--image", str(png), "--instruction", "Pick up the red cube"]
    assert main(args + ["--steps", "2"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["step"] for r in lines] == [0, 1]
    first = lines[0]
    assert len(first["action"]) == 7 and len(first["action_tokens"]) == 7 and first["unnorm_key"] == "bridge_orig"
    assert all(31744 <= t <= 31999 for t in first["action_tokens"])
    assert set(first["timings_ms"]) == {"vision", "prefill", "decode", "total"} and first["kv"]["tokens_raw"] > 16
    assert lines[1]["action"] == first["action"]
    assert main(args + ["--history", "history", "--kv", "full", "--dtype", "float32", "--device", "cpu"]) == 0
    history = json.loads(capsys.readouterr().out)
    assert history["kv"]["tokens_raw"] == first["kv"]["tokens_raw"]  # the same tokens after one step, in another order


def test_info_prints_family_sizes_parameters_and_datasets(ckpt, capsys):
    assert main(["info", str(ckpt), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["family"] == "openvla" and info["datasets"] == ["bridge_orig"] and info["image_tokens"] == 16
    assert info["parameters"]["total"] == info["parameters"]["vision"] + info["parameters"]["projector"] + info["parameters"]["llm"]
    assert main(["info", str(ckpt)]) == 0
    text = capsys.readouterr().out
    assert "family: openvla" in text and "datasets: bridge_orig" in text and "total: 4," in text


def test_make_tiny_refuses_a_non_empty_directory(ckpt, capsys):
    assert main(["make-tiny", "--family", "openvla", str(ckpt)]) == 2
    assert "exists and is not empty" in capsys.readouterr().err


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--checkpoint", "/nonexistent/ckpt"], "does not exist"),
        (["--image", "/nonexistent.png"], "image /nonexistent.png does not exist"),
        (["--unnorm-key", "fractal20220817_data"], "'fractal20220817_data' is not in the checkpoint's action statistics; available: bridge_orig"),
    ],
)
def test_predict_errors_are_one_clear_line(ckpt, png, extra, message, capsys):
    args = {"--checkpoint": str(ckpt), "--image": str(png)}
    for flag, value in zip(extra[::2], extra[1::2]):
        args[flag] = value
    argv = ["predict", "--instruction", "push the button"] + [x for kv in args.items() for x in kv]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("vla-runtime predict: error:") and message in err and "Traceback" not in err


def test_unreadable_image(ckpt, tmp_path, capsys):
    bad = tmp_path / "notes.png"
    bad.write_text("not an image")
    assert main(["predict", "--checkpoint", str(ckpt), "--image", str(bad), "--instruction", "x"]) == 2
    assert "cannot read image" in capsys.readouterr().err
