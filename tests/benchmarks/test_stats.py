import pytest

from vla_runtime.bench.stats import bootstrap_median_ratio, mcnemar_exact, paired_bootstrap_diff, wilson_interval


@pytest.mark.parametrize(
    "k, n, low, high",
    [(8, 10, 0.4902, 0.9433), (0, 10, 0.0, 0.2775), (10, 10, 0.7225, 1.0), (50, 100, 0.4038, 0.5962), (1, 1, 0.2065, 1.0)],
)
def test_wilson_matches_published_values(k, n, low, high):
    # reference values: statsmodels proportion_confint(k, n, method="wilson")
    iv = wilson_interval(k, n)
    assert iv.estimate == pytest.approx(k / n)
    assert iv.low == pytest.approx(low, abs=1e-4)
    assert iv.high == pytest.approx(high, abs=1e-4)


def test_wilson_narrows_with_n_and_rejects_bad_counts():
    assert wilson_interval(80, 100).high - wilson_interval(80, 100).low < wilson_interval(8, 10).high - wilson_interval(8, 10).low
    with pytest.raises(ValueError, match="`k`"):
        wilson_interval(11, 10)
    with pytest.raises(ValueError, match="`n`"):
        wilson_interval(0, 0)


def test_mcnemar_exact_on_hand_computed_tables():
    # 1 item only A right, 9 only B right, 5 both, 3 neither: p = 2 * (C(10,0) + C(10,1)) / 2^10 = 22/1024
    a = [1] * 1 + [0] * 9 + [1] * 5 + [0] * 3
    b = [0] * 1 + [1] * 9 + [1] * 5 + [0] * 3
    r = mcnemar_exact(a, b)
    assert (r.a_only, r.b_only) == (1, 9)
    assert r.p_value == pytest.approx(22 / 1024)
    # symmetric in A and B
    assert mcnemar_exact(b, a).p_value == pytest.approx(22 / 1024)
    # 0 vs 6 discordant: p = 2 / 64
    assert mcnemar_exact([0] * 6, [1] * 6).p_value == pytest.approx(2 / 64)
    # balanced or no discordant pairs: no evidence at all
    assert mcnemar_exact([1, 0, 1, 0], [0, 1, 0, 1]).p_value == 1.0
    assert mcnemar_exact([1, 1, 0], [1, 1, 0]).p_value == 1.0
    with pytest.raises(ValueError, match="equal lengths"):
        mcnemar_exact([1], [1, 0])


def test_paired_bootstrap_keeps_the_pairing():
    a = [float(i % 7) for i in range(60)]
    shifted = [x - 0.25 for x in a]
    iv = paired_bootstrap_diff(a, shifted)
    # every pair differs by exactly 0.25: an unpaired resampling would give a wide interval
    assert (iv.estimate, iv.low, iv.high) == pytest.approx((0.25, 0.25, 0.25))
    iv = paired_bootstrap_diff([1.0] * 30 + [0.0] * 30, [0.0] * 60, seed=3)
    assert iv.estimate == pytest.approx(0.5)
    assert 0.3 < iv.low < 0.5 < iv.high < 0.7
    assert paired_bootstrap_diff([1.0] * 30 + [0.0] * 30, [0.0] * 60, seed=3) == iv  # seeded


def test_bootstrap_median_ratio_brackets_the_ratio():
    a = [10.0 + (i % 5) for i in range(40)]
    b = [x / 2 for x in a]
    iv = bootstrap_median_ratio(a, b)
    assert (iv.estimate, iv.low, iv.high) == pytest.approx((2.0, 2.0, 2.0))
    with pytest.raises(ValueError, match="equal"):
        bootstrap_median_ratio([1.0], [])
