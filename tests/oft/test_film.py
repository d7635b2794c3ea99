"""FiLM (OFT+): ``vision_backbone--*checkpoint.pt`` loaded and the towers language-conditioned as upstream.

The reference rebuilds upstream's path by hand from the raw file (``film_vit_wrapper.py``,
``openvla_utils._apply_film_to_vla``, ``predict_action``): the LoRA'd linears merged with
``alpha = min(r, 16)``, the average language embedding over the non-action positions of upstream's
sequence (``input_embeddings[~all_actions_mask]``), and each block run as attention half, then
``x * (1 + scale(l)) + shift(l)``, then MLP half, on a plain OpenVLA backbone holding the file's weights.
It shares nothing with ``film.py`` / ``openvla_oft_film.py``.
"""

import shutil

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from vla_runtime.api import Observation, load_policy
from vla_runtime.checkpoints.openvla import load_openvla
from vla_runtime.checkpoints.tiny_openvla_oft import make_tiny_openvla_oft

from oft_reference import all_actions_mask, input_ids_and_labels, proprio_token, reference_chunk, strip_ddp
from test_forward import INSTRUCTION, _stats, upstream_normalize_proprio, upstream_unnormalize


@pytest.fixture(scope="module")
def oft_film(tmp_path_factory):
    """LIBERO sizes with a FiLM vision backbone whose linears are LoRA layers (rank 4), float32 on disk."""
    return make_tiny_openvla_oft(tmp_path_factory.mktemp("oft") / "film", seed=3, dtype=torch.float32, film=True)


@pytest.fixture(scope="module")
def film_policy(oft_film):
    return load_policy(oft_film, device="cpu", dtype="float32")


def upstream_vision(path):
    """The file as upstream's strict ``load_state_dict`` + PEFT forward sees it: {key without LoRA: merged weight}."""
    raw = strip_ddp(torch.load(next(path.glob("vision_backbone--*checkpoint.pt")), weights_only=True))
    merged = {}
    for k, v in raw.items():
        if ".lora_" in k:
            continue
        if ".base_layer." in k:
            owner, param = k.split(".base_layer.")
            if param == "weight":
                a, b = raw[owner + ".lora_A.default.weight"], raw[owner + ".lora_B.default.weight"]
                v = v + (min(a.shape[0], 16) / a.shape[0]) * (b @ a)
            k = f"{owner}.{param}"
        merged[k.removeprefix("vision_backbone.")] = v
    return merged


def film_patches(path, pixels, prompt_ids, *, film=True, lora=True):
    """Upstream's FiLM'd, projected image tokens [1, N, dim] by hand (float64). ``film=False`` skips the
    modulation and ``lora=False`` drops the LoRA deltas (wrong variants, to show the test tells them apart)."""
    vla = load_openvla(path, dtype=torch.float64).model
    state = upstream_vision(path)
    if not lora:
        raw = strip_ddp(torch.load(next(path.glob("vision_backbone--*checkpoint.pt")), weights_only=True))
        state.update({k.removeprefix("vision_backbone.").replace(".base_layer.", "."): v for k, v in raw.items() if ".base_layer." in k})
    ids, labels, _ = input_ids_and_labels(prompt_ids, action_dim=7, chunk=8)
    mask = all_actions_mask(torch.tensor([labels]), 7)[0]
    embeds = vla.language_model.model.embed_tokens.weight.double()[torch.tensor(ids)]  # [T, dim]
    language = embeds[~mask].mean(0)  # [dim]: BOS, prompt, 29871 and </s>
    feats = []
    img = {"featurizer": pixels[:, :3].double(), "fused_featurizer": pixels[:, 3:].double()}
    for tower in ("featurizer", "fused_featurizer"):
        vit = getattr(vla.vision_backbone, tower)
        x = vit._pos_embed(vit.patch_embed(img[tower]))
        for i in range(len(vit.blocks) - 1):  # upstream returns block depth - 2's output
            p = f"{tower}.blocks.{i}."
            w = {k[len(p):]: v for k, v in state.items() if k.startswith(p)}
            blk = vit.blocks[i]
            blk.load_state_dict({k[len("block."):]: v for k, v in w.items() if k.startswith("block.")})
            x = x + blk.ls1(blk.attn(blk.norm1(x)))
            if film:
                gamma = F.linear(language, w["scale.weight"], w["scale.bias"])
                beta = F.linear(language, w["shift.weight"], w["shift.bias"])
                x = x * (1 + gamma) + beta
            x = x + blk.ls2(blk.mlp(blk.norm2(x)))
        feats.append(x[:, vit.num_prefix_tokens :])
    return vla.projector(torch.cat(feats, dim=2))


def film_reference(policy, path, image, state, **wrong):
    stats = _stats(path)
    prompt_ids = list(policy.tokenizer.prompt(INSTRUCTION).input_ids)
    with torch.no_grad():
        patches = film_patches(path, policy.image_processor(image)[None], prompt_ids, **wrong)
        head = strip_ddp(torch.load(next(path.glob("action_head--*checkpoint.pt")), weights_only=True))
        projector = strip_ddp(torch.load(next(path.glob("proprio_projector--*checkpoint.pt")), weights_only=True))
        proprio = proprio_token(projector, torch.as_tensor(upstream_normalize_proprio(state, stats["proprio"])))
        normalized = reference_chunk(
            lm_state=policy.model.vla.language_model.state_dict(), llm_cfg=policy.model.vla.cfg.llm, prompt_ids=prompt_ids,
            patches=patches, head=head, action_dim=7, chunk=8, proprio=proprio,
        ).numpy()  # fmt: skip
    return upstream_unnormalize(normalized, stats["action"])


def test_film_chunk_equals_upstream_algorithm(film_policy, oft_film, frame):
    assert film_policy.config.film and film_policy.checkpoint.components["vision_backbone"].name.startswith("vision_backbone--")
    image, state = frame(5), np.linspace(-1.0, 1.0, 8)
    actions = film_policy.new_session(INSTRUCTION).step(Observation(images={"primary": image}, state=state)).actions
    np.testing.assert_allclose(actions, film_reference(film_policy, oft_film, image, state), atol=1e-4, rtol=1e-4)
    for wrong in ({"film": False}, {"lora": False}):  # the comparison can fail
        assert np.abs(film_reference(film_policy, oft_film, image, state, **wrong) - actions).max() > 1e-3, wrong


def test_film_is_language_conditioned(film_policy, frame):
    """The same image under two instructions: other image tokens (without FiLM they would be equal)."""
    model = film_policy.model
    pixels = film_policy.image_processor(frame(6))[None]
    with torch.no_grad():
        a = model.embed_images([pixels], model.language(film_policy.tokenizer.prompt("pick up the cup")))
        b = model.embed_images([pixels], model.language(film_policy.tokenizer.prompt("open the drawer")))
        assert (a - b).abs().max() > 1e-3
        with pytest.raises(ValueError, match="FiLM-conditioned.*pass `language`"):
            model.embed_images([pixels])


def test_film_without_lora_and_in_history_mode(tmp_path, frame):
    path = make_tiny_openvla_oft(tmp_path / "plain", seed=4, dtype=torch.float32, film=True, film_lora_rank=None)
    policy = load_policy(path, device="cpu", dtype="float32")
    image, state = frame(7), np.zeros(8)
    actions = policy.new_session(INSTRUCTION).step(Observation(images={"primary": image}, state=state)).actions
    np.testing.assert_allclose(actions, film_reference(policy, path, image, state), atol=1e-4, rtol=1e-4)
    from vla_runtime.config import HistoryMode, SessionConfig

    history = policy.new_session(INSTRUCTION, SessionConfig(history=HistoryMode.HISTORY))
    chunks = [history.step(Observation(images={"primary": frame(8 + i)}, state=state)).actions for i in range(2)]
    assert all(c.shape == (8, 7) and np.isfinite(c).all() for c in chunks)  # FiLM'd tokens stream into the cache


def _rewrite(path, tmp_path, edit):
    out = tmp_path / "broken"
    shutil.copytree(path, out)
    file = next(out.glob("vision_backbone--*checkpoint.pt"))
    torch.save(edit(torch.load(file, weights_only=True)), file)
    return out


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda s: {k: v for k, v in s.items() if not k.endswith("blocks.0.scale.weight")}, r"missing \['vision_backbone.featurizer.blocks.0.scale.weight', 'vision_backbone.fused_featurizer.blocks.0.scale.weight'\]"),
        (lambda s: {k.replace("module.vision_backbone.", "module."): v for k, v in s.items()}, "keys must start with `vision_backbone.`"),
        (lambda s: {k: v for k, v in s.items() if "blocks.1.block.attn.qkv.lora_B" not in k}, "has no .*lora_B.default.weight"),
        (lambda s: {k: (v[:, :-1] if k.endswith("featurizer.blocks.0.shift.weight") else v) for k, v in s.items()}, r"`vision_backbone.featurizer.blocks.0.shift.weight` has shape \[\d+, 63\]; expected \[\d+, 64\]"),
        (lambda s: {**s, "module.vision_backbone.featurizer.blocks.0.block.extra": torch.zeros(1)}, r"unexpected \['vision_backbone.featurizer.blocks.0.block.extra'\]"),
        (lambda s: {k: v for k, v in s.items() if not (k.endswith(".scale.weight") or k.endswith(".scale.bias") or ".shift." in k)}, "has no FiLM layers"),
    ],
)
def test_film_load_errors_are_named(oft_film, tmp_path, edit, match):
    with pytest.raises(ValueError, match=match):
        load_policy(_rewrite(oft_film, tmp_path, edit), device="cpu", dtype="float32")
