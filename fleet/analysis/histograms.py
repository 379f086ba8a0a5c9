"""Reading the gateway's histograms as Prometheus does: a quantile of a ``LATENCY_BUCKETS_MS``
histogram, the requests above a threshold in it, and a window's generation histograms.

Both verdict methods (``fleet.analysis.canary``, ``fleet.analysis.sequential``) read latency
this way, so a limit in milliseconds means what a Grafana panel over the same buckets shows.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from fleet.types import LATENCY_BUCKETS_MS, N_LATENCY, N_OUTPUT_TOKENS, ArmWindow


def histogram_quantile(q: float, counts: np.ndarray | tuple[int, ...]) -> float:
    """The q-quantile (ms) of a LATENCY_BUCKETS_MS histogram, as Prometheus computes it.

    Linear interpolation inside the bucket holding rank q·total (the first bucket starts at
    0); a rank in the open bucket gives the last finite bound. ``(0.5, [0, 4, 0, ...])`` → 1.5.
    """
    counts = np.asarray(counts, dtype=np.float64)
    total = counts.sum()
    if total <= 0:
        return math.nan
    rank = q * total
    cumulative = np.cumsum(counts)
    i = int(np.searchsorted(cumulative, rank, side="left"))
    if i >= len(LATENCY_BUCKETS_MS):
        return float(LATENCY_BUCKETS_MS[-1])
    lower = 0.0 if i == 0 else float(LATENCY_BUCKETS_MS[i - 1])
    below = 0.0 if i == 0 else cumulative[i - 1]
    return lower + (float(LATENCY_BUCKETS_MS[i]) - lower) * (rank - below) / counts[i]


def count_above(counts: np.ndarray, threshold_ms: float) -> float:
    """Requests slower than threshold_ms in a latency histogram, linear inside its bucket
    (the reading ``histogram_quantile`` makes). The open bucket (> 10 s) counts whole."""
    bounds = (0.0, *LATENCY_BUCKETS_MS)
    total = 0.0
    for i, c in enumerate(np.asarray(counts, dtype=np.float64)):
        if i == len(LATENCY_BUCKETS_MS) or bounds[i] >= threshold_ms:
            total += c
        elif bounds[i + 1] > threshold_ms:
            total += c * (bounds[i + 1] - threshold_ms) / (bounds[i + 1] - bounds[i])
    return total


def filled(window: ArmWindow, field: str) -> ArmWindow:
    """``window`` with a generation histogram (``tpot_ms``, ``output_tokens``) of zeros when it
    served none (nothing to judge yet)."""
    if getattr(window, field):
        return window
    return dataclasses.replace(window, **{field: (0,) * (N_LATENCY if field == "tpot_ms" else N_OUTPUT_TOKENS)})
