"""Is one condition better than another beyond the noise between seeds?

Welch's t-test (Welch 1947, "The generalization of 'Student's' problem when several different population
variances are involved") compares two means without assuming equal variances: t = (m1 - m2) / sqrt(s1²/n1 +
s2²/n2), with the Welch-Satterthwaite degrees of freedom. scipy computes it (``scipy.stats.ttest_ind`` with
``equal_var=False``). The effect is the difference of the means with its confidence interval on the same
degrees of freedom. When several conditions are each tested against one reference, the p-values are adjusted
with Holm's step-down method (Holm 1979, "A simple sequentially rejective multiple test procedure"), which
keeps the chance of any false "better"/"worse" at alpha over the whole table.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

DEFAULT_ALPHA = 0.05


@dataclass(frozen=True)
class Welch:
    """The two-sided Welch t-test of ``a`` against ``b``."""

    t: float
    df: float
    p: float
    difference: float  # mean(a) - mean(b)


def welch(a: Sequence[float], b: Sequence[float]) -> Welch:
    """Welch's two-sided t-test; both samples need at least two values. Two samples without any spread
    give p = 0 when their means differ and p = 1 when they are equal (scipy returns NaN there)."""
    from scipy import stats

    if len(a) < 2 or len(b) < 2:
        raise ValueError(f"Welch's test needs two or more values per sample (got {len(a)} and {len(b)})")
    difference = statistics.fmean(a) - statistics.fmean(b)
    if statistics.variance(a) == 0 and statistics.variance(b) == 0:
        return Welch(
            math.copysign(math.inf, difference) if difference else 0.0,
            math.nan,
            float(difference == 0),
            difference,
        )
    result = stats.ttest_ind(list(a), list(b), equal_var=False)
    return Welch(float(result.statistic), float(result.df), float(result.pvalue), difference)


def difference_interval(
    a: Sequence[float], b: Sequence[float], level: float = 0.95
) -> tuple[float, float, float]:
    """mean(a) - mean(b) and its two-sided ``level`` confidence interval (Welch: the standard error
    sqrt(s1²/n1 + s2²/n2) and the Welch-Satterthwaite degrees of freedom); both samples need two values."""
    from scipy import stats

    if len(a) < 2 or len(b) < 2:
        raise ValueError(f"an interval needs two or more values per sample (got {len(a)} and {len(b)})")
    difference = statistics.fmean(a) - statistics.fmean(b)
    va, vb = statistics.variance(a) / len(a), statistics.variance(b) / len(b)
    if va + vb == 0:
        return difference, difference, difference
    df = (va + vb) ** 2 / (va**2 / (len(a) - 1) + vb**2 / (len(b) - 1))
    half = float(stats.t.ppf(0.5 + level / 2, df)) * math.sqrt(va + vb)
    return difference, difference - half, difference + half


def holm(pvalues: Sequence[float]) -> list[float]:
    """Holm's adjusted p-values, in the order given: the i-th smallest of m is multiplied by m - i + 1, and
    each adjusted value is at least the one before it (so the rejections are step-down)."""
    m = len(pvalues)
    order = sorted(range(m), key=lambda i: pvalues[i])
    adjusted = [0.0] * m
    running = 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (m - rank) * pvalues[i]))
        adjusted[i] = running
    return adjusted


@dataclass(frozen=True)
class Contrast:
    """One condition against the reference: the difference of mean final losses with its interval, the
    Welch p-value, the Holm-adjusted p-value over the table, and what the table says."""

    difference: float | None
    low: float | None
    high: float | None
    p: float | None
    p_holm: float | None
    verdict: str


def contrasts(
    samples: Sequence[Sequence[float]], reference: int, alpha: float = DEFAULT_ALPHA, level: float = 0.95
) -> list[Contrast]:
    """Each sample of final losses against ``samples[reference]``, lower being better: Welch's test, its
    p-values adjusted together with Holm's method, the verdict at ``alpha`` on the adjusted p."""
    ref = samples[reference]
    tested = [i for i, s in enumerate(samples) if i != reference and len(s) >= 2 and len(ref) >= 2]
    tests = {i: welch(samples[i], ref) for i in tested}
    adjusted = dict(zip(tested, holm([tests[i].p for i in tested])))
    out = []
    for i, sample in enumerate(samples):
        if i == reference:
            out.append(Contrast(0.0, None, None, None, None, "reference"))
        elif i not in tests:
            fewest = min(len(sample), len(ref))
            mean = statistics.fmean(sample) - statistics.fmean(ref) if sample and ref else None
            out.append(
                Contrast(
                    mean, None, None, None, None, f"cannot tell ({fewest} seed{'s' if fewest != 1 else ''})"
                )
            )
        else:
            difference, low, high = difference_interval(sample, ref, level)
            p_holm = adjusted[i]
            if p_holm < alpha:
                said = f"{'worse' if difference > 0 else 'better'}, {_p(p_holm)}"
            else:
                said = f"within noise, {_p(p_holm)}"
            out.append(Contrast(difference, low, high, tests[i].p, p_holm, said))
    return out


def verdict(a: Sequence[float], reference: Sequence[float], alpha: float = DEFAULT_ALPHA) -> str:
    """A table cell: how the final losses ``a`` of one choice compare with the ``reference`` choice's,
    lower being better. ``"worse, p=0.003"``, ``"better, p=0.01"``, ``"within noise, p=0.41"``, or why it
    cannot tell."""
    if len(a) < 2 or len(reference) < 2:
        fewest = min(len(a), len(reference))
        return f"cannot tell ({fewest} seed{'s' if fewest != 1 else ''})"
    test = welch(a, reference)
    if test.p < alpha:
        return f"{'worse' if test.difference > 0 else 'better'}, {_p(test.p)}"
    return f"within noise, {_p(test.p)}"


def _p(p: float) -> str:
    return "p<0.001" if p < 0.001 else f"p={p:.2g}" if p < 0.1 else f"p={p:.2f}"
