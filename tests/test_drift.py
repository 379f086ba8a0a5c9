"""Drift statistics against scipy and hand-computed values; reports, verdicts, rendering."""

from __future__ import annotations

import math
import xml.etree.ElementTree as ET

import numpy as np
import pandas as pd
import pydantic
import pytest
from scipy import stats
from scipy.spatial import distance

from fleet.analysis.drift import (
    DriftReport,
    concept_drift,
    drift_markdown,
    drift_report,
    drift_svg,
    feature_drift,
    js_distance,
    ks,
    prediction_drift,
    psi,
    svg_data_uri,
    wasserstein,
)
from fleet.analysis.drift.stats import KS_EXACT_N
from fleet.catalog import profile
from fleet.catalog.policies.monitoring import DriftThresholds, MonitoringPolicy, RetrainTrigger
from fleet.types import score_bins

T = DriftThresholds()


def _policy(**drift) -> MonitoringPolicy:
    return MonitoringPolicy(schedule="*/15 * * * *", window_hours=1.0, min_rows=100, drift=DriftThresholds(**drift))


def _profile(ref: np.ndarray, names: list[str], seed: int = 0, **kw) -> dict:
    proba = np.random.default_rng(seed).dirichlet([2.0, 2.0], size=len(ref))
    return profile.baseline_profile(ref, names, proba, **kw)


# -- the statistics ---------------------------------------------------------------------------
@pytest.mark.parametrize(("m", "n", "shift"), [(1, 1, 0.0), (5, 3, 1.0), (300, 300, 0.0), (1000, 7000, 0.4)])
def test_wasserstein_matches_scipy(m: int, n: int, shift: float) -> None:
    rng = np.random.default_rng(m + n)
    u, v = np.sort(rng.normal(size=m)), np.sort(rng.normal(shift, 1.5, size=n))
    assert wasserstein(u, v) == pytest.approx(stats.wasserstein_distance(u, v), rel=1e-12, abs=1e-15)


def test_wasserstein_and_ks_with_ties_match_scipy() -> None:
    rng = np.random.default_rng(4)
    u = np.sort(rng.integers(0, 5, 200).astype(float))
    v = np.sort(rng.integers(1, 7, 333).astype(float))
    assert wasserstein(u, v) == pytest.approx(stats.wasserstein_distance(u, v), rel=1e-12)
    d, p = ks(u, v)
    expected = stats.ks_2samp(u, v, method="asymp")
    assert d == pytest.approx(expected.statistic, abs=1e-15) and p == pytest.approx(expected.pvalue, rel=1e-9)


def test_wasserstein_of_constants_is_their_distance() -> None:
    assert wasserstein(np.full(10, 2.0), np.full(4, 5.5)) == pytest.approx(3.5)
    assert wasserstein(np.full(10, 2.0), np.full(4, 2.0)) == 0.0


@pytest.mark.parametrize(("m", "n", "shift"), [(50, 70, 0.0), (1000, 5000, 0.3), (300, 300, 1.0), (2, 3, 5.0)])
def test_ks_matches_scipy_asymptotic(m: int, n: int, shift: float) -> None:
    rng = np.random.default_rng(m * n)
    u, v = np.sort(rng.normal(size=m)), np.sort(rng.normal(shift, 1.2, size=n))
    d, p = ks(u, v)
    expected = stats.ks_2samp(u, v, method="asymp")
    assert d == pytest.approx(expected.statistic, abs=1e-15)
    assert p == pytest.approx(expected.pvalue, rel=1e-9, abs=1e-300)


def test_ks_of_identical_samples_is_zero_with_p_one() -> None:
    u = np.sort(np.random.default_rng(5).normal(size=100))
    assert ks(u, u) == (0.0, 1.0)


@pytest.mark.parametrize(("n", "shift", "rel"), [(25_000, 0.03, 5e-3), (300_000, 0.004, 5e-4)])
def test_ks_above_the_exact_size_uses_the_corrected_limiting_distribution(n: int, shift: float, rel: float) -> None:
    rng = np.random.default_rng(6)
    u, v = np.sort(rng.normal(size=n)), np.sort(rng.normal(shift, 1.0, size=n))
    assert n * n / (2 * n) > KS_EXACT_N
    d, p = ks(u, v)
    expected = stats.ks_2samp(u, v, method="asymp")
    assert d == pytest.approx(expected.statistic, abs=1e-15)
    assert 1e-10 < expected.pvalue < 0.5 and p == pytest.approx(expected.pvalue, rel=rel)


def test_ks_p_value_uses_the_size_the_sketch_stands_for() -> None:
    u = np.linspace(-2, 2, 100)
    v = np.sort(np.random.default_rng(7).normal(0.2, 1.0, size=5000))
    d, p_sketch = ks(u, v)
    _, p_full = ks(u, v, n_reference=50_000)
    en = round(50_000 * 5000 / 55_000)
    assert p_full == pytest.approx(stats.kstwo.sf(d, en)) and p_full < p_sketch


def test_psi_by_hand() -> None:
    # half a count per bin: (10.5, 10.5) vs (5.5, 15.5), each over 21: (5/21)·ln(31/11)
    assert psi(np.array([10, 10]), np.array([5, 15])) == pytest.approx(5 / 21 * math.log(31 / 11))
    assert psi(np.array([5, 15]), np.array([10, 10])) == pytest.approx(psi(np.array([10, 10]), np.array([5, 15])))
    assert psi(np.array([2, 8]), np.array([2, 8])) == 0.0
    # with counts in every bin the smoothing fades: at 10^6 rows it is the unsmoothed 0.25·ln 3
    big = psi(np.array([500_000, 500_000]), np.array([250_000, 750_000]))
    assert big == pytest.approx(0.25 * math.log(3), rel=1e-5)


def test_psi_matches_scipy_as_the_symmetrised_kl_of_the_smoothed_proportions() -> None:
    rng = np.random.default_rng(8)
    a, b = rng.integers(0, 40, 12), rng.integers(0, 40, 12)
    a[3] = b[3] = 0  # a bin neither side has: left out
    a[5], b[7] = 0, 0  # a bin one side lacks: half a count
    used = (a + b) > 0
    p, q = (a[used] + 0.5) / (a[used] + 0.5).sum(), (b[used] + 0.5) / (b[used] + 0.5).sum()
    assert psi(a, b) == pytest.approx(stats.entropy(p, q) + stats.entropy(q, p), rel=1e-12)


def test_psi_empty_bins_cost_half_a_count_not_an_epsilon() -> None:
    # one row in 50 that the other side lacks: a fixed 1e-4 stand-in would read 0.105 here
    assert psi(np.array([50, 0]), np.array([49, 1])) == pytest.approx(
        (0.5 / 51 - 1.5 / 51) * math.log(1 / 3) + (50.5 / 51 - 49.5 / 51) * math.log(50.5 / 49.5)
    )
    assert psi(np.array([50, 0]), np.array([49, 1])) < 0.025
    # bins neither side has change nothing, so the layout's unused bins do not matter
    assert psi(np.array([10, 10, 0, 0]), np.array([10, 5, 5, 0])) == psi(np.array([10, 10, 0]), np.array([10, 5, 5]))


def test_psi_of_a_side_without_counts_is_nan() -> None:
    assert math.isnan(psi(np.array([0, 0]), np.array([3, 1])))


def test_psi_and_js_are_vectorised_over_rows() -> None:
    rng = np.random.default_rng(8)
    ref, cur = rng.integers(0, 30, (5, 6)), rng.integers(0, 30, (5, 6))
    cur[2, 3] = 0
    ref[1, 4] = cur[1, 4] = 0
    assert psi(ref, cur) == pytest.approx([psi(r, c) for r, c in zip(ref, cur)])
    assert js_distance(ref, cur) == pytest.approx([js_distance(r, c) for r, c in zip(ref, cur)])


@pytest.mark.parametrize(
    ("p", "q"),
    [([0.1, 0.2, 0.7, 0.0], [0.3, 0.3, 0.2, 0.2]), ([1, 2, 3], [3, 2, 1]), ([0.25, 0.75], [0.25, 0.75])],
)
def test_js_distance_matches_scipy_base_2(p: list, q: list) -> None:
    assert js_distance(np.array(p), np.array(q)) == pytest.approx(distance.jensenshannon(p, q, base=2), abs=1e-12)


def test_js_distance_bounds() -> None:
    assert js_distance(np.array([1.0, 0.0]), np.array([0.0, 1.0])) == pytest.approx(1.0)
    assert js_distance(np.array([0.3, 0.7]), np.array([0.3, 0.7])) == 0.0


# -- features against the profile -------------------------------------------------------------
@pytest.fixture(scope="module")
def small_baseline() -> tuple[np.ndarray, dict]:
    # 3 decimals survive the sketch's rounding (a millionth of the range): the sketch is the data
    ref = np.round(np.random.default_rng(10).normal(size=(800, 2)), 3)
    return ref, _profile(ref, ["a", "b"])


def test_feature_statistics_match_scipy_on_the_raw_baseline(small_baseline) -> None:
    ref, prof = small_baseline
    rng = np.random.default_rng(11)
    window = pd.DataFrame({"a": rng.normal(0.0, 1.0, 3000), "b": rng.normal(0.8, 1.3, 3000)})
    by_name = {f.feature: f for f in feature_drift(prof, window, T)}
    for i, name in enumerate(["a", "b"]):
        f, r, c = by_name[name], ref[:, i], window[name].to_numpy()
        assert f.wasserstein.value == pytest.approx(stats.wasserstein_distance(r, c), rel=1e-12)
        assert f.wasserstein_norm == pytest.approx(f.wasserstein.value / r.std())
        expected = stats.ks_2samp(r, c, method="asymp")
        assert f.ks_statistic == pytest.approx(expected.statistic, abs=1e-15)
        assert f.ks_pvalue.value == pytest.approx(expected.pvalue, rel=1e-9, abs=1e-300)
        edges = np.array(prof["features"][name]["bin_edges"])
        full = np.concatenate(([-np.inf], edges[1:-1], [np.inf]))
        ref_n, cur_n = np.histogram(r, full)[0], np.histogram(c, full)[0]
        ref_p, cur_p = ref_n / r.size, cur_n / c.size
        assert f.reference == pytest.approx(tuple(ref_p)) and f.current == pytest.approx(tuple(cur_p))
        assert f.psi.value == pytest.approx(float(psi(ref_n, cur_n)))
        assert f.js.value == pytest.approx(distance.jensenshannon(ref_p, cur_p, base=2))
    assert by_name["a"].status == "ok" and by_name["b"].status == "drift"
    assert by_name["b"].psi.exceeded and by_name["b"].js.exceeded


def test_nulls_are_left_out_and_reported_not_binned(small_baseline) -> None:
    _, prof = small_baseline
    rng = np.random.default_rng(12)
    clean = rng.normal(size=1000)
    with_nulls = pd.Series([*clean, None, np.nan, np.inf, -np.inf], dtype=object)
    a = feature_drift(prof, pd.DataFrame({"a": with_nulls, "b": 0.0}), T)[0]
    b = feature_drift(prof, pd.DataFrame({"a": clean, "b": 0.0}), T)[0]
    assert a.rows == 1000 and a.null_rate == pytest.approx(4 / 1004)
    assert (a.psi.value, a.js.value, a.wasserstein.value, a.ks_statistic) == (
        b.psi.value,
        b.js.value,
        b.wasserstein.value,
        b.ks_statistic,
    )


def test_all_null_or_missing_column_has_no_data_and_does_not_drift(small_baseline) -> None:
    _, prof = small_baseline
    window = pd.DataFrame({"a": [np.nan] * 200})
    a, b = feature_drift(prof, window, T)
    assert (a.status, a.rows, a.null_rate, a.psi.value, a.wasserstein.value) == ("no_data", 0, 1.0, None, None)
    assert b.status == "no_data" and not a.drifting and not b.drifting


def test_constant_feature_same_value_is_no_drift_other_value_is() -> None:
    prof = _profile(np.full((500, 1), 2.0), ["k"])
    same = feature_drift(prof, pd.DataFrame({"k": np.full(300, 2.0)}), T)[0]
    assert (same.psi.value, same.js.value, same.wasserstein.value, same.ks_statistic) == (0.0, 0.0, 0.0, 0.0)
    assert same.ks_pvalue.value == 1.0 and same.status == "ok"
    moved = feature_drift(prof, pd.DataFrame({"k": np.full(300, 2.5)}), T)[0]
    assert moved.status == "drift" and moved.wasserstein.value == pytest.approx(0.5)
    assert moved.wasserstein_norm == pytest.approx(0.5 / 0.001)  # std 0, floored like Evidently
    assert moved.ks_statistic == 1.0


def test_ks_alone_never_makes_a_feature_drift() -> None:
    rng = np.random.default_rng(13)
    prof = _profile(rng.normal(size=(200_000, 1)), ["x"])
    window = pd.DataFrame({"x": rng.normal(0.03, 1.0, size=200_000)})  # tiny shift, huge n
    f = feature_drift(prof, window, T)[0]
    assert f.ks_pvalue.exceeded and f.ks_pvalue.value < T.ks_pvalue
    assert not f.psi.exceeded and not f.js.exceeded and f.status == "ok"


def test_wasserstein_decides_only_when_the_policy_sets_a_threshold() -> None:
    rng = np.random.default_rng(14)
    prof = _profile(rng.normal(size=(20_000, 1)), ["x"])
    window = pd.DataFrame({"x": rng.normal(0.15, 1.0, size=20_000)})
    off = feature_drift(prof, window, T)[0]
    on = feature_drift(prof, window, DriftThresholds(wasserstein=0.1))[0]
    assert not off.psi.exceeded and not off.js.exceeded and off.wasserstein.threshold is None
    assert off.status == "ok" and on.status == "drift" and on.wasserstein.exceeded


def test_format_1_profiles_still_give_psi_and_js() -> None:
    # written by the first profile code: no kind, no sketch; constant features had one bin
    old = {
        "rows": 4,
        "features": {
            "x": {
                "count": 4,
                "null_rate": 0.0,
                "mean": 0.5,
                "std": 0.5,
                "min": 0.0,
                "max": 1.0,
                "quantiles": {},
                "bin_edges": [0.0, 0.5, 1.0],
                "histogram": [2, 2],
            },
            "c": {
                "count": 4,
                "null_rate": 0.0,
                "mean": 1.0,
                "std": 0.0,
                "min": 1.0,
                "max": 1.0,
                "quantiles": {},
                "bin_edges": [0.5, 1.5],
                "histogram": [4],
            },
            "gone": {"null_rate": 1.0, "count": 4},
        },
    }
    x, c, gone = feature_drift(old, pd.DataFrame({"x": [0.1, 0.2, 0.3, 0.9], "c": 1.0, "gone": 1.0}), T)
    # [2, 2] vs [3, 1], half a count each: (2.5, 2.5) vs (3.5, 1.5) over 5 → 0.2·ln(7/3)
    assert x.psi.value == pytest.approx(0.2 * math.log(7 / 3)) and x.wasserstein.value is None
    assert x.ks_pvalue.value is None and not x.ks_pvalue.exceeded and x.status == "drift"
    assert c.bins == ("all",) and c.psi.value == 0.0
    assert gone.status == "no_baseline"


def test_categorical_drift_pools_unseen_values_with_the_baseline_tail() -> None:
    x = np.zeros((10, 1))
    prof = _profile(x, ["n"], categorical={"colour": list("rrrrrggggb")}, reference_size=10)
    # max_categories is 50, so nothing was pooled at baseline: "(other)" is 0 there
    window = pd.DataFrame({"n": 0.0, "colour": ["r"] * 4 + ["g"] * 4 + ["pink"] * 2 + [None] * 2})
    f = [f for f in feature_drift(prof, window, T) if f.feature == "colour"][0]
    assert f.kind == "categorical" and f.bins == ("r", "g", "b", "(other)")
    assert f.reference == pytest.approx((0.5, 0.4, 0.1, 0.0)) and f.current == pytest.approx((0.4, 0.4, 0.0, 0.2))
    assert f.rows == 10 and f.null_rate == pytest.approx(2 / 12)
    # the baseline's frequencies times its 10 non-null rows, against the window's 10
    assert f.psi.value == pytest.approx(float(psi(np.array([5, 4, 1, 0]), np.array([4, 4, 0, 2]))))
    assert f.js.value == pytest.approx(distance.jensenshannon(f.reference, f.current, base=2))
    assert f.wasserstein.value is None and f.status == "drift"


# -- predictions and the report ---------------------------------------------------------------
def test_prediction_drift_bins_scores_like_the_profile() -> None:
    rng = np.random.default_rng(15)
    proba = rng.dirichlet([2.0, 2.0], size=5000)
    prof = profile.baseline_profile(rng.normal(size=(5000, 1)), ["x"], proba)
    same = pd.DataFrame({"score": proba[:, 1], "prediction": proba.argmax(axis=1)})
    p = prediction_drift(prof, same, T)
    assert p.rows == 5000 and p.score.psi.value == 0.0 and p.classes.js.value == 0.0 and not p.drifting
    skewed = rng.dirichlet([1.0, 4.0], size=5000)
    q = prediction_drift(prof, pd.DataFrame({"score": skewed[:, 1], "prediction": skewed.argmax(axis=1)}), T)
    want = np.histogram(skewed[:, 1], bins=np.linspace(0, 1, 11))[0] / 5000
    assert q.score.current == pytest.approx(tuple(want)) and q.drifting


def test_scores_on_bin_edges_land_where_the_profile_put_them() -> None:
    # profile and window both bin by fleet.types.score_bins (np.histogram put 0.3 in bin 2)
    scores = np.arange(11) / 10
    prof = profile.baseline_profile(np.zeros((11, 1)), ["x"], np.stack([1 - scores, scores], axis=1))
    p = prediction_drift(prof, pd.DataFrame({"score": [*scores, np.nan]}), T)
    assert p.rows == 11 and p.score.current == pytest.approx(tuple(np.array(score_bins(scores)) / 11))
    assert p.score.psi.value == 0.0


def test_a_class_the_baseline_never_predicted_is_counted() -> None:
    prof = {"rows": 4, "features": {}, "predictions": {"class_frequencies": [0.5, 0.5]}}
    p = prediction_drift(prof, pd.DataFrame({"prediction": [0, 1, 2, 2]}), T)
    assert p.classes.bins == ("0", "1", "2") and p.classes.reference == (0.5, 0.5, 0.0)
    assert p.classes.current == (0.25, 0.25, 0.5) and p.drifting


@pytest.fixture(scope="module")
def drifted() -> tuple[dict, pd.DataFrame]:
    rng = np.random.default_rng(16)
    prof = _profile(rng.normal(size=(4000, 4)), ["a", "b", "c", "d"], seed=16)
    window = pd.DataFrame(rng.normal(size=(2000, 4)) + [0.0, 1.0, 0.0, 1.0], columns=["a", "b", "c", "d"])
    proba = rng.dirichlet([2.0, 2.0], size=2000)
    return prof, window.assign(score=proba[:, 1], prediction=proba.argmax(axis=1))


def test_report_names_the_drifting_features_and_the_verdict(drifted) -> None:
    prof, window = drifted
    r = drift_report(prof, window, _policy())
    assert r.verdict == "drift" and r.dataset_drift and r.drifting_features == ("b", "d")
    assert [f.feature for f in r.features] == ["a", "b", "c", "d"] and not r.prediction.drifting
    assert "2 of 4 features drift (b, d)" in r.reason and r.feature("b").drifting


def test_fewer_drifting_features_than_the_alert_count_is_ok(drifted) -> None:
    prof, window = drifted
    r = drift_report(prof, window, _policy(features_drifting_to_alert=3))
    assert r.verdict == "ok" and not r.dataset_drift and r.drifting_features == ("b", "d")


def test_too_few_rows_is_insufficient_data_not_ok(drifted) -> None:
    prof, window = drifted
    r = drift_report(prof, window.head(50), _policy())
    assert r.verdict == "insufficient_data" and "fewer than min_rows 100" in r.reason


def test_report_is_frozen_and_round_trips_through_json(drifted) -> None:
    prof, window = drifted
    r = drift_report(prof, window, _policy())
    assert DriftReport.model_validate_json(r.model_dump_json()) == r
    with pytest.raises(pydantic.ValidationError):
        r.verdict = "ok"


# -- concept drift ----------------------------------------------------------------------------
def test_concept_drift_accuracy_and_f1_by_hand() -> None:
    pred = [1, 1, 0, 0, 1, 0, 1, 1, 0, 0]
    labels = [1, 0, 0, 0, 1, 1, 1, 1, 0, None]  # the unlabelled row is left out
    c = concept_drift(pred, labels, {"accuracy": 0.95, "f1": 0.9}, RetrainTrigger(min_feedback_rows=5))
    # 9 rows: tp 4, fp 1, fn 1, tn 3 → accuracy 7/9, precision = recall = 0.8, F1 0.8
    assert c.rows == 9 and c.accuracy == pytest.approx(7 / 9) and c.f1 == pytest.approx(0.8)
    assert c.accuracy_drop == pytest.approx(0.95 - 7 / 9) and c.f1_drop == pytest.approx(0.1)
    assert c.verdict == "degraded"


def test_concept_drift_small_drop_is_ok_and_few_labels_insufficient() -> None:
    pred, labels = [1, 0] * 100, [1, 0] * 99 + [0, 1]
    ok = concept_drift(pred, labels, {"accuracy": 1.0}, RetrainTrigger())
    assert ok.verdict == "ok" and ok.accuracy == pytest.approx(0.99)
    few = concept_drift(pred[:10], labels[:10], {"accuracy": 1.0}, RetrainTrigger())
    assert few.verdict == "insufficient_data" and few.rows == 10
    none = concept_drift(pred, labels, {}, RetrainTrigger())
    assert none.verdict == "no_baseline" and none.accuracy_drop is None


def test_multiclass_f1_is_macro() -> None:
    pred, labels = [0, 1, 2, 2], [0, 1, 1, 2]
    c = concept_drift(pred, labels, {"accuracy": 0.75}, RetrainTrigger(min_feedback_rows=1))
    # class 0: 1, class 1: p 1 r 0.5 → 2/3, class 2: p 0.5 r 1 → 2/3
    assert c.f1 == pytest.approx((1 + 2 / 3 + 2 / 3) / 3)


# -- rendering --------------------------------------------------------------------------------
def test_markdown_lists_drifting_features_first_with_thresholds(drifted) -> None:
    prof, window = drifted
    r = drift_report(prof, window, _policy())
    concept = concept_drift(window["prediction"], window["prediction"], {"accuracy": 1.0, "f1": 1.0}, RetrainTrigger())
    md = drift_markdown(r, concept)
    rows = [line for line in md.splitlines() if line.startswith("| ") and not line.startswith("| feature")]
    assert [row.split(" | ")[0][2:] for row in rows] == ["b", "d", "a", "c"]
    assert "PSI > 0.2, JS > 0.1, Wasserstein off" in md and "**drift**" in rows[0]
    assert "Labelled feedback (2000 rows): ok" in md


def test_svg_has_a_panel_of_bars_per_drifting_feature(drifted) -> None:
    prof, window = drifted
    r = drift_report(prof, window, _policy())
    svg = drift_svg(r)
    root = ET.fromstring(svg)
    ns = "{http://www.w3.org/2000/svg}"
    bars = [e for e in root.iter(f"{ns}rect")][1:]  # after the background
    assert len(bars) == 2 * sum(len(r.feature(n).bins) for n in ("b", "d"))
    assert b"b \xe2\x80\x94 PSI" in svg and svg_data_uri(svg).startswith("data:image/svg+xml;base64,")
    empty = ET.fromstring(drift_svg(r, features=[]))
    assert "no drifting features" in "".join(empty.itertext())


def test_text_in_a_numeric_column_counts_as_null(small_baseline) -> None:
    _, prof = small_baseline
    window = pd.DataFrame({"a": pd.Series([0.1, "oops", 0.3, None], dtype=object), "b": 0.0})
    a = feature_drift(prof, window, T)[0]
    assert a.rows == 2 and a.null_rate == 0.5


def test_ks_from_a_sketch_estimates_the_full_samples_statistic() -> None:
    rng = np.random.default_rng(17)
    ref = rng.normal(size=200_000)
    prof = _profile(ref[:, None], ["x"])
    window = pd.DataFrame({"x": rng.normal(0.01, 1.0, size=200_000)})
    f = feature_drift(prof, window, T)[0]
    full = stats.ks_2samp(ref, window["x"].to_numpy())
    sketch_only = ks(np.array(prof["features"]["x"]["reference"]), np.sort(window["x"].to_numpy()))[0]
    assert abs(f.ks_statistic - full.statistic) < 1e-4 < abs(sketch_only - full.statistic)
    assert f.ks_pvalue.value == pytest.approx(full.pvalue, rel=0.2)


def test_ks_from_a_sketch_of_discrete_data_keeps_the_step_cdf() -> None:
    rng = np.random.default_rng(18)
    u = np.sort(rng.poisson(3.0, 1000).astype(float))  # ties: a step CDF is the right one
    v = np.sort(rng.poisson(3.2, 5000).astype(float))
    assert ks(u, v, 100_000, bounds=(0.0, 12.0)) == ks(u, v, 100_000)
