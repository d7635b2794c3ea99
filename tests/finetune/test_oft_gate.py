"""OpenVLA-OFT history mode with the chunked cache's gate trained (``vla_finetune``, ``kv: chunked``): the training
forward (the parallel form, query blocks not kept) at a near-zero temperature equals a streaming history session
step by step under a budget that binds; training changes the gate; the gate loads back for history sessions."""

import copy
import hashlib
import json

import numpy as np
import pytest
import torch

from vla_finetune.train import make_trainer
from vla_finetune.trainer import DistEnv
from vla_runtime.api import Observation, load_policy
from vla_runtime.checkpoints.tiny_openvla_oft import make_tiny_openvla_oft
from vla_runtime.config import HistoryMode, SessionConfig
from vla_runtime.kv import ChunkedGatedCache, ChunkGate, KVMode, make_cache

from .conftest import make_config, write_dataset

STEPS = 6
KV = {"chunk": 2, "window": 3, "max_chunks": 2}  # 5 observation tokens a step: a chunk or two close every step


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().cpu().contiguous().numpy().tobytes()).hexdigest()


@pytest.fixture(scope="module")
def gate_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("oft-gate")
    ckpt = make_tiny_openvla_oft(root / "tiny-oft", seed=5, image_size=28, dtype=torch.float32)
    dataset = write_dataset(root / "oft-reach", state_dim=8)
    cfg = make_config(ckpt, dataset, root / "run", max_steps=STEPS, log_every=2, lr=1e-3, batch_size=2, lora={"rank": 8},
                      kv=KV, data={"window": 4, "stride": 2}, gate={"lr": 5e-2, "retention_target": 0.3})  # fmt: skip
    trainer = make_trainer(cfg, DistEnv())
    assert trainer.gate is not None and trainer.kv.mode is KVMode.CHUNKED
    before = {name: digest(p) for name, p in trainer.gate.named_parameters()}
    trainer.train()
    return trainer, before, ckpt, root / "run"


def dropping(gate: ChunkGate) -> ChunkGate:
    """A copy whose scores straddle tau: some chunks dropped by the gate, the kept ones competing for the budget."""
    gate = copy.deepcopy(gate)
    torch.manual_seed(1)
    with torch.no_grad():
        gate.readout_weight.normal_(0.0, 3.0)
        gate.readout_bias.zero_()
    return gate


def observation(data, frame: int) -> Observation:
    return Observation(images={"primary": data.decoded.frames[frame]}, state=data.decoded.states[frame])


@torch.no_grad()
def parallel_and_streamed(trainer, gate: ChunkGate, index: int, instruction: str):
    """The head's rows of every step of window ``index`` two ways: the training forward at T = 1e-4 (hard gates)
    and a history session whose chunked cache holds ``gate``, fed the window's steps one by one (the same image
    and proprio embeddings). Returns ([S, K * A, dim], [S, K * A, dim], the session's cache)."""
    data, module = trainer.data, trainer.module
    module.eval()
    batch = data.batch([index], np.random.default_rng(0))
    saved, module.gate = module.gate, gate
    try:
        parallel, _ = module.history_hidden(batch, temperature=1e-4)
    finally:
        module.gate = saved
    session = trainer.policy.new_session(instruction, SessionConfig(history=HistoryMode.HISTORY, kv=trainer.kv))
    session.cache = make_cache(session.kv_config, trainer.policy.gate_geometry, gate=gate)
    model, streamed = session.policy.model, []
    for i in range(batch["pixels"].shape[1]):
        image = model.embed_images([batch["pixels"][:, i]])
        streamed.append(session._history_hidden(image, model.embed_proprio(batch["proprio"][:, i]))[0])
    return parallel[0], torch.stack(streamed), session.cache


@pytest.mark.parametrize("which", ["trained", "untrained", "dropping"])
def test_training_forward_equals_the_streamed_chunked_session(gate_run, which):
    trainer, _, _, _ = gate_run
    gates = {
        "trained": lambda: trainer.gate, "untrained": lambda: ChunkGate(trainer.gate.cfg), "dropping": lambda: dropping(trainer.gate),
    }  # fmt: skip
    segment = trainer.data.segments[1]
    index = next(i for i, s in enumerate(trainer.data.samples) if s.frame == segment[0])  # a window at a segment start
    parallel, streamed, cache = parallel_and_streamed(trainer, gates[which](), index, segment[2])
    torch.testing.assert_close(parallel, streamed, atol=1e-4, rtol=1e-4)
    stats = (cache.chunks_formed, int(cache.gate_dropped.sum()), int(cache.budget_dropped.sum()))
    assert cache.chunks_formed > KV["max_chunks"], stats
    if which != "trained":  # the default gate keeps every chunk, the dropping one some: both fill the budget
        assert stats[2] > 0, stats  # the budget bound within the window
    if which == "dropping":
        assert stats[1] > 0, stats


def test_training_changes_the_gate_and_logs_retention(gate_run):
    trainer, before, _, out = gate_run
    after = {name: digest(p) for name, p in trainer.gate.named_parameters()}
    changed = {n for n in before if before[n] != after[n]}
    assert {"tau", "readout_weight", "key_aggregator.fc2_weight", "value_aggregator.fc2_weight"} <= changed, changed
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [2, 4, 6]
    assert all(0 < r["kept_ratio"] < 1 and 0 <= r["hard_kept"] <= 1 and r["temperature"] > 0 for r in log)
    assert log[-1]["temperature"] < log[0]["temperature"]  # the anneal toward hard gates


def test_the_gate_loads_back_for_history_sessions(gate_run):
    trainer, _, ckpt, out = gate_run
    assert {"gates.safetensors", "kv_config.json", "session_config.json"} <= {p.name for p in out.iterdir()}
    policy = load_policy(ckpt, adapter=out, device="cpu", dtype="float32")
    assert policy.kv_gate is not None
    for name, p in trainer.gate.state_dict().items():
        torch.testing.assert_close(policy.kv_gate.state_dict()[name], p, atol=0, rtol=0, msg=name)
    data = trainer.data
    index = next(i for i, s in enumerate(data.samples) if s.frame == data.segments[1][0])
    session = policy.new_session(data.segments[1][2])
    assert session.history and isinstance(session.cache, ChunkedGatedCache) and session.cache.gate is policy.kv_gate
    trainer.module.eval()
    with torch.no_grad():
        trained = trainer.module.predict(data.batch([index], np.random.default_rng(0)), temperature=1e-4)[0].numpy()
    untrained = load_policy(ckpt, adapter=out, device="cpu", dtype="float32")
    untrained.kv_gate = ChunkGate(policy.kv_gate.cfg)  # the default gate: mean pooling, keeps every chunk
    default = untrained.new_session(data.segments[1][2])
    differs = 0.0
    for i, frame in enumerate(data.frames_of(data.samples[index])):
        actions = session.step(observation(data, frame)).actions
        np.testing.assert_allclose(actions, session.action_stats.unnormalize(trained[i]), atol=1e-4, rtol=1e-4)
        differs = max(differs, float(np.abs(default.step(observation(data, frame)).actions - actions).max()))
    assert differs > 1e-4  # the trained gate, not the default, shapes what the session holds
