"""CogACT's DiT: upstream names and math (timm modules as the oracle), sizes from weights, CFG, seeded sampling."""

import pytest
import torch
import torch.nn as nn
from timm.layers import Mlp as TimmMlp
from timm.models.vision_transformer import Attention as TimmAttention

from vla_runtime.models.cogact.configuration_cogact import DIT_SIZES, CogACTSamplingConfig, DiTConfig
from vla_runtime.models.cogact.modeling_cogact import ActionModel
from vla_runtime.models.diffusion import TimestepEmbedder

TINY = DiTConfig.from_name("tiny")


class ReferenceDiT(nn.Module):
    """Upstream's DiT forward rebuilt from timm's Attention/Mlp (as upstream builds it), loaded strictly."""

    def __init__(self, cfg: DiTConfig) -> None:
        super().__init__()
        h = cfg.hidden
        self.x_embedder = nn.Module()
        self.x_embedder.linear = nn.Linear(cfg.action_dim, h)
        self.history_embedder = nn.Module()
        self.history_embedder.linear = nn.Linear(cfg.action_dim, h)
        self.t_embedder = TimestepEmbedder(h)
        self.z_embedder = nn.Module()
        self.z_embedder.linear = nn.Linear(cfg.token_size, h)
        self.z_embedder.uncondition = nn.Parameter(torch.zeros(1, cfg.token_size))
        self.positional_embedding = nn.Parameter(torch.zeros(cfg.chunk + 1, h))
        self.blocks = nn.ModuleList()
        for _ in range(cfg.depth):
            block = nn.Module()
            block.attn = TimmAttention(h, num_heads=cfg.heads, qkv_bias=True)
            block.mlp = TimmMlp(h, int(h * cfg.mlp_ratio), act_layer=lambda: nn.GELU(approximate="tanh"))
            self.blocks.append(block)
        self.final_layer = nn.Module()
        self.final_layer.linear = nn.Linear(h, cfg.action_dim)

    def forward(self, x, t, z):
        ln = lambda v: nn.functional.layer_norm(v, v.shape[-1:], eps=1e-6)  # noqa: E731
        c = self.t_embedder(t).unsqueeze(1) + self.z_embedder.linear(z)
        h = torch.cat([c, self.x_embedder.linear(x)], dim=1) + self.positional_embedding
        for block in self.blocks:
            h = h + block.attn(ln(h))
            h = h + block.mlp(ln(h))
        return self.final_layer.linear(ln(h))[:, 1:]


def random_action_model(cfg: DiTConfig = TINY, seed: int = 0) -> ActionModel:
    torch.manual_seed(seed)
    model = ActionModel(cfg).eval()
    with torch.no_grad():  # upstream zero-inits the final layer; give it weights so outputs are informative
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


def test_dit_matches_timm_reference_with_upstream_names():
    model = random_action_model()
    ref = ReferenceDiT(TINY)
    net_state = {k.removeprefix("net."): v for k, v in model.state_dict().items()}
    ref.load_state_dict(net_state, strict=True)  # same names as upstream's timm-based DiT
    x, t, z = torch.randn(3, 16, 7), torch.tensor([0, 42, 99]), torch.randn(3, 1, TINY.token_size)
    torch.testing.assert_close(model.net(x, t, z), ref(x, t, z), atol=1e-5, rtol=1e-5)


def test_state_dict_keys_are_upstreams():
    keys = set(ActionModel(TINY).state_dict())
    expected = {
        "net.positional_embedding", "net.z_embedder.uncondition",
        *(f"net.{m}.linear.{p}" for m in ("x_embedder", "history_embedder", "z_embedder", "final_layer") for p in ("weight", "bias")),
        *(f"net.t_embedder.mlp.{i}.{p}" for i in (0, 2) for p in ("weight", "bias")),
        *(f"net.blocks.{b}.{m}.{p}" for b in range(2) for m in ("attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2") for p in ("weight", "bias")),
    }  # fmt: skip
    assert keys == expected
    assert ActionModel(TINY).net.z_embedder.uncondition.shape == (1, TINY.token_size)  # sized to the LLM, not 4096


@pytest.mark.parametrize("name, params_m", [("DiT-S", 12.48), ("DiT-B", 88.99), ("DiT-L", 307.76)])
def test_sizes_are_read_back_from_weights(name, params_m):
    with torch.device("meta"):  # shapes only
        model = ActionModel(DiTConfig.from_name(name))
    assert sum(p.numel() for p in model.parameters()) / 1e6 == pytest.approx(params_m, abs=0.01)  # paper: 13M / 89M / 308M
    cfg = DiTConfig.from_state_dict(model.state_dict())
    assert (cfg.depth, cfg.hidden, cfg.heads) == DIT_SIZES[name]
    assert (cfg.chunk, cfg.action_dim, cfg.token_size) == (16, 7, 4096)


def test_unknown_width_needs_explicit_heads():
    state = ActionModel(TINY).state_dict()
    with pytest.raises(ValueError, match="action_model_num_heads"):
        DiTConfig.from_state_dict(state)
    assert DiTConfig.from_state_dict(state, heads=2) == TINY
    with pytest.raises(KeyError, match="net.positional_embedding"):
        DiTConfig.from_state_dict({k: v for k, v in state.items() if k != "net.positional_embedding"})


def test_cfg_scale_one_equals_no_guidance():
    model = random_action_model()
    x, t, z = torch.randn(2, 16, 7), torch.tensor([90, 90]), torch.randn(2, 1, TINY.token_size)
    torch.testing.assert_close(model.net.forward_with_cfg(x, t, z, 1.0), model.net(x, t, z), atol=1e-6, rtol=1e-6)
    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    torch.testing.assert_close(model.sample(z, cfg_scale=1.0, generator=g1), model.sample(z, cfg_scale=1.0, generator=g2))


def test_cfg_combines_conditional_and_learned_unconditional():
    model = random_action_model()
    x, t, z = torch.randn(2, 16, 7), torch.tensor([50, 50]), torch.randn(2, 1, TINY.token_size)
    cond = model.net(x, t, z)
    uncond = model.net(x, t, model.net.z_embedder.uncondition.expand(2, 1, -1))
    guided = model.net.forward_with_cfg(x, t, z, 1.5)
    torch.testing.assert_close(guided, uncond + 1.5 * (cond - uncond), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(guided, cond, atol=1e-4)


def test_sampling_is_deterministic_under_a_seed():
    model = random_action_model()
    z = torch.randn(1, 1, TINY.token_size)
    a = model.sample(z, cfg_scale=1.5, generator=torch.Generator().manual_seed(7))
    b = model.sample(z, cfg_scale=1.5, generator=torch.Generator().manual_seed(7))
    c = model.sample(z, cfg_scale=1.5, generator=torch.Generator().manual_seed(8))
    assert a.shape == (1, 16, 7)
    assert torch.equal(a, b)
    assert not torch.allclose(a, c)


def test_training_loss_trains_the_dit():
    model = random_action_model().train()
    g = torch.Generator().manual_seed(0)
    actions, cognition = torch.rand(4, 16, 7) * 2 - 1, torch.randn(4, 1, TINY.token_size)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(60):
        loss = model.loss(actions, cognition, repeats=2, generator=g)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert sum(losses[-10:]) / 10 < 0.6 * sum(losses[:10]) / 10
    with pytest.raises(ValueError, match=r"actions must be \[B, 16, 7\]"):
        model.loss(actions[:, :15], cognition)


def test_sampling_config_validation():
    with pytest.raises(ValueError, match="cfg_scale"):
        CogACTSamplingConfig(cfg_scale=0.5)
    assert CogACTSamplingConfig().diffusion.sample_steps == 10
