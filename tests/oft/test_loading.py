"""Telling an OFT directory apart and the errors a broken one gives: each names what is wrong."""

import shutil

import numpy as np
import pytest
import torch

from vla_runtime.api import Observation, detect_family, load_policy
from vla_runtime.checkpoints.openvla_oft import load_openvla_oft
from vla_runtime.config import SessionConfig
from vla_runtime.kv import KVConfig

HEAD = "action_head--150000_checkpoint.pt"


@pytest.fixture
def copy(oft_libero, tmp_path):
    """A private copy of the LIBERO checkpoint to break."""
    return shutil.copytree(oft_libero, tmp_path / "ckpt")


def _edit_head(path, edit):
    state = torch.load(path / HEAD, weights_only=True)
    edit(state)
    torch.save(state, path / HEAD)


def test_detection(copy):
    assert detect_family(copy) == "openvla-oft"
    (copy / HEAD).unlink()
    assert detect_family(copy) == "openvla"  # a plain OpenVLA directory stays OpenVLA


def test_missing_and_duplicate_action_head(copy):
    shutil.copy(copy / HEAD, copy / "action_head--50000_checkpoint.pt")
    with pytest.raises(ValueError, match="2 action_head checkpoints .*expected exactly one"):
        load_openvla_oft(copy)
    (copy / HEAD).unlink()
    (copy / "action_head--50000_checkpoint.pt").unlink()
    with pytest.raises(FileNotFoundError, match="no action_head--\\*checkpoint.pt"):
        load_openvla_oft(copy)


def test_head_missing_key_and_wrong_shape(copy):
    _edit_head(copy, lambda s: s.pop("module.model.mlp_resnet_blocks.1.ffn.1.bias"))
    with pytest.raises(ValueError, match=r"missing \['model.mlp_resnet_blocks.1.ffn.1.bias'\]"):
        load_policy(copy, device="cpu")
    _edit_head(copy, lambda s: s.__setitem__("module.model.mlp_resnet_blocks.1.ffn.1.bias", torch.zeros(3)))
    with pytest.raises(ValueError, match=r"`model.mlp_resnet_blocks.1.ffn.1.bias` has shape \[3\]; expected \[64\]"):
        load_policy(copy, device="cpu")


def test_head_from_another_backbone(copy):
    def widen(s):
        s["module.model.layer_norm1.weight"] = torch.ones(7 * 128)

    _edit_head(copy, widen)
    with pytest.raises(ValueError, match="896 features per action; expected llm_dim 64 x action_dim 7 = 448"):
        load_policy(copy, device="cpu")


def test_ddp_prefix_is_optional(copy, oft_libero, frame):
    _edit_head(copy, lambda s: [s.__setitem__(k.removeprefix("module."), s.pop(k)) for k in list(s)])
    obs = Observation(images={"primary": frame(0)}, state=np.zeros(8))
    a = load_policy(copy, device="cpu").new_session("go").step(obs).actions
    b = load_policy(oft_libero, device="cpu").new_session("go").step(obs).actions
    np.testing.assert_array_equal(a, b)


def test_a_weight_both_with_and_without_the_ddp_prefix_is_refused(copy):
    _edit_head(copy, lambda s: s.__setitem__("model.fc2.bias", torch.zeros_like(s["module.model.fc2.bias"])))
    with pytest.raises(ValueError, match=r"holds `model.fc2.bias` twice \(with and without the DDP prefix"):
        load_openvla_oft(copy)


def test_not_a_state_dict_and_unpicklable(copy):
    torch.save([torch.zeros(1)], copy / HEAD)
    with pytest.raises(ValueError, match="is not a state dict of tensors"):
        load_openvla_oft(copy)
    torch.save({"x": np.float64}, copy / HEAD, _use_new_zipfile_serialization=True)
    with pytest.raises(ValueError, match=f"cannot read {HEAD}"):
        load_openvla_oft(copy)


def test_noisy_projector_beside_an_l1_head(copy):
    torch.save({}, copy / "noisy_action_projector--150000_checkpoint.pt")
    with pytest.raises(ValueError, match=r"\(the diffusion variant\) but .* is an L1-regression head"):
        load_openvla_oft(copy)


def test_platform_choice(oft_libero, oft_no_proprio, caplog):
    with pytest.raises(ValueError, match="platform aloha has 14-D actions; the action head predicts 7"):
        load_policy(oft_libero, device="meta", platform="aloha")
    with pytest.raises(ValueError, match="platform 'mars' is not one of libero, bridge, aloha"):
        load_policy(oft_libero, device="meta", platform="mars")
    assert load_policy(oft_libero, device="meta").chunk_size == 8  # 7-D actions + 8-D proprio: LIBERO only
    with caplog.at_level("WARNING"):
        ambiguous = load_policy(oft_no_proprio, device="meta")  # 7-D actions, no proprio: LIBERO or Bridge
    assert ambiguous.chunk_size == 8 and ambiguous.checkpoint.platform.value == "libero"
    assert "fit libero, bridge; using libero" in caplog.text
    # without a proprio projector the weights cannot tell "trained without proprio" from "file left behind": said
    assert "no proprio_projector--*checkpoint.pt: the policy runs without proprioception" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING"):
        load_policy(oft_libero, device="meta")
    assert "without proprioception" not in caplog.text
    assert load_policy(oft_no_proprio, device="meta", platform="bridge").chunk_size == 5


def test_session_errors(oft_libero, frame):
    policy = load_policy(oft_libero, device="cpu")
    small = policy.new_session("go", SessionConfig(history="history", kv=KVConfig.of("full", capacity=40)))
    with pytest.raises(ValueError, match="FullCache is full: .* > capacity 40"):  # history mode: the cache's limits
        small.step(Observation(images={"primary": frame(0)}, state=np.zeros(8)))
    session = policy.new_session("go")
    with pytest.raises(ValueError, match=r"needs `state` \[8\], got None"):
        session.step(Observation(images={"primary": frame(0)}))
    with pytest.raises(ValueError, match=r"lacks camera\(s\) \['primary'\]"):
        session.step(Observation(images={"wrist": frame(0)}, state=np.zeros(8)))
    with pytest.raises(KeyError, match="not in the checkpoint's action statistics"):
        policy.new_session("go", SessionConfig(unnorm_key="nope"))
    with pytest.raises(ValueError, match="name a camera twice"):
        load_policy(oft_libero, device="meta", cameras=("primary", "primary"))
    with pytest.raises(ValueError, match="`num_images` must be 1, 2 or 3"):
        load_policy(oft_libero, device="meta", cameras=("primary", "a", "b", "c"))


def test_adapter_errors_name_the_directory(oft_libero, oft_no_proprio, tmp_path):
    with pytest.raises(FileNotFoundError, match="adapter directory .*nope does not exist"):
        load_policy(oft_libero, device="meta", adapter=tmp_path / "nope")
    with pytest.raises(ValueError, match="is not an OFT fine-tuning output: it has none of adapter_config.json"):
        load_policy(oft_libero, device="meta", adapter=tmp_path)
    shutil.copy(next(oft_libero.glob("proprio_projector--*")), tmp_path / "proprio_projector--10_checkpoint.pt")
    with pytest.raises(ValueError, match="is a proprio projector, but .* was trained without one"):
        load_policy(oft_no_proprio, device="meta", adapter=tmp_path)
