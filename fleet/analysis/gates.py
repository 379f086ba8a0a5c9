"""The fixed-sample gates: each reads one window of both arms and says pass, pending or breach,
as a ``GateResult`` (observed vs allowed, in a unit, and why).

``fleet.analysis.canary.judge`` runs them at every tick at the policy's confidence;
``fleet.analysis.sequential`` runs ``samples``, ``predictions`` and ``exact_match`` at alpha
spent over its looks. None is judged before ``policy.min_samples`` per arm:

- ``error_rate``: canary − stable error rate against ``max_error_rate_increase`` as the
  margin, with the Farrington–Manning score test at ``confidence`` (exact p-values while
  the expected counts are small, where its normal approximation is too eager), in both
  directions:
  a breach needs confidence that the increase exceeds the margin, a pass needs confidence
  that it does not (non-inferiority). A +1 pp regression hides in a few hundred requests,
  so "no breach found yet" is not allowed to read as "fine". With a margin of 0 there is
  nothing to show non-inferiority against; the gate then passes when no increase is found.
- ``latency`` (``latency_p99``): breached when canary p99 / stable p99 (from the histograms,
  read as Prometheus ``histogram_quantile`` does) exceeds ``max_p99_ratio`` *and* an exact
  binomial test finds more than 1 % of canary requests slower than ``max_p99_ratio`` x stable
  p99 — the p99 claim itself, tested. It waits for enough stable requests that the stable p99
  can be bounded at ``confidence`` (299 at 95 %), since the limit is made of it. A one-sided
  Mann-Whitney U over the binned latencies (ties share ranks) says whether the whole
  distribution moved or only its tail; it does not decide, because requiring it misses
  tail-only regressions (simulated on bench/rollout.py's streams: a quarter of canaries
  whose slowest 3 % of requests are 8x slower were still undetected after 10 minutes).
- ``predictions``: PSI of canary vs stable score histograms above ``max_prediction_psi``,
  with a noncentral chi-square test that the populations' PSI exceeds it: at 50 rows per
  arm two samples of one model already differ by PSI ~0.2. The PSI is drift monitoring's
  (``fleet.analysis.drift.stats.psi``, half a count per used bin), so a limit means the same there.
- ``exact_match``: labelled answers' mismatches, by ``error_rate``'s test; never holds a step.
- ``shadow_agreement`` (``phase="shadow"`` with ``min_shadow_agreement`` set): binomial
  tests of the agreement rate against the minimum, both directions like ``error_rate``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import numpy as np
from scipy import stats

from fleet.analysis.drift.stats import psi
from fleet.analysis.histograms import count_above, histogram_quantile
from fleet.analysis.significance import error_test, growth_needed, more_samples, psi_above
from fleet.types import ArmWindow

Status = Literal["pass", "pending", "breach"]

_Q = 0.99  # the latency gate's quantile


@dataclass(frozen=True, slots=True)
class GateResult:
    """One gate's reading of the window: observed vs allowed, in ``unit``, and why."""

    gate: str  # samples | error_rate | latency_p99 | predictions | shadow_agreement | deadline
    status: Status
    observed: float | None  # None: nothing to observe yet
    allowed: float
    unit: str  # how observed/allowed read: "requests", "pp", "x", "psi", "fraction", "s"
    explanation: str
    p_value: float | None = None
    more_canary: int | None = 0  # estimated further canary samples to decide; None: unknown
    more_stable: int | None = 0


def percent(x: float) -> str:
    """A rate as people read it in an explanation: 0.0123 → "1.23 %"."""
    return f"{100 * x:.2f} %"


def points(x: float) -> str:
    """A difference of rates in percentage points, signed: 0.005 → "+0.50 pp"."""
    return f"{100 * x:+.2f} pp"


def samples(stable: ArmWindow, canary: ArmWindow, n: int) -> GateResult:
    short_c, short_s = max(0, n - canary.requests), max(0, n - stable.requests)
    observed = min(canary.requests, stable.requests)
    if short_c or short_s:
        what = "no data yet" if observed == 0 else "not enough data yet"
        expl = f"{what}: canary {canary.requests}, stable {stable.requests} requests, min_samples {n} per arm"
        return GateResult("samples", "pending", observed, n, "requests", expl, None, short_c, short_s)
    expl = f"canary {canary.requests}, stable {stable.requests} requests (min_samples {n} per arm)"
    return GateResult("samples", "pass", observed, n, "requests", expl)


def error_rate(stable: ArmWindow, canary: ArmWindow, n: int, margin: float, alpha: float) -> GateResult:
    xc, nc, xs, ns = canary.error_count, canary.requests, stable.error_count, stable.requests
    if nc < n or ns < n:
        return GateResult(
            "error_rate",
            "pending",
            None,
            margin,
            "pp",
            "waits for min_samples requests per arm",
            None,
            max(0, n - nc),
            max(0, n - ns),
        )
    diff = xc / nc - xs / ns
    p_worse, p_within, se = error_test(xc, nc, xs, ns, margin)
    rates = (
        f"canary {xc}/{nc} = {percent(xc / nc)}, stable {xs}/{ns} = {percent(xs / ns)}: "
        f"{points(diff)} vs allowed {points(margin)}"
    )
    conf = f"{1 - alpha:.0%}"
    if p_worse < alpha:
        return GateResult(
            "error_rate",
            "breach",
            diff,
            margin,
            "pp",
            f"error rate {rates}, above the margin at {conf} (p={p_worse:.2g})",
            p_worse,
        )
    if margin == 0.0 or p_within < alpha:
        shown = (
            f"no increase found (p={p_worse:.2g})"
            if margin == 0.0
            else f"within the margin at {conf} (p={p_within:.2g})"
        )
        return GateResult("error_rate", "pass", diff, margin, "pp", f"error rate {rates}, {shown}", p_within)
    gap = abs(diff - margin)
    more = growth_needed(z_needed=float(stats.norm.isf(alpha)), se=se, gap=gap)
    expl = f"error rate {rates}, not yet decided at {conf} (p={min(p_worse, p_within):.2g})"
    return GateResult(
        "error_rate",
        "pending",
        diff,
        margin,
        "pp",
        expl,
        min(p_worse, p_within),
        more_samples(nc, more),
        more_samples(ns, more),
    )


def stable_needed(n: int, alpha: float) -> int:
    """The stable requests the latency gates wait for: the limit is ``max_ratio`` x the stable
    p99, so that p99 must be known well enough — with fewer than log(alpha)/log(0.99) requests
    even their maximum may sit below it. (The other gates wait for ``min_samples``.)"""
    return max(n, math.ceil(math.log(alpha) / math.log(_Q)))


def latency(
    stable: ArmWindow,
    canary: ArmWindow,
    n: int,
    max_ratio: float,
    alpha: float,
    *,
    gate: str = "latency_p99",
    field: str = "latency_ms",
    floor_ms: float | None = None,
) -> GateResult:
    """p99 ratio of a millisecond histogram: latency (a generation's: to its first token), or
    with ``field="tpot_ms"`` a generation's time per output token. ``floor_ms``: against a
    baseline from another time (the 100 % step) a request is slow only above it too."""
    hc, hs = np.asarray(getattr(canary, field)), np.asarray(getattr(stable, field))
    nc, ns = int(hc.sum()), int(hs.sum())
    ns_needed = stable_needed(n, alpha)
    if nc < n or ns < ns_needed:
        return GateResult(
            gate,
            "pending",
            None,
            max_ratio,
            "x",
            f"waits for {n} canary and {ns_needed} stable answered requests (canary {nc}, stable {ns})",
            None,
            max(0, n - nc),
            max(0, ns_needed - ns),
        )
    p99c, p99s = histogram_quantile(_Q, hc), histogram_quantile(_Q, hs)
    ratio = p99c / p99s if p99s > 0 else (1.0 if p99c == 0 else math.inf)
    # canary p99 <= limit means at most 1 % of canary requests are slower than the limit
    limit = max(max_ratio * p99s, floor_ms or 0.0)
    slower = min(nc, round(count_above(hc, limit)))
    p_tail = float(stats.binomtest(slower, nc, 1 - _Q, alternative="greater").pvalue)
    idx = np.arange(len(hc))  # bucket index as the value: ties within a bucket share their rank
    ranks = stats.mannwhitneyu(np.repeat(idx, hc), np.repeat(idx, hs), alternative="greater", method="asymptotic")
    p_rank = float(ranks.pvalue)
    shape = (
        "the rank test finds it slower overall too"
        if p_rank < alpha
        else "the rank test finds no overall slowdown: a slower tail"
    )
    what = "p99" if field == "latency_ms" else "p99 time per output token:"
    reading = (
        f"{what} canary {p99c:.1f} ms / stable {p99s:.1f} ms = {ratio:.2f}x vs allowed {max_ratio:g}x; "
        f"{slower}/{nc} canary requests above {limit:.1f} ms"
        + (" (bake_latency_floor_ms: the baseline is from before)" if limit > max_ratio * p99s else "")
    )
    if ratio > max_ratio and p_tail < alpha:
        return GateResult(
            gate,
            "breach",
            float(ratio),
            max_ratio,
            "x",
            f"{reading}, more than 1 % at {1 - alpha:.0%} (p={p_tail:.2g}); {shape} (Mann-Whitney p={p_rank:.2g})",
            p_tail,
        )
    why = "within the limit" if ratio <= max_ratio else f"not significantly more than 1 % (p={p_tail:.2g})"
    return GateResult(gate, "pass", float(ratio), max_ratio, "x", f"{reading}: {why}", p_tail)


def predictions(
    stable: ArmWindow,
    canary: ArmWindow,
    n: int,
    max_psi: float,
    alpha: float,
    *,
    gate: str = "predictions",
    field: str = "predictions",
    what: str = "scores",
) -> GateResult:
    """PSI of two histograms: predicted scores, or with ``field="output_tokens"`` a
    generation's output lengths."""
    pc, ps = np.asarray(getattr(canary, field)), np.asarray(getattr(stable, field))
    nc, ns = int(pc.sum()), int(ps.sum())
    if nc < n or ns < n:
        return GateResult(
            gate,
            "pending",
            None,
            max_psi,
            "psi",
            f"waits for min_samples {'prediction rows' if field == 'predictions' else 'answers'} per arm "
            f"(canary {nc}, stable {ns})",
            None,
            max(0, n - nc),
            max(0, n - ns),
        )
    value, p = float(psi(pc, ps)), psi_above(pc, ps, max_psi)
    # two samples of one distribution differ by chance by about (bins-1)(1/nc + 1/ns)
    noise = (np.count_nonzero(pc + ps) - 1) * (1 / nc + 1 / ns)
    reading = (
        f"PSI of canary vs stable {what} {value:.3f} vs allowed {max_psi:g} "
        f"(sampling noise alone gives ~{noise:.3f} at these counts)"
    )
    if value > max_psi and p < alpha:
        return GateResult(
            gate, "breach", value, max_psi, "psi", f"{reading}, above the limit at {1 - alpha:.0%} (p={p:.2g})", p
        )
    why = "within the limit" if value <= max_psi else f"not significantly above it (p={p:.2g})"
    return GateResult(gate, "pass", value, max_psi, "psi", f"{reading}: {why}", p)


def exact_match(stable: ArmWindow, canary: ArmWindow, n: int, margin: float, alpha: float) -> GateResult:
    """Exact-match feedback: the canary's share of mismatched answers against the stable's, by
    the error-rate gate's non-inferiority test. Labels arrive when callers send them, if ever:
    too few is a pass that says so (it never holds a step), and a canary not shown worse
    passes; only one significantly worse than the margin breaches."""
    xc, nc, xs, ns = (
        canary.labelled - canary.matched,
        canary.labelled,
        stable.labelled - stable.matched,
        stable.labelled,
    )
    if nc < n or ns < n:
        return GateResult(
            "exact_match",
            "pass",
            None,
            margin,
            "pp",
            f"not judged: {nc} canary and {ns} stable labels, min_labels {n} per arm",
        )
    drop = (ns - xs) / ns - (nc - xc) / nc  # of the match rate, canary below stable
    p_worse, p_within, _ = error_test(xc, nc, xs, ns, margin)
    rates = (
        f"exact match canary {nc - xc}/{nc} = {percent((nc - xc) / nc)}, stable {ns - xs}/{ns} = "
        f"{percent((ns - xs) / ns)}: a drop of {points(drop)} vs allowed {points(margin)}"
    )
    if p_worse < alpha:
        return GateResult(
            "exact_match",
            "breach",
            drop,
            margin,
            "pp",
            f"{rates}, beyond the margin at {1 - alpha:.0%} (p={p_worse:.2g})",
            p_worse,
        )
    return GateResult(
        "exact_match", "pass", drop, margin, "pp", f"{rates}, not shown beyond it (p={p_worse:.2g})", p_within
    )


def shadow_agreement(shadow: ArmWindow, n: int, minimum: float, alpha: float) -> GateResult:
    k, pairs = shadow.shadow_agreed, shadow.shadow_pairs
    if pairs < n:
        return GateResult(
            "shadow_agreement",
            "pending",
            None,
            minimum,
            "fraction",
            f"waits for min_samples answered shadow pairs ({pairs} of {n})",
            None,
            n - pairs,
            0,
        )
    rate = k / pairs
    reading = f"shadow agreed on {k}/{pairs} = {percent(rate)} vs required {percent(minimum)}"
    p_below = float(stats.binomtest(k, pairs, minimum, alternative="less").pvalue) if minimum > 0 else 1.0
    if p_below < alpha:
        return GateResult(
            "shadow_agreement",
            "breach",
            rate,
            minimum,
            "fraction",
            f"{reading}, below it at {1 - alpha:.0%} (p={p_below:.2g})",
            p_below,
        )
    # at a minimum of 1.0 nothing can be shown "above" it: all pairs agreeing is the pass
    p_above = float(stats.binomtest(k, pairs, minimum, alternative="greater").pvalue) if minimum < 1 else 0.0
    if p_above < alpha:
        return GateResult(
            "shadow_agreement",
            "pass",
            rate,
            minimum,
            "fraction",
            f"{reading}, at or above it at {1 - alpha:.0%} (p={p_above:.2g})",
            p_above,
        )
    se = math.sqrt(minimum * (1 - minimum) / pairs)
    more = growth_needed(z_needed=float(stats.norm.isf(alpha)), se=se, gap=abs(rate - minimum))
    return GateResult(
        "shadow_agreement",
        "pending",
        rate,
        minimum,
        "fraction",
        f"{reading}, not yet decided (p={min(p_below, p_above):.2g})",
        min(p_below, p_above),
        more_samples(pairs, more),
        0,
    )
