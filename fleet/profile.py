"""Baseline profiles: what a version's inputs and predictions looked like when it was made.

Stored in the manifest at registration; drift monitoring compares live traffic with it.
Histograms use fixed bin edges (from the baseline's own 0.5 % and 99.5 % quantiles, plus
open-ended outer bins) so live data can be binned the same way later.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

QUANTILES = (0.01, 0.05, 0.25, 0.5, 0.75, 0.95, 0.99)
BINS = 10


def _histogram(values: np.ndarray, edges: np.ndarray) -> list[int]:
    # Outer bins catch everything below the first / above the last edge.
    full = np.concatenate(([-np.inf], edges[1:-1], [np.inf]))
    return np.histogram(values, bins=full)[0].astype(int).tolist()


def feature_profile(values: np.ndarray) -> dict[str, Any]:
    finite = values[np.isfinite(values)]
    null_rate = 1.0 - finite.size / values.size if values.size else 0.0
    if finite.size == 0:
        return {"null_rate": null_rate, "count": int(values.size)}
    lo, hi = np.quantile(finite, [0.005, 0.995])
    edges = np.linspace(lo, hi, BINS + 1) if hi > lo else np.array([lo - 0.5, lo + 0.5])
    return {
        "count": int(values.size),
        "null_rate": float(null_rate),
        "mean": float(finite.mean()),
        "std": float(finite.std()),
        "min": float(finite.min()),
        "max": float(finite.max()),
        "quantiles": {str(q): float(v) for q, v in zip(QUANTILES, np.quantile(finite, QUANTILES))},
        "bin_edges": edges.tolist(),
        "histogram": _histogram(finite, edges),
    }


def baseline_profile(features: np.ndarray, names: Sequence[str], probabilities: np.ndarray) -> dict[str, Any]:
    """Profile of a 2-D feature matrix and the class probabilities predicted for it."""
    if features.ndim != 2 or features.shape[1] != len(names):
        raise ValueError(f"features of shape {features.shape} do not match {len(names)} names")
    classes = probabilities.argmax(axis=1)
    n_classes = probabilities.shape[1]
    edges = np.linspace(0.0, 1.0, BINS + 1)
    return {
        "rows": int(features.shape[0]),
        "features": {name: feature_profile(features[:, i].astype(np.float64)) for i, name in enumerate(names)},
        "predictions": {
            "class_frequencies": (np.bincount(classes, minlength=n_classes) / len(classes)).tolist(),
            "positive_probability": {
                "bin_edges": edges.tolist(),
                "histogram": np.histogram(probabilities[:, -1], bins=edges)[0].astype(int).tolist(),
            },
        },
    }
