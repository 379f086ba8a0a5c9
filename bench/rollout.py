"""Simulated canary rollouts (fleet.analysis.simulate) through the real verdicts, three ways on the same
streams: the sequential method (fleet.analysis.sequential), the fixed method as shipped before it
(fleet.analysis.canary), and Flagger's default checks.

Streams, scenarios and the policies' loops are ``fleet.analysis.simulate``'s (``fleet rollout
--dry-run`` runs the same). Bad canaries: +1 / +5 percentage points of errors, 1.5x / 3x
latency, and (beyond the brief) shifted scores, PSI ~0.6. Time to detect: from the canary's
first request to the rollback verdict (a multiple of the tick). Canary requests: what the
canary served until the verdict, failures included.

Policies:
- sequential: the policy file's rollout policy as is (``method: sequential``): always-valid
  tests every ``analysis_window_s`` on everything since the first step.
- fixed: the same policy judged by ``fleet.analysis.canary`` as shipped before the sequential
  method (``method: fixed``, analysis_window_s 10, min_samples 50): each step re-tested at
  ``gates.confidence`` every tick; at 100 % the baseline is the previous step's stable arm.
- flagger: Flagger's analysis loop (pkg/controller/scheduler.go) with the documented
  built-in checks: every 60 s the last minute of canary traffic must have request success
  rate >= 99 % and p99 (histogram_quantile over the same buckets) <= 500 ms; a failed
  check (no data counts as failed) adds to failedChecks, which never resets during a
  rollout; the tick after it reaches the threshold (5, as in Flagger's tutorials; the
  code's default is 1) rolls back; a passed check moves to the next step weight, and a
  pass at 100 % promotes. Same step weights as the fleet policy.

Targets (issue 18), checked for the sequential policy: good canaries promoted in a median
at most Flagger's 180 s with at most 1 % false rollbacks; +5 pp errors detected at least 10x
faster than Flagger; +1 pp errors detected in a median at most 120 s.

    .venv/bin/python bench/rollout.py [--rollouts 200] [--rps 20] [--base-errors 0.001]
        [--window 2] [--min-samples 20] [--steps 10,50,100] [--deadline 900] [--seed 5]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from fleet.analysis.simulate import (
    BASE_ERR,
    BASE_MS,
    FLAGGER_INTERVAL_S,
    FLAGGER_MAX_P99_MS,
    FLAGGER_MIN_SUCCESS,
    FLAGGER_THRESHOLD,
    SCENARIOS,
    SIGMA,
    Result,
    Scenario,
    Stream,
    run,
    run_flagger,
)
from fleet.catalog.policies.loader import load_policies
from fleet.catalog.policies.rollout import RolloutPolicy
from fleet.types import LATENCY_BUCKETS_MS, PREDICTION_BINS, latency_bucket, score_bin

# -- report -----------------------------------------------------------------------------------


FIXED_BEFORE = {"method": "fixed", "analysis_window_s": 10.0, "min_samples": 50}  # shipped until the sequential method


def _policies(args: argparse.Namespace) -> dict[str, RolloutPolicy]:
    current = load_policies(args.policies).rollout[args.rollout]
    base = {**current.model_dump(), "method": "sequential"}
    policies = {
        SEQUENTIAL: RolloutPolicy.model_validate(base),
        FIXED: RolloutPolicy.model_validate({**current.model_dump(), **FIXED_BEFORE}),
    }
    given = {
        k: v
        for k, v in (
            ("analysis_window_s", args.window),
            ("min_samples", args.min_samples),
            ("steps", args.steps),
            ("hold_deadline_s", args.deadline),
        )
        if v is not None
    }
    if given:  # validated like a policy file, so a bad --steps is refused the same way
        policies[PROPOSED] = RolloutPolicy.model_validate({**base, **given})
    return policies


def _stats(results: list[Result], bad: bool) -> dict[str, float]:
    n = len(results)
    rolled = [r for r in results if r.outcome == "rollback"]
    promoted = [r for r in results if r.outcome == "promote"]
    decided = rolled if bad else promoted  # time to detect a bad canary, to promote a good one
    times = np.array([r.at for r in decided]) if decided else np.array([np.nan])
    return {
        "rollback %": 100 * len(rolled) / n,
        "deadline %": 100 * sum(r.by_deadline for r in rolled) / n,
        "promote %": 100 * len(promoted) / n,
        "median s": float(np.median(times)),
        "p90 s": float(np.percentile(times, 90)),
        "exposed": float(np.mean([r.exposed for r in results])),
        "failed": float(np.mean([r.failed for r in results])),
    }


def _check_binning(rng: np.random.Generator) -> None:
    """The vectorised binning here must be the gateway's (tests/test_metrics.py holds
    fleet.analysis.sources' binning to the gateway's)."""
    ms = np.concatenate([rng.lognormal(2, 2, 5000), LATENCY_BUCKETS_MS, np.nextafter(LATENCY_BUCKETS_MS, np.inf)])
    assert np.array_equal(np.searchsorted(LATENCY_BUCKETS_MS, ms, side="left"), [latency_bucket(x) for x in ms])
    scores = np.concatenate([rng.random(5000), np.linspace(0, 1, 11)])
    vectorised = np.clip((scores * PREDICTION_BINS).astype(np.int64), 0, PREDICTION_BINS - 1)
    assert np.array_equal(vectorised, [score_bin(x) for x in scores])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rollouts", type=int, default=200, help="per scenario")
    parser.add_argument("--rps", type=float, default=20.0, help="total requests per second")
    parser.add_argument("--window", type=float, help="a proposed analysis_window_s for the sequential method")
    parser.add_argument("--min-samples", type=int, help="a proposed min_samples")
    parser.add_argument("--steps", type=lambda v: [int(x) for x in v.split(",")], help="proposed steps, e.g. 20,50,100")
    parser.add_argument("--deadline", type=float, help="proposed hold_deadline_s")
    parser.add_argument("--base-errors", type=float, default=BASE_ERR, help="stable (and good canary) error rate")
    parser.add_argument("--policies", default="policies")
    parser.add_argument("--rollout", default="default", help="rollout policy name")
    parser.add_argument("--seed", type=int, default=5)
    args = parser.parse_args()
    policies = _policies(args)
    current = policies[SEQUENTIAL]
    _check_binning(np.random.default_rng(args.seed))
    horizon = max(len(p.steps) * p.hold_deadline_s for p in policies.values()) + 120
    print(
        f"{args.rollouts} rollouts per scenario at {args.rps:g} req/s total (Poisson), canary steps "
        f"{current.steps} %, gates {current.gates.model_dump(exclude_none=True)}"
    )
    print(
        f"latency lognormal, median {BASE_MS:g} ms, sigma {SIGMA}; stable errors {args.base_errors:.2%}; "
        f"seed {args.seed}"
    )
    print(
        f"flagger: interval {FLAGGER_INTERVAL_S:g} s, success rate >= {FLAGGER_MIN_SUCCESS:g} %, "
        f"p99 <= {FLAGGER_MAX_P99_MS:g} ms, threshold {FLAGGER_THRESHOLD} failed checks, same steps"
    )
    print(
        f"{SEQUENTIAL}: {args.policies}, rollout.{args.rollout} ({_describe(current)}, max_false_rollback_rate "
        f"{current.max_false_rollback_rate:g}, power {current.power:g})"
    )
    print(f"{FIXED}: {_describe(policies[FIXED], current)}, confidence {current.gates.confidence:g}")
    if PROPOSED in policies:
        print(f"{PROPOSED}: {_describe(policies[PROPOSED], current)}, the rest as is")
    print()
    began = time.perf_counter()
    table: dict[str, dict[str, dict[str, float]]] = {}
    for si, scenario in enumerate(SCENARIOS):
        runs: dict[str, list[Result]] = {name: [] for name in [*policies, FLAGGER]}
        for i in range(args.rollouts):
            stream = Stream((args.seed, si, i), args.rps, horizon, scenario, args.base_errors)
            for name, policy in policies.items():
                runs[name].append(run(stream, policy))
            runs[FLAGGER].append(run_flagger(stream, current.steps))
        table[scenario.name] = {name: _stats(r, scenario.bad) for name, r in runs.items()}
        _print_scenario(scenario, table[scenario.name])
    print(f"(simulated in {time.perf_counter() - began:.0f} s)\n")
    for name in (SEQUENTIAL, PROPOSED):
        if name in policies:
            _verdict(name, table)


FLAGGER = "flagger defaults"
SEQUENTIAL, FIXED, PROPOSED = "sequential", "fixed (before)", "proposed"


def _describe(p: RolloutPolicy, base: RolloutPolicy | None = None) -> str:
    shown = {
        "method": p.method,
        "analysis_window_s": p.analysis_window_s,
        "min_samples": p.min_samples,
        "steps": p.steps,
        "hold_deadline_s": p.hold_deadline_s,
    }
    if base is not None:
        shown = {k: v for k, v in shown.items() if getattr(base, k) != v}
    return ", ".join(f"{k} {v:g}" if isinstance(v, float) else f"{k} {v}" for k, v in shown.items())


def _print_scenario(scenario: Scenario, rows: dict[str, dict[str, float]]) -> None:
    """(deadline): rolled back because the step was still undecided at hold_deadline_s."""
    when = "to detect" if scenario.bad else "to promote"
    print(f"{scenario.name}: {'bad canary' if scenario.bad else 'good canary (every rollback is a false rollback)'}")
    print(
        f"  {'policy':20} {'rolled back':>11} {'(deadline)':>10} {'promoted':>9} {when + ', median':>19} {'p90':>7} "
        f"{'canary requests':>15} {'of them failed':>14}"
    )
    for name, s in rows.items():
        deadline = f"{s['deadline %']:.1f}%" if name != FLAGGER else "-"
        print(
            f"  {name:20} {s['rollback %']:10.1f}% {deadline:>10} {s['promote %']:8.1f}% {_secs(s['median s']):>19} "
            f"{_secs(s['p90 s']):>7} {s['exposed']:15.0f} {s['failed']:14.1f}"
        )
    print()


def _verdict(name: str, table: dict) -> None:
    """The targets, said plainly: each one met or not, with the figures."""
    good, plus1, plus5 = table["good"], table["+1% errors"], table["+5% errors"]
    checks = [
        ("good canaries promoted, median", good[name]["median s"], good[FLAGGER]["median s"], "s", "<="),
        ("false rollbacks of good canaries", good[name]["rollback %"], 1.0, "%", "<="),
        (
            "+5 pp errors detected, x faster than Flagger",
            plus5[FLAGGER]["median s"] / plus5[name]["median s"],
            10.0,
            "x",
            ">=",
        ),
        ("+1 pp errors detected, median", plus1[name]["median s"], 120.0, "s", "<="),
    ]
    met = [value <= target if sign == "<=" else value >= target for _, value, target, _, sign in checks]
    print(f"{name}: targets {'MET' if all(met) else 'NOT ALL MET'}")
    for (what, value, target, unit, sign), ok in zip(checks, met, strict=True):
        print(f"  {what}: {value:.1f} {unit} (target {sign} {target:g} {unit}) {'met' if ok else 'NOT met'}")
    print()


def _secs(x: float) -> str:
    return "-" if np.isnan(x) else f"{x:.0f} s"


if __name__ == "__main__":
    main()
