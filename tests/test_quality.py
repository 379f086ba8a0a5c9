"""Data-quality suites: built from the schema and baseline, run by Great Expectations."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest

from bentos.tabular_mlp import data
from fleet.analysis import quality
from fleet.catalog import profile
from fleet.catalog.policies.monitoring import QualityThresholds
from fleet.catalog.registry import TensorSpec
from fleet.errors import InvalidInput

DEMO_INPUTS = [TensorSpec(name="features", datatype="FP32", shape=[-1, 4])]
Q = QualityThresholds()


@pytest.fixture(scope="module", autouse=True)
def gx_imported() -> None:
    """Pay GX's import (~4 s) once for the module; contexts themselves take milliseconds."""
    quality._context()


@pytest.fixture(scope="module")
def demo() -> tuple[dict, pd.DataFrame]:
    x, _ = data.generate(4000, seed=7)
    proba = np.random.default_rng(7).dirichlet([1.0, 1.0], size=len(x))
    return profile.baseline_profile(x, data.FEATURES, proba), pd.DataFrame(x, columns=list(data.FEATURES))


def _window(rows: int = 2000, seed: int = 8, shift: float = 0.0) -> pd.DataFrame:
    """Shaped like the inference log: float64 features plus the log's own columns."""
    x, _ = data.generate(rows, seed=seed, shift=shift)
    frame = pd.DataFrame(x.astype(np.float64), columns=list(data.FEATURES))
    return frame.assign(
        ts=pd.Timestamp("2026-01-01", tz="UTC"),
        request_id=[f"r{i}" for i in range(rows)],
        row=0,
        model="demo",
        version="1.0.0",
        tenant="t",
        latency_ms=1.5,
        prediction=0,
        score=0.3,
    )


# -- building the suite (no GX) ---------------------------------------------------------------
def test_columns_take_the_profiles_feature_names(demo) -> None:
    prof, _ = demo
    cols = quality.feature_columns(DEMO_INPUTS, prof)
    assert [c.name for c in cols] == list(data.FEATURES) and {c.datatype for c in cols} == {"FP32"}
    unnamed = quality.feature_columns(
        [TensorSpec(name="x", datatype="INT64", shape=[-1, 2]), TensorSpec(name="y", datatype="BYTES", shape=[-1])],
        None,
    )
    assert [(c.name, c.datatype, c.tensor) for c in unnamed] == [
        ("f0", "INT64", "x"),
        ("f1", "INT64", "x"),
        ("f2", "BYTES", "y"),
    ]


def test_schema_and_profile_that_disagree_are_refused(demo) -> None:
    prof, _ = demo
    with pytest.raises(InvalidInput, match="hold 3 features .* the baseline profile names 4: income"):
        quality.feature_columns([TensorSpec(name="features", datatype="FP32", shape=[-1, 3])], prof)
    with pytest.raises(InvalidInput, match="fixed dimensions after the batch"):
        quality.feature_columns([TensorSpec(name="features", datatype="FP32", shape=[-1, -1])], prof)


def test_suite_has_schema_null_and_range_checks_per_feature(demo) -> None:
    prof, _ = demo
    suite = quality.build_expectations(
        DEMO_INPUTS, prof, QualityThresholds(max_null_rate=0.02, max_out_of_range_rate=0.05)
    )
    income = [e for e in suite if e.column == "income"]
    assert [e.expectation for e in income] == [
        "expect_column_to_exist",
        "expect_column_values_to_be_in_type_list",
        "expect_column_values_to_not_be_null",
        "expect_column_values_to_be_between",
    ]
    base = prof["features"]["income"]
    pad = 0.1 * (base["max"] - base["min"])
    assert income[2].kwargs == {"mostly": pytest.approx(0.98)}
    assert income[3].kwargs == {
        "min_value": pytest.approx(base["min"] - pad),
        "max_value": pytest.approx(base["max"] + pad),
        "mostly": pytest.approx(0.95),
    }
    assert len(suite) == 16


def test_null_allowance_is_the_baselines_rate_plus_the_policys() -> None:
    values = np.array([1.0, 2.0, np.nan, 4.0] * 50)  # 25 % null at baseline
    prof = profile.baseline_profile(values[:, None], ["x"], np.full((200, 2), 0.5))
    suite = quality.build_expectations([TensorSpec(name="x", datatype="FP64", shape=[-1, 1])], prof, Q)
    nulls = [e for e in suite if e.expectation == "expect_column_values_to_not_be_null"][0]
    assert nulls.kwargs["mostly"] == pytest.approx(1 - 0.26)


def test_categories_become_a_value_set_of_the_tensors_datatype() -> None:
    prof = profile.baseline_profile(
        np.zeros((6, 0)),
        [],
        np.full((6, 2), 0.5),
        categorical={"colour": list("rrgbbb"), "code": [3, 1, 3, 3, 1, 2]},
    )
    inputs = [
        TensorSpec(name="colour", datatype="BYTES", shape=[-1]),
        TensorSpec(name="code", datatype="INT64", shape=[-1]),
    ]
    suite = quality.build_expectations(inputs, prof, Q)
    sets = {e.column: e.kwargs["value_set"] for e in suite if e.expectation == "expect_column_values_to_be_in_set"}
    assert sets == {"colour": ["b", "r", "g"], "code": [3.0, 1.0, 2.0]}


def test_without_a_profile_only_the_schema_is_checked() -> None:
    suite = quality.build_expectations(DEMO_INPUTS, None, Q)
    assert {e.expectation for e in suite} == {
        "expect_column_to_exist",
        "expect_column_values_to_be_in_type_list",
        "expect_column_values_to_not_be_null",
    }
    assert [e.column for e in suite][::3] == ["f0", "f1", "f2", "f3"]


# -- running it -------------------------------------------------------------------------------
def test_training_data_and_a_clean_log_window_pass(demo) -> None:
    prof, train = demo
    suite = quality.build_expectations(DEMO_INPUTS, prof, Q)
    for frame in (train, _window()):
        result = quality.validate(frame, suite, name="clean")
        assert result.passed, quality.quality_markdown(result)
        assert result.evaluated == 16 and result.failed == 0 and result.failing_rows_fraction == 0.0


def test_drifted_but_plausible_data_is_not_bad_data(demo) -> None:
    prof, _ = demo
    result = quality.validate(_window(shift=1.0), quality.build_expectations(DEMO_INPUTS, prof, Q))
    assert result.passed  # shifted by one std: drift's business, not quality's


def test_nulls_over_the_limit_fail_with_observed_vs_expected(demo) -> None:
    prof, _ = demo
    window = _window()
    window.loc[:59, "age"] = np.nan  # 3 %
    window.loc[:4, "tenure"] = None  # 0.25 %: within 1 %
    result = quality.validate(window, quality.build_expectations(DEMO_INPUTS, prof, Q), name="nulls")
    assert not result.passed and result.failed == 1
    (failure,) = result.failures
    assert (failure.column, failure.expectation) == ("age", "expect_column_values_to_not_be_null")
    assert failure.expected == "null fraction <= 0.01" and failure.observed == "null fraction 0.03 (60 of 2000)"
    assert failure.unexpected_fraction == pytest.approx(0.03)
    assert result.failing_rows_fraction == pytest.approx(60 / 2000)


def test_out_of_range_values_fail_beyond_the_allowed_fraction(demo) -> None:
    prof, _ = demo
    suite = quality.build_expectations(DEMO_INPUTS, prof, Q)
    window = _window()
    window.loc[:9, "income"] = 1e6  # 0.5 %: allowed
    assert quality.validate(window, suite).passed
    window.loc[:99, "income"] = -1e6  # 5 %
    result = quality.validate(window, suite)
    (failure,) = result.failures
    assert failure.expectation == "expect_column_values_to_be_between"
    assert failure.observed == "out of range fraction 0.05 (100 of 2000)"
    assert result.failing_rows_fraction == pytest.approx(0.05)


def test_a_missing_column_fails_every_check_on_it(demo) -> None:
    prof, _ = demo
    result = quality.validate(_window().drop(columns=["debt_ratio"]), quality.build_expectations(DEMO_INPUTS, prof, Q))
    failed = {(o.column, o.expectation) for o in result.failures}
    assert {c for c, _ in failed} == {"debt_ratio"} and len(failed) == 4
    assert {o.observed for o in result.failures} == {"column missing"}
    assert result.failing_rows_fraction == 1.0


def test_text_where_numbers_belong_fails_the_type_check(demo) -> None:
    prof, _ = demo
    window = _window().astype({"age": object})
    window.loc[3, "age"] = "forty"
    result = quality.validate(window, quality.build_expectations(DEMO_INPUTS, prof, Q))
    types = [o for o in result.expectations if o.column == "age" and o.expectation.endswith("type_list")]
    assert not types[0].passed and not result.passed


def test_categorical_columns_check_type_and_categories() -> None:
    rng = np.random.default_rng(9)
    prof = profile.baseline_profile(
        np.zeros((1000, 0)), [], np.full((1000, 2), 0.5), categorical={"colour": rng.choice(list("rgb"), 1000)}
    )
    suite = quality.build_expectations([TensorSpec(name="colour", datatype="BYTES", shape=[-1])], prof, Q)
    known = pd.DataFrame({"colour": rng.choice(list("rgb"), 500)})  # pandas 3: the "str" dtype
    assert str(known["colour"].dtype) == "str"
    assert quality.validate(known, suite).passed
    as_objects = known.astype(object)
    as_objects.loc[:9, "colour"] = "pink"  # 2 % unknown
    result = quality.validate(as_objects, suite)
    (failure,) = result.failures
    assert failure.expectation == "expect_column_values_to_be_in_set" and failure.unexpected_fraction == pytest.approx(
        0.02
    )
    numbers = quality.validate(pd.DataFrame({"colour": np.arange(500.0)}), suite)
    assert {o.expectation for o in numbers.failures} >= {"expect_column_values_to_be_in_type_list"}


def test_result_is_json_and_renders_as_markdown_and_table(demo) -> None:
    prof, _ = demo
    window = _window()
    window.loc[:99, "age"] = np.nan
    result = quality.validate(window, quality.build_expectations(DEMO_INPUTS, prof, Q), name="window 14:00")
    back = quality.QualityResult.model_validate(json.loads(result.model_dump_json()))
    assert back == result
    md = quality.quality_markdown(result)
    assert md.startswith("## Data quality: window 14:00") and "**failed** (1 of 16 expectations)" in md
    assert md.splitlines()[6].startswith("| age | column_values_to_not_be_null | **FAIL** |")
    table = quality.quality_table(result)
    assert table[0]["passed"] is False and len(table) == 16


def test_an_empty_window_still_checks_the_schema(demo) -> None:
    prof, _ = demo
    result = quality.validate(_window().head(0), quality.build_expectations(DEMO_INPUTS, prof, Q))
    assert result.rows == 0 and result.failing_rows_fraction == 0.0
    assert all(o.passed for o in result.expectations if o.expectation == "expect_column_to_exist")


def test_great_expectations_stays_off_the_import_path_and_analytics_off() -> None:
    code = (
        "import sys, fleet.analysis.quality, fleet.analysis.drift, fleet.catalog.profile; "
        "assert 'great_expectations' not in sys.modules, 'GX imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
    assert os.environ["GX_ANALYTICS_ENABLED"] == "false"
