"""In-memory metrics: the fake for tests of flow logic. Tests say what each version served
and when, exactly as the gateway records it; ``window`` sums it like the real sources do.

    m = MemoryMetrics()
    m.answered("demo", "1.1.0", at=t0 + 3, latency_ms=12.0, scores=[0.7], count=50)
    m.failed("demo", "1.1.0", at=t0 + 4, error_class="timeout")
    m.window("demo", "1.1.0", t0, t0 + 10)  # → ArmWindow(requests=51, errors={"timeout": 1, ...})
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import replace as _replace

from fleet.analysis.sources._common import MetricsUnavailable, empty_window, sum_windows
from fleet.errors import InvalidInput
from fleet.types import (
    ERROR_CLASSES,
    N_LATENCY,
    N_OUTPUT_TOKENS,
    ArmWindow,
    latency_bucket,
    output_bucket,
    score_bins,
)


class MemoryMetrics:
    max_window_s: int | None = None

    def __init__(self) -> None:
        self._events: list[tuple[float, ArmWindow]] = []
        self._lock = threading.Lock()
        self.reads: list[tuple[str, str, float, float]] = []  # every window() asked, in order
        self.unavailable: str | None = None  # set to a message: reads raise MetricsUnavailable

    def answered(
        self, model: str, version: str, at: float, latency_ms: float, scores: Iterable[float] = (), count: int = 1
    ) -> None:
        """``count`` answered requests at ``at``, each with this latency and these output scores."""
        base = empty_window(model, version, at, at)
        latency, predictions = list(base.latency_ms), list(base.predictions)
        latency[latency_bucket(latency_ms)] += count
        for i, n in enumerate(score_bins(list(scores))):
            predictions[i] += n * count
        self._add(at, _replace(base, requests=count, latency_ms=tuple(latency), predictions=tuple(predictions)))

    def generated(
        self, model: str, version: str, at: float, ttft_ms: float, tpot_ms: float, tokens: int, count: int = 1
    ) -> None:
        """``count`` finished generations at ``at``, each with these times and ``tokens`` output tokens."""
        base = empty_window(model, version, at, at)
        latency, tpot, lengths = list(base.latency_ms), [0] * N_LATENCY, [0] * N_OUTPUT_TOKENS
        latency[latency_bucket(ttft_ms)] += count
        tpot[latency_bucket(tpot_ms)] += count
        lengths[output_bucket(tokens)] += count
        self._add(
            at,
            _replace(
                base, requests=count, latency_ms=tuple(latency), tpot_ms=tuple(tpot), output_tokens=tuple(lengths)
            ),
        )

    def failed(self, model: str, version: str, at: float, error_class: str = "5xx", count: int = 1) -> None:
        if error_class not in ERROR_CLASSES:
            raise InvalidInput(f"error class {error_class!r}; expected one of {', '.join(ERROR_CLASSES)}")
        base = empty_window(model, version, at, at)
        self._add(at, _replace(base, requests=count, errors={**base.errors, error_class: count}))

    def labelled(self, model: str, version: str, at: float, matched: bool, count: int = 1) -> None:
        """``count`` exact-match labels on answers of ``version``, arrived at ``at``."""
        base = empty_window(model, version, at, at)
        self._add(at, _replace(base, labelled=count, matched=count if matched else 0))

    def shadow_pair(self, model: str, version: str, at: float, agreed: bool, count: int = 1) -> None:
        base = empty_window(model, version, at, at)
        self._add(at, _replace(base, shadow_pairs=count, shadow_agreed=count if agreed else 0))

    def window(self, model: str, version: str, start: float, end: float) -> ArmWindow:
        with self._lock:
            self.reads.append((model, version, start, end))
            if self.unavailable is not None:
                raise MetricsUnavailable(f"memory metrics: {self.unavailable}")
            parts = [w for at, w in self._events if start <= at < end and (w.model, w.version) == (model, version)]
        total = sum_windows(parts, model, version, start, end)
        return _replace(total, start=start, end=end)  # the window asked for, not just its events

    def _add(self, at: float, window: ArmWindow) -> None:
        with self._lock:
            self._events.append((at, window))
