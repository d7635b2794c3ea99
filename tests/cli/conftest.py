"""A tiny OpenVLA checkpoint and a frame, made once per test module, for the CLI tests."""

import numpy as np
import pytest
from PIL import Image

from vla_runtime.cli import main


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    out = tmp_path_factory.mktemp("cli") / "tiny"
    assert main(["make-tiny", "--family", "openvla", str(out), "--seed", "3"]) == 0
    return out


@pytest.fixture(scope="module")
def png(tmp_path_factory):
    path = tmp_path_factory.mktemp("img") / "frame.png"
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (60, 80, 3), dtype=np.uint8)).save(path)
    return path
