"""The budget in closed form (top M of the kept chunks) equals the cache's chunk-by-chunk rule, and the
relaxed (soft) budget converges to it."""

import pytest
import torch

from vla_runtime.kv.budget import BudgetMode, beaten_counts, log_membership, visible_chunks
from vla_runtime.kv.budget import admit, apply_admission


def replay(scores: torch.Tensor, kept: torch.Tensor, m: int) -> torch.Tensor:
    """``admit`` chunk by chunk (what ``ChunkedGatedCache`` does): [B, n + 1, n] held after each prefix."""
    b, n = scores.shape
    valid = torch.zeros(b, m, dtype=torch.bool)
    slot_scores, ages = torch.zeros(b, m), torch.zeros(b, m, dtype=torch.long)
    held = [torch.zeros(b, n, dtype=torch.bool)]
    for j in range(n):
        adm = admit(valid, slot_scores, ages, scores[:, j], kept[:, j])
        valid, slot_scores, ages = apply_admission(adm, valid, slot_scores, ages, scores[:, j], j)
        now = torch.zeros(b, n, dtype=torch.bool)
        for r in range(b):
            now[r, ages[r][valid[r]]] = True
        held.append(now)
    return torch.stack(held, dim=1)


@pytest.mark.parametrize("m", [0, 1, 3, 7])
def test_top_m_in_closed_form_equals_the_chunk_by_chunk_rule(m):
    g = torch.Generator().manual_seed(m)
    scores = torch.randint(0, 5, (6, 40), generator=g).float()  # few distinct values: many ties
    kept = torch.rand(6, 40, generator=g) > 0.3
    formed = torch.arange(41)
    closed = visible_chunks(beaten_counts(scores, kept), kept, formed, m)
    assert torch.equal(closed, replay(scores, kept, m))
    assert torch.equal(closed[:, -1].sum(-1), kept.sum(-1).clamp(max=m))  # the budget is full, never over


def test_soft_membership_converges_to_the_hard_budget_and_only_binds_over_budget():
    scores = torch.tensor([[0.3, 2.0, -1.0, 1.5, 0.9, 0.1]])
    kept = torch.tensor([[True, True, True, True, False, True]])
    formed = torch.tensor([2, 4, 6])
    hard = visible_chunks(beaten_counts(scores, kept), kept, formed, 2)
    log_m = log_membership(scores, kept, formed, 2, temperature=1e-3)
    before = torch.arange(6)[None, :] < formed[:, None]
    eligible = kept[:, None, :] & before
    assert torch.equal((log_m.exp() > 0.5) & eligible, hard)
    assert (log_m[:, 0] == 0).all()  # two kept chunks, budget 2: nothing binds yet
    assert log_m[0, 2, 2] < -100 and log_m[0, 2, 1] > -1e-3  # the lowest kept chunk is out, the best is in
    warm = log_membership(scores, kept, formed, 2, temperature=1.0)
    assert -3 < warm[0, 2, 2] < -0.5  # soft: out, but still reachable by the gradient


def test_budget_mode_parses_the_yaml_name():
    assert BudgetMode.parse("soft") is BudgetMode.SOFT and BudgetMode.parse(BudgetMode.HARD) is BudgetMode.HARD
    with pytest.raises(KeyError, match="soft"):
        BudgetMode.parse("topk")
