"""Not-kept bidirectional query blocks in the parallel form equal a streaming ``ChunkedGatedCache`` that runs each
block inside ``bidirectional_block()`` (OpenVLA-OFT's history mode), under a budget that binds."""

import pytest
import torch

from vla_runtime.kv import ChunkedGatedCache, ChunkGate, KVMode
from vla_runtime.kv.budget import BudgetMode
from vla_runtime.kv.chunked_parallel import ForwardSchedule, ParallelChunkedAttention
from vla_runtime.kv.query_parallel import ParallelQueryAttention, QueryBlocks

from .cases import PROMPT, kv, tiny_model
from .test_parallel import dropping_gate

OBS, QUERY, STEPS = 10, 6, 7
KV = kv(KVMode.CHUNKED, "hard")  # window 8, chunk 4, budget 3: chunks form every step and the budget evicts


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def sequence(steps: int = STEPS, batch: int = 1, seed: int = 0):
    """P | O_1 | Q_1 | ... | O_S | Q_S embeddings [B, N, dim], the kept forwards' lengths and the blocks."""
    n = PROMPT + steps * (OBS + QUERY)
    x = torch.randn(batch, n, 64, generator=torch.Generator().manual_seed(seed))
    return x, [PROMPT] + [OBS] * steps, QueryBlocks(after=tuple(range(1, steps + 1)), length=QUERY)


@torch.no_grad()
def stream(model, cache, x: torch.Tensor, steps: int = STEPS) -> torch.Tensor:
    """The session's order: pin the prompt, then per step keep O_i and run Q_i in a rolled-back block."""
    out = [model(inputs_embeds=x[:, :PROMPT], cache=cache, pin=True)]
    for i in range(steps):
        at = PROMPT + i * (OBS + QUERY)
        out.append(model(inputs_embeds=x[:, at : at + OBS], cache=cache))
        with cache.bidirectional_block():
            out.append(model(inputs_embeds=x[:, at + OBS : at + OBS + QUERY], cache=cache))
    return torch.cat(out, dim=1)


def parallel(model, gate, x, lengths, blocks, *, soft: bool, temperature: float = 1.0, budget=BudgetMode.HARD, kv_cfg=KV):
    params = kv_cfg.params.resolve(model.cfg.geometry)
    schedule = ForwardSchedule.build(lengths, PROMPT, window=params.window, chunk=params.chunk)
    attn = ParallelQueryAttention(
        schedule, blocks, gate, params, model.cfg.rope, soft=soft, temperature=temperature, budget=budget
    )
    return model(inputs_embeds=x, cache=attn), attn


@pytest.mark.parametrize("gate_kind", ["untrained", "dropping"])
def test_query_blocks_equal_streaming_bidirectional_blocks(model, gate_kind):
    x, lengths, blocks = sequence()
    gate = ChunkGate(KV.gate_config(model.cfg.geometry)) if gate_kind == "untrained" else dropping_gate(model)
    cache = ChunkedGatedCache(model.cfg.geometry, KV.params, gate=gate)
    streamed = stream(model, cache, x)
    with torch.no_grad():
        hard, attn = parallel(model, gate, x, lengths, blocks, soft=False)
        sharp, _ = parallel(model, gate, x, lengths, blocks, soft=True, temperature=1e-4)
        relaxed, _ = parallel(model, gate, x, lengths, blocks, soft=True, temperature=1e-4, budget=BudgetMode.SOFT)
        warm, _ = parallel(model, gate, x, lengths, blocks, soft=True, temperature=1.0)
    torch.testing.assert_close(hard, streamed, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(sharp, streamed, atol=1e-4, rtol=1e-4)
    # the relaxed top-M converges too where scores are distinct (the default gate's equal scores give m = 1/2)
    if gate_kind == "dropping":
        torch.testing.assert_close(relaxed, streamed, atol=1e-4, rtol=1e-4)
    assert (warm - streamed).abs().max() > 1e-3  # soft gates at T = 1 are another (trainable) function
    aux = attn.aux()
    assert aux.schedule.n_chunks == cache.chunks_formed > 10  # chunks formed from observation tokens only
    assert int(cache.budget_dropped.sum()) > 0  # the budget bound within the episode
    assert aux.retained.sum().item() == cache.stats().chunks_retained
    if gate_kind == "dropping":
        assert 0 < int(cache.gate_dropped.sum()) == int((~aux.kept).sum())


def test_query_blocks_with_chunk_mass_equal_streaming(model):
    """The bidirectional blocks read chunk keys with ``chunk_mass``'s log C too, in both forms."""
    kv_mass = kv(KVMode.CHUNKED, "hard", chunk_mass=True)
    x, lengths, blocks = sequence()
    gate = dropping_gate(model)
    streamed = stream(model, ChunkedGatedCache(model.cfg.geometry, kv_mass.params, gate=gate), x)
    plain = stream(model, ChunkedGatedCache(model.cfg.geometry, KV.params, gate=gate), x)
    with torch.no_grad():
        hard, _ = parallel(model, gate, x, lengths, blocks, soft=False, kv_cfg=kv_mass)
    torch.testing.assert_close(hard, streamed, atol=1e-4, rtol=1e-4)
    assert (streamed - plain).abs().max() > 1e-3


def test_kept_tokens_never_see_query_blocks(model):
    """The kept tokens' outputs equal the parallel form of the kept forwards alone, whatever the blocks hold."""
    x, lengths, blocks = sequence(steps=4)
    gate = dropping_gate(model)
    params = KV.params.resolve(model.cfg.geometry)
    kept_idx, _ = blocks.token_order(lengths)
    with torch.no_grad():
        out, _ = parallel(model, gate, x, lengths, blocks, soft=True)
        y = x.clone()
        y[:, [i for i in range(x.shape[1]) if i not in set(kept_idx)]] = 7.0
        changed, _ = parallel(model, gate, y, lengths, blocks, soft=True)
        schedule = ForwardSchedule.build(lengths, PROMPT, window=params.window, chunk=params.chunk)
        alone = model(inputs_embeds=x[:, kept_idx], cache=ParallelChunkedAttention(schedule, gate, params, model.cfg.rope))
    torch.testing.assert_close(out[:, kept_idx], alone, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(changed[:, kept_idx], alone, atol=1e-5, rtol=1e-5)


def test_batch_rows_are_independent_windows(model):
    x, lengths, blocks = sequence(steps=4, batch=2, seed=3)
    gate = dropping_gate(model)
    with torch.no_grad():
        both, _ = parallel(model, gate, x, lengths, blocks, soft=True, temperature=0.5)
        rows = [parallel(model, gate, x[i : i + 1], lengths, blocks, soft=True, temperature=0.5)[0] for i in range(2)]
    torch.testing.assert_close(both, torch.cat(rows), atol=1e-5, rtol=1e-5)


def test_soft_query_blocks_train_the_gate(model):
    """A loss on the query blocks' outputs alone reaches the aggregators, the LSTM readout and tau."""
    x, lengths, blocks = sequence(steps=4)
    gate = dropping_gate(model)
    _, q_rows = blocks.token_order(lengths)
    out, attn = parallel(model, gate, x, lengths, blocks, soft=True, temperature=1.0)
    out[:, [t for block in q_rows for t in block]].pow(2).mean().backward()
    grads = dict(gate.named_parameters())
    for name in ("tau", "readout_weight", "readout_bias", "key_aggregator.fc2_weight", "value_aggregator.fc2_weight"):
        assert grads[name].grad is not None and grads[name].grad.abs().sum() > 0, name  # a loss on the blocks alone
    assert attn.aux().keep_prob.requires_grad


def test_blocks_layout_and_bad_input():
    blocks = QueryBlocks(after=(1, 2), length=2)
    kept, rows = blocks.token_order([3, 2, 2])
    assert kept == [0, 1, 2, 3, 4, 7, 8] and rows == [[5, 6], [9, 10]]
    with pytest.raises(ValueError, match="follows forward 2"):
        blocks.token_order([3, 2])
    with pytest.raises(ValueError, match="non-decreasing"):
        QueryBlocks(after=(2, 1), length=2)
    with pytest.raises(ValueError, match="`length`"):
        QueryBlocks(after=(1,), length=0)
