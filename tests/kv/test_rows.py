"""RowsCache: a batched forward whose rows attend through their own caches equals each row run alone,
for every cache of the matrix, while the rows hold different histories."""

import pytest
import torch

from vla_runtime.kv import KVMode
from vla_runtime.kv.rows import RowsCache

from .cases import REGISTERED, build, episode, tiny_model


@pytest.mark.parametrize("level", ["easy", "hard"])
@pytest.mark.parametrize("mode", REGISTERED, ids=lambda m: m.value)
@torch.no_grad()
def test_rows_equal_separate_streams(mode, level):
    model = tiny_model()
    x, bounds = episode(4, batch=2, seed=1)
    alone = [build(mode, level, model) for _ in range(2)]
    rows = [build(mode, level, model) for _ in range(2)]
    # row 1 runs one extra step first, alone: from then on the two rows hold different lengths
    extra = torch.randn(1, bounds[1], x.shape[2], generator=torch.Generator().manual_seed(7))
    model(inputs_embeds=x[1:, : bounds[0]], cache=alone[1], pin=True)
    model(inputs_embeds=x[1:, : bounds[0]], cache=rows[1], pin=True)
    model(inputs_embeds=extra, cache=alone[1])
    model(inputs_embeds=extra, cache=rows[1])
    model(inputs_embeds=x[:1, : bounds[0]], cache=alone[0], pin=True)
    model(inputs_embeds=x[:1, : bounds[0]], cache=rows[0], pin=True)
    together = RowsCache(rows)
    start = bounds[0]
    for n in bounds[1:]:
        expected = torch.cat([model(inputs_embeds=x[i : i + 1, start : start + n], cache=alone[i]) for i in range(2)])
        torch.testing.assert_close(model(inputs_embeds=x[:, start : start + n], cache=together), expected, rtol=1e-5, atol=1e-5)
        start += n
    for a, r in zip(alone, rows):
        assert a.stats() == r.stats()
    assert rows[0].stats().tokens_seen != rows[1].stats().tokens_seen
    assert together.stats().tokens_seen == sum(r.stats().tokens_seen for r in rows)


@torch.no_grad()
def test_mark_and_rollback_reach_every_row():
    model = tiny_model()
    x, bounds = episode(2, batch=2)
    rows = [build(KVMode.FULL, "easy", model) for _ in range(2)]
    together = RowsCache(rows)
    model(inputs_embeds=x[:, : bounds[0]], cache=together, pin=True)
    held = [r.stats().tokens_seen for r in rows]
    mark = together.mark()
    model(inputs_embeds=x[:, bounds[0] : bounds[0] + bounds[1]], cache=together)
    together.rollback(mark)
    assert [r.stats().tokens_seen for r in rows] == held
    with pytest.raises(ValueError, match="unknown RowsCache mark"):
        together.rollback(mark)
    with pytest.raises(ValueError, match="batch of 1 rows for 2 caches"):
        model(inputs_embeds=x[:1, :3], cache=together)
