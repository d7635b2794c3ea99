"""OpenVLAPolicy / session behaviour: inputs, modes, the KV seam wiring, devices and dtypes."""

import numpy as np
import pytest
import torch

from vla_runtime import kv as kv_module
from vla_runtime.api import FAMILIES, Observation, Policy, load_policy
from vla_runtime.config import SessionConfig
from vla_runtime.device import resolve_dtype
from vla_runtime.kv import ChunkedGatedParams, FullCache, FullParams, KVConfig, KVMode, SinkWindowParams
from vla_runtime.policies.openvla import OpenVLAPolicy


def obs(image, state=None):
    return Observation(images={"primary": image}, state=state)


def test_family_is_registered_and_result_has_timings_and_kv(tiny_openvla, frame):
    policy = load_policy(tiny_openvla)
    assert "openvla" in FAMILIES and isinstance(policy, OpenVLAPolicy) and isinstance(policy, Policy)
    assert policy.dtype == torch.float32 and policy.device.type == "cpu"  # CPU default float32
    result = policy.new_session("open the drawer").step(obs(frame(0)))
    assert result.actions.shape == (1, 7) and result.actions.dtype == np.float64
    assert set(result.timings) == {"vision", "prefill", "decode", "total"}
    assert result.timings["total"] >= result.timings["vision"] + result.timings["prefill"] + result.timings["decode"]
    prompt_len = len(policy.tokenizer.prompt("open the drawer").input_ids)
    assert result.kv.tokens_raw == prompt_len + 16 + 6  # [BOS] + image + prompt + 29871, then 6 fed tokens


def test_dtype_defaults_per_device():
    assert resolve_dtype(None, torch.device("cpu")) == torch.float32
    assert resolve_dtype(None, torch.device("cuda")) == torch.bfloat16
    assert resolve_dtype("bf16", torch.device("cpu")) == torch.bfloat16
    with pytest.raises(KeyError, match="unknown dtype 'int4'"):
        resolve_dtype("int4", torch.device("cpu"))


def test_bfloat16_on_cpu_runs_and_stays_close(tiny_openvla, frame):
    image = frame(4)
    f32 = load_policy(tiny_openvla, device="cpu").new_session("lift the cup").step(obs(image))
    bf16 = load_policy(tiny_openvla, device="cpu", dtype="bfloat16")
    assert next(bf16.model.parameters()).dtype == torch.bfloat16
    result = bf16.new_session("lift the cup").step(obs(image))
    assert result.actions.shape == f32.actions.shape and np.isfinite(result.actions).all()


@pytest.mark.parametrize(
    "image, message",
    [
        (np.zeros((32, 32), np.uint8), "uint8 \\[H, W, 3\\]"),
        (np.zeros((32, 32, 3), np.float32), "dtype float32"),
        (np.zeros((32, 32, 4), np.uint8), "shape \\(32, 32, 4\\)"),
        ([[0, 0, 0]], "numpy uint8 array"),
    ],
)
def test_bad_images_are_rejected_with_what_was_expected(tiny_openvla, image, message):
    session = load_policy(tiny_openvla).new_session("push the puck")
    with pytest.raises(ValueError, match=message):
        session.step(obs(image))


def test_missing_camera_is_named(tiny_openvla, frame):
    session = load_policy(tiny_openvla).new_session("push the puck")
    with pytest.raises(ValueError, match="no 'primary' image; cameras given: \\['wrist'\\]"):
        session.step(Observation(images={"wrist": frame(0)}))


def test_proprio_token_is_used_and_checked(tiny_openvla_proprio, frame):
    policy = load_policy(tiny_openvla_proprio)
    session = policy.new_session("reach the peg")
    image = frame(8)
    with pytest.raises(ValueError, match="needs `state` \\[8\\]"):
        session.step(obs(image))
    with pytest.raises(ValueError, match="shape \\(3,\\); this policy expects \\[8\\]"):
        session.step(obs(image, np.zeros(3)))
    a = session.step(obs(image, np.full(8, -0.5)))
    b = session.step(obs(image, np.full(8, 0.9)))
    assert a.kv.tokens_raw == b.kv.tokens_raw == len(session.prompt.input_ids) + 16 + 1 + 6
    assert not np.array_equal(a.actions, b.actions)  # the state reaches the model


def test_history_mode_grows_one_step_at_a_time_and_reset_forgets(tiny_openvla, frame):
    policy = load_policy(tiny_openvla)
    session = policy.new_session("slide the block", SessionConfig(history="history"))
    prompt = session.prompt
    pinned = 1 + len(prompt.instruction)
    per_step = 16 + len(prompt.out) + 1 + 6
    sizes, first = [], None
    for s in range(3):
        result = session.step(obs(frame(30 + s)))
        first = first if first is not None else result.actions
        sizes.append(result.kv.tokens_raw)
    assert sizes == [pinned + per_step, pinned + 2 * per_step + 1, pinned + 3 * per_step + 2]
    session.reset()
    again = session.step(obs(frame(30)))
    assert again.kv.tokens_raw == sizes[0] and np.array_equal(again.actions, first)
    session.reset("put the mug on top of the cabinet")
    assert session.instruction == "put the mug on top of the cabinet" and len(session.prompt.instruction) != len(prompt.instruction)
    assert session.step(obs(frame(30))).kv.tokens_raw == 1 + len(session.prompt.instruction) + per_step


def recording_cache(params_class, made: list):
    """Stands in for a registered cache class (same ``params_class``) to see what the session passes to it
    through ``make_cache`` (the registry's constructor contract); it builds a ``FullCache``."""

    def build(geometry, params, *, batch, device, dtype, **extra):
        made.append((params, extra))
        return FullCache(geometry, FullParams(capacity=params.capacity), batch=batch, device=device, dtype=dtype)

    build.params_class = params_class
    return build


def test_sessions_build_caches_through_make_cache_with_the_gate_only_when_it_asks(tiny_openvla, frame, monkeypatch):
    made = []
    monkeypatch.setitem(kv_module.CACHES, "chunked", recording_cache(ChunkedGatedParams, made))
    monkeypatch.setitem(kv_module.CACHES, "sink_window", recording_cache(SinkWindowParams, made))
    policy = load_policy(tiny_openvla)
    policy.kv_gate = torch.nn.Identity()  # whatever the owner hands over
    chunked = policy.new_session("pour the bottle", SessionConfig(kv=KVConfig(KVMode.CHUNKED), history="history"))
    chunked.step(obs(frame(0)))
    sink = policy.new_session("pour the bottle", SessionConfig(kv=KVConfig.of(KVMode.SINK_WINDOW, window=40), history="history"))
    (params_chunked, extra_chunked), (params_sink, extra_sink) = made
    one_step = 16 + len(chunked.prompt.out) + 1 + 1 + 6  # prev token + image + "\nOut:" + 29871 + 6 fed tokens
    assert params_chunked.window == one_step and params_chunked.capacity is None
    # an eager session's store grows with its episode (``tests/kv/test_growth.py``)
    assert extra_chunked == {"gate": policy.kv_gate, "grow": True} and extra_sink == {"grow": True}
    assert params_sink.window == 40 and isinstance(sink.cache, FullCache)


def test_full_cache_capacity_in_history_mode_is_the_model_limit(tiny_openvla, frame):
    policy = load_policy(tiny_openvla, kv=KVConfig.of(KVMode.FULL, capacity=90))
    session = policy.new_session("wipe the table", SessionConfig(kv=policy.kv, history="history"))
    session.step(obs(frame(0)))
    session.step(obs(frame(1)))
    with pytest.raises(ValueError, match="FullCache is full"):
        for s in range(5):
            session.step(obs(frame(2 + s)))


def test_adapter_is_not_accepted_yet(tiny_openvla):
    with pytest.raises(ValueError, match="adapter"):
        load_policy(tiny_openvla, adapter=tiny_openvla)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_defaults_to_bfloat16_and_agrees_with_cpu_tokens_mostly(tiny_openvla, frame):
    gpu = load_policy(tiny_openvla, device="cuda")
    assert gpu.dtype == torch.bfloat16 and next(gpu.model.parameters()).is_cuda
    image = frame(9)
    result = gpu.new_session("open the drawer").step(obs(image))
    assert np.isfinite(result.actions).all() and result.timings["total"] > 0
    full = load_policy(tiny_openvla, device="cuda", dtype="float32").new_session("open the drawer")
    cpu = load_policy(tiny_openvla, device="cpu").new_session("open the drawer")
    full.step(obs(image))
    cpu.step(obs(image))
    assert np.array_equal(full.last_tokens, cpu.last_tokens)
