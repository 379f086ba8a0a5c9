"""Canary verdicts: one pure function from an analysis window of both arms to advance, hold
or roll back.

``judge(stable, canary, policy, step_started=t0)`` → ``Verdict``. How a rollout uses it,
one tick every ``policy.analysis_window_s``:

- A step starts at ``t0`` when its weight is set. Each tick reads both arms over
  ``[t0, now)`` — cumulative over the step, so a low-traffic canary gathers evidence tick
  after tick instead of failing on thin windows (flagger#1035, argo-rollouts#1466).
- ``advance``: every gate passed; set the next weight and start a new step.
  ``rollback``: a gate is breached (each breach says observed vs allowed), or the step was
  still undecided at ``t0 + policy.hold_deadline_s`` (the ``deadline`` gate, naming what
  stayed undecided). ``hold``: not enough data yet; ``more_canary`` / ``more_stable``
  estimate how many further requests would decide it, ``deadline`` says when holding fails.
- At 100 % the stable arm serves nothing: pass the stable window of the previous step as
  the baseline, or the step holds until its deadline.

Gates (``policy.gates``), none judged before ``policy.min_samples`` per arm:

- ``error_rate``: canary − stable error rate against ``max_error_rate_increase`` as the
  margin, with the Farrington–Manning score test at ``confidence`` (exact p-values while
  the expected counts are small, where its normal approximation is too eager), in both
  directions:
  a breach needs confidence that the increase exceeds the margin, a pass needs confidence
  that it does not (non-inferiority). A +1 pp regression hides in a few hundred requests,
  so "no breach found yet" is not allowed to read as "fine". With a margin of 0 there is
  nothing to show non-inferiority against; the gate then passes when no increase is found.
- ``latency_p99``: breached when canary p99 / stable p99 (from the histograms, read as
  Prometheus ``histogram_quantile`` does) exceeds ``max_p99_ratio`` *and* an exact binomial
  test finds more than 1 % of canary requests slower than ``max_p99_ratio`` x stable p99 —
  the p99 claim itself, tested. It waits for enough stable requests that the stable p99 can
  be bounded at ``confidence`` (299 at 95 %), since the limit is made of it. A one-sided
  Mann-Whitney U over the binned latencies (ties share ranks) says whether the whole
  distribution moved or only its tail; it does not decide, because requiring it misses
  tail-only regressions (simulated on bench/rollout.py's streams: a quarter of canaries
  whose slowest 3 % of requests are 8x slower were still undetected after 10 minutes).
- ``predictions``: PSI of canary vs stable score histograms above ``max_prediction_psi``,
  with a noncentral chi-square test that the populations' PSI exceeds it: at 50 rows per
  arm two samples of one model already differ by PSI ~0.2. The PSI is drift monitoring's
  (``fleet.analysis.drift.stats.psi``, half a count per used bin), so a limit means the same there.
- ``shadow_agreement`` (``phase="shadow"`` with ``min_shadow_agreement`` set): binomial
  tests of the agreement rate against the minimum, both directions like ``error_rate``.

Each tick is one look at the policy's confidence, so a long step is many looks; the
margins and tests above keep false rollbacks of whole rollouts at about 1 % at the
bench's 20 req/s (bench/rollout.py). Windows up to ``hold_deadline_s`` long must be
readable: the gateway source keeps 900 s, or sum tick windows with
``fleet.analysis.sources.sum_windows``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Literal

import numpy as np
from scipy import stats

from fleet.analysis.drift.stats import psi
from fleet.catalog.policies.rollout import RolloutPolicy
from fleet.types import LATENCY_BUCKETS_MS, N_OUTPUT_TOKENS, ArmWindow

N_LATENCY = len(LATENCY_BUCKETS_MS) + 1

Outcome = Literal["advance", "hold", "rollback"]
Status = Literal["pass", "pending", "breach"]
Phase = Literal["canary", "shadow"]

_Q = 0.99  # the latency gate's quantile
_LARGE_COUNTS = 30  # expected errors and successes per arm from which the normal approximation holds
_MORE_CAP = 10_000_000  # "more needed" estimates past this are reported as unknown (None)


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


@dataclass(frozen=True, slots=True)
class Verdict:
    outcome: Outcome
    gates: tuple[GateResult, ...]
    at: float  # end of the judged window (unix seconds)
    deadline: float  # a hold at or after this time is a rollback
    canary_requests: int
    stable_requests: int
    summary: str
    more_canary: int | None = 0  # the most any pending gate still needs; None: unknown
    more_stable: int | None = 0

    @property
    def breaches(self) -> tuple[GateResult, ...]:
        return tuple(g for g in self.gates if g.status == "breach")

    @property
    def pending(self) -> tuple[GateResult, ...]:
        return tuple(g for g in self.gates if g.status == "pending")

    def table(self) -> list[dict[str, str]]:
        """Rows for a Prefect table artifact: gate, status, observed, allowed, explanation."""
        return [
            {
                "gate": g.gate,
                "status": g.status,
                "observed": _show(g.observed, g.unit),
                "allowed": _show_limit(g),
                "explanation": g.explanation,
            }
            for g in self.gates
        ]


def judge(
    stable: ArmWindow,
    canary: ArmWindow,
    policy: RolloutPolicy,
    *,
    step_started: float,
    phase: Phase = "canary",
    concurrent: bool = True,
) -> Verdict:
    """Judge one window of both arms; ``step_started`` is when the step's weight was set.

    (stable, canary, policy, t0) → Verdict(outcome, gates, deadline, more_canary, ...).
    Time is the canary window's end, never the clock, so the same inputs give the same verdict.
    In the shadow phase ``canary`` is the shadow version's window (mirrored traffic), whose
    ``shadow_pairs`` / ``shadow_agreed`` the ``shadow_agreement`` gate reads.
    ``concurrent=False``: ``stable`` is a baseline from another time (the 100 % step), not
    the same traffic; predictions then cannot be compared (the inputs differ) and that gate
    is left to the steps before, where both arms saw the same requests.
    """
    gates_policy, n = policy.gates, policy.min_samples
    alpha = 1.0 - gates_policy.confidence
    # a generative model's policy (fleet.yaml's rollout "generative") sets the generation gates
    generative = gates_policy.max_tpot_p99_ratio is not None or gates_policy.max_output_length_psi is not None
    results = [
        _samples(stable, canary, n),
        _error_rate(stable, canary, n, gates_policy.max_error_rate_increase, alpha),
        _latency(stable, canary, n, gates_policy.max_p99_ratio, alpha),
        _predictions(stable, canary, n, gates_policy.max_prediction_psi, alpha)
        if concurrent and not generative
        else GateResult(
            "predictions",
            "pass",
            None,
            gates_policy.max_prediction_psi,
            "psi",
            "not judged: a generation predicts no scores (output_length judges its answers)"
            if generative
            else "not judged against a baseline from another time: the inputs differ; the steps before "
            "compared both arms on the same traffic",
        ),
    ]
    if gates_policy.max_tpot_p99_ratio is not None:  # a generative model's policy
        results.append(
            _latency(
                _histogram(stable, "tpot_ms"),
                _histogram(canary, "tpot_ms"),
                n,
                gates_policy.max_tpot_p99_ratio,
                alpha,
                gate="tpot_p99",
                field="tpot_ms",
            )
        )
    if gates_policy.max_output_length_psi is not None:
        results.append(
            _predictions(
                _histogram(stable, "output_tokens"),
                _histogram(canary, "output_tokens"),
                n,
                gates_policy.max_output_length_psi,
                alpha,
                gate="output_length",
                field="output_tokens",
                what="output lengths",
            )
        )
    if gates_policy.max_exact_match_drop is not None and phase != "shadow":
        results.append(_exact_match(stable, canary, gates_policy.min_labels, gates_policy.max_exact_match_drop, alpha))
    if phase == "shadow" and gates_policy.min_shadow_agreement is not None:
        results.append(_shadow(canary, n, gates_policy.min_shadow_agreement, alpha))
    at, deadline = canary.end, step_started + policy.hold_deadline_s
    breached = [g for g in results if g.status == "breach"]
    pending = [g for g in results if g.status == "pending"]
    if breached:
        outcome: Outcome = "rollback"
        summary = "roll back: " + "; ".join(g.explanation for g in breached)
    elif not pending:
        outcome, summary = "advance", "advance: every gate passed"
    elif at >= deadline:
        outcome = "rollback"
        undecided = ", ".join(f"{g.gate} ({_more_text(g)})" for g in pending)
        expl = (
            f"still undecided {at - step_started:.0f} s into the step, hold_deadline_s is "
            f"{policy.hold_deadline_s:g} s: {undecided}"
        )
        results.append(GateResult("deadline", "breach", at - step_started, policy.hold_deadline_s, "s", expl))
        summary = "roll back: " + expl
    else:
        outcome = "hold"
        # before min_samples every gate waits for the same thing: say it once
        shown = [g for g in pending if g.gate == "samples"] or pending
        summary = f"hold (a failure from {_clock(deadline)} on): " + "; ".join(g.explanation for g in shown)
    return Verdict(
        outcome=outcome,
        gates=tuple(results),
        at=at,
        deadline=deadline,
        canary_requests=canary.requests,
        stable_requests=stable.requests,
        summary=summary,
        more_canary=_most(g.more_canary for g in pending),
        more_stable=_most(g.more_stable for g in pending),
    )


# -- gates ------------------------------------------------------------------------------------


def _histogram(window: ArmWindow, field: str) -> ArmWindow:
    """``window`` with a generation histogram of zeros when it served none (nothing to judge yet)."""
    if getattr(window, field):
        return window
    return dataclasses.replace(window, **{field: (0,) * (N_LATENCY if field == "tpot_ms" else N_OUTPUT_TOKENS)})


def _samples(stable: ArmWindow, canary: ArmWindow, n: int) -> GateResult:
    short_c, short_s = max(0, n - canary.requests), max(0, n - stable.requests)
    observed = min(canary.requests, stable.requests)
    if short_c or short_s:
        what = "no data yet" if observed == 0 else "not enough data yet"
        expl = f"{what}: canary {canary.requests}, stable {stable.requests} requests, min_samples {n} per arm"
        return GateResult("samples", "pending", observed, n, "requests", expl, None, short_c, short_s)
    expl = f"canary {canary.requests}, stable {stable.requests} requests (min_samples {n} per arm)"
    return GateResult("samples", "pass", observed, n, "requests", expl)


def _error_rate(stable: ArmWindow, canary: ArmWindow, n: int, margin: float, alpha: float) -> GateResult:
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
    p_worse, p_within, se = _error_test(xc, nc, xs, ns, margin)
    rates = (
        f"canary {xc}/{nc} = {_pct(xc / nc)}, stable {xs}/{ns} = {_pct(xs / ns)}: {_pp(diff)} vs allowed {_pp(margin)}"
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
    more = _more(z_needed=float(stats.norm.isf(alpha)), se=se, gap=gap)
    expl = f"error rate {rates}, not yet decided at {conf} (p={min(p_worse, p_within):.2g})"
    return GateResult(
        "error_rate", "pending", diff, margin, "pp", expl, min(p_worse, p_within), _scaled(nc, more), _scaled(ns, more)
    )


def _latency(
    stable: ArmWindow,
    canary: ArmWindow,
    n: int,
    max_ratio: float,
    alpha: float,
    *,
    gate: str = "latency_p99",
    field: str = "latency_ms",
) -> GateResult:
    """p99 ratio of a millisecond histogram: latency (a generation's: to its first token), or
    with ``field="tpot_ms"`` a generation's time per output token."""
    hc, hs = np.asarray(getattr(canary, field)), np.asarray(getattr(stable, field))
    nc, ns = int(hc.sum()), int(hs.sum())
    # the limit is max_ratio x the stable p99, so the stable p99 must be known well enough:
    # with fewer than log(alpha)/log(0.99) requests even their maximum may sit below it
    ns_needed = max(n, math.ceil(math.log(alpha) / math.log(_Q)))
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
    limit = max_ratio * p99s
    slower = min(nc, round(_count_above(hc, limit)))
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


def _predictions(
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
    value, p = float(psi(pc, ps)), _psi_above(pc, ps, max_psi)
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


def _exact_match(stable: ArmWindow, canary: ArmWindow, n: int, margin: float, alpha: float) -> GateResult:
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
    p_worse, p_within, _ = _error_test(xc, nc, xs, ns, margin)
    rates = (
        f"exact match canary {nc - xc}/{nc} = {_pct((nc - xc) / nc)}, stable {ns - xs}/{ns} = "
        f"{_pct((ns - xs) / ns)}: a drop of {_pp(drop)} vs allowed {_pp(margin)}"
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


def _shadow(shadow: ArmWindow, n: int, minimum: float, alpha: float) -> GateResult:
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
    reading = f"shadow agreed on {k}/{pairs} = {_pct(rate)} vs required {_pct(minimum)}"
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
    more = _more(z_needed=float(stats.norm.isf(alpha)), se=se, gap=abs(rate - minimum))
    return GateResult(
        "shadow_agreement",
        "pending",
        rate,
        minimum,
        "fraction",
        f"{reading}, not yet decided (p={min(p_below, p_above):.2g})",
        min(p_below, p_above),
        _scaled(pairs, more),
        0,
    )


# -- statistics -------------------------------------------------------------------------------


def histogram_quantile(q: float, counts: np.ndarray | tuple[int, ...]) -> float:
    """The q-quantile (ms) of a LATENCY_BUCKETS_MS histogram, as Prometheus computes it.

    Linear interpolation inside the bucket holding rank q·total (the first bucket starts at
    0); a rank in the open bucket gives the last finite bound. ``(0.5, [0, 4, 0, ...])`` → 1.5.
    """
    counts = np.asarray(counts, dtype=np.float64)
    total = counts.sum()
    if total <= 0:
        return math.nan
    rank = q * total
    cumulative = np.cumsum(counts)
    i = int(np.searchsorted(cumulative, rank, side="left"))
    if i >= len(LATENCY_BUCKETS_MS):
        return float(LATENCY_BUCKETS_MS[-1])
    lower = 0.0 if i == 0 else float(LATENCY_BUCKETS_MS[i - 1])
    below = 0.0 if i == 0 else cumulative[i - 1]
    return lower + (float(LATENCY_BUCKETS_MS[i]) - lower) * (rank - below) / counts[i]


def _count_above(counts: np.ndarray, threshold_ms: float) -> float:
    """Requests slower than threshold_ms in a latency histogram, linear inside its bucket
    (the reading ``histogram_quantile`` makes). The open bucket (> 10 s) counts whole."""
    bounds = (0.0, *LATENCY_BUCKETS_MS)
    total = 0.0
    for i, c in enumerate(np.asarray(counts, dtype=np.float64)):
        if i == len(LATENCY_BUCKETS_MS) or bounds[i] >= threshold_ms:
            total += c
        elif bounds[i + 1] > threshold_ms:
            total += c * (bounds[i + 1] - threshold_ms) / (bounds[i + 1] - bounds[i])
    return total


def _psi_above(actual: np.ndarray, expected: np.ndarray, limit: float) -> float:
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


def _psi_within(actual: np.ndarray, expected: np.ndarray, limit: float) -> float:
    """p-value of "the populations' PSI is at least ``limit``": ``_psi_above``'s other side.

    The noncentral chi-square grows stochastically with its noncentrality, so a statistic in
    the lower tail at noncentrality ``limit`` x n_eff is at least as unlikely for any PSI
    above the limit: small p shows the PSI within it (non-inferiority, as ``_error_test``'s
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


def _error_test(x1: int, n1: int, x2: int, n2: int, delta: float) -> tuple[float, float, float]:
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


def _more(z_needed: float, se: float, gap: float) -> float | None:
    """Factor by which every arm must grow for |gap| to reach z_needed standard errors."""
    if gap <= 0 or se <= 0:
        return None
    return max(1.0, (z_needed * se / gap) ** 2)


def _scaled(n: int, factor: float | None) -> int | None:
    if factor is None or n * (factor - 1) > _MORE_CAP:
        return None
    return math.ceil(n * (factor - 1))


def _most(values) -> int | None:
    values = list(values)
    return None if any(v is None for v in values) else max(values, default=0)


# -- wording ----------------------------------------------------------------------------------


def _clock(seconds: float) -> str:
    """Unix seconds as a UTC clock time, "2026-12-01 14:02:09 UTC": summaries are read by people."""
    return datetime.fromtimestamp(seconds, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _pct(x: float) -> str:
    return f"{100 * x:.2f} %"


def _pp(x: float) -> str:
    return f"{100 * x:+.2f} pp"


def _show(value: float | None, unit: str) -> str:
    if value is None:
        return "-"
    if unit in ("requests", "s"):
        return f"{value:.0f} {unit}"
    return {"pp": _pp, "fraction": _pct}.get(unit, lambda v: f"{v:.3g} {unit}")(value)


def _show_limit(g: GateResult) -> str:
    sign = {"samples": ">=", "shadow_agreement": ">=", "deadline": "<"}.get(g.gate, "<=")
    return f"{sign} {_show(g.allowed, g.unit)}"


def _more_text(g: GateResult) -> str:
    if g.more_canary is None or g.more_stable is None:
        return "no estimate of the data still needed"
    return f"~{g.more_canary} more canary and ~{g.more_stable} more stable samples"
