"""The drift statistics, vectorised and pure: PSI, Jensen-Shannon, Wasserstein-1, KS.

Each is checked against scipy in tests/test_drift.py. PSI takes counts per bin and JS counts
or proportions, one row per feature (a 1-D array is one feature); Wasserstein and KS take two
sorted samples. ``psi`` is the fleet's only PSI: drift monitoring, the canary's prediction
gate (``fleet.analysis.gates``) and retraining's expected shift (``flows/retrain.py``) all read it.
"""

from __future__ import annotations

import numpy as np
from scipy import special, stats

PSI_SMOOTHING = 0.5  # counts added to each bin that either histogram has
KS_EXACT_N = 10_000  # effective sample size up to which the KS p-value is scipy's own


# -- statistics over histograms: rows are features, columns bins (1-D works too) -------------
def psi(reference: np.ndarray, current: np.ndarray) -> np.ndarray:
    """Population stability index of two histograms of counts over the same bins: Σ (r − c)·ln(r / c).

    r and c are the proportions after half a count is added to every bin that either side
    has (Jeffreys' prior); bins empty on both sides are left out, so unused bins of a layout
    change nothing. An empty bin thus costs what half an observation would at that sample
    size: finite, and vanishing as the sample grows. A fixed epsilon (Evidently's 1e-4)
    instead charges 0.1 of PSI for one row in 50 that the other side lacks, at any size,
    which swamps small samples (the canary gate judges 50 rows a side) and makes PSI x n
    useless as a chi-square statistic. With counts in every bin the smoothing moves PSI by
    O(bins / n). The arguments commute; [10, 10] vs [5, 15] → (5/21)·ln(31/11) ≈ 0.247
    (unsmoothed 0.25·ln 3 ≈ 0.275). A side without any count gives NaN: nothing to compare.
    """
    r, c = np.asarray(reference, dtype=np.float64), np.asarray(current, dtype=np.float64)
    used = (r + c) > 0
    empty = (r.sum(axis=-1) == 0) | (c.sum(axis=-1) == 0)
    r, c = np.where(used, r + PSI_SMOOTHING, 0.0), np.where(used, c + PSI_SMOOTHING, 0.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        r, c = r / r.sum(axis=-1, keepdims=True), c / c.sum(axis=-1, keepdims=True)
        terms = np.where(used, (r - c) * np.log(r / c), 0.0)
    return np.where(empty, np.nan, terms.sum(axis=-1))[()]  # [()]: a number for one histogram


def js_distance(reference: np.ndarray, current: np.ndarray) -> np.ndarray:
    """Jensen-Shannon distance, base 2, of distributions (rows normalised to sum 1): 0..1."""
    p, q = np.asarray(reference, float), np.asarray(current, float)
    p = p / p.sum(axis=-1, keepdims=True)
    q = q / q.sum(axis=-1, keepdims=True)
    m = (p + q) / 2
    divergence = (special.rel_entr(p, m).sum(axis=-1) + special.rel_entr(q, m).sum(axis=-1)) / 2
    return np.sqrt(np.maximum(divergence / np.log(2), 0.0))


def wasserstein(u: np.ndarray, v: np.ndarray) -> float:
    """Wasserstein-1 of two sorted samples: ∫ |F_u − F_v| dx (scipy's algorithm, no re-sort).

    Merges u into v by position, so one O(len u · log len v) search and O(n) passes replace
    scipy's two argsorts and two searchsorted calls over the pooled data.
    """
    m, n = u.size, v.size
    at = np.searchsorted(v, u, side="left") + np.arange(m)  # where each u lands in the merge
    is_u = np.zeros(m + n, dtype=bool)
    is_u[at] = True
    merged = np.empty(m + n)
    merged[at] = u
    merged[~is_u] = v
    cu = np.cumsum(is_u)[:-1]
    cv = np.arange(1, m + n) - cu
    # ties sit side by side with zero width, so counts are only used where they are complete
    return float(np.abs(cu / m - cv / n) @ np.diff(merged))


def _ks_sketch(u: np.ndarray, v: np.ndarray, lo: float, hi: float) -> float:
    """KS statistic of the sample a sketch of midpoint quantiles stands for, against v.

    The sketch's own step CDF is off by up to 1/(2·len u) everywhere, which at large n is a
    third of the statistic's noise. The CDF through (lo, 0), (u_i, (i + ½)/len u), (hi, 1) is
    within a few 1e-5 of the full sample's for continuous data; it is continuous and v's is a
    step function, so the sup lies at v's values, from either side.
    """
    levels = np.concatenate(([0.0], (np.arange(u.size) + 0.5) / u.size, [1.0]))
    lo, hi = min(lo, u[0]), max(hi, u[-1])  # the stored sketch is rounded; min and max are not
    f = np.interp(v, np.concatenate(([lo], u, [hi])), levels)
    rank = np.arange(v.size, dtype=np.float64)
    return float(max(np.abs(f - (rank + 1) / v.size).max(), np.abs(f - rank / v.size).max()))


def ks(
    u: np.ndarray, v: np.ndarray, n_reference: int | None = None, *, bounds: tuple[float, float] | None = None
) -> tuple[float, float]:
    """KS statistic of two sorted samples, and the asymptotic two-sided p-value.

    F_u only steps at u's values, so the sup of |F_u − F_v| lies at a value of u or just below
    one: 2·len(u) searches in v replace scipy's search of every pooled value. ``n_reference``:
    the size u stands for (u may be a sketch of a larger sample); default len(u). When u is
    such a sketch, with distinct values and the sample's (min, max) as ``bounds``, the
    statistic is the sample's as the sketch's interpolated CDF estimates it (``_ks_sketch``);
    with ties (discrete data, whose CDF is a step function anyway) the sketch's own.
    p-value: scipy's for an effective n = n_u·n_v/(n_u + n_v) up to ``KS_EXACT_N``, the
    corrected limiting Kolmogorov distribution above.
    """
    m = float(n_reference or u.size)
    if bounds is not None and m > u.size and (np.diff(u) > 0).all():
        d = _ks_sketch(u, v, *bounds)
    else:
        values, first = np.unique(u, return_index=True)
        cum_u = np.append(first[1:], u.size) / u.size  # F_u at each distinct value
        before_u = np.concatenate(([0.0], cum_u[:-1]))  # F_u just below it
        at_v = np.searchsorted(v, values, side="right") / v.size
        below_v = np.searchsorted(v, values, side="left") / v.size
        d = float(max(np.abs(cum_u - at_v).max(), np.abs(before_u - below_v).max()))
    en = np.round(m * v.size / (m + v.size))
    if en <= KS_EXACT_N:
        p = stats.kstwo.sf(d, en)  # what ks_2samp(method="asymp") computes
    else:
        # kstwo's exact sums take from 10 ms to a second each above this size. The limiting
        # distribution at √n·d + 1/(6√n) (its first-order finite-n correction) is within
        # 0.5 % of kstwo for p > 1e-10 from n = 10^4, 0.05 % from 10^5; KS only informs.
        root = np.sqrt(en)
        p = stats.kstwobign.sf(d * root + 1 / (6 * root))
    return d, float(np.clip(p, 0.0, 1.0))
