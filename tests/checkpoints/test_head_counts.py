"""The vision towers' head counts round-trip through ``config.json``: ``make-tiny`` writes them and the loaders
read the file's values (not the tiny-size table's).

Upstream has no key for them: ``PrismaticConfig`` holds ``timm_model_ids``/``image_sizes``/
``timm_override_act_layers`` only, and its ``PrismaticVisionBackbone`` calls ``timm.create_model(timm_id,
pretrained=False, num_classes=0, img_size=..., act_layer=...)``, so the id alone fixes the geometry. The
count of a non-standard (tiny) tower lives in our extra key ``vision_num_heads`` (one entry per tower)."""

import json

import pytest

from vla_runtime.api import load_policy
from vla_runtime.checkpoints.tiny_openvla import TINY_TOWERS, make_tiny_openvla
from vla_runtime.checkpoints.tiny_prismatic import make_tiny_cogact
from vla_runtime.models.prismatic.configuration_vision import backbone_spec


def rewrite_heads(config_file, heads: list[int]) -> None:
    config = json.loads(config_file.read_text())
    config["vision_num_heads"] = heads
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


@pytest.mark.parametrize("backbone", ["dinosiglip-vit-so-224px", "siglip-vit-so400m", "clip-vit-l"])
def test_openvla_head_counts_round_trip(backbone, tmp_path):
    path = make_tiny_openvla(tmp_path / "ckpt", vision_backbone_id=backbone)
    expected = [TINY_TOWERS[timm_id][2] for timm_id in backbone_spec(backbone).timm_ids]
    assert json.loads((path / "config.json").read_text())["vision_num_heads"] == expected
    assert [t.num_heads for t in load_policy(path, device="meta").config.vision.towers] == expected
    other = [2 * h for h in expected]  # also divides the tiny widths (32, 48): the file's value must win
    rewrite_heads(path / "config.json", other)
    assert [t.num_heads for t in load_policy(path, device="meta").config.vision.towers] == other


def test_prismatic_run_head_counts_round_trip(tmp_path):
    run = make_tiny_cogact(tmp_path / "cogact")
    expected = [TINY_TOWERS[timm_id][2] for timm_id in backbone_spec("dinosiglip-vit-so-224px").timm_ids]
    assert json.loads((run / "config.json").read_text())["vision_num_heads"] == expected
    assert [t.num_heads for t in load_policy(run, device="meta").config.vlm.vision.towers] == expected
    rewrite_heads(run / "config.json", [2 * h for h in expected])
    assert [t.num_heads for t in load_policy(run, device="meta").config.vlm.vision.towers] == [2 * h for h in expected]
