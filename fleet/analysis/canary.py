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

Gates (``policy.gates``, each in ``fleet.analysis.gates``), none judged before
``policy.min_samples`` per arm: ``error_rate`` (non-inferiority against
``max_error_rate_increase``), ``latency_p99`` (``max_p99_ratio``), ``predictions``
(``max_prediction_psi``), for a generative model's policy ``tpot_p99``, ``output_length`` and
``exact_match``, and in the shadow phase ``shadow_agreement``.

Each tick is one look at the policy's confidence, so a long step is many looks; the
gates' margins and tests keep false rollbacks of whole rollouts at about 1 % at the
bench's 20 req/s (bench/rollout.py). Windows up to ``hold_deadline_s`` long must be
readable: the gateway source keeps 900 s, or sum tick windows with
``fleet.analysis.sources.sum_windows``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Literal

from fleet.analysis import gates
from fleet.analysis.gates import GateResult, percent, points
from fleet.analysis.histograms import filled
from fleet.catalog.policies.rollout import RolloutPolicy
from fleet.types import ArmWindow

Outcome = Literal["advance", "hold", "rollback"]
Phase = Literal["canary", "shadow"]


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
        gates.samples(stable, canary, n),
        gates.error_rate(stable, canary, n, gates_policy.max_error_rate_increase, alpha),
        gates.latency(
            stable,
            canary,
            n,
            gates_policy.max_p99_ratio,
            alpha,
            floor_ms=None if concurrent else gates_policy.bake_latency_floor_ms,
        ),
        gates.predictions(stable, canary, n, gates_policy.max_prediction_psi, alpha)
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
            gates.latency(
                filled(stable, "tpot_ms"),
                filled(canary, "tpot_ms"),
                n,
                gates_policy.max_tpot_p99_ratio,
                alpha,
                gate="tpot_p99",
                field="tpot_ms",
            )
        )
    if gates_policy.max_output_length_psi is not None:
        results.append(
            gates.predictions(
                filled(stable, "output_tokens"),
                filled(canary, "output_tokens"),
                n,
                gates_policy.max_output_length_psi,
                alpha,
                gate="output_length",
                field="output_tokens",
                what="output lengths",
            )
        )
    if gates_policy.max_exact_match_drop is not None and phase != "shadow":
        results.append(
            gates.exact_match(stable, canary, gates_policy.min_labels, gates_policy.max_exact_match_drop, alpha)
        )
    if phase == "shadow" and gates_policy.min_shadow_agreement is not None:
        results.append(gates.shadow_agreement(canary, n, gates_policy.min_shadow_agreement, alpha))
    return conclude(
        results,
        at=canary.end,
        step_started=step_started,
        hold_deadline_s=policy.hold_deadline_s,
        canary_requests=canary.requests,
        stable_requests=stable.requests,
        advanced="advance: every gate passed",
    )


def conclude(
    results: list[GateResult],
    *,
    at: float,
    step_started: float,
    hold_deadline_s: float,
    canary_requests: int,
    stable_requests: int,
    advanced: str,
) -> Verdict:
    """The verdict of a tick's gate results, either method's: any breach rolls back; no gate
    pending advances (``advanced`` is its summary); else it holds, and a hold at or after
    ``step_started + hold_deadline_s`` is a rollback by the ``deadline`` gate, naming what
    stayed undecided. ``results`` gets that gate appended."""
    deadline = step_started + hold_deadline_s
    breached = [g for g in results if g.status == "breach"]
    pending = [g for g in results if g.status == "pending"]
    if breached:
        outcome: Outcome = "rollback"
        summary = "roll back: " + "; ".join(g.explanation for g in breached)
    elif not pending:
        outcome, summary = "advance", advanced
    elif at >= deadline:
        outcome = "rollback"
        undecided = ", ".join(f"{g.gate} ({_more_text(g)})" for g in pending)
        expl = (
            f"still undecided {at - step_started:.0f} s into the step, hold_deadline_s is "
            f"{hold_deadline_s:g} s: {undecided}"
        )
        results.append(GateResult("deadline", "breach", at - step_started, hold_deadline_s, "s", expl))
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
        canary_requests=canary_requests,
        stable_requests=stable_requests,
        summary=summary,
        more_canary=_most(g.more_canary for g in pending),
        more_stable=_most(g.more_stable for g in pending),
    )


def _most(values: Iterable[int | None]) -> int | None:
    values = list(values)
    return None if any(v is None for v in values) else max(values, default=0)


# -- wording ----------------------------------------------------------------------------------


def _clock(seconds: float) -> str:
    """Unix seconds as a UTC clock time, "2026-12-01 14:02:09 UTC": summaries are read by people."""
    return datetime.fromtimestamp(seconds, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _show(value: float | None, unit: str) -> str:
    if value is None:
        return "-"
    if unit in ("requests", "s"):
        return f"{value:.0f} {unit}"
    return {"pp": points, "fraction": percent}.get(unit, lambda v: f"{v:.3g} {unit}")(value)


def _show_limit(g: GateResult) -> str:
    sign = {"samples": ">=", "shadow_agreement": ">=", "deadline": "<"}.get(g.gate, "<=")
    return f"{sign} {_show(g.allowed, g.unit)}"


def _more_text(g: GateResult) -> str:
    if g.more_canary is None or g.more_stable is None:
        return "no estimate of the data still needed"
    return f"~{g.more_canary} more canary and ~{g.more_stable} more stable samples"
