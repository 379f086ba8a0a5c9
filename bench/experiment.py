"""Time to a decision of an A/B experiment (fleet.analysis.ab), next to fixed-horizon tests.

A ``clicked`` outcome at a base rate of 20 % on arm A; arm B better by 1, 2 or 5 percentage
points (absolute), or equal. ``--rps`` requests a second, split 50/50, every answer getting
an outcome; the experiment looks every ``--tick-s`` seconds with ``--min-effect`` 0.01 and
``--alpha`` 0.05, as ``fleet experiment start`` does, until a decision or ``--max-hours``.

Beside it, in the same run, two fixed-horizon two-proportion z-tests at the same alpha:
- *planned*: sized in advance for 80 % power at the minimum effect (what one would fix
  before knowing the effect), the same horizon whatever the true effect is;
- *same power*: sized, knowing the true effect, for the power the sequential test reached
  by ``--max-hours`` (read as 99 % where every run found it; the fairest fixed test: it is
  given what no one knows in advance).

    .venv/bin/python bench/experiment.py [--runs 200] [--rps 20] [--tick-s 30] [--seed 18]
"""

from __future__ import annotations

import argparse
import math
import time

import numpy as np
from scipy import stats

from fleet.analysis.ab import arm_stats, decide, interval

BASE = 0.20
EFFECTS = (0.0, 0.01, 0.02, 0.05)


def one(rng: np.random.Generator, effect: float, per_look: int, looks: int, min_effect: float, alpha: float):  # noqa: ANN201
    """(status, winner, looks taken) of one simulated experiment."""
    ka = np.cumsum(rng.binomial(per_look, BASE, looks))
    kb = np.cumsum(rng.binomial(per_look, BASE + effect, looks))
    for t in range(looks):
        n = per_look * (t + 1)
        a = _stats("A", ka[t], n)
        b = _stats("B", kb[t], n)
        decision = decide(a, b, interval(a, b, alpha, min_effect, 1.0), min_effect, t == looks - 1, "clicked")
        if decision.status != "running":
            return decision.status, decision.winner, t + 1
    raise AssertionError("the last look decides")


def _stats(version: str, k: int, n: int):  # noqa: ANN202
    """Bernoulli counts as arm_stats reads them (mean, sample variance), without the arrays."""
    mean = k / n
    base = arm_stats(version, np.zeros(0))
    return type(base)(version, n, mean, mean * (1 - mean) * n / (n - 1))


def fixed_n(effect: float, alpha: float, power: float) -> float:
    """Outcomes per arm a two-sided two-proportion z-test needs for ``power`` at ``effect``."""
    z = stats.norm.isf(alpha / 2) + stats.norm.ppf(power)
    var = BASE * (1 - BASE) + (BASE + effect) * (1 - BASE - effect)
    return z * z * var / (effect * effect)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--rps", type=float, default=20.0, help="requests/s, each with an outcome, split 50/50")
    parser.add_argument("--tick-s", type=float, default=30.0)
    parser.add_argument("--min-effect", type=float, default=0.01)
    parser.add_argument("--alpha", type=float, default=0.05)
    parser.add_argument("--max-hours", type=float, default=6.0)
    parser.add_argument("--seed", type=int, default=18)
    args = parser.parse_args()
    per_look = max(1, round(args.rps / 2 * args.tick_s))
    looks = math.ceil(args.max_hours * 3600 / args.tick_s)
    per_arm_s = args.rps / 2
    print(
        f"{args.runs} experiments per effect: clicked at {BASE:.0%} on A, {args.rps:g} req/s split 50/50 "
        f"({per_arm_s:g} outcomes/s per arm), a look every {args.tick_s:g} s, min effect {args.min_effect:g}, "
        f"alpha {args.alpha:g}, at most {args.max_hours:g} h"
    )
    planned = fixed_n(args.min_effect, args.alpha, 0.8)
    print(
        f"fixed horizon planned for 80 % power at the minimum effect: {planned:.0f} outcomes per arm = "
        f"{_t(planned / per_arm_s)}, whatever the effect\n"
    )
    print(
        f"{'B - A':>7} {'B wins':>7} {'A wins':>7} {'no diff':>8} {'out of time':>12} {'decided, median':>16} "
        f"{'p90':>8} {'fixed, same power':>18} {'median / same, planned':>19}"
    )
    began = time.perf_counter()
    rng = np.random.default_rng(args.seed)
    for effect in EFFECTS:
        runs = [one(rng, effect, per_look, looks, args.min_effect, args.alpha) for _ in range(args.runs)]
        share = {
            k: sum(1 for s, w, _ in runs if (s, w) == k) / args.runs
            for k in (("winner", "B"), ("winner", "A"), ("no_difference", None), ("out_of_time", None))
        }
        wanted = ("winner", "B") if effect > 0 else ("no_difference", None)
        times = [n * args.tick_s for s, w, n in runs if (s, w) == wanted]
        median = float(np.median(times)) if times else math.nan
        p90 = float(np.percentile(times, 90)) if times else math.nan
        if effect > 0 and share[wanted] > 0.5:  # a power of 100 % in these runs is read as 99 %
            same = fixed_n(effect, args.alpha, min(share[wanted], 0.99)) / per_arm_s
            ratio = f"{median / same:.2f}x / {median / (planned / per_arm_s):.2f}x"
        else:
            same, ratio = math.nan, "-"
        print(
            f"{effect:+7.2f} {share['winner', 'B']:7.0%} {share['winner', 'A']:7.0%} {share['no_difference', None]:8.0%} "
            f"{share['out_of_time', None]:12.0%} {_t(median):>16} {_t(p90):>8} {_t(same):>18} {ratio:>19}"
        )
    print(
        f"\n(simulated in {time.perf_counter() - began:.0f} s; with no effect, 'decided' is the time to 'no difference'"
        "; B wins there is a false winner)"
    )


def _t(seconds: float) -> str:
    if math.isnan(seconds):
        return "-"
    return f"{seconds / 60:.0f} min" if seconds >= 120 else f"{seconds:.0f} s"


if __name__ == "__main__":
    main()
