"""HybridVLA's diffusion-in-LLM modules: upstream names and math (timm as the oracle), loading, token order."""

import pytest
import torch
import torch.nn as nn
from timm.layers import Mlp as TimmMlp
from timm.layers import RmsNorm as TimmRmsNorm

from vla_runtime.models.diffusion import timestep_embedding
from vla_runtime.models.hybridvla.configuration_hybridvla import DiffusionHeadConfig, HybridVLASamplingConfig
from vla_runtime.models.hybridvla.modeling_hybridvla import DIFFUSION_MODULES, DiffusionHead

CFG = DiffusionHeadConfig(dim=64, action_dim=7, future_window=2)


def random_head(seed=0) -> DiffusionHead:
    torch.manual_seed(seed)
    head = DiffusionHead(CFG)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return head


def test_modules_match_timm_layers_under_upstream_names():
    head = random_head()
    gelu_tanh = lambda: nn.GELU(approximate="tanh")  # noqa: E731
    ref_embed = nn.Module()
    ref_embed.mlp = TimmMlp(7, 64, 64, act_layer=gelu_tanh)
    ref_embed.load_state_dict(head.x_embedder.state_dict(), strict=True)
    ref_final = nn.Module()
    ref_final.norm_final = TimmRmsNorm(64, eps=1e-6)
    ref_final.mlp = TimmMlp(64, 64, 7, act_layer=gelu_tanh)
    ref_final.load_state_dict(head.final_layer.state_dict(), strict=True)
    a, h = torch.randn(3, 7), torch.randn(3, 5, 64)
    torch.testing.assert_close(head.x_embedder(a), ref_embed.mlp(a))
    torch.testing.assert_close(head.final_layer(h), ref_final.mlp(ref_final.norm_final(h)), atol=1e-5, rtol=1e-5)


def test_checkpoint_layout_round_trip_and_missing_module_error():
    head = random_head()
    modules = head.module_state_dicts()
    assert sorted(modules) == sorted(DIFFUSION_MODULES)
    assert sorted(modules["final_layer"]) == ["mlp.fc1.bias", "mlp.fc1.weight", "mlp.fc2.bias", "mlp.fc2.weight", "norm_final.weight"]
    assert modules["proprio_embedder"]["mlp.fc1.weight"].shape == (64, 7)
    loaded = DiffusionHead(DiffusionHead.config_from_state_dicts(modules, future_window=2))
    assert loaded.cfg == CFG
    loaded.load_module_state_dicts(modules)
    for name, sd in loaded.module_state_dicts().items():
        for key, value in sd.items():
            assert torch.equal(value, modules[name][key]), (name, key)
    with pytest.raises(KeyError, match=r"lacks diffusion module\(s\) \['t_embedder'\]"):
        DiffusionHead.config_from_state_dicts({k: v for k, v in modules.items() if k != "t_embedder"}, future_window=0)


def test_step_tokens_are_timestep_first_then_one_token_per_action():
    head = random_head()
    x, t = torch.randn(2, CFG.chunk, 7), torch.tensor([75, 0])
    tokens = head.embed_step(x, t)
    assert tokens.shape == (2, 1 + CFG.chunk, 64)
    torch.testing.assert_close(tokens[:, 0], head.t_embedder.mlp(timestep_embedding(t, 256)))
    torch.testing.assert_close(tokens[:, 1:], head.x_embedder(x))
    assert head.embed_proprio(torch.randn(2, 7)).shape == (2, 1, 64)


def test_sampling_config_defaults_and_errors():
    cfg = HybridVLASamplingConfig()
    assert cfg.diffusion.sample_steps == 4 and cfg.branches == (True, True)
    assert HybridVLASamplingConfig(mode="ar").branches == (False, True)
    with pytest.raises(KeyError, match="diff\\+ar, diff, ar"):
        HybridVLASamplingConfig(mode="both")
