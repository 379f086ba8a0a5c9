"""Anytime-valid statistics: e-processes and confidence sequences, pure functions of counts.

An *e-process* is a product of likelihood ratios, averaged over a few alternatives, that is a
nonnegative supermartingale while the null holds (here: the canary no worse than stable). By
Ville's inequality it ever reaches ``1/alpha`` with probability at most ``alpha``, however often
it is looked at and whenever the looking stops (Ramdas, Grünwald, Vovk & Shafer,
"Game-theoretic statistics and safe anytime-valid inference", Statistical Science 2023).
Confidence sequences are the same idea read as intervals (Howard, Ramdas, McAuliffe & Sekhon,
"Time-uniform, nonparametric, nonasymptotic confidence sequences", Annals of Statistics 2021).

- ``ErrorHarm``: is the canary's error rate above the stable's? Each tick, given how many
  errors both arms made together, the number that fell on the canary is binomial with the
  canary's share of the requests when the rates are equal (conditioning removes the
  unknown rate). Against rate ratios ``PSI_GRID`` this is a mixture of likelihood ratios. The
  exact law of that count is hypergeometric, smaller than the binomial in the convex order
  (Hoeffding 1963), so the process stays a supermartingale; with the canary better, more so.
- ``TailHarm``: are more than 1 % (``TAIL_NULL``) of the canary's answers above a limit? A
  one-sample mixture of binomial likelihood ratios against 1 %, over the shares ``TAIL_GRID``.
- ``bernoulli_bounds``: a confidence sequence for one arm's rate (Robbins' beta-binomial
  mixture, a mixture over three priors so that rare and common events both get tight bounds).

``fleet.analysis.sequential`` builds the rollout's gates from them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy import optimize

PSI_GRID = (2.0, 4.0, 10.0, 30.0)  # error-rate ratios the harm test bets on
TAIL_GRID = (0.02, 0.035, 0.06, 0.1, 0.18, 0.32)  # share of canary answers above the limit, vs 1 %
TAIL_NULL = 0.01  # p99: at most 1 % of answers above it
BETA_PRIORS = ((1.0, 30.0), (1.0, 300.0), (1.0, 3000.0))  # Beta(a, b) mixed for one arm's rate


def _logmeanexp(values) -> float:  # noqa: ANN001
    """log(mean(exp(values))) without overflow (plain Python: scipy's costs 100x on 4 values)."""
    values = [float(v) for v in values]
    top = max(values)
    return top + math.log(sum(math.exp(v - top) for v in values) / len(values))


def _start(log_e: tuple[float, ...], k: int) -> np.ndarray:
    if log_e and len(log_e) != k:
        raise ValueError(f"stored evidence has {len(log_e)} alternatives, expected {k}: it was kept by another version")
    return np.asarray(log_e) if log_e else np.zeros(k)


@dataclass(frozen=True)
class ErrorHarm:
    """The conditional test of "canary errors more often than stable": log e-value per rate
    ratio in ``PSI_GRID``, equally weighted. ``update`` takes one tick's counts."""

    log_e: tuple[float, ...] = ()  # one per PSI_GRID value; () before any evidence

    def update(self, canary_requests: int, canary_errors: int, stable_requests: int, stable_errors: int) -> ErrorHarm:
        errors = canary_errors + stable_errors
        if errors == 0 or canary_requests == 0 or stable_requests == 0:
            return self  # nothing to compare this tick: the likelihood ratio is 1
        psi = np.asarray(PSI_GRID)
        q0 = canary_requests / (canary_requests + stable_requests)
        q1 = psi * canary_requests / (psi * canary_requests + stable_requests)
        step = canary_errors * np.log(q1 / q0) + stable_errors * np.log((1 - q1) / (1 - q0))
        return ErrorHarm(tuple((_start(self.log_e, len(psi)) + step).tolist()))

    @property
    def e_value(self) -> float:
        return math.exp(min(_logmeanexp(np.asarray(self.log_e)), 700.0)) if self.log_e else 1.0


@dataclass(frozen=True)
class TailHarm:
    """The one-sample test of "more than 1 % of canary answers are above the limit": log
    e-value per alternative share in ``TAIL_GRID``. ``update`` takes one tick's canary answers
    and how many were above the limit (fractional: read inside a histogram bucket)."""

    log_e: tuple[float, ...] = ()  # one per TAIL_GRID value; () before any evidence

    def update(self, answered: int, above: float) -> TailHarm:
        if answered <= 0:
            return self
        above = min(max(above, 0.0), float(answered))
        p1 = np.asarray(TAIL_GRID)
        step = above * np.log(p1 / TAIL_NULL) + (answered - above) * np.log((1 - p1) / (1 - TAIL_NULL))
        return TailHarm(tuple((_start(self.log_e, len(p1)) + step).tolist()))

    @property
    def e_value(self) -> float:
        return math.exp(min(_logmeanexp(np.asarray(self.log_e)), 700.0)) if self.log_e else 1.0


def _log_mixture(x: float, n: float, p: float) -> float:
    """log of the beta-binomial mixture martingale for "the rate is p" after x events in n."""
    terms = [_betaln(a + x, b + n - x) - _betaln(a, b) for a, b in BETA_PRIORS]
    return _logmeanexp(terms) - (x * math.log(p) + (n - x) * math.log1p(-p))


def _betaln(a: float, b: float) -> float:
    return math.lgamma(a) + math.lgamma(b) - math.lgamma(a + b)


def bernoulli_bounds(x: float, n: float, level: float) -> tuple[float, float]:
    """(lower, upper): a confidence sequence for a rate after ``x`` events in ``n`` trials,
    holding at every n at once with probability at least ``1 - level`` (each side
    ``level``: ask for the side you need). ``(0, 40, 0.05)`` → ``(0.0, ~0.078)``."""
    if n <= 0:
        return 0.0, 1.0
    x = min(max(x, 0.0), n)
    threshold = math.log(1 / level)
    mle = x / n

    def over(p: float) -> float:
        return _log_mixture(x, n, p) - threshold

    tiny = 1e-12
    at = min(max(mle, tiny), 1 - tiny)
    lo = hi = mle
    if over(at) < 0:  # the estimate itself is in the sequence (it always is but at tiny n)
        lo = optimize.brentq(over, tiny, at, xtol=1e-10) if over(tiny) > 0 else 0.0
        hi = optimize.brentq(over, at, 1 - tiny, xtol=1e-10) if over(1 - tiny) > 0 else 1.0
    return lo, hi
