"""``HistoryMode.OBSERVATIONS``: each step's action tokens are decoded inside a mark and rolled back. The
training forms (a mask for the full cache, causal query blocks for the chunked one) equal the runtime's
cache streamed that way over whole episodes; a session in this mode holds frames only."""

import numpy as np
import pytest
import torch

from vla_finetune.layout import window_forwards
from vla_finetune.observation_form import chunked_form, masked_form, positions_and_mask
from vla_finetune.trainer import Trainer
from vla_runtime.api import Observation, load_policy
from vla_runtime.config import HistoryMode, SessionConfig
from vla_runtime.kv import KVConfig, make_cache

from .conftest import gate_that_drops, make_config

# lengths (10, 10, 9, 10); chunk 4 and a budget of 2 chunks per layer: the budget binds within 3 steps
WHOLE = {"history": "observations", "data": {"window": 0, "length_bucket": 4}}


@pytest.fixture(scope="module", params=["chunked", "full"])
def trained(request, tiny_ckpt, tiny_dataset, tmp_path_factory):
    out = tmp_path_factory.mktemp("runs") / f"observations-{request.param}"
    kv = {"mode": request.param, **({"max_chunks": 2} if request.param == "chunked" else {"chunk": None})}
    cfg = make_config(tiny_ckpt, tiny_dataset, out, trainable="all", max_steps=2, lr=1e-3, kv=kv, **WHOLE)
    trainer = Trainer(cfg)
    trainer.train()
    return trainer, out


@torch.no_grad()
def streamed_and_parallel(trainer, index: int):
    """Hidden states at window ``index``'s real action targets: the training form (hard gates) and the
    runtime's cache fed the frames and, inside a mark rolled back after each step, the decode forwards."""
    data, module, vla = trainer.data, trainer.module, trainer.policy.model
    batch = data.batch([index], np.random.default_rng(0))
    layout = data.layouts[batch.pop("key")]
    rope = vla.language_model.cfg.rope
    if module.gate is None:
        form = masked_form(layout, rope, torch.device("cpu"))
    else:
        form = chunked_form(layout, module.gate, module.chunked, rope, temperature=1e-4, budget=module.loss.budget)
    w = data.windows[index]
    real = layout.target_pos[: w.steps * data.action_dim]
    parallel = module.decode(module.embed(batch, layout)[0], form)[:, real]
    rows = data._rows(w)[: w.steps]
    forwards = window_forwards(data.prompts[w.episode], data.action_ids[rows].tolist(), history=True,
                               has_proprio=True, prev_token=None, keep_actions=False)  # fmt: skip
    pixels = module.pixels(batch)
    images = [vla.embed_image(pixels[:, s]) for s in range(w.steps)]
    proprio = [vla.embed_proprio(batch["proprio"][:, s]) for s in range(w.steps)]
    extra = {} if module.gate is None else {"gate": module.gate}
    cache = make_cache(trainer.kv, vla.language_model.cfg.geometry, **extra)
    decoder = vla.language_model.model
    hidden, mark = [], None
    for f in forwards:
        has_image = any(s.kind.name == "IMAGE" for s in f.segments)
        if has_image and mark is not None:
            cache.rollback(mark)  # the step before: its decodes leave the cache
        hidden.append(decoder(inputs_embeds=vla.embed_forward(f, images=images, proprio=proprio), cache=cache, pin=f.pin))
        if has_image:
            mark = cache.mark()
    return parallel, torch.cat(hidden, dim=1)[:, real], layout, cache


def test_the_training_form_equals_the_cache_streamed_with_each_steps_decodes_rolled_back(trained):
    trainer, _ = trained
    gate = trainer.module.gate
    with gate_that_drops(gate):  # a gate that drops chunks, and a budget that evicts
        parallel, streamed, layout, cache = streamed_and_parallel(trainer, 2)
    assert not layout.keeps_all and sum(not k for k in layout.kept) == 12 * (trainer.data.action_dim - 1)
    if gate is not None:
        assert int(cache.gate_dropped.sum()) > 0 and int(cache.budget_dropped.sum()) > 0
    torch.testing.assert_close(parallel, streamed, atol=1e-4, rtol=1e-4)


def test_with_actions_kept_the_same_episode_trains_on_another_sequence(trained):
    """The observation layout is not the history one: no frame starts with the previous action token."""
    trainer, _ = trained
    data = trainer.data
    assert not data.keep_actions
    layout = data.layouts[data.bucket_key(data.windows[0])]
    frames = [n for n, kept in zip(layout.boundaries, layout.kept) if kept][1:]  # after the prompt
    with_actions = window_forwards(data.prompts[0], data.action_ids[:3].tolist(), history=True, has_proprio=True,
                                   prev_token=None)  # fmt: skip
    n_image = data.n_image_tokens
    assert len(set(frames)) == 1 and with_actions[1 + data.action_dim].length(n_image) == frames[0] + 1


def test_positions_reuse_the_rolled_back_slots_and_blocks_see_only_themselves():
    from vla_finetune.layout import FlatLayout

    empty = torch.zeros(0, dtype=torch.long)
    layout = FlatLayout((2, 3, 1, 1, 3, 1, 1), 2, empty, empty, empty, empty, (True, True, False, False, True, False, False))
    positions, mask = positions_and_mask(layout)
    assert positions.tolist() == [0, 1, 2, 3, 4, 5, 6, 5, 6, 7, 8, 9]
    first_block, second_frame, second_block = [5, 6], [7, 8, 9], [10, 11]
    assert mask[6, first_block].all() and not mask[second_frame][:, first_block].any()
    assert not mask[second_block][:, first_block].any() and mask[11, second_block].all() and not mask[10, 11]
    assert mask[second_block][:, :5].all() and mask[second_block][:, second_frame].all()


def test_a_session_in_observations_mode_holds_frames_only(trained):
    trainer, out = trained
    if trainer.module.gate is not None:
        pytest.skip("one cache is enough: the full cache counts every token it holds")
    policy = load_policy(out, device="cpu")
    rng = np.random.default_rng(0)
    obs = [Observation(images={"primary": rng.integers(0, 255, (32, 32, 3), dtype=np.uint8)},
                       state=rng.normal(size=4).astype(np.float32)) for _ in range(4)]  # fmt: skip
    held = {}
    for mode in (HistoryMode.HISTORY, HistoryMode.OBSERVATIONS):
        session = policy.new_session("reach the red block", SessionConfig(kv=KVConfig.from_dict({"mode": "full"}), history=mode))
        first = session.step(obs[0]).actions
        for o in obs[1:]:
            session.step(o)
        held[mode] = (session.cache.stats().tokens_seen, first)
    (history, first_h), (observations, first_o) = held[HistoryMode.HISTORY], held[HistoryMode.OBSERVATIONS]
    # 4 steps: history keeps 3 prev-action tokens in front of frames 2-4 and every step's 6 fed decodes
    assert history - observations == 3 + 4 * (policy.config.action_dim - 1)
    np.testing.assert_array_equal(first_h, first_o)  # the first step sees the same context in both modes
