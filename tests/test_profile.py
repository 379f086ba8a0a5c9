"""Baseline profiles: histograms, the reference sketch, categories, nulls, size, old formats."""

from __future__ import annotations

import json

import numpy as np
import pytest

from bentos.tabular_mlp import data
from fleet.catalog import profile
from fleet.types import score_bin, score_bins


def _probabilities(rows: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).dirichlet([1.0, 1.0], size=rows)


def test_numeric_feature_profile_has_histogram_quantiles_and_a_sorted_sketch() -> None:
    values = np.random.default_rng(1).normal(size=5000)
    p = profile.feature_profile(values)
    assert p["kind"] == "numeric" and p["count"] == 5000 and p["null_rate"] == 0.0
    assert sum(p["histogram"]) == 5000 and len(p["histogram"]) == len(p["bin_edges"]) - 1 == profile.BINS
    assert p["bin_edges"][0] == pytest.approx(np.quantile(values, 0.005))
    assert p["quantiles"]["0.5"] == pytest.approx(np.median(values))
    ref = p["reference"]
    assert len(ref) == profile.REFERENCE_SIZE and ref == sorted(ref) and p["reference_count"] == 5000
    assert ref[0] >= values.min() and ref[-1] <= values.max()


def test_sketch_is_the_midpoint_order_statistics() -> None:
    values = np.arange(10_000, dtype=float)  # v(i) = i
    sketch = profile.reference_sketch(values, 1000)
    assert sketch.tolist() == [5.0 + 10 * i for i in range(1000)]  # ⌊(i + ½)·10⌋
    small = np.arange(7, dtype=float)
    assert profile.reference_sketch(small, 1000) is small  # no more values than the size: all of them


def test_small_baselines_store_every_value_so_statistics_are_exact() -> None:
    values = np.round(np.random.default_rng(2).normal(size=800), 3)
    p = profile.feature_profile(values)
    assert p["reference"] == sorted(values.tolist())


def test_nan_and_infinities_are_nulls_not_values() -> None:
    values = np.array([1.0, 2.0, np.nan, np.inf, -np.inf, 3.0, 4.0, 5.0])
    p = profile.feature_profile(values)
    assert p["null_rate"] == pytest.approx(3 / 8)
    assert p["min"] == 1.0 and p["max"] == 5.0 and sum(p["histogram"]) == 5
    assert p["reference"] == [1.0, 2.0, 3.0, 4.0, 5.0] and p["reference_count"] == 5


def test_all_null_column_has_only_its_null_rate() -> None:
    p = profile.feature_profile(np.full(10, np.nan))
    assert p == {"kind": "numeric", "null_rate": 1.0, "count": 10}


def test_constant_feature_gets_bins_below_at_and_above_its_value() -> None:
    p = profile.feature_profile(np.full(100, 3.5))
    assert p["histogram"] == [0, 100, 0]
    assert p["bin_edges"][1] == 3.5 and p["bin_edges"][2] > 3.5
    assert p["reference"] == [3.5] * 100


def test_categorical_profile_counts_non_null_values_most_frequent_first() -> None:
    p = profile.categorical_profile(["b", "a", "b", None, np.nan, "c", "b", "a"])
    assert p["kind"] == "categorical" and p["count"] == 8 and p["null_rate"] == pytest.approx(2 / 8)
    assert list(p["categories"]) == ["b", "a", "c"]
    assert p["categories"] == pytest.approx({"b": 0.5, "a": 2 / 6, "c": 1 / 6})
    assert p["other"] == 0.0 and p["distinct"] == 3


def test_categorical_profile_pools_the_tail_beyond_max_categories() -> None:
    values = ["x"] * 5 + ["y"] * 3 + ["z"] * 1 + ["w"] * 1
    p = profile.categorical_profile(values, max_categories=2)
    assert p["categories"] == pytest.approx({"x": 0.5, "y": 0.3}) and p["other"] == pytest.approx(0.2)
    assert p["distinct"] == 4


def test_integral_floats_are_keyed_as_integers() -> None:
    # the inference log stores every feature as float64: category 3 arrives as 3.0
    keys, null = profile.category_keys(np.array([3.0, 1.0, np.nan, 3.0]))
    assert keys.tolist() == ["3", "1", "3"] and null.tolist() == [False, False, True, False]
    assert list(profile.categorical_profile([3, 1, 3])["categories"]) == ["3", "1"]


def test_category_ties_are_ordered_by_name_whatever_the_row_order() -> None:
    a = profile.categorical_profile(["q", "p", "r"])
    b = profile.categorical_profile(["r", "q", "p"])
    assert list(a["categories"]) == list(b["categories"]) == ["p", "q", "r"]


def test_baseline_profile_of_the_demo_data_is_small_and_json() -> None:
    x, _ = data.generate(4000, seed=7)
    p = profile.baseline_profile(x, data.FEATURES, _probabilities(4000))
    assert p["format"] == profile.FORMAT and p["rows"] == 4000
    assert list(p["features"]) == list(data.FEATURES)
    assert sum(p["predictions"]["positive_probability"]["histogram"]) == 4000
    assert sum(p["predictions"]["class_frequencies"]) == pytest.approx(1.0)
    size = len(json.dumps(p))
    assert size < 60_000, f"profile is {size} bytes"  # ~11 kB per feature


def test_scores_are_binned_by_the_gateways_rule() -> None:
    # np.histogram over linspace(0, 1, 11) put 0.3 in bin 2 (that edge is 0.30000000000000004)
    # where the gateway's score_bin says 3: the baseline must bin as live traffic is binned
    scores = np.arange(11) / 10
    p = profile.baseline_profile(np.zeros((11, 1)), ["x"], np.stack([1 - scores, scores], axis=1))
    assert [score_bin(s) for s in scores] == [*range(10), 9]
    assert p["predictions"]["positive_probability"]["histogram"] == score_bins(scores) == [1] * 9 + [2]


def test_baseline_profile_with_categorical_features() -> None:
    x = np.random.default_rng(3).normal(size=(6, 2))
    p = profile.baseline_profile(x, ["a", "b"], _probabilities(6), categorical={"colour": list("rgbrgr")})
    assert list(p["features"]) == ["a", "b", "colour"]
    assert profile.feature_kind(p["features"]["colour"]) == "categorical"
    assert profile.feature_kind({"null_rate": 0.0, "histogram": [1]}) == "numeric"  # format 1


@pytest.mark.parametrize(
    ("categorical", "message"),
    [({"a": list("abcdef")}, "both as numeric and as categorical"), ({"c": ["x"]}, "has 1 values for 6 rows")],
)
def test_baseline_profile_refuses_inconsistent_columns(categorical: dict, message: str) -> None:
    x = np.zeros((6, 2))
    with pytest.raises(ValueError, match=message):
        profile.baseline_profile(x, ["a", "b"], _probabilities(6), categorical=categorical)


def test_sketch_rounding_is_relative_to_the_spread_not_the_magnitude() -> None:
    values = 1e6 + np.random.default_rng(4).normal(size=50_000)
    p = profile.feature_profile(values)
    ref = np.array(p["reference"])
    exact = profile.reference_sketch(np.sort(values))
    assert np.abs(ref - exact).max() <= 1e-6 * (values.max() - values.min())
    assert (np.diff(ref) > 0).all()  # 7 significant digits would have made ties of these
