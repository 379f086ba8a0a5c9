"""Always-valid sequential tests for canary analysis: verdicts that may be taken at every tick.

``fleet.analysis.canary.judge`` re-tests each step's data at every tick at a fixed confidence, so
its error rates hold per look, not per rollout; its margins are wide to keep false rollbacks
down, and that is what makes good canaries wait. The gates here are built on
``fleet.analysis.anytime``'s e-processes and confidence sequences, whose error rates hold
however often they are looked at. The use for deployments follows Lindon, Sanden &
Shirikian, "Rapid regression detection in software deployments through sequential testing"
(KDD 2022, Netflix).

The gates:

- Errors: ``ErrorHarm``, the conditional test, finds harm while both arms serve. Two
  ``bernoulli_bounds`` bound the *difference* of rates: upper bound of the canary minus
  lower bound of the stable below the margin is non-inferiority shown; the canary's lower
  bound above the stable's upper bound is harm shown (this one works at 100 % too, where
  the stable serves nothing and the conditional test has no data).
- Predicted scores: the fixed-sample PSI test of ``fleet.analysis.gates`` (``psi_above``)
  at alpha spent over the looks finds drift past ``max_prediction_psi``; the last step with
  stable traffic also needs the PSI shown *within* it (``psi_within``, at ``1 - power``
  spent over the looks the same way, so a canary at the limit is promoted at most that
  often however long it holds). The other gates can pass on a few hundred requests, far
  too few for the harm test to see even twice the limit at its small alpha. While that step
  holds, its end-of-step look is taken at each tick, alpha spent over them (``end_looks``).
- Latency: ``TailHarm`` asks whether more than 1 % of the canary's answers are slower than
  ``max_p99_ratio`` x the stable's p99 (canary p99 above the allowed ratio), with the
  threshold re-read from the stable arm each tick (the stable's data never depends on the
  canary's).

The false-rollback budget (``max_false_rollback_rate``) is split between the gates; each
gate's share splits again between its tests (a union bound: the rate of the whole rollout
is at most the sum). ``power`` is the chance that a canary exactly at a margin is *not*
promoted: it is then rolled back, or held until ``hold_deadline_s`` and rolled back.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import numpy as np
from scipy import stats

from fleet.analysis import gates
from fleet.analysis.anytime import TAIL_NULL, ErrorHarm, TailHarm, bernoulli_bounds
from fleet.analysis.canary import Verdict, conclude
from fleet.analysis.gates import GateResult, percent, points
from fleet.analysis.histograms import count_above, filled, histogram_quantile
from fleet.analysis.significance import growth_needed, more_samples, psi_within
from fleet.types import ArmWindow

if TYPE_CHECKING:
    from fleet.catalog.policies.rollout import RolloutPolicy

STABLE_P99_ANSWERS = math.ceil(math.log(0.05) / math.log(1 - TAIL_NULL))  # 299
# the false-rollback budget's split between the gates (their sum is 1); a gate that a policy
# does not judge gives its share to no one: the rate stays under the budget
SHARE = {"error_rate": 0.6, "latency": 0.25, "predictions": 0.15}
CONDITIONAL = 0.8  # of the error gate's share: the conditional test's (the bounds' test has the rest)


@dataclass(frozen=True)
class Evidence:
    """A rollout's sequential evidence so far, kept between ticks (stored with its state):
    the error test's, one tail test per latency gate, and how many verdicts were taken."""

    errors: ErrorHarm = field(default_factory=ErrorHarm)
    tails: tuple[tuple[str, TailHarm], ...] = ()
    looks: int = 0  # the fixed-sample gates (predictions) spend alpha per look
    end_looks: int = 0  # end-of-step looks taken at the deciding step (it may hold for many ticks)

    def tail(self, gate: str) -> TailHarm:
        return dict(self.tails).get(gate, TailHarm())

    def with_tail(self, gate: str, tail: TailHarm) -> Evidence:
        return replace(self, tails=tuple(sorted({**dict(self.tails), gate: tail}.items())))

    def to_dict(self) -> dict[str, object]:
        return {
            "errors": list(self.errors.log_e),
            "tails": {g: list(t.log_e) for g, t in self.tails},
            "looks": self.looks,
            **({"end_looks": self.end_looks} if self.end_looks else {}),  # stored records before it lack it
        }

    @classmethod
    def from_dict(cls, data: dict | None) -> Evidence:
        if not data:
            return cls()
        tails = tuple(sorted((g, TailHarm(tuple(v))) for g, v in data.get("tails", {}).items()))
        return cls(ErrorHarm(tuple(data["errors"])), tails, int(data.get("looks", 0)), int(data.get("end_looks", 0)))

    def looked(self) -> Evidence:
        return replace(self, looks=self.looks + 1)


def spent_alpha(alpha: float, look: int) -> float:
    """Alpha for look ``look`` (1, 2, ...) of a fixed-sample test: alpha x 6 / (pi^2 look^2),
    which sums to alpha over every look there could be (a union bound)."""
    return alpha * 6.0 / (math.pi**2 * look**2)


# -- the verdict ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Arms:
    """What ``judge`` reads at one tick: this tick's increments of both arms, both arms since the
    rollout began (``canary_all``/``stable_all``: the concurrent evidence), and the step's
    canary so far (``min_samples`` counts per step)."""

    tick_canary: ArmWindow
    tick_stable: ArmWindow
    canary_all: ArmWindow
    stable_all: ArmWindow
    step_canary: ArmWindow
    step_stable: ArmWindow


def judge(
    arms: Arms, policy: RolloutPolicy, evidence: Evidence, *, step: int, step_started: float
) -> tuple[Verdict, Evidence]:
    """One tick of a sequential rollout: (verdict, the evidence to keep for the next tick).

    Harm shown on any gate rolls back at once, at any step. A step before the last one
    with stable traffic advances once it has ``min_samples`` canary requests; that last
    step (the one before 100 %, or 100 % when it is the only step) advances only when
    non-inferiority is shown — the canary's error rate at most ``max_error_rate_increase``
    above the stable's, at most 1 % of its answers above ``max_p99_ratio`` x the stable's
    p99, and its scores' PSI vs the stable's below ``max_prediction_psi`` — on everything
    both arms served since the rollout began; 100 % after it is a bake:
    ``min_samples`` more canary requests without harm. Undecided at ``hold_deadline_s`` into
    a step rolls back, as in ``fleet.analysis.canary``.
    """
    g = policy.gates
    alpha, beta = policy.max_false_rollback_rate, 1.0 - policy.power
    weight = policy.steps[step]
    concurrent = weight < 100
    deciding = step == _deciding_step(policy.steps)
    evidence = evidence.looked()
    results = [
        gates.samples(arms.step_stable if concurrent else arms.step_canary, arms.step_canary, policy.min_samples)
    ]
    generative = g.max_tpot_p99_ratio is not None or g.max_output_length_psi is not None
    err, evidence = _errors(
        arms, g.max_error_rate_increase, alpha * SHARE["error_rate"], beta, evidence, deciding, concurrent
    )
    results.append(err)
    latency_gates = [("latency_p99", "latency_ms", g.max_p99_ratio)]
    if g.max_tpot_p99_ratio is not None:
        latency_gates.append(("tpot_p99", "tpot_ms", g.max_tpot_p99_ratio))
    for gate, hist, ratio in latency_gates:
        res, evidence = _tail(
            arms,
            gate,
            hist,
            ratio,
            alpha * SHARE["latency"] / len(latency_gates),
            beta,
            evidence,
            deciding,
            policy.min_samples,
            None if concurrent or hist != "latency_ms" else g.bake_latency_floor_ms,
        )
        results.append(res)
    # the drift gates are fixed-sample tests: half their share is spent over every look (a
    # large shift is caught at once), half on one look at the end of each step, taken when
    # every other gate lets the step advance (a smaller one is caught before it does). The
    # last step with stable traffic also holds until the scores are shown within the limit,
    # at beta spent over the looks: the step's other gates can pass on a few hundred
    # requests, too few for the harm test to see a PSI of twice the limit
    share = alpha * SHARE["predictions"] / 2
    within = spent_alpha(beta, evidence.looks) if deciding and concurrent else None
    drift = _drift(arms, policy, spent_alpha(share, evidence.looks), concurrent, generative, within)
    end = share / len(policy.steps)  # a step's end look
    if within is not None and all(r.status == "pass" for r in results) and all(r.status != "breach" for r in drift):
        # the deciding step may hold for many ticks: its end look is taken at each, alpha spent over them
        evidence = replace(evidence, end_looks=evidence.end_looks + 1)
        drift = _drift(arms, policy, spent_alpha(end, evidence.end_looks), concurrent, generative, within)
    elif all(r.status == "pass" for r in [*results, *drift]):
        drift = _drift(arms, policy, end, concurrent, generative, within)
    verdict = conclude(
        [*results, *drift],
        at=arms.tick_canary.end,
        step_started=step_started,
        hold_deadline_s=policy.hold_deadline_s,
        canary_requests=arms.step_canary.requests,
        stable_requests=arms.step_stable.requests,
        advanced="advance: no harm shown" + ("; non-inferiority shown" if deciding else ""),
    )
    return verdict, evidence


def _drift(
    arms: Arms, policy: RolloutPolicy, alpha: float, concurrent: bool, generative: bool, within: float | None = None
) -> list[GateResult]:
    """Predicted scores (or a generation's output lengths) and exact-match labels, at ``alpha``:
    both arms since the first step, while both serve (at 100 % the inputs differ). With
    ``within`` (the last step with stable traffic) the scores pass only once their PSI is
    shown within the limit at that level, and are pending until then."""
    g, results = policy.gates, []
    if concurrent and not generative:
        scores = gates.predictions(arms.stable_all, arms.canary_all, policy.min_samples, g.max_prediction_psi, alpha)
        if within is not None and scores.status == "pass":
            scores = _psi_shown_within(scores, arms, g.max_prediction_psi, within)
        results.append(scores)
    elif concurrent and g.max_output_length_psi is not None:
        results.append(
            gates.predictions(
                filled(arms.stable_all, "output_tokens"),
                filled(arms.canary_all, "output_tokens"),
                policy.min_samples,
                g.max_output_length_psi,
                alpha,
                gate="output_length",
                field="output_tokens",
                what="output lengths",
            )
        )
    if g.max_exact_match_drop is not None:
        results.append(gates.exact_match(arms.stable_all, arms.canary_all, g.min_labels, g.max_exact_match_drop, alpha))
    return results


def _psi_shown_within(result: GateResult, arms: Arms, limit: float, level: float) -> GateResult:
    """``result`` (the scores' harm test, passed) kept as a pass if the populations' PSI is
    shown below ``limit`` at ``level``, else pending: "no drift found" on a few hundred rows
    is not "no drift", as "no increase found" is not "within the margin" for errors."""
    pc, ps = np.asarray(arms.canary_all.predictions), np.asarray(arms.stable_all.predictions)
    p = psi_within(pc, ps, limit)
    if p < level:
        return replace(result, explanation=f"{result.explanation}; within it shown (p={p:.2g} < {level:.2g})")
    nc, ns = int(pc.sum()), int(ps.sum())
    n_eff, dof = 1 / (1 / nc + 1 / ns), max(1, np.count_nonzero(pc + ps) - 1)
    # the statistic's spread at the limit, in PSI: more rows shrink it about as 1/sqrt(n)
    se = math.sqrt(2 * (dof + 2 * limit * n_eff)) / n_eff
    more = growth_needed(float(stats.norm.isf(level)), se, limit - result.observed) if result.observed < limit else None
    return replace(
        result,
        status="pending",
        p_value=p,
        more_canary=more_samples(nc, more),
        more_stable=more_samples(ns, more),
        explanation=f"{result.explanation}; within it not yet shown (p={p:.2g}, needs < {level:.2g})",
    )


def _deciding_step(steps: list[int]) -> int:
    """The step that must show non-inferiority: the last one that still has stable traffic."""
    below = [i for i, w in enumerate(steps) if w < 100]
    return below[-1] if below else len(steps) - 1


def _errors(
    arms: Arms,
    margin: float,
    alpha: float,
    beta: float,
    evidence: Evidence,
    deciding: bool,
    concurrent: bool = True,
) -> tuple[GateResult, Evidence]:
    tc, ts = arms.tick_canary, arms.tick_stable
    harm = evidence.errors.update(tc.requests, tc.error_count, ts.requests, ts.error_count)
    evidence = replace(evidence, errors=harm)
    xc, nc = arms.canary_all.error_count, arms.canary_all.requests
    xs, ns = arms.stable_all.error_count, arms.stable_all.requests
    if nc == 0:
        return GateResult("error_rate", "pending", None, margin, "pp", "no canary requests yet", None, 1, 0), evidence
    rates = (
        f"canary {xc}/{nc} = {percent(xc / nc)}, stable {xs}/{ns} = {percent(xs / ns) if ns else '-'} "
        "since the rollout began"
    )
    diff = xc / nc - (xs / ns if ns else 0.0)
    if harm.e_value >= 1 / (alpha * CONDITIONAL):
        return GateResult(
            "error_rate",
            "breach",
            diff,
            margin,
            "pp",
            f"error rate {rates}: higher on the canary, e-value {harm.e_value:.3g} >= {1 / (alpha * CONDITIONAL):.3g} "
            f"(false-rollback budget {alpha:.2%})",
            1 / harm.e_value,
        ), evidence
    # at 100 % (no stable traffic, no conditional test) the two rates' bounds compare the canary
    # with the stable as it served earlier in the rollout; while both serve, only the
    # conditional test judges harm: it compares the same seconds' traffic
    if not concurrent and ns and xc / nc > xs / ns:  # else the canary's lower bound cannot pass the stable's upper
        lo_c, _ = bernoulli_bounds(xc, nc, alpha * (1 - CONDITIONAL) / 2)
        _, hi_s = bernoulli_bounds(xs, ns, alpha * (1 - CONDITIONAL) / 2)
        if lo_c > hi_s:
            return GateResult(
                "error_rate",
                "breach",
                diff,
                margin,
                "pp",
                f"error rate {rates}: the canary's is at least {percent(lo_c)}, the stable's at most "
                f"{percent(hi_s)} (confidence sequences)",
                None,
            ), evidence
    if not deciding or margin == 0.0:
        why = (
            "no increase shown (a margin of 0 leaves nothing to show within)"
            if margin == 0.0
            else "no increase shown; within the margin is shown before the last step with stable traffic ends"
        )
        return GateResult("error_rate", "pass", diff, margin, "pp", f"error rate {rates}: {why}"), evidence
    _, hi_c = bernoulli_bounds(xc, nc, beta / 2)
    lo_s, _ = bernoulli_bounds(xs, ns, beta / 2)
    bound = hi_c - lo_s
    if bound < margin:
        return GateResult(
            "error_rate",
            "pass",
            diff,
            margin,
            "pp",
            f"error rate {rates}: the increase is below {points(bound)}, within the margin {points(margin)}",
        ), evidence
    return GateResult(
        "error_rate",
        "pending",
        diff,
        margin,
        "pp",
        f"error rate {rates}: the increase is below {points(bound)} so far, not yet within {points(margin)}",
        None,
        _more_needed(nc, bound, margin),
        0,
    ), evidence


def _tail(
    arms: Arms,
    gate: str,
    hist: str,
    ratio: float,
    alpha: float,
    beta: float,
    evidence: Evidence,
    deciding: bool,
    n: int,
    floor: float | None = None,
) -> tuple[GateResult, Evidence]:
    """``floor``: at 100 % (no stable beside the canary) an answer is slow only above it too."""
    stable_all = np.asarray(getattr(filled(arms.stable_all, hist), hist))
    canary_all = np.asarray(getattr(filled(arms.canary_all, hist), hist))
    tick = np.asarray(getattr(filled(arms.tick_canary, hist), hist))
    ns, nc = int(stable_all.sum()), int(canary_all.sum())
    # the limit is made of the stable's p99, so its estimate must be fair first: 299 answers,
    # fleet.analysis.gates' latency rule. The limit is re-read every tick as stable answers add up; an
    # estimate low by chance lowers the limit and makes a false rollback more likely, so this
    # gate's rate holds only approximately (bench/rollout.py measures whole rollouts)
    ns_needed = max(n, STABLE_P99_ANSWERS)
    if ns < ns_needed or nc == 0:
        return GateResult(
            gate,
            "pending" if deciding else "pass",
            None,
            ratio,
            "x",
            f"waits for {ns_needed} stable answers to know the stable's p99 (stable {ns}, canary {nc})",
            None,
            0,
            max(0, ns_needed - ns),
        ), evidence
    p99s = histogram_quantile(1 - TAIL_NULL, stable_all)
    limit = max(ratio * p99s, floor or 0.0)
    tail = evidence.tail(gate).update(int(tick.sum()), count_above(tick, limit))
    evidence = evidence.with_tail(gate, tail)
    above = min(float(nc), count_above(canary_all, limit))
    p99c = histogram_quantile(1 - TAIL_NULL, canary_all)
    reading = (
        f"{'p99' if hist == 'latency_ms' else 'p99 time per output token:'} canary {p99c:.1f} ms / stable "
        f"{p99s:.1f} ms = {p99c / p99s:.2f}x vs allowed {ratio:g}x; {above:.0f}/{nc} canary answers above "
        f"{limit:.1f} ms" + (" (bake_latency_floor_ms: no stable beside it at 100 %)" if limit > ratio * p99s else "")
    )
    if tail.e_value >= 1 / alpha:
        return GateResult(
            gate,
            "breach",
            p99c / p99s,
            ratio,
            "x",
            f"{reading}: more than 1 %, e-value {tail.e_value:.3g} >= {1 / alpha:.3g}",
            1 / tail.e_value,
        ), evidence
    if not deciding:
        return GateResult(
            gate,
            "pass",
            p99c / p99s,
            ratio,
            "x",
            f"{reading}: no excess shown; within 1 % is shown before the last step with stable traffic ends",
        ), evidence
    _, hi = bernoulli_bounds(above, nc, beta)
    if hi < TAIL_NULL:
        return GateResult(gate, "pass", p99c / p99s, ratio, "x", f"{reading}: at most {hi:.2%} (within 1 %)"), evidence
    return GateResult(
        gate,
        "pending",
        p99c / p99s,
        ratio,
        "x",
        f"{reading}: at most {hi:.2%} so far, not yet within 1 %",
        None,
        _more_needed(nc, hi, TAIL_NULL),
        0,
    ), evidence


def _more_needed(n: int, bound: float, target: float) -> int | None:
    """A rough guess of the further canary samples before ``bound`` falls below ``target``
    (such bounds shrink about as 1/n for rare events)."""
    if target <= 0 or bound <= 0:
        return None
    return max(1, math.ceil(n * (bound / target - 1)))


def guardrails(arms: Arms, policy: RolloutPolicy, evidence: Evidence) -> tuple[list[GateResult], Evidence]:
    """Harm tests only (an A/B experiment's guardrails): the error-rate and latency gates of
    ``judge`` as at a step that need not show non-inferiority. A ``breach`` among the results
    is harm shown, at the policy's ``max_false_rollback_rate``; nothing here ever holds."""
    g = policy.gates
    alpha = policy.max_false_rollback_rate
    err, evidence = _errors(
        arms,
        g.max_error_rate_increase,
        alpha * SHARE["error_rate"],
        1 - policy.power,
        evidence,
        deciding=False,
        concurrent=True,
    )
    tail, evidence = _tail(
        arms,
        "latency_p99",
        "latency_ms",
        g.max_p99_ratio,
        alpha * SHARE["latency"],
        1 - policy.power,
        evidence,
        False,
        policy.min_samples,
    )
    return [err, tail], evidence.looked()
