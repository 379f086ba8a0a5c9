"""What every metrics source shares: its errors and window sums (the binning is fleet.types')."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from fleet.errors import FleetError, InvalidInput
from fleet.types import ERROR_CLASSES, N_LATENCY, PREDICTION_BINS, ArmWindow

__all__ = ["BadMetricsAnswer", "MetricsUnavailable", "empty_window", "sum_windows"]


class MetricsUnavailable(FleetError):
    """A metrics source could not be reached or did not answer; the message names its URL.

    A rollout reads this as "no data yet" (hold until the step's deadline), never as a
    verdict about the canary.
    """

    status = 503


class BadMetricsAnswer(MetricsUnavailable):
    """A source answered, but not in the agreed shape (another bucket layout, a bad query)."""

    status = 502


def empty_window(model: str, version: str, start: float, end: float) -> ArmWindow:
    return ArmWindow(
        model=model,
        version=version,
        start=start,
        end=end,
        requests=0,
        errors=dict.fromkeys(ERROR_CLASSES, 0),
        latency_ms=(0,) * N_LATENCY,
        predictions=(0,) * PREDICTION_BINS,
    )


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
        tpot_ms=_add_some([w.tpot_ms for w in windows]),
        output_tokens=_add_some([w.output_tokens for w in windows]),
        labelled=sum(w.labelled for w in windows),
        matched=sum(w.matched for w in windows),
    )


def _add(rows: Sequence[Sequence[int]]) -> tuple[int, ...]:
    return tuple(sum(column) for column in zip(*rows, strict=True))


def _add_some(rows: Sequence[Sequence[int]]) -> tuple[int, ...]:
    """As ``_add``, over the windows that have the histogram (generations; empty for tensors)."""
    present = [r for r in rows if r]
    return _add(present) if present else ()
