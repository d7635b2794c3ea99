"""``matching_sink_window``: a sliding window that holds exactly the KV bytes of a chunked cache at its budget."""

import pytest
import torch

from vla_runtime.kv import KVConfig, KVMode, make_cache, matching_sink_window

from .cases import PROMPT, episode, tiny_model


@torch.no_grad()
def bytes_per_forward(model, cache, x: torch.Tensor, bounds: list[int]) -> list[int]:
    """KV bytes the cache holds after each forward of the episode (the prompt pinned)."""
    held, start = [], 0
    for n in bounds:
        model(inputs_embeds=x[:, start : start + n], cache=cache, pin=start + n <= PROMPT)
        start += n
        held.append(cache.stats().bytes)
    return held


def test_the_matched_window_holds_the_bytes_of_a_full_chunk_budget():
    model = tiny_model()
    chunked = KVConfig.of(KVMode.CHUNKED, window=8, chunk=4, max_chunks=3, capacity=64)
    sink = matching_sink_window(chunked, n_sink=2)
    p = sink.params
    assert (sink.mode, p.window, p.n_sink, p.capacity) == (KVMode.SINK_WINDOW, 3 + 8 + 4 - 1 - 2, 2, 64)
    x, bounds = episode(10)
    chunked_cache = make_cache(chunked, model.cfg.geometry)
    held_chunked = bytes_per_forward(model, chunked_cache, x, bounds)
    held_sink = bytes_per_forward(model, make_cache(sink, model.cfg.geometry), x, bounds)
    assert chunked_cache.stats().chunks_retained == 3 * model.cfg.n_layers  # the budget is full (untrained gate keeps all)
    # once both are full, the sliding window holds a constant amount: the chunked cache's most
    assert max(held_chunked) == max(held_sink) == held_sink[-1]
    assert min(held_chunked[-8:]) < max(held_chunked)  # (the chunked cache breathes with its filling chunk)


def test_matching_needs_a_chunked_config_with_its_sizes():
    with pytest.raises(ValueError, match="takes a chunked KVConfig, got mode 'full'"):
        matching_sink_window(KVConfig(KVMode.FULL))
    with pytest.raises(ValueError, match="needs the chunked cache's `window` and `max_chunks`"):
        matching_sink_window(KVConfig.of(KVMode.CHUNKED, max_chunks=8))
