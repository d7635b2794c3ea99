"""Image transform, centre crop, prompt, token layout, action (de)tokenisation, unnorm_key rules."""

import json

import numpy as np
import pytest
import torch
from PIL import Image

from vla_runtime.checkpoints.tiny_openvla import BRIDGE_ACTION
from vla_runtime.models.prismatic.configuration_prismatic import OpenVLAConfig
from vla_runtime.models.prismatic.configuration_vision import IMAGENET_MEAN, IMAGENET_STD
from vla_runtime.models.openvla.processing_openvla import (
    ActionTokenizer,
    history_frame,
    history_sequence,
    single_layout,
)
from vla_runtime.models.prismatic.processing_prismatic import (
    ActionStats,
    ImageProcessor,
    SegmentKind,
    center_crop,
    history_prompt,
    resolve_unnorm_key,
)
from vla_runtime.models.prismatic.prompt_prismatic import PromptTokenizer

DINO_BF16_MEAN = (0.484375, 0.455078125, 0.40625)
DINO_BF16_STD = (0.228515625, 0.2236328125, 0.224609375)


def reference_pixels(image: np.ndarray, size: int, *, means, stds) -> torch.Tensor:
    """Upstream's resize-naive path written out with PIL + numpy: bicubic squash, /255, (x - m) / s per
    tower, towers stacked on channels. Returns [3 * towers, size, size]."""
    resized = np.asarray(Image.fromarray(image).resize((size, size), Image.BICUBIC), dtype=np.float32) / np.float32(255)
    out = [(resized - np.float32(m)) / np.float32(s) for m, s in zip(means, stds)]  # [size, size, 3] each
    return torch.from_numpy(np.concatenate([o.transpose(2, 0, 1) for o in out]))


def test_image_processor_uses_bf16_dino_constants_and_matches_reference(tiny_openvla, frame):
    cfg = OpenVLAConfig.from_pretrained_dir(tiny_openvla)
    proc = ImageProcessor.from_pretrained_dir(tiny_openvla, cfg.vision)
    # the values upstream's preprocessor_config.json stores (bf16-rounded under set_default_dtype(bfloat16))
    assert proc.towers[0].mean == DINO_BF16_MEAN and proc.towers[0].std == DINO_BF16_STD
    assert proc.towers[1].mean == (0.5, 0.5, 0.5) and proc.towers[1].std == (0.5, 0.5, 0.5)
    image = frame(0, (75, 130, 3))
    pixels = proc(image)
    assert pixels.shape == (6, 56, 56) and pixels.dtype == torch.float32
    ref = reference_pixels(image, 56, means=(DINO_BF16_MEAN, (0.5,) * 3), stds=(DINO_BF16_STD, (0.5,) * 3))
    assert torch.equal(pixels, ref)


@pytest.mark.parametrize("strategy", ["letterbox", "resize-crop"])
def test_other_resize_strategies(strategy, tiny_openvla):
    cfg = OpenVLAConfig.from_pretrained_dir(tiny_openvla)
    proc = ImageProcessor.from_config(cfg.vision, {"image_resize_strategy": strategy})
    wide = np.zeros((28, 112, 3), np.uint8)
    wide[:, :56] = 255  # left half white, right half black
    pixels = proc(wide)[3:]  # SigLIP channels: (x - 0.5) / 0.5
    if strategy == "letterbox":
        # padded to a square with the (last tower's) mean colour: rows above and below the image read ~0
        assert pixels[:, :12].abs().max() < 0.01 and pixels[:, -12:].abs().max() < 0.01
        assert pixels[:, 28, 5].min() > 0.99 and pixels[:, 28, -5].max() < -0.99
    else:
        # short side to 56, then a centre crop: the middle of the wide image, half white and half black
        assert pixels[:, :, :20].min() > 0.99 and pixels[:, :, -20:].max() < -0.99


@pytest.mark.parametrize("strategy", ["resize-naive", "letterbox", "resize-crop"])
@pytest.mark.parametrize("shape", [(56, 56), (75, 130)])  # at the towers' size (vectorised), and not
def test_batch_equals_frame_by_frame(strategy, shape, tiny_openvla, frame):
    cfg = OpenVLAConfig.from_pretrained_dir(tiny_openvla)
    proc = ImageProcessor.from_config(cfg.vision, {"image_resize_strategy": strategy})
    frames = np.stack([frame(i, (*shape, 3)) for i in range(5)])
    batch = proc.batch(frames)
    assert batch.shape == (5, 6, 56, 56)
    assert torch.equal(batch, torch.stack([proc(f) for f in frames]))
    with pytest.raises(ValueError, match=r"expected uint8 frames \[N, H, W, 3\], got float32 \[5, 56, 56, 3\]"):
        proc.batch(np.zeros((5, 56, 56, 3), np.float32))


def test_without_preprocessor_config_the_timm_constants_apply(tiny_openvla, tmp_path):
    cfg = OpenVLAConfig.from_pretrained_dir(tiny_openvla)
    proc = ImageProcessor.from_pretrained_dir(tmp_path, cfg.vision)
    assert proc.towers[0].mean == IMAGENET_MEAN and proc.towers[0].std == IMAGENET_STD
    assert proc.resize_strategy == "resize-naive"


def test_preprocessor_size_must_match_config(tiny_openvla):
    cfg = OpenVLAConfig.from_pretrained_dir(tiny_openvla)
    pre = json.loads((tiny_openvla / "preprocessor_config.json").read_text())
    pre["tvf_resize_params"][0]["size"] = [224, 224]
    with pytest.raises(ValueError, match="resizes tower 0 to \\[224, 224\\]"):
        ImageProcessor.from_config(cfg.vision, pre)


NAN = float("nan")


@pytest.mark.parametrize(
    "edit, key",
    [
        (lambda p: p["tvf_normalize_params"][0].__setitem__("std", [0, 0, 0]), r"tvf_normalize_params\[0\]\.std` must be 3 finite numbers > 0"),
        (lambda p: p["tvf_normalize_params"][1].__setitem__("std", [0.5, -0.5, 0.5]), r"tvf_normalize_params\[1\]\.std` must be 3 finite numbers > 0"),
        (lambda p: p["tvf_normalize_params"][0].__setitem__("std", [NAN] * 3), r"tvf_normalize_params\[0\]\.std` must be 3 finite"),
        (lambda p: p["tvf_normalize_params"][1].__setitem__("mean", [0.5, 0.5]), r"tvf_normalize_params\[1\]\.mean` must be 3 finite numbers \(one"),
        (lambda p: p["tvf_normalize_params"][0].__setitem__("mean", ["0.5"] * 3), r"tvf_normalize_params\[0\]\.mean` must be 3 finite"),
        (lambda p: p["tvf_normalize_params"][0].pop("std"), r"tvf_normalize_params\[0\]\.std` must be 3 finite numbers > 0 .*got None"),
        (lambda p: p.__setitem__("tvf_normalize_params", p["tvf_normalize_params"][:1]), r"tvf_normalize_params` has 1 entries; the vision backbone has 2"),
        (lambda p: p.__setitem__("tvf_normalize_params", {"mean": [0.5] * 3}), r"tvf_normalize_params` must be a list of \{mean, std\} mappings"),
        (lambda p: [p.pop("tvf_normalize_params"), p["stds"].__setitem__(1, [0.5, 0.5, float("inf")])], r"stds\[1\]` must be 3 finite numbers > 0"),
        (lambda p: p.__setitem__("tvf_resize_params", {"size": 56}), r"tvf_resize_params` must be a list"),
    ],
)
def test_preprocessor_normalisation_is_checked_at_load(tiny_openvla, tmp_path, edit, key):
    cfg = OpenVLAConfig.from_pretrained_dir(tiny_openvla)
    pre = json.loads((tiny_openvla / "preprocessor_config.json").read_text())
    edit(pre)
    file = tmp_path / "preprocessor_config.json"
    file.write_text(json.dumps(pre))
    with pytest.raises(ValueError, match=rf"^{tmp_path}/preprocessor_config\.json `{key}"):
        ImageProcessor.from_pretrained_dir(tmp_path, cfg.vision)


@pytest.mark.parametrize("bad", [np.zeros((8, 8), np.uint8), np.zeros((8, 8, 4), np.uint8), np.zeros((8, 8, 3), np.float32), "x.png"])
def test_image_must_be_uint8_hw3(tiny_openvla, bad):
    cfg = OpenVLAConfig.from_pretrained_dir(tiny_openvla)
    with pytest.raises(ValueError, match="uint8"):
        ImageProcessor.from_pretrained_dir(tiny_openvla, cfg.vision)(bad)


def test_center_crop_full_area_is_identity_and_crop_keeps_the_centre(frame):
    image = frame(3, (64, 64, 3))
    assert np.array_equal(center_crop(image, size=64, area=1.0), image)
    # a 0.9-area box (side 0.949) of a 100x100 image lies inside rows/cols 2..97: a border of width 2 never shows
    framed = np.zeros((100, 100, 3), np.uint8)
    framed[2:98, 2:98] = 200
    out = center_crop(framed, size=56)
    assert out.shape == (56, 56, 3) and (out == 200).all()
    # bilinear resampling of a horizontal ramp stays a monotone ramp across the cropped span
    ramp = np.repeat(np.repeat(np.arange(0, 250, 2.5).astype(np.uint8)[None, :, None], 100, 0), 3, 2)
    row = center_crop(ramp, size=20)[10, :, 0].astype(int)
    assert np.all(np.diff(row) > 0) and row[0] > ramp[0, 2, 0] and row[-1] < ramp[0, 97, 0]


def test_prompt_ids_match_transformers_tokenizer(tiny_openvla):
    from transformers import AutoTokenizer

    ours = PromptTokenizer.from_pretrained_dir(tiny_openvla, bos_id=1)
    hf = AutoTokenizer.from_pretrained(tiny_openvla)
    for instruction in ("Pick up the red cube", "put the cup in the drawer", "Stack 3 blocks, then WIPE the table!"):
        prompt = ours.prompt(instruction)
        text = f"In: What action should the robot take to {instruction.lower()}?\nOut:"
        hf_ids = hf(text).input_ids
        # upstream: tokenizer(prompt) then append 29871 ("▁") because the last id is not already 29871
        assert list(prompt.input_ids) == hf_ids + [29871]
        assert prompt.bos == 1 and prompt.empty == 29871
        assert hf.convert_ids_to_tokens(list(prompt.out)) == ["<0x0A>", "Out", ":"]


def test_layouts_follow_contract_2(tiny_openvla):
    prompt = PromptTokenizer.from_pretrained_dir(tiny_openvla, bos_id=1).prompt("open the drawer")
    single = single_layout(prompt, has_proprio=True)
    kinds = [s.kind for s in single.segments]
    assert kinds == [SegmentKind.TEXT, SegmentKind.IMAGE, SegmentKind.PROPRIO, SegmentKind.TEXT]
    assert single.segments[0].ids == (1,) and single.segments[3].ids == (*prompt.instruction, *prompt.out, 29871)
    assert single.length(16) == len(prompt.input_ids) + 16 + 1

    actions = [[31744 + 7 * s + j for j in range(7)] for s in range(3)]
    seq = history_sequence(prompt, actions, has_proprio=False)
    assert seq[0] == history_prompt(prompt) and seq[0].pin and seq[0].segments[0].ids == (1, *prompt.instruction)
    assert len(seq) == 1 + 3 * 7
    for s in range(3):
        frame = seq[1 + 7 * s]
        assert frame == history_frame(prompt, step=s, prev_token=actions[s - 1][-1] if s else None, has_proprio=False)
        head = [] if s == 0 else [(SegmentKind.TEXT, (actions[s - 1][-1],))]
        assert [(g.kind, g.ids) for g in frame.segments] == head + [(SegmentKind.IMAGE, ()), (SegmentKind.TEXT, (*prompt.out, 29871))]
        assert [f.segments[0].ids for f in seq[2 + 7 * s : 8 + 7 * s]] == [(t,) for t in actions[s][:-1]]
    assert actions[2][-1] not in [g.ids[0] for f in seq for g in f.segments if g.kind is SegmentKind.TEXT and len(g.ids) == 1]


def test_action_tokenizer_bins_and_unnormalisation():
    tok = ActionTokenizer(256, 32000)
    assert (tok.first_id, tok.last_id) == (31744, 31999)
    assert tok.encode(np.array([-1.0, 1.0, 0.0])).tolist() == [31999, 31744, 31872]
    # bin centres: -1 + (2k + 1) / 255, k = 32000 - id - 1 clipped to [0, 254]
    ids = np.array([31999, 31872, 31745, 31744, 31000, 32010])
    k = np.clip(32000 - ids - 1, 0, 254)
    assert np.allclose(tok.normalized(ids), -1 + (2 * k + 1) / 255)
    a = np.linspace(-0.999, 0.999, 101)
    assert np.abs(tok.normalized(tok.encode(a)) - a).max() <= 1 / 255 + 1e-12

    stats = ActionStats.from_dict(BRIDGE_ACTION)
    robot = ActionTokenizer(256, 32000, stats).decode(np.array([[31872] * 7]))
    centre = tok.normalized(np.array([31872]))[0]
    q01, q99 = np.array(BRIDGE_ACTION["q01"]), np.array(BRIDGE_ACTION["q99"])
    expected = 0.5 * (centre + 1) * (q99 - q01) + q01
    expected[6] = centre  # gripper (mask False) is not un-normalised
    assert np.allclose(robot[0], expected)
    assert ActionStats.from_dict({"q01": [0, 0], "q99": [1, 1]}).mask.all()  # missing mask = all True


def test_unnorm_key_rules():
    stats = {"bridge_orig": {}, "libero_spatial_no_noops": {}}
    with pytest.raises(ValueError, match="2 datasets.*bridge_orig, libero_spatial_no_noops"):
        resolve_unnorm_key(stats, None)
    with pytest.raises(KeyError, match="'fractal' is not in .*available: bridge_orig, libero_spatial_no_noops"):
        resolve_unnorm_key(stats, "fractal")
    assert resolve_unnorm_key(stats, "bridge_orig") == "bridge_orig"
    assert resolve_unnorm_key(stats, "libero_spatial") == "libero_spatial_no_noops"
    assert resolve_unnorm_key({"only": {}}, None) == "only"
