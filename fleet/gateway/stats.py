"""Windowed per-version counters: one-second slots over the last 15 minutes.

What canary analysis reads (``fleet.types.ArmWindow``): per version, requests that were
not the caller's fault, failures by class, the latency histogram over
``LATENCY_BUCKETS_MS`` and the histogram of predicted scores. Recording is a handful of
list increments; summing a window happens only when someone asks.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

# score_bins is fleet.types' (the one score binning, shared with analysis, drift and retraining);
# telemetry imports it from here
from fleet.types import (
    ERROR_CLASSES,
    LATENCY_BUCKETS_MS,
    N_OUTPUT_TOKENS,
    PREDICTION_BINS,
    latency_bucket,
    output_bucket,
)

HORIZON_S = 900
_N_LAT = len(LATENCY_BUCKETS_MS) + 1
# one slot's layout: requests | errors by class | latency buckets | prediction bins | shadow pairs,
# agreed | generations: time per output token buckets | output-length buckets | labelled, matched
_REQ = 0
_ERR = 1
_LAT = _ERR + len(ERROR_CLASSES)
_PRED = _LAT + _N_LAT
_PAIRS = _PRED + PREDICTION_BINS
_AGREED = _PAIRS + 1
_TPOT = _AGREED + 1
_OUT = _TPOT + _N_LAT
_LABELLED = _OUT + N_OUTPUT_TOKENS  # exact-match feedback: labels, and how many matched the answer
_MATCHED = _LABELLED + 1
_WIDTH = _MATCHED + 1


class _Series:
    """One version's ring of one-second slots; a slot is allocated in the first second it
    counts something, so a version asked once an hour holds one slot, not 900."""

    __slots__ = ("seconds", "slots")

    def __init__(self) -> None:
        self.seconds = [-1] * HORIZON_S
        self.slots: list[list[int] | None] = [None] * HORIZON_S

    def slot(self, now: float) -> list[int]:
        sec = int(now)
        i = sec % HORIZON_S
        slot = self.slots[i]
        if self.seconds[i] != sec or slot is None:
            # the slot before its second: a reader in another thread (fleet.gateway.top) that sees
            # the new second never pairs it with the slot of 15 minutes before
            slot = self.slots[i] = [0] * _WIDTH
            self.seconds[i] = sec
        return slot


class WindowedStats:
    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._series: dict[tuple[str, str], _Series] = {}

    def _slot(self, model: str, version: str) -> list[int]:
        series = self._series.get((model, version))
        if series is None:
            series = self._series[model, version] = _Series()
        return series.slot(self._clock())

    def answered(self, model: str, version: str, latency_ms: float, bins: list[int] | None) -> None:
        slot = self._slot(model, version)
        slot[_REQ] += 1
        slot[_LAT + latency_bucket(latency_ms)] += 1
        if bins is not None:
            for i, n in enumerate(bins):
                if n:
                    slot[_PRED + i] += n

    def generated(
        self, model: str, version: str, ttft_ms: float, tpot_ms: float | None, completion_tokens: int
    ) -> None:
        """A finished generation: its time to first token is its latency."""
        slot = self._slot(model, version)
        slot[_REQ] += 1
        slot[_LAT + latency_bucket(ttft_ms)] += 1
        if tpot_ms is not None:
            slot[_TPOT + latency_bucket(tpot_ms)] += 1
        slot[_OUT + output_bucket(completion_tokens)] += 1

    def labelled(self, model: str, version: str, matched: bool) -> None:
        """Exact-match feedback on an answer of ``version``, in the window the label arrived in."""
        slot = self._slot(model, version)
        slot[_LABELLED] += 1
        slot[_MATCHED] += matched

    def failed(self, model: str, version: str, error_class: str) -> None:
        slot = self._slot(model, version)
        slot[_REQ] += 1
        slot[_ERR + ERROR_CLASSES.index(error_class)] += 1

    def shadow_pair(self, model: str, version: str, agreed: bool) -> None:
        slot = self._slot(model, version)
        slot[_PAIRS] += 1
        slot[_AGREED] += agreed

    def versions(self) -> set[tuple[str, str]]:
        """The (model, version) pairs holding a series."""
        return set(self._series)

    def series_of(self, match: str = "") -> list[tuple[tuple[str, str], _Series]]:
        """((model, version), its series) of every model whose name contains ``match``, for a
        reader that sums them off the event loop (``fleet.gateway.top``): references only, the
        series themselves are read (never written) there."""
        return [kv for kv in self._series.items() if match in kv[0][0]]

    def forget(self, model: str, version: str) -> None:
        """Free a version's series (it left every route ``HORIZON_S`` ago: nothing left to read)."""
        self._series.pop((model, version), None)

    def window(self, model: str, window_s: int) -> tuple[float, float, dict[str, dict]]:
        """(start, end, version → ArmWindow fields) over the last ``window_s`` whole seconds."""
        window_s = max(1, min(int(window_s), HORIZON_S))
        now = self._clock()
        end_sec = int(now) + 1  # the current, partial second is included
        start_sec = end_sec - window_s
        out = {}
        for (m, version), series in list(self._series.items()):
            if m != model:
                continue
            total = np.zeros(_WIDTH, dtype=np.int64)
            for sec in range(start_sec, end_sec):
                if series.seconds[sec % HORIZON_S] == sec:
                    total += series.slots[sec % HORIZON_S]  # type: ignore[arg-type]
            t = total.tolist()
            out[version] = {
                "requests": t[_REQ],
                "errors": dict(zip(ERROR_CLASSES, t[_ERR:_LAT])),
                "latency_ms": t[_LAT:_PRED],
                "predictions": t[_PRED:_PAIRS],
                "shadow_pairs": t[_PAIRS],
                "shadow_agreed": t[_AGREED],
                **({"tpot_ms": t[_TPOT:_OUT], "output_tokens": t[_OUT:_LABELLED]} if any(t[_OUT:_LABELLED]) else {}),
                **({"labelled": t[_LABELLED], "matched": t[_MATCHED]} if t[_LABELLED] else {}),
            }
        return float(start_sec), min(now, float(end_sec)), out
