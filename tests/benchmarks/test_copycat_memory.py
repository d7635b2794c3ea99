"""copycat_memory.py's probe table: a probe fit on some episodes' hidden states is read on others, per flash count
and per kind of step, beside the policy's picks at the separable steps."""

import pytest
import torch


@pytest.fixture(scope="module")
def copycat(load_benchmark):
    return load_benchmark("copycat_memory")


def episode(count: int, generator: torch.Generator, *, written: int, separable_from: int, picks: list[int]) -> dict:
    """A ``run`` row with 8 steps after go: the answer (``count`` - 1) is written in the hidden state of the first
    ``written`` steps (noise after them); steps from ``separable_from`` on are separable, with the policy's picks."""
    steps = []
    for i in range(8):
        state = torch.randn(16, generator=generator)
        if i < written:
            state[count - 1] += 4.0
        sep = i >= separable_from
        steps.append((state, sep, picks[i - separable_from] if sep else None))
    return {"count": count, "steps": steps}


def test_the_probe_reads_the_answer_where_it_is_written_and_the_policy_is_scored_at_separable_steps(copycat):
    g = torch.Generator().manual_seed(0)
    fit = [episode(c, g, written=8, separable_from=4, picks=[c - 1] * 4) for c in (1, 2, 3) * 20]
    test = [  # two flashes: the answer held until the first separable step, which the policy misses
        episode(2, g, written=5, separable_from=4, picks=[0, 1, 1, 1]) for _ in range(10)
    ] + [episode(c, g, written=8, separable_from=0, picks=[c - 1] * 8) for c in (1, 3) for _ in range(10)]
    table = copycat.probe_table(fit, test)
    two = table[2]
    assert two["at go"] == "probe 100% (n=10)"  # no separable step at go: no policy score
    assert two["shared way"] == "probe 100% (n=40)"
    assert two["first separable step"] == "probe 100%, policy 0% (n=10)"
    probe_all = float(two["separable steps"].split("%")[0].removeprefix("probe "))
    assert probe_all < 60 and two["separable steps"].endswith("policy 75% (n=40)")  # noise after step 4: chance-ish
    assert table[1]["shared way"] == "-" and table[3]["first separable step"] == "probe 100%, policy 100% (n=10)"


def test_the_probe_at_go_reads_the_count_only_where_it_is_in_the_state_at_go(copycat):
    g = torch.Generator().manual_seed(1)
    # the answer in the state at go: the probe fit and read there finds it
    fit = [episode(c, g, written=1, separable_from=4, picks=[c - 1] * 4) for c in (1, 2, 3) * 20]
    test = [episode(c, g, written=1, separable_from=4, picks=[c - 1] * 4) for c in (1, 2, 3) * 5]
    assert copycat.probe_at_go(fit, test) == {1: "5/5", 2: "5/5", 3: "5/5", "all": "100%"}
    # the answer only from the second step on (motion, not memory): at go the probe has nothing to read
    late = [episode(c, g, written=0, separable_from=4, picks=[c - 1] * 4) for c in (1, 2, 3) * 20]
    for row in late:
        for i in range(1, 8):
            row["steps"][i][0][row["count"] - 1] += 4.0
    held = [episode(c, g, written=0, separable_from=4, picks=[c - 1] * 4) for c in (1, 2, 3) * 10]
    share = float(copycat.probe_at_go(late, held)["all"].removesuffix("%"))
    assert share < 60  # chance is 33 %
