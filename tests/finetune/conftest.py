"""A tiny OpenVLA checkpoint (float32, 28 px, 4-D proprio) and a tiny LeRobot v3 dataset written with the
project's own writer, made once per session; ``finetune_config`` builds fast run configs."""

from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from vla_finetune.config import FinetuneConfig
from vla_finetune.layout import window_forwards
from vla_runtime.checkpoints.tiny_openvla import make_tiny_openvla
from vla_runtime.config import from_dict
from vla_runtime.data import DatasetFeatures, Episode, LeRobotWriter, WriterConfig
from vla_runtime.kv import make_cache
from vla_runtime.kv.chunked_parallel import ForwardSchedule, ParallelChunkedAttention

TASKS = ("reach the red block", "press the button on the wall")
ACTION_NAMES = ["dx", "dy", "dz", "droll", "dpitch", "dyaw", "gripper"]
# whole-episode training through a 2-chunk budget: the auxiliary-loss tests' run settings
WHOLE = {"data": {"window": 0, "length_bucket": 4}, "kv": {"chunk": 4, "max_chunks": 2}}
CUE_STEPS = [[2, 5], [], [8, 0, 1], [9]]  # per episode of the written dataset (unsorted on purpose)
LENGTHS = (10, 10, 9, 10)  # write_dataset's default episode lengths


@pytest.fixture(scope="session", autouse=True)
def _one_thread():  # session scope: also covers the module-scoped training fixtures
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def episode(
    rng: np.random.Generator,
    n: int,
    task: str,
    *,
    action_dim: int = 7,
    state_dim: int | None = 4,
    gripper_max: float = 1.0,
    size: int = 32,
) -> Episode:
    """Frames whose content moves with time; smooth deltas and a gripper that opens and closes."""
    t = np.arange(n)
    y, x = np.mgrid[0:size, 0:size]
    frames = np.stack([((x * 8 + y * 3 + 20 * s) % 256) for s in t]).astype(np.uint8)[..., None].repeat(3, axis=-1)
    frames = np.clip(frames.astype(int) + rng.integers(0, 16, frames.shape), 0, 255).astype(np.uint8)
    deltas = 0.02 * np.sin(0.7 * t[:, None] + np.arange(action_dim - 1)[None])
    action = np.concatenate([deltas, gripper_max * (t[:, None] % 4 < 2)], axis=1).astype(np.float32)
    state = None if state_dim is None else rng.normal(size=(n, state_dim)).astype(np.float32)
    return Episode(images={"front": frames}, state=state, action=action, task=task)


def write_dataset(
    root: Path,
    *,
    lengths=LENGTHS,
    action_dim: int = 7,
    state_dim: int | None = 4,
    gripper_max: float = 1.0,
    seed: int = 0,
    size: int = 32,
    cue_steps: list[list[int]] | None = None,
    separable_steps: list[list[int]] | None = None,
) -> Path:
    """A random dataset; ``cue_steps`` / ``separable_steps``: per episode, recorded as ``episode_cue_steps`` /
    ``episode_separable_steps`` (as ``collect`` does)."""
    rng = np.random.default_rng(seed)
    features = DatasetFeatures(
        cameras={"front": (size, size)},
        state_names=None if state_dim is None else [f"s{i}" for i in range(state_dim)],
        action_names=ACTION_NAMES[:action_dim] if action_dim <= 7 else [f"a{i}" for i in range(action_dim)],
    )
    with LeRobotWriter(root, features, WriterConfig(fps=10)) as writer:
        for i, n in enumerate(lengths):
            writer.add_episode(
                episode(rng, n, TASKS[i % 2], action_dim=action_dim, state_dim=state_dim, gripper_max=gripper_max, size=size),
                per_episode={
                    **({} if cue_steps is None else {"episode_cue_steps": cue_steps[i]}),
                    **({} if separable_steps is None else {"episode_separable_steps": separable_steps[i]}),
                } or None,
            )
    return root


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory) -> Path:
    """float32 on disk so a merged checkpoint reproduces base + adapter exactly."""
    return make_tiny_openvla(
        tmp_path_factory.mktemp("ckpt") / "tiny", dtype=torch.float32, image_size=28, proprio_dim=4
    )


@pytest.fixture(scope="session")
def tiny_dataset(tmp_path_factory) -> Path:
    return write_dataset(tmp_path_factory.mktemp("data") / "tiny-reach")


@pytest.fixture(scope="session")
def cue_dataset(tmp_path_factory) -> Path:
    """The tiny dataset with ``CUE_STEPS`` recorded per episode."""
    return write_dataset(tmp_path_factory.mktemp("data") / "cues", cue_steps=CUE_STEPS)


def training_batch(trainer, windows: list[int]) -> tuple[dict, object]:
    """The trainer's batch of ``windows`` (fixed augmentation seed) and its token layout, as a forward takes them."""
    batch = trainer.data.batch(windows, np.random.default_rng(0))
    layout = trainer.data.layouts[batch.pop("key")]
    batch.pop("tokens")
    return batch, layout


def outputs_with(module, batch, layout, monkeypatch, *, grad: bool = False, **loss_fields) -> dict:
    """``module``'s outputs on a ``training_batch`` at temperature 0.5 with fields of its loss settings changed
    (``cue_weight=0.0``: the loss without that term); the change lasts for the rest of the test."""
    monkeypatch.setattr(module, "loss", replace(module.loss, **loss_fields))
    with torch.set_grad_enabled(grad):
        return module(batch, layout, temperature=0.5)


def make_config(ckpt: Path, dataset: Path, out: Path, **overrides) -> FinetuneConfig:
    """Small, fast runs: 3-step windows, batches of 2, chunk 4 (chunks form every step). A nested override
    whose value is ``None`` removes that default (``kv={"mode": "full", "chunk": None}``)."""
    data = {
        "checkpoint": ckpt, "dataset": dataset, "out": out, "batch_size": 2, "max_steps": 4, "log_every": 2, "save_every": 100,
        "kv": {"chunk": 4}, "data": {"window": 3, "stride": 2, "cache_dir": out.parent / "frame-cache"},
    }  # fmt: skip
    for key, value in overrides.items():
        if isinstance(value, dict):
            nested = data.setdefault(key, {})
            nested.update(value)
            for k in [k for k, v in value.items() if v is None]:
                del nested[k]
        else:
            data[key] = value
    return from_dict(FinetuneConfig, data)


@torch.no_grad()
def training_and_streaming_hidden(trainer, index: int):
    """Hidden states at window ``index``'s real action targets two ways: the trainer's parallel form at a
    near-zero temperature (hard gates; padding included, as training runs it) and the runtime's cache fed
    the window's real forwards one by one. Returns (parallel, streamed, cache, schedule)."""
    data, module, vla = trainer.data, trainer.module, trainer.policy.model
    chunked = module.chunked
    batch = data.batch([index], np.random.default_rng(0))
    layout = data.layouts[batch.pop("key")]
    schedule = ForwardSchedule.build(layout.boundaries, layout.pinned, window=chunked.window, chunk=chunked.chunk)
    attn = ParallelChunkedAttention(schedule, trainer.gate, chunked, vla.language_model.cfg.rope, soft=True, temperature=1e-4)
    w = data.windows[index]
    real = layout.target_pos[: w.steps * data.action_dim]
    parallel = module.decode(module.embed(batch, layout)[0], attn)[:, real]
    rows = data._rows(w)[: w.steps]
    prev = int(data.action_ids[rows[0] - 1, -1]) if w.start else None
    forwards = window_forwards(
        data.prompts[w.episode], data.action_ids[rows].tolist(), history=True, has_proprio=True, prev_token=prev
    )
    pixels = module.pixels(batch)  # [1, S, C, H, W]
    images = [vla.embed_image(pixels[:, s]) for s in range(w.steps)]
    proprio = [vla.embed_proprio(batch["proprio"][:, s]) for s in range(w.steps)]
    cache = make_cache(trainer.kv, vla.language_model.cfg.geometry, gate=trainer.gate)
    hidden = [
        vla.language_model.model(inputs_embeds=vla.embed_forward(f, images=images, proprio=proprio), cache=cache, pin=f.pin)
        for f in forwards
    ]
    return parallel, torch.cat(hidden, dim=1)[:, real], cache, schedule


@contextmanager
def gate_that_drops(gate):
    """``gate`` (a ``ChunkGate`` or ``None``) with random readout weights, so it drops chunks; restored on exit."""
    if gate is None:
        yield
        return
    saved = {k: v.clone() for k, v in gate.state_dict().items()}
    torch.manual_seed(1)
    with torch.no_grad():
        gate.readout_weight.normal_(0.0, 3.0)
        gate.readout_bias.zero_()
    try:
        yield
    finally:
        gate.load_state_dict(saved)
