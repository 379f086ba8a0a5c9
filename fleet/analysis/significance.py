"""The fixed-sample significance tests the gates use, and how much more data would decide one.

- ``error_test``: canary − stable error rate against a margin, both directions (the
  Farrington–Manning score test, exact while the expected counts are small).
- ``psi_above`` / ``psi_within``: the populations' PSI above / below a limit, from two
  histograms (a noncentral chi-square).
- ``growth_needed`` / ``more_samples``: a test still undecided, the further samples that
  would decide it at its current effect.

Pure functions of counts; ``fleet.analysis.canary``'s gates call them at every look, and
``fleet.analysis.sequential`` at alpha spent over its looks.
"""

from __future__ import annotations

import math

import numpy as np
from scipy import stats

from fleet.analysis.drift.stats import psi

_LARGE_COUNTS = 30  # expected errors and successes per arm from which the normal approximation holds
_MORE_CAP = 10_000_000  # "more needed" estimates past this are reported as unknown (None)


def psi_above(actual: np.ndarray, expected: np.ndarray, limit: float) -> float:
    """p-value of "the populations' PSI is at most ``limit``" given these two histograms.

    PSI x n_eff (n_eff = 1 / (1/n1 + 1/n2)) is about chi-square with (bins - 1) degrees of
    freedom and noncentrality PSI x n_eff (PSI is a symmetrised KL divergence; to second
    order it is Pearson's chi-square divergence). So the test is the tail of a noncentral
    chi-square at noncentrality ``limit`` x n_eff, and small samples, whose PSI is inflated
    by noise, need a larger PSI to breach. The degrees of freedom count the bins either arm
    has, the ones ``psi`` smooths and sums; its half count per bin keeps the statistic near
    Pearson's at 50 rows an arm, where a fixed epsilon (1e-4) reads one stray row as 0.1.
    """
    n1, n2 = float(np.sum(actual)), float(np.sum(expected))
    dof = np.count_nonzero(np.asarray(actual) + np.asarray(expected)) - 1
    if dof < 1:
        return 1.0
    n_eff = 1 / (1 / n1 + 1 / n2)
    return float(stats.ncx2.sf(float(psi(actual, expected)) * n_eff, dof, limit * n_eff))


def psi_within(actual: np.ndarray, expected: np.ndarray, limit: float) -> float:
    """p-value of "the populations' PSI is at least ``limit``": ``psi_above``'s other side.

    The noncentral chi-square grows stochastically with its noncentrality, so a statistic in
    the lower tail at noncentrality ``limit`` x n_eff is at least as unlikely for any PSI
    above the limit: small p shows the PSI within it (non-inferiority, as ``error_test``'s
    second p-value shows an error rate within its margin).
    """
    n1, n2 = float(np.sum(actual)), float(np.sum(expected))
    dof = np.count_nonzero(np.asarray(actual) + np.asarray(expected)) - 1
    if dof < 1:
        return 0.0  # one bin used by both: the histograms are the same
    n_eff = 1 / (1 / n1 + 1 / n2)
    return float(stats.ncx2.cdf(float(psi(actual, expected)) * n_eff, dof, limit * n_eff))


def _fm(x1, n1: int, x2, n2: int, delta: float):
    """Farrington–Manning score statistic for H0: p1 − p2 = delta, elementwise over counts.

    Returns (z, se, r1, r2): r1, r2 maximise the likelihood under p1 − p2 = delta (closed
    form, Farrington & Manning 1990) and give the SE, so zero errors still give a real SE.
    """
    p1, p2, theta = np.asarray(x1, dtype=np.float64) / n1, np.asarray(x2, dtype=np.float64) / n2, n2 / n1
    a = 1 + theta
    b = -(1 + theta + p1 + theta * p2 + delta * (theta + 2))
    c = delta * delta + delta * (2 * p1 + theta + 1) + p1 + theta * p2
    d = -p1 * delta * (1 + delta)
    v = b**3 / (3 * a) ** 3 - b * c / (6 * a * a) + d / (2 * a)
    u = np.copysign(np.sqrt(np.maximum(b * b / (3 * a) ** 2 - c / (3 * a), 0.0)), v)
    with np.errstate(divide="ignore", invalid="ignore"):
        w = np.where(u != 0, (np.pi + np.arccos(np.clip(v / u**3, -1.0, 1.0))) / 3, 0.0)
    r1 = np.clip(2 * u * np.cos(w) - b / (3 * a), 0.0, 1.0)
    r2 = np.clip(r1 - delta, 0.0, 1.0)
    se = np.sqrt(r1 * (1 - r1) / n1 + r2 * (1 - r2) / n2)
    diff = p1 - p2 - delta
    with np.errstate(divide="ignore", invalid="ignore"):  # se 0: all-success arms and delta 0
        z = np.where(se > 0, diff / se, np.where(diff == 0, 0.0, np.copysign(np.inf, diff)))
    return z, se, r1, r2


def error_test(x1: int, n1: int, x2: int, n2: int, delta: float) -> tuple[float, float, float]:
    """(p that p1 − p2 > delta, p that p1 − p2 < delta, SE) for x1/n1 (canary) vs x2/n2.

    The normal approximation of the score statistic is too kind at small expected counts
    (2/84 vs 0/306 against a 0.5 pp margin reads p = 0.008; the truth is ~0.2), so there
    the p-values are exact sums over both binomials at the restricted MLE (Krishnamoorthy's
    E-test); with 30+ expected errors and successes per arm the approximation is used.
    """
    z, se, r1, r2 = (float(t) for t in _fm(x1, n1, x2, n2, delta))
    if min(n1 * r1, n1 * (1 - r1), n2 * r2, n2 * (1 - r2)) >= _LARGE_COUNTS:
        return float(stats.norm.sf(z)), float(stats.norm.cdf(z)), se
    k1, k2 = _support(n1, r1), _support(n2, r2)
    mass = np.outer(stats.binom.pmf(k1, n1, r1), stats.binom.pmf(k2, n2, r2))
    grid = _fm(k1[:, None], n1, k2[None, :], n2, delta)[0]
    tie = 1e-9 * max(1.0, abs(z))  # the observed table itself counts on both sides
    return float(mass[grid >= z - tie].sum()), float(mass[grid <= z + tie].sum()), se


def _support(n: int, p: float) -> np.ndarray:
    """Counts of Binomial(n, p) outside of which less than 1e-12 of the mass lies."""
    lo, hi = stats.binom.ppf(1e-12, n, p), stats.binom.isf(1e-12, n, p)
    return np.arange(int(max(lo, 0)), int(min(hi, n)) + 1)


def growth_needed(z_needed: float, se: float, gap: float) -> float | None:
    """Factor by which every arm must grow for |gap| to reach z_needed standard errors."""
    if gap <= 0 or se <= 0:
        return None
    return max(1.0, (z_needed * se / gap) ** 2)


def more_samples(n: int, factor: float | None) -> int | None:
    """Further samples an arm of ``n`` needs to grow by ``factor``; None: unknown or out of reach."""
    if factor is None or n * (factor - 1) > _MORE_CAP:
        return None
    return math.ceil(n * (factor - 1))
