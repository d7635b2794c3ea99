"""Whole-episode training (``window: 0``): padded length buckets that change nothing the real steps
compute, the parallel form at full episode length equal to streaming under a budget, and a run end to end."""

import json

import numpy as np
import pytest
import torch

from vla_finetune.data import IGNORE, TrainingData
from vla_finetune.trainer import Trainer
from vla_runtime.kv.budget import BudgetMode

from .conftest import gate_that_drops, make_config, training_and_streaming_hidden

# lengths (10, 10, 9, 10); chunk 4 and a budget of 2 chunks per layer: the budget binds within 3 steps
WHOLE = {"data": {"window": 0, "length_bucket": 4}, "kv": {"chunk": 4, "max_chunks": 2}}


@pytest.fixture(scope="module")
def trained(tiny_ckpt, tiny_dataset, tmp_path_factory):
    out = tmp_path_factory.mktemp("runs") / "whole"
    trainer = Trainer(make_config(tiny_ckpt, tiny_dataset, out, trainable="all", max_steps=2, lr=1e-3, **WHOLE))
    trainer.train()
    return trainer, out


def test_whole_episodes_are_padded_to_length_buckets_with_masked_targets(trained):
    trainer, _ = trained
    data = trainer.data
    assert [(w.start, w.steps) for w in data.windows] == [(0, 10), (0, 10), (0, 9), (0, 10)]
    assert {key[1] for key in data.buckets} == {12}  # every episode padded to 12 steps
    short = data.batch([2], np.random.default_rng(0))
    labels = short["labels"].view(12, -1)
    assert torch.all(labels[9:] == IGNORE) and torch.all(labels[:9] != IGNORE)
    layout = data.layouts[short["key"]]
    assert short["tokens"] == data.real_tokens(layout, data.windows[2]) < layout.n_tokens
    assert torch.equal(short["pixels"][0, 9], short["pixels"][0, 8])  # padding repeats the last frame


def test_padding_changes_no_loss_term(trained):
    """The 9-step episode padded to 12 steps and not padded at all: same cross-entropy, same targets."""
    trainer, _ = trained
    cfg = trainer.cfg
    terms = []
    for bucket in (1, 4):
        cfg.data.length_bucket = bucket
        data = TrainingData.prepare(cfg, trainer.policy, cache_dir=cfg.data.cache_dir, build_cache=False, progress=False)
        batch = data.batch([2], np.random.default_rng(0))
        layout = data.layouts[batch.pop("key")]
        batch.pop("tokens")
        with torch.no_grad():
            out = trainer.module(batch, layout, temperature=0.5)
        terms.append((layout.n_tokens, out["ce_sum"], out["targets"], out["correct"], out["loss"]))
    cfg.data.length_bucket = 4
    (n1, *real), (n4, *padded) = terms
    assert n4 > n1
    for a, b in zip(real, padded):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_full_episode_training_form_equals_streaming_under_the_budget(trained):
    """The whole (padded) episode through the training form at a near-zero temperature equals the runtime's
    cache fed the real forwards one by one, with a gate that drops chunks and a budget that evicts."""
    trainer, _ = trained
    with gate_that_drops(trainer.gate):
        parallel, streamed, cache, schedule = training_and_streaming_hidden(trainer, 2)
    assert schedule.n_chunks >= 10
    assert int(cache.gate_dropped.sum()) > 0 and int(cache.budget_dropped.sum()) > 0
    torch.testing.assert_close(parallel, streamed, atol=1e-4, rtol=1e-4)


def test_whole_episode_run_writes_a_budgeted_chunked_policy(trained):
    trainer, out = trained
    assert trainer.cfg.gate.budget is BudgetMode.HARD and "budget: hard" in (out / "finetune_config.yaml").read_text()
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert log and all(np.isfinite(r["loss"]) and r["tokens_per_s"] > 0 for r in log)
    kv = json.loads((out / "kv_config.json").read_text())["kv"]
    assert kv["max_chunks"] == 2 and kv["chunk"] == 4 and (out / "model.safetensors").is_file()


def test_change_weight_reweights_the_tokens_that_differ_from_the_previous_step(trained, monkeypatch):
    """``--change-weight W``: the loss is the W-weighted mean of the per-token cross-entropy, where the weight
    marks tokens that differ from the previous step's (what ``change_weights`` computes)."""
    from dataclasses import replace

    from vla_finetune.model import change_weights

    trainer, _ = trained
    module, data = trainer.module, trainer.data
    batch = data.batch([0, 2], np.random.default_rng(0))
    layout = data.layouts[batch.pop("key")]
    batch.pop("tokens")
    plain = module.loss
    with torch.no_grad():
        base = module(batch, layout, temperature=0.5)
    per_token = {}
    original = torch.nn.functional.cross_entropy

    def recording(*args, **kwargs):  # the forward's per-token cross-entropy, recorded as computed
        per_token["ce"] = original(*args, **kwargs)
        return per_token["ce"]

    monkeypatch.setattr(torch.nn.functional, "cross_entropy", recording)
    monkeypatch.setattr(module, "loss", replace(plain, change_weight=5.0))
    with torch.no_grad():
        weighted = module(batch, layout, temperature=0.5)
    labels = batch["labels"]
    valid = labels != IGNORE
    w = change_weights(labels, steps=batch["pixels"].shape[1], weight=5.0) * valid
    assert 0 < int((w > 1).sum()) < int(valid.sum())  # some tokens change, most repeat
    rows = 2 / trainer.cfg.batch_size
    retention = base["loss"] - rows * base["ce_sum"] / base["targets"]  # the retention term, the same in both
    expected = rows * (per_token["ce"].view_as(labels) * w).sum() / w.sum() + retention
    torch.testing.assert_close(weighted["loss"], expected)
    assert not torch.isclose(weighted["loss"], base["loss"])
    torch.testing.assert_close(weighted["ce_sum"], base["ce_sum"])  # the logged cross-entropy stays unweighted
