"""What a monitoring run decides, from real readings of generated windows: bad data alerts and
blocks retraining whatever else it shows; drift on good data retrains, outside the cooldown."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from bentos.tabular_mlp import data
from fleet.analysis.drift import concept_drift, drift_report
from fleet.analysis.monitoring import decide
from fleet.analysis.quality import ExpectationOutcome, QualityResult
from fleet.catalog.policies.loader import load_policies
from fleet.catalog.profile import baseline_profile

ROOT = Path(__file__).resolve().parents[1]
NOW = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)


@pytest.fixture(scope="module")
def setup() -> dict:
    policy = load_policies(ROOT / "policies").monitoring["default"]
    x, y = data.generate(4000, seed=1)
    proba = np.stack([1 - (y * 0.8 + 0.1), y * 0.8 + 0.1], axis=1)
    profile = baseline_profile(x, data.FEATURES, proba)

    def window(shift: float) -> pd.DataFrame:
        wx, wy = data.generate(2000, seed=2, shift=shift)
        frame = pd.DataFrame(wx.astype(np.float64), columns=list(data.FEATURES))
        predicted = (data.rule(wx) > 0.25).astype(int)  # scored like the baseline: 0.1 or 0.9
        return frame.assign(prediction=predicted, score=0.1 + 0.8 * predicted, label=wy)

    return {"policy": policy, "profile": profile, "window": window}


def passed(ok: bool) -> QualityResult:
    outcome = ExpectationOutcome(
        expectation="expect_column_values_to_be_between",
        column="income",
        passed=ok,
        expected="within the baseline range",
        observed="12 % out of range",
        unexpected_fraction=None if ok else 0.12,
    )
    return QualityResult(
        name="w",
        passed=ok,
        rows=2000,
        evaluated=1,
        failed=0 if ok else 1,
        failing_rows_fraction=0.0 if ok else 0.12,
        expectations=(outcome,),
    )


def test_bad_data_alerts_and_blocks_retraining_even_when_it_drifts(setup: dict) -> None:
    drifting = drift_report(setup["profile"], setup["window"](1.5), setup["policy"])
    assert drifting.verdict == "drift"
    d = decide(passed(False), drifting, None, setup["policy"], rows=2000, last_retrain_at=None, now=NOW)
    assert d.action == "alert" and "retraining blocked" in d.summary and "12 % out of range" in d.summary


def test_drift_on_good_data_retrains_and_names_the_features(setup: dict) -> None:
    report = drift_report(setup["profile"], setup["window"](1.5), setup["policy"])
    d = decide(passed(True), report, None, setup["policy"], rows=2000, last_retrain_at=None, now=NOW)
    assert d.action == "retrain" and "features drifting: income (PSI" in d.summary


def test_no_drift_is_ok_and_too_few_rows_is_a_skip(setup: dict) -> None:
    report = drift_report(setup["profile"], setup["window"](0.0), setup["policy"])
    assert decide(passed(True), report, None, setup["policy"], rows=2000, last_retrain_at=None, now=NOW).action == "ok"
    skip = decide(None, None, None, setup["policy"], rows=10, last_retrain_at=None, now=NOW)
    assert skip.action == "skip" and "fewer than min_rows 500" in skip.summary


def test_a_retrain_waits_for_the_cooldown(setup: dict) -> None:
    report = drift_report(setup["profile"], setup["window"](1.5), setup["policy"])
    recent = NOW - timedelta(hours=2)
    d = decide(passed(True), report, None, setup["policy"], rows=2000, last_retrain_at=recent, now=NOW)
    assert d.action == "cooldown" and "next one allowed in 22.0 h" in d.summary
    later = decide(
        passed(True), report, None, setup["policy"], rows=2000, last_retrain_at=NOW - timedelta(hours=25), now=NOW
    )
    assert later.action == "retrain"


def test_an_accuracy_drop_on_labelled_feedback_retrains_without_input_drift(setup: dict) -> None:
    frame = setup["window"](0.0)
    report = drift_report(setup["profile"], frame, setup["policy"])
    wrong = np.where(np.arange(len(frame)) % 5 == 0, 1 - frame["label"], frame["label"])  # 80 % accurate
    concept = concept_drift(wrong, frame["label"], {"accuracy": 0.96, "f1": 0.95}, setup["policy"].retrain)
    d = decide(passed(True), report, concept, setup["policy"], rows=2000, last_retrain_at=None, now=NOW)
    assert d.action == "retrain" and "accuracy on labelled feedback 0.800" in d.summary
