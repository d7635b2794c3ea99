"""The diffusion variant against upstream's loop written out by hand (``_run_diffusion_prediction`` in
``modeling_prismatic.py``, ``DiffusionActionHead`` / ``NoisyActionProjector``, and diffusers' ``DDIMScheduler``
with upstream's settings: 50 training steps, ``squaredcos_cap_v2``, leading spacing, ``clip_sample`` to
[-1, 1], ``set_alpha_to_one``, eta = 0). The reference shares nothing with ``diffusion_oft.py``: the token ids
and the action mask are upstream's (``oft_reference``), the LLaMA is the explicit float64 one."""

import math
import shutil

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from vla_runtime.api import Observation, load_policy
from vla_runtime.checkpoints.tiny_openvla_oft import make_tiny_openvla_oft
from vla_runtime.config import SessionConfig

from oft_reference import all_actions_mask, fork_attention_mask, head_actions, input_ids_and_labels, llama_hidden, proprio_token, strip_ddp
from test_forward import INSTRUCTION, _stats, upstream_normalize_proprio, upstream_unnormalize


def ddim_alphas_cumprod(train_steps=50):
    """diffusers' ``squaredcos_cap_v2`` (betas_for_alpha_bar, max beta 0.999), cumprod in float32."""
    abar = lambda s: math.cos((s + 0.008) / 1.008 * math.pi / 2) ** 2  # noqa: E731
    betas = torch.tensor([min(1 - abar((i + 1) / train_steps) / abar(i / train_steps), 0.999) for i in range(train_steps)], dtype=torch.float32)
    return torch.cumprod(1.0 - betas, dim=0).double()


def reference_loop(policy, path, image, state, noise, steps, *, clip=True, cos_first=False, train_steps=50, starts=None):
    """Upstream's reverse diffusion -> (actions [K, A] in robot units, [(t, x_prev [K, A])] per step).
    ``starts``: each step's x_t given (ours, [K, A] each) instead of the previous step's output, to compare
    step by step. ``clip=False`` / ``cos_first=True`` are deliberately wrong variants."""
    model, stats = policy.model, _stats(path)
    prompt_ids = list(policy.tokenizer.prompt(INSTRUCTION).input_ids)
    ids, labels, num_prompt_tokens = input_ids_and_labels(prompt_ids, 7, 8)
    mask = all_actions_mask(torch.tensor([labels]), 7)[0]  # [T]
    lm = model.vla.language_model.state_dict()
    embeds = lm["model.embed_tokens.weight"].double()[torch.tensor(ids)][None]  # [1, T, dim]
    with torch.no_grad():
        patches = model.vla.embed_image(policy.image_processor(image)[None]).double()
    head = {k.replace("noise_predictor.mlp_resnet.", "model."): v for k, v in strip_ddp(torch.load(next(path.glob("action_head--*")), weights_only=True)).items()}
    noisy = strip_ddp(torch.load(next(path.glob("noisy_action_projector--*")), weights_only=True))
    proprio = proprio_token(strip_ddp(torch.load(next(path.glob("proprio_projector--*")), weights_only=True)),
                            torch.as_tensor(upstream_normalize_proprio(state, stats["proprio"])))  # fmt: skip
    dim = embeds.shape[-1]
    ac = ddim_alphas_cumprod(train_steps)
    ratio = train_steps // steps
    x = noise.double().reshape(8, 7)
    trajectory = []
    for i, t in enumerate((np.arange(steps) * ratio)[::-1]):
        if starts is not None:
            x = starts[i].double().reshape(8, 7)
        half = dim // 2
        args = float(t) * torch.exp(torch.arange(half, dtype=torch.float64) * -math.log(10000) / (half - 1))
        temb = torch.cat((args.cos(), args.sin()) if cos_first else (args.sin(), args.cos()))[None, None]  # [1, 1, dim]
        feats = F.gelu(x.reshape(-1, 1) @ noisy["fc1.weight"].T + noisy["fc1.bias"]) @ noisy["fc2.weight"].T + noisy["fc2.bias"]
        e = embeds.clone()
        e[0, mask] = feats  # _replace_input_embeddings
        seq = torch.cat([e[:, :1], patches, proprio, temb, e[:, 1:]], dim=1)
        hidden = llama_hidden(lm, model.vla.cfg.llm, seq, fork_attention_mask(seq.shape[1]))
        first = patches.shape[1] + 2 + num_prompt_tokens  # NUM_PATCHES (+ proprio + timestep token) + prompt
        eps = head_actions(head, hidden[:, first : first + 56], 8)  # [K, A]
        a_t = ac[t]
        a_prev = ac[t - ratio] if t - ratio >= 0 else torch.tensor(1.0, dtype=torch.float64)
        x0 = (x - (1 - a_t).sqrt() * eps) / a_t.sqrt()
        x0 = x0.clamp(-1, 1) if clip else x0
        x = a_prev.sqrt() * x0 + (1 - a_prev).sqrt() * eps
        trajectory.append((int(t), x))
    return upstream_unnormalize(x.numpy(), stats["action"]), trajectory


def _obs(frame, seed=0):
    return Observation(images={"primary": frame(seed)}, state=np.linspace(-0.5, 0.5, 8))


def record_steps(monkeypatch):
    """Our DDIM steps as they run: [(t, x_t [1, K, A], x_prev [1, K, A])]."""
    from vla_runtime.models.openvla_oft import diffusion_oft

    steps, original = [], diffusion_oft.OFTDDIM.step

    def step(self, eps, t, x):
        out = original(self, eps, t, x)
        steps.append((t, x.clone(), out.clone()))
        return out

    monkeypatch.setattr(diffusion_oft.OFTDDIM, "step", step)
    return steps


def test_diffusion_50_steps_each_step_equals_upstreams(oft_diffusion, frame, monkeypatch):
    """Upstream's 50 steps (t = 49 .. 0). The tiny random model is chaotic over many steps (a 1e-6 difference
    in eps is amplified to ~1e-3 in the actions by 10+ steps, in float64 too), so the long loop is compared
    step by step: each of our steps, started from our x_t, equals upstream's step from that x_t."""
    policy = load_policy(oft_diffusion, device="cpu", dtype="float32")
    assert policy.config.diffusion and policy.info()["diffusion"] == {"train_steps": 50, "steps": 50}
    obs = _obs(frame)
    recorded = record_steps(monkeypatch)
    actions = policy.new_session(INSTRUCTION, SessionConfig(seed=3)).step(obs).actions
    noise = torch.randn((1, 8, 7), generator=torch.Generator().manual_seed(3))  # the session's draw
    assert [t for t, _, _ in recorded] == list(range(49, -1, -1))
    torch.testing.assert_close(recorded[0][1], noise, rtol=0, atol=0)  # the loop starts from the seeded draw
    _, expected = reference_loop(policy, oft_diffusion, obs.images["primary"], obs.state, noise, 50, starts=[x for _, x, _ in recorded])
    for (t, _, ours), (t_ref, theirs) in zip(recorded, expected):
        assert t == t_ref
        torch.testing.assert_close(ours[0].double(), theirs, atol=2e-5, rtol=2e-5, msg=f"step t={t}")
    stats = _stats(oft_diffusion)["action"]
    np.testing.assert_allclose(actions, upstream_unnormalize(recorded[-1][2][0].double().numpy(), stats), atol=1e-6)  # robot units


@pytest.mark.parametrize("steps", [1, 2, 5])
def test_diffusion_loop_equals_upstreams(oft_diffusion, frame, steps):
    """Whole loops (leading spacing: stride 50 / steps, t = 0; 25, 0; 40, 30, ..., 0) end to end."""
    policy = load_policy(oft_diffusion, device="cpu", dtype="float32", diffusion_steps=steps)
    obs = _obs(frame, 1)
    actions = policy.new_session(INSTRUCTION).step(obs).actions
    noise = torch.randn((1, 8, 7), generator=torch.Generator().manual_seed(0))
    args = (policy, oft_diffusion, obs.images["primary"], obs.state, noise)
    np.testing.assert_allclose(actions, reference_loop(*args, steps)[0], atol=1e-4, rtol=1e-4)
    if steps == 5:  # the comparison can fail
        for wrong in ({"clip": False}, {"cos_first": True}):
            assert np.abs(reference_loop(*args, steps, **wrong)[0] - actions).max() > 1e-3, wrong
        assert np.abs(reference_loop(*args, 2)[0] - actions).max() > 1e-3  # another step count


def test_noise_comes_from_the_session_generator(oft_diffusion, frame):
    policy = load_policy(oft_diffusion, device="cpu", dtype="float32", diffusion_steps=2)
    obs = _obs(frame, 2)
    session = policy.new_session(INSTRUCTION)
    first, second = session.step(obs).actions, session.step(obs).actions
    assert np.abs(first - second).max() > 1e-3  # a new draw each step
    session.reset()
    np.testing.assert_array_equal(session.step(obs).actions, first)  # reset re-seeds
    np.testing.assert_array_equal(policy.new_session(INSTRUCTION).step(obs).actions, first)
    assert np.abs(policy.new_session(INSTRUCTION, SessionConfig(seed=1)).step(obs).actions - first).max() > 1e-3
    with pytest.raises(ValueError, match=r"`diffusion_steps` must be in \[1, diffusion_train_steps = 50\], got 51"):
        load_policy(oft_diffusion, device="meta", diffusion_steps=51)


def _swap(src, tmp_path, name, replacement=None):
    out = tmp_path / "broken"
    shutil.copytree(src, out)
    target = next(out.glob(f"{name}--*checkpoint.pt"))
    if replacement is None:
        target.unlink()
    else:
        shutil.copy(replacement, target)
    return out


def test_diffusion_load_errors_are_named(oft_diffusion, oft_libero, tmp_path):
    with pytest.raises(ValueError, match=r"is a diffusion head \(`noise_predictor.\*` keys\) but .* has no noisy_action_projector"):
        load_policy(_swap(oft_diffusion, tmp_path / "a", "noisy_action_projector"), device="cpu")
    l1_head = next(oft_libero.glob("action_head--*"))
    with pytest.raises(ValueError, match=r"\(the diffusion variant\) but action_head--150000_checkpoint.pt is an L1-regression head"):
        load_policy(_swap(oft_diffusion, tmp_path / "b", "action_head", l1_head), device="cpu")
    broken = _swap(oft_diffusion, tmp_path / "c", "action_head")
    file = broken / "noisy_action_projector--150000_checkpoint.pt"
    state = torch.load(file, weights_only=True)
    torch.save({**state, "module.fc1.weight": torch.zeros(64, 2)}, file)
    shutil.copy(next(oft_diffusion.glob("action_head--*")), broken / "action_head--150000_checkpoint.pt")
    with pytest.raises(ValueError, match=r"noisy_action_projector--150000_checkpoint.pt: `fc1.weight` has shape \[64, 2\]; expected \[64, 1\]"):
        load_policy(broken, device="cpu")


def test_film_with_diffusion(tmp_path, frame):
    """Both components load and run together (a smoke test: the FiLM and diffusion paths are each checked above)."""
    path = make_tiny_openvla_oft(tmp_path / "both", seed=6, dtype=torch.float32, film=True, diffusion=True)
    policy = load_policy(path, device="cpu", dtype="float32", diffusion_steps=2)
    assert policy.config.film and policy.config.diffusion
    obs = _obs(frame, 3)
    a, b = (policy.new_session(text).step(obs).actions for text in ("open the drawer", "close the drawer"))
    assert a.shape == (8, 7) and np.abs(a - b).max() > 1e-3
