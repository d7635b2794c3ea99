"""Scoring many continuations in one forward equals scoring them one by one."""

import torch

from vla_runtime.kv import FullCache, FullParams
from vla_runtime.memory.branches import continuation_logprobs


def test_candidates_in_one_forward_match_one_at_a_time(tiny_lm):
    prompt = torch.randint(3, 30000, (1, 20), generator=torch.Generator().manual_seed(3))
    candidates = [[5], [7, 8, 9], [7, 8], [100, 2000, 3000, 4000]]
    cache = FullCache(tiny_lm.cfg.geometry, FullParams(capacity=32))
    with torch.no_grad():
        logits = tiny_lm(prompt, cache=cache)[0, -1]
        expected = []
        for c in candidates:
            mark = cache.mark()
            lp = torch.cat([logits[None], tiny_lm(torch.tensor([c[:-1]]), cache=cache)[0]]).log_softmax(-1) if len(c) > 1 else logits[None].log_softmax(-1)
            cache.rollback(mark)
            expected.append(sum(float(lp[i, t]) for i, t in enumerate(c)))
    got = continuation_logprobs(tiny_lm, cache, logits, candidates)
    torch.testing.assert_close(got, torch.tensor(expected), atol=1e-4, rtol=1e-5)
    assert cache.length == 20  # the prompt cache is untouched
