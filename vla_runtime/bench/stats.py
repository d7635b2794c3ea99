"""Small-sample statistics for benchmark tables: intervals on proportions and paired comparisons.

* ``wilson_interval``: 95 % (or any ``z``) Wilson score interval of a proportion k/n;
* ``mcnemar_exact``: exact two-sided McNemar test on the discordant pairs of two methods answered on
  the same questions (binomial with p = 1/2);
* ``paired_bootstrap_diff``: percentile bootstrap interval of mean(a) - mean(b) over the same items;
* ``bootstrap_median_ratio``: percentile bootstrap interval of median(a) / median(b) (TTFT speed-ups).

Pure functions of lists of numbers; resampling is seeded so a table is reproducible.
"""

from __future__ import annotations

import math
import random
import statistics
from dataclasses import dataclass


@dataclass(frozen=True)
class Interval:
    estimate: float
    low: float
    high: float


def wilson_interval(k: int, n: int, *, z: float = 1.959963984540054) -> Interval:
    """Wilson score interval of the proportion ``k / n`` (z = 1.96: 95 %)."""
    if n <= 0:
        raise ValueError(f"`n` must be >= 1, got {n}")
    if not 0 <= k <= n:
        raise ValueError(f"`k` must be in [0, n={n}], got {k}")
    p = k / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return Interval(p, max(0.0, centre - half), min(1.0, centre + half))


@dataclass(frozen=True)
class McNemar:
    """Paired outcomes of methods A and B: ``a_only`` = items only A got right, ``b_only`` = only B."""

    a_only: int
    b_only: int
    p_value: float


def mcnemar_exact(a: list[int] | list[bool], b: list[int] | list[bool]) -> McNemar:
    """Exact two-sided McNemar test: are A and B right equally often on the same items?

    p = min(1, 2 * P(X <= min(a_only, b_only))) with X ~ Binomial(a_only + b_only, 1/2); 1.0 when no
    item is discordant."""
    if len(a) != len(b):
        raise ValueError(f"paired outcomes need equal lengths, got {len(a)} and {len(b)}")
    a_only = sum(1 for x, y in zip(a, b) if x and not y)
    b_only = sum(1 for x, y in zip(a, b) if y and not x)
    n = a_only + b_only
    if n == 0:
        return McNemar(0, 0, 1.0)
    tail = sum(math.comb(n, i) for i in range(min(a_only, b_only) + 1)) / 2**n
    return McNemar(a_only, b_only, min(1.0, 2 * tail))


def _percentile(sorted_xs: list[float], q: float) -> float:
    """Linear-interpolation percentile of an already sorted list, q in [0, 1]."""
    pos = q * (len(sorted_xs) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_xs) - 1)
    return sorted_xs[lo] + (sorted_xs[hi] - sorted_xs[lo]) * (pos - lo)


def paired_bootstrap_diff(a: list[float], b: list[float], *, reps: int = 2000, level: float = 0.95, seed: int = 0) -> Interval:
    """mean(a) - mean(b) over paired items, with a percentile bootstrap interval (items resampled
    together, so the pairing is kept)."""
    if len(a) != len(b) or not a:
        raise ValueError(f"paired samples need equal, non-zero lengths, got {len(a)} and {len(b)}")
    n = len(a)
    d = [x - y for x, y in zip(a, b)]
    rng = random.Random(seed)
    means = sorted(sum(d[rng.randrange(n)] for _ in range(n)) / n for _ in range(reps))
    alpha = (1 - level) / 2
    return Interval(sum(d) / n, _percentile(means, alpha), _percentile(means, 1 - alpha))


def bootstrap_median_ratio(a: list[float], b: list[float], *, reps: int = 2000, level: float = 0.95, seed: int = 0) -> Interval:
    """median(a) / median(b) with a percentile bootstrap interval, items resampled in pairs
    (a[i], b[i] measured on the same question)."""
    if len(a) != len(b) or not a:
        raise ValueError(f"paired samples need equal, non-zero lengths, got {len(a)} and {len(b)}")
    n = len(a)
    rng = random.Random(seed)
    ratios = []
    for _ in range(reps):
        idx = [rng.randrange(n) for _ in range(n)]
        ratios.append(statistics.median(a[i] for i in idx) / statistics.median(b[i] for i in idx))
    ratios.sort()
    alpha = (1 - level) / 2
    return Interval(statistics.median(a) / statistics.median(b), _percentile(ratios, alpha), _percentile(ratios, 1 - alpha))
