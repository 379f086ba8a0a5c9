"""Simulated canary rollouts through the real fleet.analysis, next to Flagger's default checks.

Each rollout replays one seeded request stream: Poisson arrivals at ``--rps``, each sent to
the canary when its routing draw falls under the current weight; the k-th canary request
has the same latency, outcome and score under every policy (common random numbers), so the
policies are compared on the same traffic. Latency is lognormal around a 10 ms median
(sigma 0.4: p99 ~ 25 ms), errors Bernoulli (``--base-errors``, 0.1 %, on stable and good
canaries), scores Beta(2, 5); all binned exactly as the gateway bins them
(LATENCY_BUCKETS_MS with the "le" rule, PREDICTION_BINS). Failed requests get no latency
or score, as in the gateway's stats. Bad canaries: +1 / +5 percentage points of errors,
1.5x / 3x latency, and (beyond the brief) shifted scores, PSI ~0.6.

Time to detect: from the canary's first request to the rollback verdict (so a multiple
of the tick). Canary requests: what the canary served until the verdict, failures included.

Policies:
- fleet: ``judge`` every ``analysis_window_s`` on the step so far (cumulative since the
  step's weight was set), steps from the policy; at 100 % the baseline is the stable arm
  of the previous step. Run twice: the policy file as is, and the proposed values.
- flagger: Flagger's analysis loop (pkg/controller/scheduler.go) with the documented
  built-in checks: every 60 s the last minute of canary traffic must have request success
  rate >= 99 % and p99 (histogram_quantile over the same buckets) <= 500 ms; a failed
  check (no data counts as failed) adds to failedChecks, which never resets during a
  rollout; the tick after it reaches the threshold (5, as in Flagger's tutorials; the
  code's default is 1) rolls back; a passed check moves to the next step weight, and a
  pass at 100 % promotes. Same step weights as the fleet policy.

    .venv/bin/python bench/rollout.py [--rollouts 200] [--rps 20] [--base-errors 0.001]
        [--window 10] [--min-samples 50] [--steps 10,50,100] [--deadline 900] [--seed 5]
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

import numpy as np

from fleet.analysis import histogram_quantile, judge
from fleet.metrics import latency_bucket, score_bin
from fleet.spec import RolloutPolicy, load_policies
from fleet.types import ERROR_CLASSES, LATENCY_BUCKETS_MS, PREDICTION_BINS, ArmWindow

BASE_MS, SIGMA, BASE_ERR = 10.0, 0.4, 0.001
N_LAT = len(LATENCY_BUCKETS_MS) + 1
FLAGGER_INTERVAL_S, FLAGGER_THRESHOLD, FLAGGER_MIN_SUCCESS, FLAGGER_MAX_P99_MS = 60.0, 5, 99.0, 500.0


@dataclass(frozen=True)
class Scenario:
    name: str
    extra_errors: float = 0.0  # added to the stable error rate
    latency_x: float = 1.0
    scores: tuple[float, float] = (2.0, 5.0)  # Beta(a, b)

    @property
    def bad(self) -> bool:
        return self != Scenario(self.name)


STABLE = Scenario("stable")
SCENARIOS = (
    Scenario("good"),
    Scenario("+1% errors", extra_errors=0.01),
    Scenario("+5% errors", extra_errors=0.05),
    Scenario("1.5x latency", latency_x=1.5),
    Scenario("3x latency", latency_x=3.0),
    Scenario("shifted scores", scores=(3.0, 3.0)),  # beyond the brief: PSI ~ 0.6
)


class Arm:
    """One arm's request stream as cumulative counters: counts over requests [a, b) are C[b] - C[a]."""

    def __init__(self, rng: np.random.Generator, n: int, s: Scenario, base_errors: float) -> None:
        err = rng.random(n) < base_errors + s.extra_errors
        latency = np.exp(rng.normal(np.log(BASE_MS * s.latency_x), SIGMA, n))
        bucket = np.searchsorted(LATENCY_BUCKETS_MS, latency, side="left")  # == bisect_left, the gateway's rule
        score = rng.beta(*s.scores, n)
        bins = np.clip((score * PREDICTION_BINS).astype(np.int64), 0, PREDICTION_BINS - 1)
        ok = (~err).astype(np.int32)
        self.err = np.concatenate([[0], np.cumsum(err, dtype=np.int64)])
        self.lat = _cumulative_onehot(bucket, ok, N_LAT)
        self.pred = _cumulative_onehot(bins, ok, PREDICTION_BINS)

    def window(self, version: str, a: int, b: int, start: float, end: float) -> ArmWindow:
        return ArmWindow(
            model="bench", version=version, start=start, end=end, requests=b - a,
            errors={"5xx": int(self.err[b] - self.err[a]), **dict.fromkeys(ERROR_CLASSES[1:], 0)},
            latency_ms=tuple((self.lat[b] - self.lat[a]).tolist()),
            predictions=tuple((self.pred[b] - self.pred[a]).tolist()),
        )  # fmt: skip


def _cumulative_onehot(idx: np.ndarray, weight: np.ndarray, width: int) -> np.ndarray:
    out = np.zeros((len(idx) + 1, width), dtype=np.int32)
    np.add.at(out, (np.arange(1, len(idx) + 1), idx), weight)
    return np.cumsum(out, axis=0, dtype=np.int32)


class Stream:
    """Arrivals and routing draws, plus a canary and a stable arm; ``route`` consumes them."""

    def __init__(self, seed: tuple[int, ...], rps: float, horizon_s: float, canary: Scenario, base_errors: float):
        rng = np.random.default_rng(seed)
        n = int(rng.poisson(rps * horizon_s))
        self.times = np.sort(rng.uniform(0.0, horizon_s, n))
        self.draw = rng.random(n)
        self.stable, self.canary = Arm(rng, n, STABLE, base_errors), Arm(rng, n, canary, base_errors)
        self.horizon_s = horizon_s

    def route(self, t0: float, t1: float, weight: float) -> tuple[int, int]:
        """(canary, stable) requests arriving in [t0, t1) at this canary weight (percent)."""
        i, j = np.searchsorted(self.times, [t0, t1])
        to_canary = int(np.count_nonzero(self.draw[i:j] < weight / 100))
        return to_canary, int(j - i) - to_canary


@dataclass(frozen=True)
class Result:
    outcome: str  # rollback | promote | unfinished
    at: float  # seconds since the canary first got traffic
    exposed: int  # requests the canary served
    failed: int  # of those, failures the callers saw
    by_deadline: bool = False  # rolled back because the step stayed undecided, not on a gate


def run_fleet(stream: Stream, policy: RolloutPolicy) -> Result:
    t, kc, ks, tick = 0.0, 0, 0, policy.analysis_window_s
    baseline = None
    for step, weight in enumerate(policy.steps):
        t0, kc0, ks0 = t, kc, ks
        while t + tick <= stream.horizon_s:
            c, s = stream.route(t, t + tick, weight)
            t, kc, ks = t + tick, kc + c, ks + s
            canary = stream.canary.window("canary", kc0, kc, t0, t)
            stable = stream.stable.window("stable", ks0, ks, t0, t)
            if weight == 100 and baseline is not None:
                stable = baseline  # nothing is served by stable at 100 %
            verdict = judge(stable, canary, policy, step_started=t0)
            if verdict.outcome == "rollback":
                deadline = [g.gate for g in verdict.breaches] == ["deadline"]
                return Result("rollback", t, kc, int(stream.canary.err[kc]), deadline)
            if verdict.outcome == "advance":
                baseline = stable
                break
        else:
            return Result("unfinished", t, kc, int(stream.canary.err[kc]))
    return Result("promote", t, kc, int(stream.canary.err[kc]))


def run_flagger(stream: Stream, steps: list[int]) -> Result:
    weight, failed, t, kc = steps[0], 0, 0.0, 0  # tick 0 only sets the first weight
    while t + FLAGGER_INTERVAL_S <= stream.horizon_s:
        c, _ = stream.route(t, t + FLAGGER_INTERVAL_S, weight)
        window_start, t = kc, t + FLAGGER_INTERVAL_S
        kc += c
        if failed >= FLAGGER_THRESHOLD:  # checked before this tick's analysis, as Flagger does
            return Result("rollback", t, kc, int(stream.canary.err[kc]))
        w = stream.canary.window("canary", window_start, kc, t - FLAGGER_INTERVAL_S, t)
        answered = int(sum(w.latency_ms))
        ok = (
            w.requests > 0 and answered > 0  # "no values found" fails the check
            and 100.0 * (1 - w.error_count / w.requests) >= FLAGGER_MIN_SUCCESS
            and histogram_quantile(0.99, w.latency_ms) <= FLAGGER_MAX_P99_MS
        )  # fmt: skip
        if not ok:
            failed += 1
        elif weight < 100:
            weight = next(s for s in steps if s > weight)
        else:
            return Result("promote", t, kc, int(stream.canary.err[kc]))
    return Result("unfinished", t, kc, int(stream.canary.err[kc]))


# -- report -----------------------------------------------------------------------------------


PROPOSED = {"analysis_window_s": 10.0, "min_samples": 50}


def _policy(args: argparse.Namespace) -> tuple[RolloutPolicy, RolloutPolicy]:
    current = load_policies(args.policies).rollout[args.rollout]
    given = (("analysis_window_s", args.window), ("min_samples", args.min_samples),
             ("steps", args.steps), ("hold_deadline_s", args.deadline))  # fmt: skip
    changes = {**PROPOSED, **{k: v for k, v in given if v is not None}}
    # validated like a policy file, so a bad --steps is refused the same way
    proposed = RolloutPolicy.model_validate({**current.model_dump(), **changes})
    return current, proposed


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
    fleet.metrics' binning to the gateway's)."""
    ms = np.concatenate([rng.lognormal(2, 2, 5000), LATENCY_BUCKETS_MS, np.nextafter(LATENCY_BUCKETS_MS, np.inf)])
    assert np.array_equal(np.searchsorted(LATENCY_BUCKETS_MS, ms, side="left"), [latency_bucket(x) for x in ms])
    scores = np.concatenate([rng.random(5000), np.linspace(0, 1, 11)])
    vectorised = np.clip((scores * PREDICTION_BINS).astype(np.int64), 0, PREDICTION_BINS - 1)
    assert np.array_equal(vectorised, [score_bin(x) for x in scores])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rollouts", type=int, default=200, help="per scenario")
    parser.add_argument("--rps", type=float, default=20.0, help="total requests per second")
    parser.add_argument("--window", type=float, help=f"proposed analysis_window_s (default {PROPOSED['analysis_window_s']})")
    parser.add_argument("--min-samples", type=int, help=f"proposed min_samples (default {PROPOSED['min_samples']})")
    parser.add_argument("--steps", type=lambda v: [int(x) for x in v.split(",")], help="proposed steps, e.g. 20,50,100")
    parser.add_argument("--deadline", type=float, help="proposed hold_deadline_s")
    parser.add_argument("--base-errors", type=float, default=BASE_ERR, help="stable (and good canary) error rate")
    parser.add_argument("--policies", default="policies")
    parser.add_argument("--rollout", default="default", help="rollout policy name")
    parser.add_argument("--seed", type=int, default=5)
    args = parser.parse_args()
    current, proposed = _policy(args)
    _check_binning(np.random.default_rng(args.seed))
    policies = {"fleet, policy as is": current}
    if proposed != current:  # the proposed values are the policy file's once adopted
        policies["fleet, proposed"] = proposed
    horizon = max(len(p.steps) * p.hold_deadline_s for p in policies.values()) + 120
    print(f"{args.rollouts} rollouts per scenario at {args.rps:g} req/s total (Poisson), canary steps "
          f"{current.steps} %, gates {current.gates.model_dump(exclude_none=True)}")  # fmt: skip
    print(f"latency lognormal, median {BASE_MS:g} ms, sigma {SIGMA}; stable errors {args.base_errors:.2%}; "
          f"seed {args.seed}")  # fmt: skip
    print(f"flagger: interval {FLAGGER_INTERVAL_S:g} s, success rate >= {FLAGGER_MIN_SUCCESS:g} %, "
          f"p99 <= {FLAGGER_MAX_P99_MS:g} ms, threshold {FLAGGER_THRESHOLD} failed checks, same steps")  # fmt: skip
    print(f"fleet, policy as is: {args.policies}, rollout.{args.rollout} ({_describe(current)})")
    if "fleet, proposed" in policies:
        print(f"fleet, proposed: {_describe(proposed, current)}, the rest as is")
    print()
    began = time.perf_counter()
    table: dict[str, dict[str, dict[str, float]]] = {}
    for si, scenario in enumerate(SCENARIOS):
        runs: dict[str, list[Result]] = {name: [] for name in [*policies, FLAGGER]}
        for i in range(args.rollouts):
            stream = Stream((args.seed, si, i), args.rps, horizon, scenario, args.base_errors)
            for name, policy in policies.items():
                runs[name].append(run_fleet(stream, policy))
            runs[FLAGGER].append(run_flagger(stream, current.steps))
        table[scenario.name] = {name: _stats(r, scenario.bad) for name, r in runs.items()}
        _print_scenario(scenario, table[scenario.name])
    print(f"(simulated in {time.perf_counter() - began:.0f} s)\n")
    for name, policy in policies.items():
        _verdict(name, policy, table, args.rps)


FLAGGER = "flagger defaults"


def _describe(p: RolloutPolicy, base: RolloutPolicy | None = None) -> str:
    shown = {"analysis_window_s": p.analysis_window_s, "min_samples": p.min_samples,
             "steps": p.steps, "hold_deadline_s": p.hold_deadline_s}  # fmt: skip
    if base is not None:
        shown = {k: v for k, v in shown.items() if getattr(base, k) != v}
    return ", ".join(f"{k} {v:g}" if isinstance(v, float) else f"{k} {v}" for k, v in shown.items())


def _print_scenario(scenario: Scenario, rows: dict[str, dict[str, float]]) -> None:
    """(deadline): rolled back because the step was still undecided at hold_deadline_s."""
    when = "to detect" if scenario.bad else "to promote"
    print(f"{scenario.name}: {'bad canary' if scenario.bad else 'good canary (every rollback is a false rollback)'}")
    print(f"  {'policy':20} {'rolled back':>11} {'(deadline)':>10} {'promoted':>9} {when + ', median':>19} {'p90':>7} "
          f"{'canary requests':>15} {'of them failed':>14}")  # fmt: skip
    for name, s in rows.items():
        deadline = f"{s['deadline %']:.1f}%" if name != FLAGGER else "-"
        print(f"  {name:20} {s['rollback %']:10.1f}% {deadline:>10} {s['promote %']:8.1f}% {_secs(s['median s']):>19} "
              f"{_secs(s['p90 s']):>7} {s['exposed']:15.0f} {s['failed']:14.1f}")  # fmt: skip
    print()


def _verdict(name: str, policy: RolloutPolicy, table: dict, rps: float) -> None:
    """Target: >= 10x faster detection than Flagger at <= 1 % false rollbacks, said plainly."""
    false_rb = table["good"][name]["rollback %"]
    speedups, missed = {}, {}
    for scenario, rows in table.items():
        if scenario == "good":
            continue
        ours, theirs = rows[name], rows[FLAGGER]
        if theirs["rollback %"] >= 50 and ours["rollback %"] >= 50:
            speedups[scenario] = theirs["median s"] / ours["median s"]
        elif ours["rollback %"] >= 50:
            missed[scenario] = (theirs["promote %"], ours["median s"])
    met = false_rb <= 1.0 and bool(speedups) and min(speedups.values()) >= 10
    print(f"{name}: target {'MET' if met else 'NOT MET'}")
    print(f"  false rollbacks on good canaries: {false_rb:.1f} % (target <= 1 %)")
    for scenario, x in speedups.items():
        print(f"  {scenario}: detected {x:.1f}x faster than Flagger (median {table[scenario][name]['median s']:.0f} s "
              f"vs {table[scenario][FLAGGER]['median s']:.0f} s; target >= 10x)")  # fmt: skip
    for scenario, (promoted, ours) in missed.items():
        print(f"  {scenario}: Flagger's checks promote {promoted:.0f} % of these canaries; "
              f"detected here in {ours:.0f} s (median)")  # fmt: skip
    if met:
        print()
        return
    first = policy.steps[0]
    canary_rps = rps * first / 100
    if speedups and min(speedups.values()) < 10:
        slowest = min(speedups, key=speedups.get)
        flagger_s = table[slowest][FLAGGER]["median s"]
        print(f"  why: Flagger takes {FLAGGER_THRESHOLD + 1} ticks of {FLAGGER_INTERVAL_S:g} s ({flagger_s:.0f} s) "
              f"whatever the traffic; 10x faster means a verdict within {flagger_s / 10:.0f} s, but at {first} % of "
              f"{rps:g} req/s the canary gets {canary_rps:g} req/s, {flagger_s / 10 * canary_rps:.0f} requests in "
              f"that time, and this policy needs min_samples {policy.min_samples} and a significant test first, "
              f"looked at every {policy.analysis_window_s:g} s")  # fmt: skip
    if false_rb > 1.0:
        print(f"  why: {false_rb:.1f} % of good canaries were rolled back; at {canary_rps:g} req/s to the canary, showing "
              f"the error rate is within +{policy.gates.max_error_rate_increase:.1%} at {policy.gates.confidence:.0%} "
              f"can take longer than hold_deadline_s {policy.hold_deadline_s:g} s (the 'deadline' gate)")  # fmt: skip
    print()


def _secs(x: float) -> str:
    return "-" if np.isnan(x) else f"{x:.0f} s"


if __name__ == "__main__":
    main()
