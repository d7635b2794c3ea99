"""The CUDA loading path: stored KV in pinned host memory, copied on a side stream while layers
compute, ordered by per-layer events. Same numbers as loading serially and as on CPU."""

import pytest
import torch

from vla_runtime.memory import KVStore, MemoryPrefill, PrefillConfig, StoreConfig, TierConfig

from .conftest import make_prompt

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_pinned_side_stream_loading_matches_serial_and_cpu(tiny_lm):
    prompt = make_prompt(lengths=(6, 5, 7, 6, 5, 6, 7, 5), joint=tuple((i,) for i in range(8)))
    cpu = MemoryPrefill(tiny_lm, KVStore(), PrefillConfig(method="keep", decay=0.6)).run(prompt)
    model = tiny_lm.to("cuda")
    try:
        store = KVStore(StoreConfig([TierConfig("host", 1 << 26)]), device="cuda")
        results = {}
        for schedule in ("serial", "balanced", "balanced"):
            results[schedule] = MemoryPrefill(model, store, PrefillConfig(method="keep", decay=0.6, load_schedule=schedule)).run(prompt)
        key = next(k for k in store.keys())
        assert store.get(key).k.is_pinned()  # host tier on a CUDA machine is pinned
        torch.testing.assert_close(results["balanced"].logits, results["serial"].logits, rtol=0, atol=0)
        torch.testing.assert_close(results["balanced"].logits.cpu(), cpu.logits, atol=1e-4, rtol=1e-4)
        assert set(results["balanced"].load_log) == set(results["serial"].load_log)
    finally:
        tiny_lm.to("cpu")
