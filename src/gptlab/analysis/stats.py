"""Is one choice better than another beyond the noise between seeds?

Welch's t-test (Welch 1947, "The generalization of 'Student's' problem when several different population
variances are involved") compares two means without assuming equal variances: t = (m1 - m2) / sqrt(s1²/n1 +
s2²/n2), with the Welch-Satterthwaite degrees of freedom. scipy computes it (``scipy.stats.ttest_ind`` with
``equal_var=False``); this module decides what a table cell says about it.
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
