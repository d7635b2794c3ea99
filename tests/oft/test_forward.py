"""OFT's parallel decoding against upstream's algorithm written out plainly (``oft_reference``), and against
our OpenVLA path where the two must agree (image preprocessing, vision tokens, prompt ids)."""

import json

import numpy as np
import pytest
import torch

from vla_runtime.api import Observation, load_policy
from vla_runtime.kv.bidirectional import BidirectionalPass
from vla_runtime.kv.rope import RopeConfig
from vla_runtime.models.openvla_oft.configuration_oft import NormalizationType
from vla_runtime.models.openvla_oft.normalization_oft import BoundsStats
from vla_runtime.policies.openvla import load_openvla_policy

from oft_reference import proprio_token, reference_chunk, strip_ddp

INSTRUCTION = "Put the Bowl on the plate"


def upstream_unnormalize(a, stats):
    mask = np.asarray(stats.get("mask", [True] * len(stats["q01"])))
    lo, hi = np.asarray(stats["q01"]), np.asarray(stats["q99"])
    return np.where(mask, 0.5 * (a + 1) * (hi - lo + 1e-8) + lo, a)


def upstream_normalize_proprio(x, stats, lo_key="q01", hi_key="q99"):
    mask = np.asarray(stats.get("mask", [True] * len(stats[lo_key])))
    lo, hi = np.asarray(stats[lo_key]), np.asarray(stats[hi_key])
    return np.clip(np.where(mask, 2 * (x - lo) / (hi - lo + 1e-8) - 1, x), -1.0, 1.0)


def reference(policy, path, images, state=None, **variant):
    """Upstream's normalised chunk [K, A] for ``images`` (uint8 frames, policy's camera order)."""
    model, cfg = policy.model, policy.config
    with torch.no_grad():
        patches = torch.cat([model.vla.embed_image(policy.image_processor(im)[None]) for im in images], dim=1)
        head = strip_ddp(torch.load(next(path.glob("action_head--*checkpoint.pt")), weights_only=True))
        proprio = None
        if state is not None:
            projector = strip_ddp(torch.load(next(path.glob("proprio_projector--*checkpoint.pt")), weights_only=True))
            proprio = proprio_token(projector, torch.as_tensor(state))
        return reference_chunk(
            lm_state=model.vla.language_model.state_dict(), llm_cfg=model.vla.cfg.llm,
            prompt_ids=list(policy.tokenizer.prompt(INSTRUCTION).input_ids), patches=patches, head=head,
            action_dim=cfg.action_dim, chunk=cfg.chunk_size, proprio=proprio, **variant,
        ).numpy()  # fmt: skip


@pytest.fixture(scope="module")
def libero(oft_libero):
    return load_policy(oft_libero, device="cpu", dtype="float32")


def _stats(path, key="libero_spatial_no_noops"):
    return json.loads((path / "dataset_statistics.json").read_text())[key]


def test_chunk_equals_upstream_algorithm_with_proprio(libero, oft_libero, frame):
    stats = _stats(oft_libero)
    state = np.linspace(-1.5, 1.5, 8)
    image = frame(0)
    result = libero.new_session(INSTRUCTION).step(Observation(images={"primary": image}, state=state))
    assert result.actions.shape == (8, 7)
    normalized = reference(libero, oft_libero, [image], upstream_normalize_proprio(state, stats["proprio"]))
    np.testing.assert_allclose(result.actions, upstream_unnormalize(normalized, stats["action"]), atol=1e-4, rtol=1e-4)
    # the comparison can fail: the slice one later, or causal attention, give other actions
    for wrong in ({"offset": 1}, {"causal": True}):
        other = upstream_unnormalize(reference(libero, oft_libero, [image], upstream_normalize_proprio(state, stats["proprio"]), **wrong), stats["action"])
        assert np.abs(other - result.actions).max() > 1e-2, wrong


def test_two_cameras_in_order(oft_libero, frame):
    policy = load_policy(oft_libero, device="cpu", dtype="float32", cameras=("primary", "wrist"))
    stats, state = _stats(oft_libero), np.zeros(8)
    images = {"primary": frame(1), "wrist": frame(2, (40, 40, 3))}
    actions = policy.new_session(INSTRUCTION).step(Observation(images=images, state=state)).actions
    normalized = reference(policy, oft_libero, [images["primary"], images["wrist"]], upstream_normalize_proprio(state, stats["proprio"]))
    np.testing.assert_allclose(actions, upstream_unnormalize(normalized, stats["action"]), atol=1e-4, rtol=1e-4)
    swapped = policy.new_session(INSTRUCTION).step(Observation(images={"primary": images["wrist"], "wrist": images["primary"]}, state=state))
    assert np.abs(swapped.actions - actions).max() > 1e-3
    assert policy.info()["image_tokens"] == 2 * load_policy(oft_libero, device="meta").info()["image_tokens"]


def test_bridge_chunk_without_proprio(oft_no_proprio, frame):
    policy = load_policy(oft_no_proprio, device="cpu", dtype="float32", platform="bridge")
    assert policy.chunk_size == 5 and policy.config.proprio_dim is None
    image = frame(3)
    actions = policy.new_session(INSTRUCTION).step(Observation(images={"primary": image})).actions
    stats = _stats(oft_no_proprio, "bridge_orig")
    np.testing.assert_allclose(actions, upstream_unnormalize(reference(policy, oft_no_proprio, [image]), stats["action"]), atol=1e-4, rtol=1e-4)


def test_inputs_match_the_openvla_path(libero, oft_libero, frame):
    """Same directory through the OpenVLA family: the same pixels, image tokens and prompt ids."""
    openvla = load_openvla_policy(oft_libero, device="cpu", dtype="float32")
    for crop in (False, True):
        obs = Observation(images={"primary": frame(4)}, state=np.zeros(8))
        from vla_runtime.config import SessionConfig

        oft_session = libero.new_session(INSTRUCTION, SessionConfig(center_crop=crop))
        ovla_session = openvla.new_session(INSTRUCTION, SessionConfig(center_crop=crop))
        (oft_pixels,), _ = oft_session.inputs(obs)
        ovla_pixels, _ = ovla_session.inputs(obs)
        torch.testing.assert_close(oft_pixels, ovla_pixels, rtol=0, atol=0)
        with torch.no_grad():
            torch.testing.assert_close(libero.model.embed_images([oft_pixels]), openvla.model.embed_image(ovla_pixels), rtol=0, atol=0)
    text = [s.ids for s in ovla_session.frame.segments if s.ids]
    assert (*text[0], *text[1]) == oft_session.prompt.input_ids


def test_bidirectional_pass_is_unmasked_attention_at_positions_from_zero():
    rope = RopeConfig(head_dim=8)
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(1, 4, 6, 8, generator=g), torch.randn(1, 2, 6, 8, generator=g), torch.randn(1, 2, 6, 8, generator=g)
    seam = BidirectionalPass(rope)
    out = seam.attend(0, q, k, v)
    seam.end_forward()
    inv = 1.0 / (10000.0 ** (torch.arange(0, 8, 2).double() / 8))
    f = torch.arange(6).double()[:, None] * inv
    cos, sin = torch.cat((f, f), -1).cos(), torch.cat((f, f), -1).sin()
    rot = lambda x: x.double() * cos + torch.cat((-x[..., 4:], x[..., :4]), -1).double() * sin  # noqa: E731
    kr, vr = rot(k).repeat_interleave(2, 1), v.double().repeat_interleave(2, 1)
    expected = ((rot(q) @ kr.transpose(-1, -2)) / 8**0.5).softmax(-1) @ vr
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)
    assert seam.attend(0, q[:, :, :3], k[:, :, :3], v[:, :, :3]).shape == (1, 4, 3, 8)  # a new length, new positions


def test_bounds_normalization_is_upstreams():
    stats = {"min": [-2.0, -1.0, 0.0], "max": [2.0, 3.0, 1.0], "q01": [-1.0, 0.0, 0.0], "q99": [1.0, 2.0, 1.0], "mask": [True, True, False]}
    x = np.array([[0.5, -0.25, 1.7], [-1.3, 1.2, 0.4]])
    for kind, keys in ((NormalizationType.BOUNDS, ("min", "max")), (NormalizationType.BOUNDS_Q99, ("q01", "q99"))):
        b = BoundsStats.from_dict(stats, kind, what="test")
        lo, hi = np.asarray(stats[keys[0]]), np.asarray(stats[keys[1]])
        np.testing.assert_allclose(b.unnormalize(x), np.where(stats["mask"], 0.5 * (x + 1) * (hi - lo + 1e-8) + lo, x))
        np.testing.assert_allclose(b.normalize(x * 3), upstream_normalize_proprio(x * 3, stats, *keys))
    with pytest.raises(ValueError, match="need `min` and `max` for BOUNDS"):
        BoundsStats.from_dict({"q01": [0.0], "q99": [1.0]}, NormalizationType.BOUNDS, what="action")
