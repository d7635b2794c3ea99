"""The parallel (training) form reproduces streaming inference, and trains."""

import bisect
import math

import pytest
import torch

from vla_runtime.kv import ChunkedGatedCache, ChunkGate, ChunkGateConfig, KVConfig, KVMode
from vla_runtime.kv.budget import BudgetMode, beaten_counts, visible_chunks
from vla_runtime.kv.chunked_parallel import ForwardSchedule, Segment, parallel_forward, step_boundaries

from .cases import PROMPT, episode, kv, run_stream, tiny_model

KV = kv(KVMode.CHUNKED, "hard")  # window 8, chunk 4, budget 3: compresses every step


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def dropping_gate(model, kv_cfg: KVConfig = KV, seed: int = 1) -> ChunkGate:
    """A gate whose scores straddle tau: some chunks kept, some dropped, kept ones compete for the budget."""
    torch.manual_seed(seed)
    gate = ChunkGate(kv_cfg.gate_config(model.cfg.geometry))
    with torch.no_grad():
        gate.readout_weight.normal_(0.0, 3.0)
        gate.readout_bias.zero_()
        gate.key_aggregator.fc2_weight.normal_(0.0, 0.05)  # a trained-looking aggregator, not the mean
    return gate


def test_schedule_replays_the_cache_bookkeeping():
    # prompt 5 (pinned), then forwards of 12, 1, 1, 12; window 8, chunk 4
    s = ForwardSchedule.build([5, 12, 1, 1, 12], 5, window=8, chunk=4)
    # after the 12-token forward: 12 raw -> (12-8)//4 = 1 chunk [5, 9); after 1: 9 raw; after 1: 10 raw;
    # after 12: 22 raw -> 3 chunks [9, 13), [13, 17), [17, 21)
    assert s.chunk_starts == (5, 9, 13, 17) and s.chunk_forward == (1, 4, 4, 4)
    assert s.segments == (
        Segment(start=0, end=5, pinned=0, head=0, first_forward=0),
        Segment(start=5, end=17, pinned=5, head=5, first_forward=1),
        Segment(start=17, end=31, pinned=5, head=9, first_forward=2),
    )
    with pytest.raises(ValueError, match="pinned_len"):
        ForwardSchedule.build([5, 12], 7, window=8, chunk=4)
    assert step_boundaries(5, [12, 12], 3) == [5, 12, 1, 1, 1, 12, 1, 1, 1]


@pytest.mark.parametrize("gate_kind, budget", [("untrained", 3), ("dropping", 3), ("dropping", 64)])
def test_hard_parallel_form_equals_streaming_inference(model, gate_kind, budget):
    """Budget 3 evicts on every step (one chunk at a time through ``admit``); budget 64 never fills, so
    the cache admits each step's chunks in one batch: both must match the parallel replay."""
    kv_cfg = kv(KVMode.CHUNKED, "hard", max_chunks=budget, capacity=budget + 40)
    x, bounds = episode(7)
    gate = ChunkGate(kv_cfg.gate_config(model.cfg.geometry)) if gate_kind == "untrained" else dropping_gate(model)
    cache = ChunkedGatedCache(model.cfg.geometry, kv_cfg.params, gate=gate)
    streamed = run_stream(model, cache, x, bounds)
    with torch.no_grad():
        logits, aux = parallel_forward(model, x, bounds, PROMPT, gate, kv_cfg, soft=False)
    torch.testing.assert_close(logits, streamed, atol=1e-4, rtol=1e-4)
    # compression really happened: chunks formed, the budget evicted, and the dropping gate dropped
    stats = cache.stats()
    assert aux.schedule.n_chunks == cache.chunks_formed > 10
    assert (int(cache.budget_dropped.sum()) > 0) == (budget == 3)
    assert aux.retained.sum().item() == stats.chunks_retained
    if gate_kind == "dropping":
        assert 0 < int(cache.gate_dropped.sum()) == int((~aux.kept).sum())
        margin = (aux.scores - gate.tau.detach()[None, :, None]).abs().min()
        assert margin > 1e-3  # decisions are not on a knife edge, so float noise cannot flip them


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_chunk_mass_weighs_each_chunk_key_by_its_tokens_in_both_forms(model, backend):
    """``chunk_mass``: log C on every chunk key's score, in streaming (decodes and prefills) and the parallel form
    alike; it changes the outputs wherever chunks are held, and nothing before the first chunk forms."""
    kv_mass = kv(KVMode.CHUNKED, "hard", max_chunks=3, capacity=43, chunk_mass=True, backend=backend)
    kv_plain = kv(KVMode.CHUNKED, "hard", max_chunks=3, capacity=43, backend=backend)
    assert kv_mass.params.chunk_score_bias == pytest.approx(math.log(kv_mass.params.chunk))
    x, bounds = episode(7)
    gate = dropping_gate(model)
    streamed = run_stream(model, ChunkedGatedCache(model.cfg.geometry, kv_mass.params, gate=gate), x, bounds)
    plain = run_stream(model, ChunkedGatedCache(model.cfg.geometry, kv_plain.params, gate=gate), x, bounds)
    with torch.no_grad():
        logits, aux = parallel_forward(model, x, bounds, PROMPT, gate, kv_mass, soft=False)
        sharp, _ = parallel_forward(model, x, bounds, PROMPT, gate, kv_mass, soft=True, temperature=1e-4)
    torch.testing.assert_close(logits, streamed, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(sharp, streamed, atol=1e-4, rtol=1e-4)
    first = sum(bounds[: aux.schedule.chunk_forward[0] + 1])  # tokens up to the forward that formed the first chunk
    torch.testing.assert_close(streamed[:, :first], plain[:, :first])
    assert (streamed[:, first:] - plain[:, first:]).abs().amax(-1).min() > 1e-4  # every later token reads the chunks


def test_chunk_mass_refuses_the_triton_kernel(model):
    kv_cfg = kv(KVMode.CHUNKED, "hard", chunk_mass=True, backend="triton")
    with pytest.raises(ValueError, match="chunk_mass.*torch"):
        ChunkedGatedCache(model.cfg.geometry, kv_cfg.params)


def test_soft_form_converges_to_hard_and_keeps_kept_chunks_in_place(model):
    x, bounds = episode(5)
    gate = dropping_gate(model)
    with torch.no_grad():
        hard, _ = parallel_forward(model, x, bounds, PROMPT, gate, KV, soft=False)
        sharp, aux = parallel_forward(model, x, bounds, PROMPT, gate, KV, soft=True, temperature=1e-3)
        warm, _ = parallel_forward(model, x, bounds, PROMPT, gate, KV, soft=True, temperature=1.0)
    torch.testing.assert_close(sharp, hard, atol=1e-4, rtol=1e-4)
    assert (warm - hard).abs().max() > 1e-3  # soft gates at T=1 are a different (trainable) function
    assert torch.equal(aux.kept, aux.keep_prob > 0.5)


def test_parallel_form_is_causal(model):
    x, bounds = episode(5)
    y = x.clone()
    cut = PROMPT + 2 * 15 + 4
    y[:, cut:] += torch.randn_like(y[:, cut:])
    gate = dropping_gate(model)
    with torch.no_grad():
        for soft in (False, True):
            a, _ = parallel_forward(model, x, bounds, PROMPT, gate, KV, soft=soft)
            b, _ = parallel_forward(model, y, bounds, PROMPT, gate, KV, soft=soft)
            assert torch.equal(a[:, :cut], b[:, :cut])
            assert not torch.allclose(a[:, cut:], b[:, cut:])


def test_batch_rows_are_independent_windows(model):
    x, bounds = episode(4, batch=2)
    gate = dropping_gate(model)
    with torch.no_grad():
        both, aux = parallel_forward(model, x, bounds, PROMPT, gate, KV, soft=True)
        row1, aux1 = parallel_forward(model, x[1:], bounds, PROMPT, gate, KV, soft=True)
    torch.testing.assert_close(both[1:], row1, atol=1e-5, rtol=1e-5)
    assert torch.equal(aux.kept[1:], aux1.kept)
    assert aux.keep_prob.shape == (2, model.cfg.n_layers, aux.schedule.n_chunks)


def test_soft_gates_train_the_gate_and_the_retention_loss(model):
    x, bounds = episode(4)
    gate = ChunkGate(KV.gate_config(model.cfg.geometry))
    logits, aux = parallel_forward(model, x, bounds, PROMPT, gate, KV, soft=True, temperature=1.0)
    loss = torch.nn.functional.cross_entropy(logits[0, :-1], logits[0, 1:].argmax(-1)) + aux.kept_ratio
    loss.backward()
    for name in ("tau", "readout_weight", "readout_bias", "key_aggregator.fc2_weight", "value_aggregator.fc2_weight"):
        grad = dict(gate.named_parameters())[name].grad
        assert grad is not None and grad.abs().sum() > 0, name
    assert 0 < float(aux.kept_ratio.detach()) < 1
    # the untrained gate keeps every chunk: g = sigmoid(keep_margin)
    torch.testing.assert_close(aux.keep_prob, torch.full_like(aux.keep_prob, torch.sigmoid(torch.tensor(3.0)).item()))


def test_bad_input_is_a_clear_error(model):
    x, bounds = episode(2)
    gate = ChunkGate(KV.gate_config(model.cfg.geometry))
    with pytest.raises(ValueError, match="boundaries cover"):
        parallel_forward(model, x[:, :-1], bounds, PROMPT, gate, KV)
    with pytest.raises(ValueError, match="does not fit|needs"):
        parallel_forward(model, x, bounds, PROMPT, ChunkGate(ChunkGateConfig(n_layers=2, head_dim=16, chunk=8)), KV)


def test_whole_episode_parallel_form_equals_streaming_and_reports_the_retained_chunks(model):
    """A 32-step episode (500 tokens, ~120 chunks per layer): chunks form, the gate drops some, the budget
    evicts most; the hard parallel form equals streaming at every position, the soft form at a near-zero
    temperature too (under either budget mode), and the cache's ``retained_starts()`` are the chunks the
    parallel form says are held at the end."""
    budget = 3
    kv_cfg = kv(KVMode.CHUNKED, "hard", max_chunks=budget, capacity=budget + 40)
    x, bounds = episode(32, seed=2)
    gate = dropping_gate(model, kv_cfg, seed=3)
    cache = ChunkedGatedCache(model.cfg.geometry, kv_cfg.params, gate=gate)
    streamed = run_stream(model, cache, x, bounds)
    with torch.no_grad():
        hard, aux = parallel_forward(model, x, bounds, PROMPT, gate, kv_cfg, soft=False)
        sharp = {
            mode: parallel_forward(model, x, bounds, PROMPT, gate, kv_cfg, soft=True, temperature=1e-4, budget=mode)[0]
            for mode in BudgetMode
        }
    torch.testing.assert_close(hard, streamed, atol=1e-4, rtol=1e-4)
    for out in sharp.values():
        torch.testing.assert_close(out, hard, atol=1e-4, rtol=1e-4)
    assert aux.schedule.n_chunks > 100 and int(cache.gate_dropped.sum()) > 0 and int(cache.budget_dropped.sum()) > 100
    starts = torch.tensor(aux.schedule.chunk_starts)
    held = tuple(tuple(starts[aux.retained[0, layer]].tolist()) for layer in range(model.cfg.n_layers))
    assert cache.retained_starts() == held and all(len(layer) == budget for layer in held)


def test_soft_budget_lets_the_loss_reach_evicted_chunks(model):
    """With the budget full, the hard-budget form gives a chunk evicted before any forward saw it no
    gradient (it is masked); the soft budget does, which lets training pull a needed chunk into the budget."""
    kv_cfg = kv(KVMode.CHUNKED, "hard", max_chunks=2, capacity=42)
    x, bounds = episode(12, seed=4)
    grads = {}
    for mode in BudgetMode:
        gate = dropping_gate(model, kv_cfg, seed=5)
        scores = {}
        original = gate.score

        def recording(*args, _orig=original, **kwargs):  # keep each layer's scores to read their gradient
            s, state = _orig(*args, **kwargs)
            s.retain_grad()
            scores[kwargs.get("layers")] = s
            return s, state

        gate.score = recording
        logits, aux = parallel_forward(model, x, bounds, PROMPT, gate, kv_cfg, soft=True, budget=mode)
        logits[:, -1].logsumexp(-1).sum().backward()
        sched = aux.schedule
        formed = torch.tensor([bisect.bisect_left(sched.chunk_forward, seg.first_forward) for seg in sched.segments])
        kept = aux.kept[:, 0]
        visible = visible_chunks(beaten_counts(aux.scores[:, 0].detach(), kept), kept, formed, 2)  # [1, S, n]
        never = kept[0] & ~visible[0].any(0) & (torch.arange(sched.n_chunks) < formed[-1])  # evicted unseen
        grads[mode] = scores[0].grad[0, never].abs()
    assert grads[BudgetMode.HARD].numel() > 5
    assert torch.all(grads[BudgetMode.HARD] == 0) and torch.all(grads[BudgetMode.SOFT] > 0)
