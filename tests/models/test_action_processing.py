"""Post-processing with un-normalisation masks, CogACT's adaptive ensemble, HybridVLA's AR tokens and ensemble."""

import math

import numpy as np
import pytest

from vla_runtime.models.action_postprocess import postprocess_actions
from vla_runtime.models.cogact.configuration_cogact import AdaptiveEnsembleConfig
from vla_runtime.models.cogact.processing_cogact import AdaptiveEnsembler, ensemble_weights
from vla_runtime.models.hybridvla.configuration_hybridvla import CollaborativeEnsembleConfig
from vla_runtime.models.hybridvla.processing_hybridvla import (
    ar_action_tokenizer,
    ar_is_confident,
    collaborative_ensemble,
    quat_xyzw_to_euler_xyz,
)
from vla_runtime.models.prismatic.processing_prismatic import ActionStats

BRIDGE = {  # bridge_orig action statistics (OpenVLA's dataset_statistics.json)
    "q01": [-0.028727, -0.041703, -0.026094, -0.080921, -0.092887, -0.207183, 0.0],
    "q99": [0.028310, 0.040855, 0.040162, 0.081920, 0.077929, 0.203826, 1.0],
    "mask": [True] * 6 + [False],
}


def test_postprocess_unnormalises_masked_dims_and_keeps_the_gripper_binary():
    stats = ActionStats.from_dict(BRIDGE, what="bridge_orig action")
    raw = np.array([[-1.0] * 6 + [0.2], [1.0] * 6 + [0.9], [0.0] * 6 + [0.5], [2.0, -3.0, 0, 0, 0, 0, 0.49]])
    out = postprocess_actions(raw, stats)
    np.testing.assert_allclose(out[0, :6], BRIDGE["q01"][:6])
    np.testing.assert_allclose(out[1, :6], BRIDGE["q99"][:6])
    np.testing.assert_allclose(out[2, :6], (np.array(BRIDGE["q01"]) + np.array(BRIDGE["q99"]))[:6] / 2)
    assert out[3, 0] == pytest.approx(BRIDGE["q99"][0]) and out[3, 1] == pytest.approx(BRIDGE["q01"][1])  # clipped first
    assert out[:, 6].tolist() == [0.0, 1.0, 1.0, 0.0]  # mask False: binarised (0 if x < 0.5 else 1), not scaled
    with pytest.raises(ValueError, match="6 dims; the statistics have 7"):
        postprocess_actions(raw[:, :6], stats)


def test_missing_mask_scales_every_dim():
    stats = ActionStats.from_dict({"q01": [0.0, -2.0, 0.0], "q99": [4.0, 2.0, 10.0]}, what="action")
    np.testing.assert_allclose(postprocess_actions(np.array([0.0, 0.0, 0.7]), stats), [2.0, 0.0, 10.0])  # gripper too


def test_adaptive_ensemble_weights_on_a_hand_made_example():
    a_new = np.array([1.0, 0, 0, 0, 0, 0, 1])
    a_old = np.array([0.0, 1, 0, 0, 0, 0, 1])  # cos(a_old, a_new) = 1/2 (gripper dim included)
    w = ensemble_weights(np.stack([a_old, a_new]), alpha=0.1)
    np.testing.assert_allclose(w, [1 / (1 + math.exp(0.05)), 1 / (1 + math.exp(-0.05))], rtol=1e-6)
    assert w[0] == pytest.approx(0.4875026, abs=1e-7)


def test_adaptive_ensembler_takes_row_j_of_the_chunk_from_j_steps_ago():
    ens = AdaptiveEnsembler(AdaptiveEnsembleConfig(horizon=3, alpha=0.1))
    chunks = [np.full((16, 7), 0.0) for _ in range(4)]
    for k, c in enumerate(chunks):
        c[:, :6] = (k + 1) * 10 + np.arange(16)[:, None]  # chunk k, row r -> value 10(k+1) + r
        c[:, 6] = 1.0
    first = ens(chunks[0])
    np.testing.assert_allclose(first, chunks[0][0])  # one prediction: itself
    ens(chunks[1])
    ens(chunks[2])
    out = ens(chunks[3])  # deque keeps chunks 1, 2, 3 -> rows 2, 1, 0
    candidates = np.stack([chunks[1][2], chunks[2][1], chunks[3][0]])
    np.testing.assert_allclose(out, ensemble_weights(candidates, 0.1) @ candidates)
    assert len(ens) == 3
    ens.reset()
    assert len(ens) == 0


def test_ensemble_rebinarises_gripper_with_half_closed():
    ens = AdaptiveEnsembler(AdaptiveEnsembleConfig(horizon=2, alpha=0.0))  # alpha 0: plain mean
    c0, c1 = np.zeros((16, 7)), np.zeros((16, 7))
    c0[:, 0], c1[:, 0] = 1.0, 1.0
    c0[1, 6], c1[0, 6] = 1.0, 0.0  # open then closed -> mean 0.5 -> deploy.py's `> 0.5` gives 0
    ens(c0)
    assert ens(c1)[6] == 0.0


CODEC = ar_action_tokenizer()


def test_ar_token_bin_golden_values_and_round_trip():
    assert (CODEC.first_id, CODEC.last_id) == (31744, 31999)
    assert CODEC.normalized(np.array([31999]))[0] == pytest.approx(-1 + 1 / 255)
    assert CODEC.normalized(np.array([31872]))[0] == pytest.approx(0.0, abs=1e-12)
    ids = np.arange(31745, 32000)
    np.testing.assert_array_equal(CODEC.encode(CODEC.normalized(ids)), ids)
    assert CODEC.normalized(np.array([31744]))[0] == CODEC.normalized(np.array([31745]))[0]  # bins 256, 255 share a centre
    a = np.random.default_rng(0).uniform(-1, 1, (50, 7))
    assert np.abs(CODEC.normalized(CODEC.encode(a)) - a).max() <= 1 / 255 + 1e-12  # within half a bin (2/255)


def test_need_to_sub_shifts_the_token_range():
    shifted = ar_action_tokenizer(need_to_sub=7)
    assert (shifted.first_id, shifted.last_id) == (31737, 31992)
    a = np.array([0.3, -0.7])
    np.testing.assert_array_equal(shifted.encode(a), CODEC.encode(a) - 7)
    np.testing.assert_allclose(shifted.normalized(shifted.encode(a)), CODEC.normalized(CODEC.encode(a)))


def test_collaborative_ensemble_code_rule_vs_paper_rule():
    conf = np.array([0.97] * 6 + [0.1])  # first six sum to 5.82 > 5.8; mean of all 0.846 < 0.96
    diff = np.array([0.1, 0.2, 0.3, 0.0, 0.0, 0.0, 1.0])
    ar = np.array([0.3, 0.2, 0.1, 0.0, 0.0, 0.2, 0.0])
    action, used = collaborative_ensemble(diff, ar, conf, CollaborativeEnsembleConfig())
    assert used
    np.testing.assert_allclose(action[:6], (diff[:6] + ar[:6]) / 2)
    assert action[6] == 0.0  # mean 0.5 -> sim.py's `1 if > 0.5 else 0`
    action, used = collaborative_ensemble(diff, ar, conf, CollaborativeEnsembleConfig(rule="paper"))
    assert not used and np.array_equal(action, diff)
    assert not ar_is_confident(np.array([0.96] * 6 + [1.0]), CollaborativeEnsembleConfig())  # 5.76 <= 5.8
    assert ar_is_confident(np.full(7, 0.97), CollaborativeEnsembleConfig(rule="paper"))
    with pytest.raises(KeyError, match="code, paper"):
        CollaborativeEnsembleConfig(rule="vote")


def test_quaternion_to_extrinsic_xyz_euler_matches_scipy():
    from scipy.spatial.transform import Rotation

    rng = np.random.default_rng(0)
    for euler in [*rng.uniform(-3.0, 3.0, (20, 3)) * [1.0, 0.5, 1.0], [-3.1416, 0.2423, 3.1416]]:
        quat = Rotation.from_euler("xyz", euler).as_quat()  # [x, y, z, w]
        ours = quat_xyzw_to_euler_xyz(quat)
        np.testing.assert_allclose(Rotation.from_euler("xyz", ours).as_matrix(), Rotation.from_quat(quat).as_matrix(), atol=1e-9)
        np.testing.assert_allclose(ours, Rotation.from_quat(quat).as_euler("xyz"), atol=1e-9)
