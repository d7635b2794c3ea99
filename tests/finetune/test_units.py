"""The pieces: window layout vs the runtime's forwards, statistics, crop, LoRA targets, schedules."""

import numpy as np
import pytest
import torch
import torch.nn as nn

from vla_finetune.config import GateTraining, LoraSettings
from vla_finetune.data import window_starts
from vla_finetune.layout import flatten, window_forwards
from vla_finetune.lora import apply_lora, resolve_targets
from vla_finetune.model import head_rows
from vla_finetune.schedule import lr_factor
from vla_finetune.statistics import dataset_statistics, default_action_mask
from vla_runtime.models.openvla.processing_openvla import history_frame
from vla_runtime.models.prismatic.processing_prismatic import center_crop, crop_resize
from vla_runtime.models.prismatic.prompt_prismatic import PromptIds

PROMPT = PromptIds(bos=1, instruction=(10, 11, 12), out=(13, 14), empty=29871)


@pytest.mark.parametrize("prev", [None, 31990])
def test_history_window_layout_and_targets(prev):
    ids = [[31900 + 10 * s + k for k in range(7)] for s in range(3)]  # 3 steps x 7 action tokens
    forwards = window_forwards(PROMPT, ids, history=True, has_proprio=True, prev_token=prev)
    layout, text = flatten(forwards, n_image_tokens=4, action_dim=7)
    first = history_frame(PROMPT, step=0, prev_token=prev, has_proprio=True).length(4)
    later = history_frame(PROMPT, step=1, prev_token=0, has_proprio=True).length(4)
    assert layout.pinned == 4 and layout.boundaries == (4, first, *[1] * 6, later, *[1] * 6, later, *[1] * 6)
    n = layout.n_tokens
    assert sorted([*layout.text_pos.tolist(), *layout.image_pos.tolist(), *layout.proprio_pos.tolist()]) == list(
        range(n)
    )
    # every target predicts the token at the next position: the first from the frame's "▁", then each fed action token
    tokens = dict(zip(layout.text_pos.tolist(), text))
    for s in range(3):
        targets = layout.target_pos[7 * s : 7 * s + 7].tolist()
        assert tokens[targets[0]] == 29871
        assert [tokens.get(p + 1) for p in targets[:-1]] == ids[s][:-1]
        if s < 2:  # the step's last token is fed at the start of the next frame
            assert tokens[targets[-1] + 1] == ids[s][-1]
    if prev is None:  # the episode's first frame starts with its image
        assert layout.image_pos[0] == 4
    else:  # mid-episode: the previous step's last action token comes first, as the runtime feeds it
        assert tokens[4] == prev and layout.image_pos[0] == 5


def test_single_window_is_stock_openvla_plus_decodes():
    layout, text = flatten(window_forwards(PROMPT, [list(range(31900, 31907))], history=False, has_proprio=False, prev_token=None),
                           n_image_tokens=4, action_dim=7)  # fmt: skip
    assert layout.pinned == 0 and layout.image_pos.tolist() == [1, 2, 3, 4]
    assert text == [1, 10, 11, 12, 13, 14, 29871, *range(31900, 31906)]
    assert layout.target_pos.tolist() == list(range(10, 17))


def test_window_starts_cover_every_step():
    assert window_starts(10, 3, 2) == [0, 2, 4, 6, 7]
    assert window_starts(9, 3, 3) == [0, 3, 6]
    assert window_starts(2, 3, 1) == []


def test_statistics_in_openvla_format():
    rng = np.random.default_rng(0)
    actions = np.concatenate([rng.normal(size=(500, 6)), rng.integers(0, 2, (500, 1))], axis=1)
    entry = dataset_statistics(actions, rng.normal(size=(500, 3)), mask=default_action_mask(7), n_episodes=5)
    assert entry["action"]["mask"] == [True] * 6 + [False]
    np.testing.assert_allclose(entry["action"]["q01"], np.quantile(actions, 0.01, axis=0))
    assert set(entry["action"]) == {"mask", "max", "mean", "min", "q01", "q99", "std"}
    assert set(entry["proprio"]) == {"max", "mean", "min", "q01", "q99", "std"}
    assert entry["num_transitions"] == 500 and entry["num_trajectories"] == 5
    assert default_action_mask(1) == [True] and default_action_mask(4) == [True, True, True, False]


def test_crop_resize_centred_is_the_eval_crop():
    image = np.random.default_rng(1).integers(0, 256, (40, 52, 3), dtype=np.uint8)
    np.testing.assert_array_equal(crop_resize(image, size=28, area=0.9), center_crop(image, size=28))
    corner = crop_resize(image, size=28, area=0.9, at=(0.0, 1.0))
    assert not np.array_equal(corner, center_crop(image, size=28))
    np.testing.assert_array_equal(crop_resize(image, size=40, area=1.0, at=(0.0, 1.0))[:, :, 0].shape, (40, 40))
    with pytest.raises(ValueError, match="fractions in"):
        crop_resize(image, size=28, at=(1.5, 0.0))


def test_lora_on_the_head_rows_equals_the_full_head():
    torch.manual_seed(0)
    model = nn.Sequential()
    model.add_module("lm_head", nn.Linear(8, 50, bias=False))
    apply_lora(model, LoraSettings(rank=4, target_modules=["lm_head"]))
    nn.init.normal_(model.lm_head.lora_B["default"].weight)
    x = torch.randn(3, 5, 8)
    torch.testing.assert_close(head_rows(model.lm_head, x, slice(20, 44)), model.lm_head(x)[..., 20:44])
    plain = nn.Linear(8, 50)
    torch.testing.assert_close(head_rows(plain, x, slice(1, 9)), plain(x)[..., 1:9])


def test_lora_targets_resolve_to_full_names():
    model = nn.Module()
    model.language_model = nn.Module()
    model.language_model.model = nn.Module()
    model.language_model.model.layers = nn.ModuleList(
        [nn.ModuleDict({"q_proj": nn.Linear(4, 4), "o_proj": nn.Linear(4, 4)})]
    )
    model.language_model.lm_head = nn.Linear(4, 9)
    assert resolve_targets(model, ["q_proj", "lm_head"]) == [
        "language_model.model.layers.0.q_proj",
        "language_model.lm_head",
    ]
    assert resolve_targets(model, "llm-linear") == [
        "language_model.model.layers.0.q_proj",
        "language_model.model.layers.0.o_proj",
    ]
    assert len(resolve_targets(model, "all-linear")) == 3


def test_schedules():
    assert [lr_factor(s, schedule="constant", warmup=2, max_steps=10) for s in (0, 1, 2, 9)] == [0.5, 1.0, 1.0, 1.0]
    assert lr_factor(2, schedule="cosine", warmup=2, max_steps=10) == pytest.approx(1.0)
    assert lr_factor(10, schedule="cosine", warmup=2, max_steps=10) == pytest.approx(0.0)
    gate = GateTraining(temperature=1.0, temperature_final=0.01)
    assert (
        gate.temperature_at(0, 11) == 1.0
        and gate.temperature_at(5, 11) == pytest.approx(0.1)
        and gate.temperature_at(10, 11) == pytest.approx(0.01)
    )
    assert LoraSettings(rank=8).lora_alpha == 8 and LoraSettings().lora_alpha == 16
