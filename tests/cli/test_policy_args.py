"""predict, serve and eval spell the policy options alike, with the same defaults, and build the session
from them the same way (``vla_runtime.cli.policy_args``)."""

import pytest

from vla_runtime.cli import build_parser
from vla_runtime.cli.policy_args import load_options, session_from_args
from vla_runtime.config import CompileMode, HistoryMode
from vla_runtime.kv import KVMode

COMMON = ["--kv", "chunked", "--kv-capacity", "4096", "--kv-window", "48", "--kv-max-chunks", "3",
          "--history", "history", "--device", "cpu", "--dtype", "float32", "--unnorm-key", "bridge_orig", "--center-crop",
          "--compile", "default", "--quantize", "int8"]
REQUIRED = {
    "predict": ["--checkpoint", "ckpt", "--image", "frame.png", "--instruction", "open the drawer"],
    "serve": ["--checkpoint", "ckpt"],
    "eval": ["--checkpoint", "ckpt", "--tasks", "reach-v3"],
}
POLICY_OPTIONS = ("device", "dtype", "unnorm_key", "center_crop", "history", "kv", "kv_capacity", "kv_window", "kv_max_chunks",
                  "compile", "quantize", "fuse")


def parse(command: str, *extra: str):
    return build_parser().parse_args([command, *REQUIRED[command], *extra])


def test_every_policy_command_has_the_same_defaults():
    defaults = {command: {k: getattr(parse(command), k) for k in POLICY_OPTIONS} for command in REQUIRED}
    assert defaults["predict"] == defaults["serve"] == defaults["eval"], defaults
    assert defaults["eval"]["device"] is None  # cuda when available, as predict: eval used to default to cpu


@pytest.mark.parametrize("command", sorted(REQUIRED))
def test_the_options_become_the_same_session(command):
    session = session_from_args(parse(command, *COMMON))
    assert session.history is HistoryMode.HISTORY and session.kv.mode is KVMode.CHUNKED
    assert (session.kv.params.capacity, session.kv.params.window, session.kv.params.max_chunks) == (4096, 48, 3)
    assert session.unnorm_key == "bridge_orig" and session.center_crop
    assert session.compile is CompileMode.DEFAULT


def test_an_option_of_another_cache_is_refused_with_its_owner():
    with pytest.raises(ValueError, match="max_chunks"):
        session_from_args(parse("predict", "--kv", "full", "--kv-max-chunks", "3"))


def test_quantize_fuse_and_prepack_become_load_options_of_every_built_in_family(tmp_path):
    from vla_runtime.checkpoints.tiny_openvla import make_tiny_openvla
    from vla_runtime.checkpoints.tiny_prismatic import make_tiny_cogact
    from vla_runtime.models.quantize import QuantMode

    assert load_options(parse("predict")) == {}  # --quantize none: nothing to pass
    ckpt = make_tiny_openvla(tmp_path / "tiny-openvla", seed=0)
    args = build_parser().parse_args(["serve", "--checkpoint", str(ckpt), "--quantize", "int4"])
    assert load_options(args) == {"quantize": QuantMode.INT4}
    args = build_parser().parse_args(["eval", "--checkpoint", str(ckpt), "--tasks", "reach-v3", "--fuse", "--quantize", "int8"])
    assert load_options(args) == {"quantize": QuantMode.INT8, "fuse": True}
    cogact = make_tiny_cogact(tmp_path / "tiny-cogact", seed=0)
    args = build_parser().parse_args(["serve", "--checkpoint", str(cogact), "--prepack", "--fuse"])
    assert load_options(args) == {"fuse": True, "prepack": True}


@pytest.mark.parametrize("flag", ["--fuse", "--prepack", "--quantize int8"])
def test_a_speed_flag_on_a_plug_in_family_without_them_is_refused_with_the_flag_and_the_family(tmp_path, monkeypatch, flag):
    from vla_runtime import api

    monkeypatch.setitem(api.FAMILIES, "test-plug-in", (lambda p: (p / "PLUG_IN").exists(), lambda p, **kw: None))
    (tmp_path / "PLUG_IN").touch()
    with pytest.raises(ValueError, match=f"{flag} applies to the families whose loader takes the speed options .* is a "
                                         "test-plug-in checkpoint"):  # fmt: skip
        load_options(build_parser().parse_args(["predict", "--checkpoint", str(tmp_path), "--image", "f.png",
                                                "--instruction", "x", *flag.split()]))  # fmt: skip


@pytest.mark.parametrize("command", sorted(REQUIRED))
def test_chunked_takes_the_chunk_size_of_the_checkpoints_trained_gate(command, tmp_path):
    """A gate trained with 8-token chunks fits only 8-token chunks: ``--kv chunked`` on its checkpoint takes them
    (and its widths); without a gate the cache's default stays."""
    from vla_runtime.kv import ChunkGate, ChunkGateConfig, KVConfig, save_gate

    plain = session_from_args(parse(command, *COMMON)).kv.params
    assert plain.chunk == 16
    ckpt = tmp_path / "ckpt"
    gate = ChunkGate(ChunkGateConfig(n_layers=2, head_dim=8, chunk=8, aggregator_hidden=24, gate_hidden=12))
    save_gate(gate, ckpt, KVConfig.of(KVMode.CHUNKED, chunk=8, aggregator_hidden=24, gate_hidden=12))
    args = build_parser().parse_args([command, *REQUIRED[command], *COMMON])
    args.checkpoint = str(ckpt)
    params = session_from_args(args).kv.params
    assert (params.chunk, params.aggregator_hidden, params.gate_hidden) == (8, 24, 12)
    assert (params.window, params.max_chunks) == (48, 3)  # the flags still set the rest


@pytest.mark.parametrize("command", sorted(REQUIRED))
def test_chunked_reads_its_chunks_as_the_checkpoints_gate_was_trained_to(command, tmp_path):
    """A policy trained with ``chunk_mass`` gets it back from its ``kv_config.json``; a gate saved before the field
    existed (no ``chunk_mass`` key) loads without it."""
    import json

    from vla_runtime.kv import ChunkGate, ChunkGateConfig, KVConfig, save_gate

    ckpt = tmp_path / "ckpt"
    gate = ChunkGate(ChunkGateConfig(n_layers=2, head_dim=8, chunk=8))
    save_gate(gate, ckpt, KVConfig.of(KVMode.CHUNKED, chunk=8, chunk_mass=True))
    args = build_parser().parse_args([command, *REQUIRED[command], *COMMON])
    args.checkpoint = str(ckpt)
    assert session_from_args(args).kv.params.chunk_mass is True
    meta = json.loads((ckpt / "kv_config.json").read_text())
    del meta["kv"]["chunk_mass"]
    (ckpt / "kv_config.json").write_text(json.dumps(meta))
    assert session_from_args(args).kv.params.chunk_mass is False


def test_a_window_matched_to_a_chunked_budget_uses_the_gates_chunk_size(tmp_path, capsys):
    """``eval --kv-match-chunks M`` sizes the window to a chunked cache of the checkpoint's own chunk size."""
    from vla_runtime.cli.eval import kv_config
    from vla_runtime.kv import ChunkGate, ChunkGateConfig, KVConfig, save_gate

    flags = ["--kv", "sink_window", "--kv-window", "47", "--kv-match-chunks", "256"]
    default = kv_config(parse("eval", *flags)).params.window
    ckpt = tmp_path / "ckpt"
    save_gate(ChunkGate(ChunkGateConfig(n_layers=2, head_dim=8, chunk=8, aggregator_hidden=24, gate_hidden=12)), ckpt,
              KVConfig.of(KVMode.CHUNKED, chunk=8, aggregator_hidden=24, gate_hidden=12))  # fmt: skip
    args = parse("eval", *flags)
    args.checkpoint = str(ckpt)
    assert default - kv_config(args).params.window == 16 - 8  # a chunk's waiting raw tokens: C - 1
    assert "chunk 8, 256 chunks" in capsys.readouterr().out
