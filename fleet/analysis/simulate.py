"""Simulated rollouts (canary steps or a blue-green switch and bake): seeded request streams judged tick by tick by the real
``fleet.analysis.canary`` (fixed) or ``fleet.analysis.sequential`` verdicts, and by Flagger's default checks.

Used by ``bench/rollout.py`` (many rollouts per scenario, the figures in the docs) and by
``fleet rollout --dry-run`` (a model's own traffic and policy).

Each rollout replays one seeded request stream: Poisson arrivals at ``rps``, each sent to
the canary when its routing draw falls under the current weight; the k-th canary request
has the same latency, outcome and score under every policy (common random numbers), so the
policies are compared on the same traffic. Latency is lognormal around a 10 ms median
(sigma 0.4: p99 ~ 25 ms), errors Bernoulli (``base_errors``, on stable and good canaries),
scores Beta(2, 5); all binned exactly as the gateway bins them (LATENCY_BUCKETS_MS with the
"le" rule, PREDICTION_BINS). Failed requests get no latency or score, as in the gateway's
stats. Time is from the canary's first request to the verdict, a multiple of the tick.

A blue-green policy is one step at 100 % that may not advance before ``bake_s``, judged
against the stable's last ``BASELINE_S`` at full traffic before the switch, as the rollout is.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fleet.analysis import reference
from fleet.analysis.canary import judge
from fleet.analysis.histograms import histogram_quantile
from fleet.analysis.reference import BASELINE_S
from fleet.analysis.sequential import Arms, Evidence
from fleet.analysis.sequential import judge as sequential_judge
from fleet.catalog.policies.rollout import RolloutPolicy, judged
from fleet.types import ERROR_CLASSES, LATENCY_BUCKETS_MS, PREDICTION_BINS, ArmWindow

BASE_MS, SIGMA, BASE_ERR = 10.0, 0.4, 0.001
N_LAT = len(LATENCY_BUCKETS_MS) + 1
FLAGGER_INTERVAL_S, FLAGGER_THRESHOLD, FLAGGER_MIN_SUCCESS, FLAGGER_MAX_P99_MS = 60.0, 5, 99.0, 500.0


def plan(policy: RolloutPolicy) -> tuple[tuple[float, ...], float]:
    """(the weights served in turn, the least time each must last): the canary's steps, or
    blue-green's one switch that lasts the bake."""
    if policy.strategy == "blue-green":
        return (100.0,), policy.bake_s
    return tuple(float(w) for w in policy.steps), 0.0


def switch_waits(policy: RolloutPolicy, rps: float) -> str | None:
    """What a first step at 100 % (the blue-green switch) would wait for at ``rps``, when the
    stable's traffic before it (its last ``BASELINE_S``, or the shadow phase's if longer)
    holds fewer answers than the gates need to judge against (``fleet.analysis.reference``);
    None when it would not."""
    first = plan(policy)[0][0]
    need = reference.needed(policy)
    shadow_s = policy.shadow_duration_s if policy.shadow_percent > 0 else 0.0
    have = rps * max(BASELINE_S, shadow_s)
    if first < 100 or have >= need:
        return None
    return (
        f"the switch would wait: the stable serves ~{have:.0f} requests in {BASELINE_S:.0f} s and {need} are needed "
        f"to judge the new version at 100 %; at this traffic it is rolled back at hold_deadline_s "
        f"({policy.hold_deadline_s:g} s) without traffic having moved"
    )


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
            model="bench",
            version=version,
            start=start,
            end=end,
            requests=b - a,
            errors={"5xx": int(self.err[b] - self.err[a]), **dict.fromkeys(ERROR_CLASSES[1:], 0)},
            latency_ms=tuple((self.lat[b] - self.lat[a]).tolist()),
            predictions=tuple((self.pred[b] - self.pred[a]).tolist()),
        )


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


def run(stream: Stream, policy: RolloutPolicy) -> Result:
    """The policy's method on the stream: ``run_sequential`` or ``run_fixed``."""
    return run_sequential(stream, policy) if policy.method == "sequential" else run_fixed(stream, policy)


def _before(stream: Stream, policy: RolloutPolicy) -> ArmWindow | None:
    """Blue-green's baseline: the stable's requests of the ``BASELINE_S`` before the switch."""
    if policy.strategy != "blue-green":
        return None
    n = min(len(stream.times), int(len(stream.times) * BASELINE_S / stream.horizon_s))
    return stream.stable.window("stable", 0, n, -BASELINE_S, 0.0)


def run_fixed(stream: Stream, policy: RolloutPolicy) -> Result:
    t, kc, ks, tick = 0.0, 0, 0, policy.analysis_window_s
    baseline = _before(stream, policy)
    steps, lasts = plan(policy)
    for weight in steps:
        t0, kc0, ks0 = t, kc, ks
        while t + tick <= stream.horizon_s:
            c, s = stream.route(t, t + tick, weight)
            t, kc, ks = t + tick, kc + c, ks + s
            canary = stream.canary.window("canary", kc0, kc, t0, t)
            stable = stream.stable.window("stable", ks0, ks, t0, t)
            alone = weight == 100 and baseline is not None
            if alone:
                stable = baseline  # nothing is served by stable at 100 %
            # as the rollout judges it (fleet.control.rollout.reading.judge_tick): against another
            # time's traffic, with the bake's latency floor and no prediction comparison
            verdict = judge(stable, canary, policy, step_started=t0, concurrent=not alone)
            if verdict.outcome == "rollback":
                deadline = [g.gate for g in verdict.breaches] == ["deadline"]
                return Result("rollback", t, kc, int(stream.canary.err[kc]), deadline)
            if verdict.outcome == "advance" and t - t0 >= lasts:
                baseline = stable
                break
        else:
            return Result("unfinished", t, kc, int(stream.canary.err[kc]))
    return Result("promote", t, kc, int(stream.canary.err[kc]))


def run_sequential(stream: Stream, policy: RolloutPolicy) -> Result:
    """``fleet.analysis.sequential.judge`` every ``analysis_window_s``: each tick's increments feed
    the e-processes, and the bounds read both arms since the canary's first request."""
    t, kc, ks, tick = 0.0, 0, 0, policy.analysis_window_s
    evidence = Evidence()
    baseline = _before(stream, policy)
    steps, lasts = plan(policy)
    for step, weight in enumerate(steps):
        t0, kc0, ks0 = t, kc, ks
        while t + tick <= stream.horizon_s:
            c, s = stream.route(t, t + tick, weight)
            before_c, before_s = kc, ks
            t, kc, ks = t + tick, kc + c, ks + s
            arms = Arms(
                tick_canary=stream.canary.window("canary", before_c, kc, t - tick, t),
                tick_stable=stream.stable.window("stable", before_s, ks, t - tick, t),
                canary_all=stream.canary.window("canary", 0, kc, 0.0, t),
                stable_all=stream.stable.window("stable", 0, ks, 0.0, t) if ks or baseline is None else baseline,
                step_canary=stream.canary.window("canary", kc0, kc, t0, t),
                step_stable=stream.stable.window("stable", ks0, ks, t0, t),
            )
            verdict, evidence = sequential_judge(arms, policy, evidence, step=step, step_started=t0)
            if verdict.outcome == "rollback":
                deadline = [g.gate for g in verdict.breaches] == ["deadline"]
                return Result("rollback", t, kc, int(stream.canary.err[kc]), deadline)
            if verdict.outcome == "advance" and t - t0 >= lasts:
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
            w.requests > 0
            and answered > 0  # "no values found" fails the check
            and 100.0 * (1 - w.error_count / w.requests) >= FLAGGER_MIN_SUCCESS
            and histogram_quantile(0.99, w.latency_ms) <= FLAGGER_MAX_P99_MS
        )
        if not ok:
            failed += 1
        elif weight < 100:
            weight = next(s for s in steps if s > weight)
        else:
            return Result("promote", t, kc, int(stream.canary.err[kc]))
    return Result("unfinished", t, kc, int(stream.canary.err[kc]))


# -- the dry run ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Estimate:
    """What ``runs`` simulated rollouts of one kind of canary did under a policy."""

    canary: str  # what the canary is like, in words
    bad: bool
    runs: int
    promoted: float  # fractions of the runs
    rolled_back: float
    median_s: float | None  # to the verdict that matters (promotion of a good one, rollback of a bad one)
    p90_s: float | None
    canary_requests: float  # mean served before the verdict
    canary_failures: float  # mean of those that failed


NOT_SIMULATED = (
    "the shadow phase, approval, a canary's stable traffic before the rollout (a blue-green bake's "
    "baseline is simulated) and a generation's own gates (time per token, output lengths, exact match) "
    "are not simulated; latency is lognormal around 10 ms"
)


def simulated(policy: RolloutPolicy) -> RolloutPolicy:
    """The policy as the streams can judge it: they have no generations, so a generative
    policy's generation gates are left out (its time-to-first-token gate is the latency one)."""
    gates = policy.gates.model_copy(
        update={"max_tpot_p99_ratio": None, "max_output_length_psi": None, "max_exact_match_drop": None}
    )
    return judged(policy, policy.strategy).model_copy(update={"gates": gates})


def scenarios_for(policy: RolloutPolicy) -> list[Scenario]:
    """A good canary and bad ones at and beyond the policy's own margins."""
    margin, ratio = policy.gates.max_error_rate_increase, policy.gates.max_p99_ratio
    bad = [Scenario("good")]
    if margin > 0:
        bad += [
            Scenario(f"errors +{100 * margin:g} pp (the margin)", extra_errors=margin),
            Scenario(f"errors +{400 * margin:g} pp (4x the margin)", extra_errors=4 * margin),
        ]
    bad.append(Scenario(f"latency x{1.5 * ratio:g} (1.5x the allowed p99 ratio)", latency_x=1.5 * ratio))
    return bad


def estimate(
    policy: RolloutPolicy, rps: float, base_errors: float = BASE_ERR, runs: int = 50, seed: int = 18
) -> list[Estimate]:
    """Simulated rollouts under ``policy`` at ``rps`` (the model's traffic, all versions), for
    each of ``scenarios_for(policy)``: how often and how soon each ends as it should."""
    if rps <= 0:
        raise ValueError(f"rps must be > 0, got {rps}")
    policy = simulated(policy)
    steps, lasts = plan(policy)
    horizon = len(steps) * max(policy.hold_deadline_s, lasts) + 120
    if policy.strategy == "blue-green":
        horizon += BASELINE_S  # the stream's requests before the switch are the baseline's
    found = []
    for k, scenario in enumerate(scenarios_for(policy)):
        results = [run(Stream((seed, k, i), rps, horizon, scenario, base_errors), policy) for i in range(runs)]
        wanted = "rollback" if scenario.bad else "promote"
        times = [r.at for r in results if r.outcome == wanted]
        found.append(
            Estimate(
                canary=scenario.name,
                bad=scenario.bad,
                runs=runs,
                promoted=sum(r.outcome == "promote" for r in results) / runs,
                rolled_back=sum(r.outcome == "rollback" for r in results) / runs,
                median_s=float(np.median(times)) if times else None,
                p90_s=float(np.percentile(times, 90)) if times else None,
                canary_requests=float(np.mean([r.exposed for r in results])),
                canary_failures=float(np.mean([r.failed for r in results])),
            )
        )
    return found
