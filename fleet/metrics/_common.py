"""What every metrics source shares: its errors, the gateway's binning, and window sums."""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence

from fleet.errors import FleetError, InvalidInput
from fleet.types import ERROR_CLASSES, LATENCY_BUCKETS_MS, PREDICTION_BINS, ArmWindow

N_LATENCY = len(LATENCY_BUCKETS_MS) + 1  # the finite buckets and the open one


class MetricsUnavailable(FleetError):
    """A metrics source could not be reached or did not answer; the message names its URL.

    A rollout reads this as "no data yet" (hold until the step's deadline), never as a
    verdict about the canary.
    """

    status = 503


class BadMetricsAnswer(MetricsUnavailable):
    """A source answered, but not in the agreed shape (another bucket layout, a bad query)."""

    status = 502


def latency_bucket(ms: float) -> int:
    """Index of the first bucket whose upper bound is >= ms; past the last bound, the open one.

    The gateway's rule (a Prometheus ``le`` bucket): 10.0 → 5 (the ``le=10`` bucket), 10.1 → 6.
    """
    return bisect.bisect_left(LATENCY_BUCKETS_MS, ms)


def score_bin(score: float) -> int:
    """Bin of a score in [0, 1]: i holds [i/10, (i+1)/10), 1.0 goes to the last bin."""
    return min(max(int(score * PREDICTION_BINS), 0), PREDICTION_BINS - 1)


def empty_window(model: str, version: str, start: float, end: float) -> ArmWindow:
    return ArmWindow(
        model=model, version=version, start=start, end=end, requests=0,
        errors=dict.fromkeys(ERROR_CLASSES, 0), latency_ms=(0,) * N_LATENCY, predictions=(0,) * PREDICTION_BINS,
    )  # fmt: skip


def sum_windows(windows: Iterable[ArmWindow], model: str, version: str, start: float, end: float) -> ArmWindow:
    """Add the counters of windows of one version (from several gateways, or consecutive ticks).

    The result spans the union of their time ranges, or [start, end) when there are none.
    """
    windows = list(windows)
    for w in windows:
        if (w.model, w.version) != (model, version):
            raise InvalidInput(f"cannot add a window of {w.model} {w.version} to {model} {version}")
    if not windows:
        return empty_window(model, version, start, end)
    return ArmWindow(
        model=model,
        version=version,
        start=min(w.start for w in windows),
        end=max(w.end for w in windows),
        requests=sum(w.requests for w in windows),
        errors={c: sum(w.errors.get(c, 0) for w in windows) for c in ERROR_CLASSES},
        latency_ms=_add([w.latency_ms for w in windows]),
        predictions=_add([w.predictions for w in windows]),
        shadow_pairs=sum(w.shadow_pairs for w in windows),
        shadow_agreed=sum(w.shadow_agreed for w in windows),
    )


def _add(rows: Sequence[Sequence[int]]) -> tuple[int, ...]:
    return tuple(sum(column) for column in zip(*rows, strict=True))
