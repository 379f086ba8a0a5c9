"""A/B experiments: two versions of a model compared on an outcome, with always-valid intervals.

``fleet experiment start <model> --arms A,B --split 50/50 --metric accuracy|<outcome>
--min-effect 0.01`` runs ``flows/experiment.py``: A (the stable) and B (a registered version)
share the model's traffic by the canary split, which is sticky by routing key
(``X-Fleet-Routing-Key``: a user stays in one arm); each tick reads the outcome of every
logged request since the start (labels for ``accuracy``, or a named outcome sent with
``POST /v1/feedback``), per arm, and the always-valid interval of B's mean minus A's.

The interval is the normal-mixture sequential test of two means (Johari, Koomen, Pekelis &
Walsh, "Always valid inference: continuous monitoring of A/B tests", Operations Research
2022): with ``V`` = var_A/n_A + var_B/n_B and mixing scale ``tau`` (the minimum effect),
B - A lies within ``d ± sqrt(V (V + tau²) / tau² · (2 ln(1/alpha) + ln((V + tau²)/V)))`` at
every tick at once with probability at least 1 - alpha (asymptotically: the variances are
estimated). It may be looked at as often as one likes, so the experiment ends as soon as:

- ``winner``: the interval excludes 0 (the better arm's mean is higher);
- ``no_difference``: the interval lies within ``± min_effect`` (an absolute difference, in
  the metric's units);
- ``out_of_time``: ``max_duration_s`` passed undecided;
- ``stopped``: a guardrail (``fleet.analysis.sequential``'s error-rate and latency harm tests, B
  against A) or ``fleet experiment stop``.

Pure: ``arm_stats``, ``interval``, ``decide``; the state is ``experiments/<model>.json``
(``fleet.catalog.experiments``), the experiment's state machine ``fleet.control.experiment``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from fleet.catalog.experiments import ExperimentStatus, Tick

MIN_PER_ARM = 30  # outcomes per arm before any decision (the interval's variance is estimated)
MAX_TICKS_KEPT = 500  # the history kept for the plot: older ticks are thinned out
# The smallest min_effect, as a share of the metric's range: a difference of a millionth of
# the range needs ~1e12 outcomes per arm to tell apart, and much smaller ones are not even
# computable (the interval's tau² underflows to 0)
MIN_EFFECT_SHARE = 1e-6


@dataclass(frozen=True)
class ArmStats:
    version: str
    n: int
    mean: float
    var: float  # sample variance of the outcome


@dataclass(frozen=True)
class Interval:
    diff: float  # B's mean minus A's
    lo: float
    hi: float


@dataclass(frozen=True)
class ExperimentDecision:
    status: ExperimentStatus
    winner: str | None
    summary: str


def arm_stats(version: str, values: np.ndarray) -> ArmStats:
    """``values``: the outcome of each of the arm's logged requests that has one."""
    values = np.asarray(values, dtype=np.float64)
    n = len(values)
    if n == 0:
        return ArmStats(version, 0, math.nan, math.nan)
    return ArmStats(version, n, float(values.mean()), float(values.var(ddof=1)) if n > 1 else 0.0)


def arm_stats_of_sums(version: str, sums: tuple[int, float, float]) -> ArmStats:
    """The same from the arm's count, sum and sum of squares (``fleet.logs.increments``)."""
    n, s1, s2 = sums
    if n <= 0:
        return ArmStats(version, 0, math.nan, math.nan)
    mean = s1 / n
    return ArmStats(version, int(n), mean, max(0.0, (s2 - s1 * mean) / (n - 1)) if n > 1 else 0.0)


def interval(a: ArmStats, b: ArmStats, alpha: float, tau: float, span: float) -> Interval | None:
    """The always-valid interval of ``b.mean - a.mean``; None before ``MIN_PER_ARM`` each.
    ``span``: the outcome's range (max - min; 1 for accuracy and 0/1 outcomes)."""
    if a.n < MIN_PER_ARM or b.n < MIN_PER_ARM:
        return None
    if not all(math.isfinite(x) for x in (a.mean, b.mean, a.var, b.var)):
        return None
    # rare events make a sample variance of ~0 (all outcomes equal so far), and the interval
    # a point: each arm's variance is at least what one differing outcome in n+1 would give
    va = max(a.var, _floor(a.n, span)) / a.n
    vb = max(b.var, _floor(b.n, span)) / b.n
    v, t2 = va + vb, tau * tau
    radius = math.sqrt(v * (v + t2) / t2 * (2 * math.log(1 / alpha) + math.log((v + t2) / v)))
    diff = b.mean - a.mean
    return Interval(diff, diff - radius, diff + radius)


def check_min_effect(min_effect: float, span: float, metric: str) -> None:
    """ValueError, saying what was expected, for a ``min_effect`` the interval cannot use:
    below ``MIN_EFFECT_SHARE`` of the metric's range ``span``, or not below the range itself."""
    least = span * MIN_EFFECT_SHARE
    if not (math.isfinite(min_effect) and least <= min_effect < span):
        raise ValueError(
            f"min_effect {min_effect:g} for {metric} (its range is {span:g}); expected at least {least:g} (a "
            f"smaller difference cannot be measured: about 1/min_effect² outcomes per arm) and below {span:g}"
        )


def _floor(n: int, span: float) -> float:
    return span * span * (1 / (n + 1)) * (n / (n + 1))


def decide(
    a: ArmStats, b: ArmStats, found: Interval | None, min_effect: float, out_of_time: bool, metric: str
) -> ExperimentDecision:
    """The experiment's state after a tick (pure)."""
    if found is None:
        need = f"{MIN_PER_ARM} outcomes per arm before any decision ({a.version}: {a.n}, {b.version}: {b.n})"
        if out_of_time:
            return ExperimentDecision(ExperimentStatus.OUT_OF_TIME, None, f"out of time with too few outcomes: {need}")
        return ExperimentDecision(ExperimentStatus.RUNNING, None, f"waiting: {need}")
    reading = (
        f"{metric}: {a.version} {a.mean:.4g} (n={a.n}), {b.version} {b.mean:.4g} (n={b.n}); "
        f"{b.version} - {a.version} = {found.diff:+.4g}, always-valid interval [{found.lo:+.4g}, {found.hi:+.4g}]"
    )
    if found.lo > 0:
        return ExperimentDecision(ExperimentStatus.WINNER, b.version, f"{b.version} wins: {reading}")
    if found.hi < 0:
        return ExperimentDecision(ExperimentStatus.WINNER, a.version, f"{a.version} wins: {reading}")
    if -min_effect < found.lo and found.hi < min_effect:
        return ExperimentDecision(
            ExperimentStatus.NO_DIFFERENCE, None, f"no difference of {min_effect:g} or more: {reading}"
        )
    if out_of_time:
        return ExperimentDecision(ExperimentStatus.OUT_OF_TIME, None, f"out of time, undecided: {reading}")
    return ExperimentDecision(ExperimentStatus.RUNNING, None, reading)


def thinned(ticks: list[Tick]) -> list[Tick]:
    """At most ``MAX_TICKS_KEPT`` ticks: every other one of the older half goes first."""
    if len(ticks) <= MAX_TICKS_KEPT:
        return ticks
    half = len(ticks) // 2
    return ticks[:half:2] + ticks[half:]


def split_of(text: str) -> tuple[float, float]:
    """``"50/50"`` → (50.0, 50.0); the shares must be positive and add up to 100."""
    parts = text.split("/")
    try:
        shares = tuple(float(p) for p in parts)
    except ValueError:
        shares = ()
    if len(shares) != 2 or any(not math.isfinite(s) or s <= 0 for s in shares) or abs(sum(shares) - 100) > 1e-9:
        raise ValueError(f"split {text!r}; expected two positive percentages that add up to 100, e.g. 50/50 or 90/10")
    return shares  # type: ignore[return-value]


def duration_of(text: str) -> float:
    """``"7d"``, ``"12h"``, ``"30m"``, ``"90s"`` or plain seconds → seconds (> 0)."""
    units = {"d": 86400.0, "h": 3600.0, "m": 60.0, "s": 1.0}
    raw = text.strip().lower()
    scale = units.get(raw[-1:], None)
    number = raw[:-1] if scale is not None else raw
    try:
        value = float(number) * (scale or 1.0)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"duration {text!r}; expected a positive number with d, h, m or s, e.g. 7d")
    return value


def effect_svg(ticks: list[Tick], arms: tuple[str, str], metric: str, min_effect: float) -> bytes:
    """The effect estimate (B - A) and its always-valid interval over time, as an SVG."""
    shown = [t for t in ticks if t.diff is not None]
    width, height, pad = 640, 260, 48
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" '
        'font-size="11">',
        f'<rect width="{width}" height="{height}" fill="white"/>',
        f'<text x="{pad}" y="16">{arms[1]} - {arms[0]} on {metric}: estimate and always-valid interval</text>',
    ]
    if shown:
        t0, t1 = shown[0].at, max(shown[-1].at, shown[0].at + 1)
        values = [v for t in shown for v in (t.lo, t.hi)] + [min_effect, -min_effect, 0.0]
        lo, hi = min(values), max(values)
        span = (hi - lo) or 1.0

        def x(at: float) -> float:
            return pad + (width - 2 * pad) * (at - t0) / (t1 - t0)

        def y(v: float) -> float:
            return height - pad + (2 * pad - height) * (v - lo) / span

        band = [f"{x(t.at):.1f},{y(t.hi):.1f}" for t in shown] + [
            f"{x(t.at):.1f},{y(t.lo):.1f}" for t in reversed(shown)
        ]
        parts.append(f'<polygon points="{" ".join(band)}" fill="#9ecae1" fill-opacity="0.6"/>')
        parts.append(
            f'<polyline points="{" ".join(f"{x(t.at):.1f},{y(t.diff):.1f}" for t in shown)}" '
            'fill="none" stroke="#08519c" stroke-width="2"/>'
        )
        for v, colour in ((0.0, "#444"), (min_effect, "#bbb"), (-min_effect, "#bbb")):
            parts.append(
                f'<line x1="{pad}" x2="{width - pad}" y1="{y(v):.1f}" y2="{y(v):.1f}" stroke="{colour}" '
                'stroke-dasharray="4 3"/>'
            )
            parts.append(f'<text x="{width - pad + 4}" y="{y(v) + 4:.1f}">{v:+.3g}</text>')
        parts.append(f'<text x="{pad}" y="{height - 12}">0 s</text>')
        parts.append(f'<text x="{width - pad - 40}" y="{height - 12}">{t1 - t0:.0f} s</text>')
    else:
        parts.append(f'<text x="{pad}" y="{height / 2}">no interval yet ({MIN_PER_ARM} outcomes per arm needed)</text>')
    parts.append("</svg>")
    return "\n".join(parts).encode()
