"""Baseline profiles: what a version's inputs and predictions looked like when it was made.

Stored in the manifest at registration; drift monitoring and the data-quality suite compare
live traffic with it, without the raw training data. Per numeric feature:

- histogram over fixed bin edges (the baseline's 0.5 % and 99.5 % quantiles, plus open-ended
  outer bins) so live data can be binned the same way later (PSI, Jensen-Shannon);
- quantiles, mean, std, min, max and the null rate (NaN and ±inf count as null);
- ``reference``: a quantile sketch of at most ``REFERENCE_SIZE`` values (the midpoint order
  statistics, sorted), which Wasserstein and KS are computed against. With no more values
  than that it is the data itself, so the statistics are exact.

A categorical feature (``categorical=`` of ``baseline_profile``) stores category
frequencies instead. ``format`` is 2; profiles written before it (format 1) lack ``kind``,
``reference`` and ``reference_count``, and readers treat them as numeric with no sketch.

Size: a numeric feature is about 11 kB of JSON (the sketch is 1,000 values to a millionth of
the feature's range), so the demo model's 4 features make a ~45 kB profile.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from fleet.types import PREDICTION_BINS, score_bins

FORMAT = 2
QUANTILES = (0.01, 0.05, 0.25, 0.5, 0.75, 0.95, 0.99)
BINS = 10
# Midpoint quantiles approximate Wasserstein-1 with an error of O(1/m) of the spread (a random
# sample of m values: O(1/sqrt(m))) and KS's statistic within 1/(2m); deterministic, too, so
# the same data gives the same manifest.
REFERENCE_SIZE = 1000
MAX_CATEGORIES = 50  # beyond this a column is high-cardinality: the rest is pooled as "other"


def _histogram(values: np.ndarray, edges: np.ndarray) -> list[int]:
    # Outer bins catch everything below the first / above the last edge.
    full = np.concatenate(([-np.inf], edges[1:-1], [np.inf]))
    return np.histogram(values, bins=full)[0].astype(int).tolist()


def _edges(lo: float, hi: float) -> np.ndarray:
    if hi > lo:
        return np.linspace(lo, hi, BINS + 1)
    # (Nearly) constant: bins below, at and above the value, so a change of value shows up.
    return np.array([lo - 1.0, lo, np.nextafter(lo, np.inf), lo + 1.0])


def reference_sketch(sorted_values: np.ndarray, size: int = REFERENCE_SIZE) -> np.ndarray:
    """``size`` midpoint order statistics of sorted values: [v(⌊(i + ½)·n/size⌋) for i < size].

    Values, not interpolations, so a discrete feature keeps its values. n <= size: all values.
    """
    n = sorted_values.size
    if n <= size:
        return sorted_values
    return sorted_values[((np.arange(size) + 0.5) * n / size).astype(np.int64)]


def _round(values: np.ndarray, spread: float) -> list[float]:
    # To a millionth of the feature's range (about float32's precision, relative to the
    # spread rather than to each value, so 1e6 + noise keeps its noise): half the JSON of
    # full float64 repr, and distinct values stay distinct.
    decimals = int(np.ceil(-np.log10(spread * 1e-6))) if spread > 0 else 7
    return [round(v, decimals) for v in values.tolist()]


def feature_profile(values: np.ndarray, *, reference_size: int = REFERENCE_SIZE) -> dict[str, Any]:
    """Profile of one numeric column: {"kind": "numeric", "count", "null_rate", ..., "reference"}."""
    values = np.asarray(values, dtype=np.float64)
    finite = np.sort(values[np.isfinite(values)])
    null_rate = 1.0 - finite.size / values.size if values.size else 0.0
    if finite.size == 0:
        return {"kind": "numeric", "null_rate": null_rate, "count": int(values.size)}
    lo, hi = np.quantile(finite, [0.005, 0.995])
    edges = _edges(float(lo), float(hi))
    return {
        "kind": "numeric",
        "count": int(values.size),
        "null_rate": float(null_rate),
        "mean": float(finite.mean()),
        "std": float(finite.std()),
        "min": float(finite[0]),
        "max": float(finite[-1]),
        "quantiles": {str(q): float(v) for q, v in zip(QUANTILES, np.quantile(finite, QUANTILES))},
        "bin_edges": edges.tolist(),
        "histogram": _histogram(finite, edges),
        "reference": _round(reference_sketch(finite, reference_size), float(finite[-1] - finite[0])),
        "reference_count": int(finite.size),
    }


def category_keys(values: Any) -> tuple[np.ndarray, np.ndarray]:
    """Values of a column → (string keys of the non-null values, null mask of all values).

    None, NaN and pd.NA are nulls, never a category. Integral floats are keyed as integers,
    so a category 3 logged as 3.0 (the inference log holds float64 columns) is still "3".
    """
    import pandas as pd  # not on the gateway's import path

    series = pd.Series(values) if not isinstance(values, pd.Series) else values
    null = series.isna().to_numpy()
    kept = series[~null]
    if pd.api.types.is_bool_dtype(kept.dtype):
        keys = kept.astype(str)
    elif pd.api.types.is_numeric_dtype(kept.dtype):
        numbers = kept.to_numpy(dtype=np.float64)
        integral = np.isfinite(numbers).all() and bool((numbers == np.round(numbers)).all())
        keys = kept.astype(np.int64).astype(str) if integral else kept.astype(str)
    else:
        keys = kept.astype(str)
    return keys.to_numpy(dtype=object), null


def categorical_profile(values: Any, *, max_categories: int = MAX_CATEGORIES) -> dict[str, Any]:
    """Profile of one categorical column.

    ["a", "b", "a", None] → {"kind": "categorical", "count": 4, "null_rate": 0.25,
    "categories": {"a": 0.667, "b": 0.333}, "other": 0.0, "distinct": 2}: frequencies among
    non-null values, most frequent first; past ``max_categories`` the rest is pooled as "other".
    """
    import pandas as pd

    keys, null = category_keys(values)
    count = int(null.size)
    counts = pd.Series(keys, dtype=object).value_counts(sort=False)
    # most frequent first, ties by name: the same data in any row order gives the same profile
    order = np.lexsort((counts.index.to_numpy(dtype=str), -counts.to_numpy()))
    total = max(int(keys.size), 1)
    kept, pooled = order[:max_categories], order[max_categories:]
    categories = {str(counts.index[i]): float(counts.iloc[i] / total) for i in kept}
    other = float(counts.to_numpy()[pooled].sum() / total)
    return {
        "kind": "categorical",
        "count": count,
        "null_rate": float(null.mean()) if count else 0.0,
        "categories": categories,
        "other": other,
        "distinct": int(len(counts)),
    }


def baseline_profile(
    features: np.ndarray,
    names: Sequence[str],
    probabilities: np.ndarray,
    *,
    categorical: Mapping[str, Any] | None = None,
    reference_size: int = REFERENCE_SIZE,
) -> dict[str, Any]:
    """Profile of a 2-D numeric feature matrix (columns ``names``), optional categorical
    columns (name → values, one per row) and the class probabilities predicted for the rows."""
    if features.ndim != 2 or features.shape[1] != len(names):
        raise ValueError(f"features of shape {features.shape} do not match {len(names)} names")
    categorical = dict(categorical or {})
    for name, values in categorical.items():
        if name in names:
            raise ValueError(f"feature {name!r} is given both as numeric and as categorical")
        if len(values) != features.shape[0]:
            raise ValueError(f"categorical feature {name!r} has {len(values)} values for {features.shape[0]} rows")
    classes = probabilities.argmax(axis=1)
    n_classes = probabilities.shape[1]
    edges = np.linspace(0.0, 1.0, PREDICTION_BINS + 1)  # for labels: the counts are score_bins'
    profiles = {name: feature_profile(features[:, i], reference_size=reference_size) for i, name in enumerate(names)}
    profiles.update({name: categorical_profile(values) for name, values in categorical.items()})
    return {
        "format": FORMAT,
        "rows": int(features.shape[0]),
        "features": profiles,
        "predictions": {
            "class_frequencies": (np.bincount(classes, minlength=n_classes) / len(classes)).tolist(),
            "positive_probability": {
                "bin_edges": edges.tolist(),
                "histogram": score_bins(probabilities[:, -1]),  # as the gateway bins live scores
            },
        },
    }


def feature_kind(feature: Mapping[str, Any]) -> str:
    """ "numeric" or "categorical"; format-1 profiles knew only numeric features."""
    return str(feature.get("kind", "numeric"))
