"""Dataset statistics that would un-normalise actions into NaN, nonsense or a traceback are refused with one
ValueError naming the dataset key and the statistic: non-finite values, low > high, a mask that is not booleans,
a dataset without an ``action`` mapping. OpenVLA, CogACT and OpenVLA-OFT sessions all read them this way."""

import json

import pytest

from vla_runtime.api import load_policy
from vla_runtime.checkpoints.tiny_openvla import BRIDGE_ACTION, make_tiny_openvla
from vla_runtime.checkpoints.tiny_openvla_oft import make_tiny_openvla_oft
from vla_runtime.checkpoints.tiny_prismatic import make_tiny_cogact
from vla_runtime.models.openvla_oft.configuration_oft import NormalizationType
from vla_runtime.models.openvla_oft.normalization_oft import BoundsStats
from vla_runtime.models.prismatic.processing_prismatic import ActionStats

NAN, INF = float("nan"), float("inf")


def edited(**changes) -> dict:
    return {**BRIDGE_ACTION, **changes}


@pytest.mark.parametrize(
    "stats, match",
    [
        (edited(q01=[NAN] + BRIDGE_ACTION["q01"][1:]), r"bridge_orig action statistic `q01` has non-finite values \[nan\] at dim\(s\) \[0\]"),
        (edited(q99=[INF] * 7), r"`q99` has non-finite values \[inf, .*expected finite numbers"),
        (edited(q01=[1.0] * 7), r"`q01` > `q99` at dim\(s\) \[0, 1, 2, 3, 4, 5\]; expected q01 <= q99"),
        (edited(q01=["a"] * 7), r"`q01` must be a list of numbers"),
        (edited(q99=[[1.0], [2.0, 3.0]]), r"`q99` must be a list of numbers"),
        (edited(mask=["false"] * 7), r"`mask` must be a list of booleans"),
        (edited(mask=[1] * 7), r"`mask` must be a list of booleans"),
        (edited(mask=[True] * 6), r"mismatched shapes"),
        ([1, 2], r"bridge_orig action statistics must be a mapping"),
    ],
)
def test_action_stats_refuse_bad_values(stats, match):
    with pytest.raises(ValueError, match=match):
        ActionStats.from_dict(stats, what="bridge_orig action")


def test_bounds_stats_refuse_bad_values():
    bounds = {"min": [0.0, NAN], "max": [1.0, 1.0]}
    with pytest.raises(ValueError, match=r"aloha action statistic `min` has non-finite values \[nan\] at dim\(s\) \[1\]"):
        BoundsStats.from_dict(bounds, NormalizationType.BOUNDS, what="aloha action")
    with pytest.raises(ValueError, match=r"`min` > `max` at dim\(s\) \[0\]"):
        BoundsStats.from_dict({"min": [2.0], "max": [1.0]}, NormalizationType.BOUNDS, what="aloha action")
    with pytest.raises(ValueError, match=r"need `q01` and `q99` for BOUNDS_Q99"):
        BoundsStats.from_dict(bounds, NormalizationType.BOUNDS_Q99, what="aloha action")
    ok = BoundsStats.from_dict({"q01": [0, -1], "q99": [0, 1]}, NormalizationType.BOUNDS_Q99, what="x")  # equal bounds are fine
    assert ok.mask.all() and ok.low.dtype.kind == "f"


def nan_q01(stats: dict) -> None:
    for entry in stats.values():
        entry["action"]["q01"][0] = NAN


@pytest.mark.parametrize(
    "edit, match",
    [
        (nan_q01, r"bridge_orig action statistic `q01` has non-finite values"),
        (lambda s: s["bridge_orig"].pop("action"), r"dataset statistics 'bridge_orig' have no `action` entry"),
        (lambda s: s["bridge_orig"].__setitem__("action", [1, 2]), r"'bridge_orig' `action` must be a mapping"),
        (lambda s: s.__setitem__("bridge_orig", [1]), r"'bridge_orig' must map quantities to statistics"),
    ],
)
def test_openvla_and_cogact_sessions_refuse_bad_statistics(tmp_path, edit, match):
    for path in (make_tiny_openvla(tmp_path / "openvla", seed=0), make_tiny_cogact(tmp_path / "cogact", seed=0)):
        file = path / "dataset_statistics.json"
        stats = json.loads(file.read_text()) if file.is_file() else json.loads((path / "config.json").read_text())["norm_stats"]
        edit(stats)
        file.write_text(json.dumps(stats))
        policy = load_policy(path, device="meta")
        with pytest.raises(ValueError, match=match):
            policy.new_session("pick up the cup")


def test_oft_session_refuses_nan_proprio_statistics(tmp_path):
    path = make_tiny_openvla_oft(tmp_path / "oft", seed=0)
    file = path / "dataset_statistics.json"
    stats = json.loads(file.read_text())
    (key,) = stats
    stats[key]["proprio"]["q99"][2] = NAN
    file.write_text(json.dumps(stats))
    with pytest.raises(ValueError, match=rf"{key} proprio statistic `q99` has non-finite values \[nan\] at dim\(s\) \[2\]"):
        load_policy(path, device="meta").new_session("pick up the cup")
