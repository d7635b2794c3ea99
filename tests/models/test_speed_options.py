"""Every built-in family takes the load-time speed options (``models.speed``): a fused or prepacked CogACT,
HybridVLA or OpenVLA-OFT acts as the plain policy does up to float rounding, and all three options together
(fuse, then int8, then prepack) load in that order and act. A plug-in family that does not take them is refused by
the flag's or the parameter's name."""

import numpy as np
import pytest
import torch
import torch.nn as nn

from vla_runtime import api
from vla_runtime.api import Observation, check_speed_options, load_policy
from vla_runtime.checkpoints.tiny_openvla_oft import make_tiny_openvla_oft
from vla_runtime.checkpoints.tiny_prismatic import make_tiny_cogact, make_tiny_hybridvla
from vla_runtime.config import SessionConfig
from vla_runtime.models.llama import LlamaConfig
from vla_runtime.models.prepack import PrepackedLinear
from vla_runtime.models.quantize import Int8Linear, QuantMode, weight_bytes
from vla_runtime.kv.rope import RopeConfig
from vla_runtime.policies import registry

LLM = LlamaConfig(dim=512, n_layers=2, n_heads=8, n_kv_heads=8, head_dim=64, ffn_dim=1376, vocab_size=32064,
                  max_position=2048, rope=RopeConfig(head_dim=64, original_max_position=2048))  # big enough to pack
FAMILIES = {  # family -> the tiny checkpoint's maker and its options, load_policy's options
    "cogact": (make_tiny_cogact, {}, {}),
    "hybridvla": (make_tiny_hybridvla, {}, {}),
    "openvla-oft": (make_tiny_openvla_oft, {"dtype": torch.float32}, {}),
}
VARIANTS = {
    "fused": {"fuse": True},
    "prepacked": {"prepack": True},
    "all three": {"fuse": True, "quantize": QuantMode.INT8, "prepack": True},
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_family_acts_as_the_plain_policy_fused_and_prepacked_and_takes_all_three(tmp_path, family):
    make, make_options, load_options = FAMILIES[family]
    path = make(tmp_path / family, seed=0, llm=LLM, **make_options)
    assert api.detect_family(path) == family
    plain = load_policy(path, device="cpu", **load_options)
    policies = {name: load_policy(path, device="cpu", **load_options, **options) for name, options in VARIANTS.items()}
    first_layer = lambda p: p.vlm.language_model.model.layers[0]  # noqa: E731
    assert type(first_layer(plain).self_attn.q_proj) is nn.Linear
    assert type(first_layer(policies["fused"]).self_attn.qkv_proj) is nn.Linear
    assert not hasattr(first_layer(policies["fused"]).self_attn, "q_proj")
    assert isinstance(first_layer(policies["prepacked"]).self_attn.q_proj, PrepackedLinear)
    every = policies["all three"]
    assert isinstance(first_layer(every).self_attn.qkv_proj, Int8Linear)  # fused, then quantized
    assert isinstance(every.vlm.language_model.lm_head, PrepackedLinear)  # prepacked where not quantized
    layers = lambda p: weight_bytes(p.vlm.language_model.model.layers)  # noqa: E731
    assert layers(plain) > 3.5 * layers(every)

    state_dim = {"hybridvla": plain.action_dim, "openvla-oft": getattr(plain.config, "proprio_dim", None)}.get(family)
    config = SessionConfig(seed=3)  # the same seed: the diffusion heads draw the same noise
    sessions = {name: p.new_session("pick up the cube", config) for name, p in {"plain": plain, **policies}.items()}
    rng = np.random.default_rng(0)
    for _ in range(3):
        image = rng.integers(0, 256, (96, 128, 3), dtype=np.uint8)
        state = None if state_dim is None else rng.uniform(-0.5, 0.5, state_dim)
        actions = {name: s.step(Observation(images={"primary": image}, state=state)).actions for name, s in sessions.items()}
        for name in ("fused", "prepacked"):
            np.testing.assert_allclose(actions[name], actions["plain"], atol=1e-4, err_msg=name)
        assert actions["all three"].shape == actions["plain"].shape and np.isfinite(actions["all three"]).all()


def test_a_plug_in_family_takes_the_speed_options_only_when_it_says_so(tmp_path, monkeypatch):
    monkeypatch.setattr(registry, "FAMILIES", dict(registry.FAMILIES))  # register_family adds to both
    monkeypatch.setattr(registry, "SPEED_FAMILIES", set(registry.SPEED_FAMILIES))
    for name, says in (("test-plain", False), ("test-fast", True)):
        (tmp_path / name).mkdir()
        registry.register_family(name, lambda p, name=name: p.name == name, lambda p, **kw: None, speed_options=says)
    check_speed_options(tmp_path / "test-plain", {})  # nothing asked: nothing to refuse
    check_speed_options(tmp_path / "test-fast", {"fuse": "--fuse"})
    with pytest.raises(ValueError, match=r"--fuse applies to the families whose loader takes the speed options "
                                         r"\(cogact, hybridvla, openvla, openvla-oft, test-fast\); .* is a test-plain checkpoint"):
        check_speed_options(tmp_path / "test-plain", {"fuse": "--fuse", "prepack": "--prepack"})
