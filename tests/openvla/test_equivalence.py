"""Our OpenVLA against references built from the upstream building blocks on the same tiny weights:
timm's own ``get_intermediate_layers`` (what upstream calls), a functional projector and transformers'
``LlamaForCausalLM`` (inputs_embeds). Also: predict is deterministic, and history mode over several
steps equals one forward over the whole history sequence (the layout of contract 2)."""

import json

import numpy as np
import pytest
import timm
import torch
import torch.nn.functional as F
import transformers
from safetensors.torch import load_file

from vla_runtime.api import Observation, load_policy
from vla_runtime.checkpoints.tiny_openvla import make_tiny_openvla
from vla_runtime.config import ActionDecoding, SessionConfig
from vla_runtime.kv import FullCache, FullParams
from vla_runtime.models.openvla.processing_openvla import history_sequence
from vla_runtime.models.prismatic.configuration_vision import TOWER_PREFIXES, VISION_BACKBONES
from vla_runtime.models.prismatic.modeling_prismatic import tower_features

ATOL = 1e-4


class Reference:
    """Upstream's computation from its parts: timm towers, functional projector, transformers LLaMA."""

    def __init__(self, path, policy):
        state = {k: v.float() for k, v in load_file(str(path / "model.safetensors")).items()}
        config = json.loads((path / "config.json").read_text())
        cfg = policy.config
        self.towers = []
        for prefix, tower, act in zip(TOWER_PREFIXES, cfg.vision.towers, config["timm_override_act_layers"]):
            # upstream: timm.create_model(id, pretrained=False, num_classes=0, img_size=..., act_layer=override);
            # the tiny geometry overrides the id's sizes
            vit = timm.create_model(
                tower.timm_id, pretrained=False, num_classes=0, img_size=tower.image_size, act_layer=act,
                embed_dim=tower.embed_dim, depth=tower.depth, num_heads=tower.num_heads,
            )  # fmt: skip
            sub = {k[len(prefix) :].replace("scale_factor", "gamma"): v for k, v in state.items() if k.startswith(prefix)}
            vit.load_state_dict(sub, strict=True)
            self.towers.append(vit.eval())
        self.projector = [(state[f"projector.fc{i}.weight"], state[f"projector.fc{i}.bias"]) for i in (1, 2, 3)
                          if f"projector.fc{i}.weight" in state]  # fmt: skip
        text = config["text_config"]
        hf_cfg = transformers.LlamaConfig(**{k: v for k, v in text.items() if k not in ("model_type", "torch_dtype")})
        self.llm = transformers.LlamaForCausalLM(hf_cfg).eval()
        lm = {k[len("language_model.") :]: v for k, v in state.items() if k.startswith("language_model.")}
        self.llm.load_state_dict(lm, strict=True)

    def features(self, pixel_values):
        """[B, 3 * towers, H, W] -> concatenated second-to-last-block patch features (upstream's monkey patch)."""
        chunks = torch.split(pixel_values, 3, dim=1)
        return torch.cat([vit.get_intermediate_layers(x, n={len(vit.blocks) - 2})[0] for vit, x in zip(self.towers, chunks)], dim=2)

    def image_tokens(self, pixel_values):
        x = self.features(pixel_values)
        for i, (w, b) in enumerate(self.projector):
            x = F.linear(x, w, b)
            if i + 1 < len(self.projector):
                x = F.gelu(x)
        return x


@pytest.mark.parametrize("backbone_id", sorted(VISION_BACKBONES))
def test_featurizer_equals_timm_get_intermediate_layers(backbone_id, tiny_openvla, tmp_path, frame):
    """Every vision_backbone_id: DINOv2 (registers, LayerScale), SigLIP (no prefix, attn_pool), CLIP
    (pre-norm, quick_gelu), IN1k (patch 16); fused and single-tower."""
    path = tiny_openvla if backbone_id == "dinosiglip-vit-so-224px" else make_tiny_openvla(tmp_path / "t", vision_backbone_id=backbone_id)
    policy = load_policy(path, device="cpu", dtype="float32")
    ref = Reference(path, policy)
    pixels = torch.stack([policy.image_processor(frame(s)) for s in range(2)])  # [2, 3 * towers, S, S]
    with torch.no_grad():
        backbone = policy.model.vision_backbone
        ours = backbone(pixels)
        vits = [backbone.featurizer] + ([backbone.fused_featurizer] if backbone.fused_featurizer is not None else [])
        for vit, ref_vit, x in zip(vits, ref.towers, torch.split(pixels, 3, dim=1)):
            torch.testing.assert_close(tower_features(vit, x), ref_vit.get_intermediate_layers(x, n={len(ref_vit.blocks) - 2})[0], rtol=0, atol=1e-6)
        torch.testing.assert_close(ours, ref.features(pixels), rtol=0, atol=1e-6)
        torch.testing.assert_close(policy.model.embed_image(pixels), ref.image_tokens(pixels), rtol=0, atol=1e-5)
    assert ours.shape == (2, policy.config.vision.num_patches, sum(t.embed_dim for t in policy.config.vision.towers))
    # the skipped last block matters to the full forward but not to the features
    with torch.no_grad():
        n = policy.config.vision.num_patches
        assert not torch.allclose(ref.towers[0].forward_features(torch.split(pixels, 3, dim=1)[0])[:, -n:], ours[..., : vits[0].embed_dim])


def test_prefill_and_decode_logits_match_transformers(tiny_openvla, frame, hf_cache):
    policy = load_policy(tiny_openvla, device="cpu", dtype="float32")
    ref = Reference(tiny_openvla, policy)
    model = policy.model
    prompt = policy.tokenizer.prompt("Put the red cube in the blue bowl")
    input_ids = torch.tensor([prompt.input_ids])
    pixels = policy.image_processor(frame(7))[None]
    with torch.no_grad():
        cache = FullCache(policy.config.llm.geometry, FullParams(capacity=128))
        ours = model(pixels, input_ids, cache=cache)  # [1, T', V]
        text = ref.llm.get_input_embeddings()(input_ids)
        embeds = torch.cat([text[:, :1], ref.image_tokens(pixels), text[:, 1:]], dim=1)  # image right after BOS
        past = transformers.DynamicCache(config=ref.llm.config)
        out = ref.llm(inputs_embeds=embeds, **hf_cache(ref.llm, past), use_cache=True)
        assert ours.shape == out.logits.shape == (1, len(prompt.input_ids) + 16, 32064)
        torch.testing.assert_close(ours, out.logits, rtol=0, atol=ATOL)
        tok = out.logits[:, -1:].argmax(-1)
        for _ in range(6):
            ours = model.language_model(tok, cache=cache)
            out = ref.llm(tok, **hf_cache(ref.llm, past), use_cache=True)
            torch.testing.assert_close(ours, out.logits, rtol=0, atol=ATOL)
            tok = out.logits[:, -1:].argmax(-1)


def test_session_tokens_are_upstreams_greedy_tokens(tiny_openvla, frame):
    """Unrestricted greedy decoding in a single-mode session = transformers' generate on upstream's input."""
    policy = load_policy(tiny_openvla, device="cpu", decoding=ActionDecoding.FULL)
    ref = Reference(tiny_openvla, policy)
    image = frame(11)
    session = policy.new_session("Wipe the table")
    session.step(Observation(images={"primary": image}))
    prompt = policy.tokenizer.prompt("Wipe the table")
    with torch.no_grad():
        text = ref.llm.get_input_embeddings()(torch.tensor([prompt.input_ids]))
        embeds = torch.cat([text[:, :1], ref.image_tokens(policy.image_processor(image)[None]), text[:, 1:]], dim=1)
        gen = ref.llm.generate(inputs_embeds=embeds, max_new_tokens=7, min_new_tokens=7, do_sample=False, pad_token_id=32000)
    assert session.last_tokens.tolist() == gen[:, -7:].tolist()


def test_predict_is_deterministic(tiny_openvla, frame):
    image = frame(5)
    results = []
    for _ in range(2):
        policy = load_policy(tiny_openvla, device="cpu")
        session = policy.new_session("pick up the red cube")
        results += [session.step(Observation(images={"primary": image})) for _ in range(2)]
    for r in results[1:]:
        assert np.array_equal(r.actions, results[0].actions)
    other = policy.new_session("pick up the red cube").step(Observation(images={"primary": frame(6)}))
    assert not np.array_equal(other.actions, results[0].actions)  # the image matters


@pytest.mark.parametrize("proprio", [False, True])
def test_history_mode_equals_one_forward_over_the_history_sequence(proprio, tiny_openvla, tiny_openvla_proprio, frame):
    path = tiny_openvla_proprio if proprio else tiny_openvla
    policy = load_policy(path, device="cpu")
    model = policy.model
    decoder = model.language_model.model
    captured = []
    handle = decoder.register_forward_hook(lambda mod, args, out: captured.append(out.clone()))
    session = policy.new_session("Stack the green block on the red cube", SessionConfig(history="history"))
    images = [frame(20 + s) for s in range(3)]
    states = [np.linspace(-1, 1, 8) * (s + 1) for s in range(3)]
    tokens = []
    try:
        for image, state in zip(images, states):
            session.step(Observation(images={"primary": image}, state=state if proprio else None))
            tokens.append(session.last_tokens[0].tolist())
    finally:
        handle.remove()

    forwards = history_sequence(session.prompt, tokens, has_proprio=proprio)
    assert len(captured) == len(forwards) == 1 + 3 * 7
    with torch.no_grad():
        image_tokens = [model.embed_image(policy.image_processor(im)[None]) for im in images]
        prop = [model.embed_proprio(session.state_input(s)) for s in states] if proprio else []
        embeds = torch.cat([model.embed_forward(f, images=image_tokens, proprio=prop) for f in forwards], dim=1)
        whole = decoder(inputs_embeds=embeds, cache=FullCache(policy.config.llm.geometry, FullParams(capacity=embeds.shape[1])))
    assert whole.shape[1] == sum(h.shape[1] for h in captured) == session.cache.stats().tokens_raw
    start = 0
    for hidden in captured:
        torch.testing.assert_close(hidden, whole[:, start : start + hidden.shape[1]], rtol=0, atol=ATOL)
        start += hidden.shape[1]
    # and the tokens the session chose are the parallel form's greedy action tokens
    head = model.language_model.lm_head.weight[31744:32000]
    ends = np.cumsum([f.length(16) for f in forwards]) - 1
    predicted = [int(F.linear(whole[0, e], head).argmax()) + 31744 for e in ends[1:]]
    assert predicted == [t for step in tokens for t in step]
