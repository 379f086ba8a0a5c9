"""Drift of live inputs and predictions from a version's baseline profile, and concept drift.

In: the version's baseline profile (``fleet.catalog.profile``, any format), a window of the inference
log (a DataFrame with one column per profiled feature, plus ``prediction`` and ``score``) and
the monitoring policy. Out: a frozen, JSON-serialisable ``DriftReport``.

Per numeric feature, against the profile (nulls — None, NaN, ±inf — are left out of every
distribution and reported as the window's null rate):

- PSI over the profile's bins, from counts: ``stats.psi`` adds half a count to each bin
  either side has, so an empty bin costs what half a row would at the window's size (the
  fleet's one PSI, also the canary gate's). On the same bins it agrees with Evidently's to
  O(bins / rows) wherever no bin is empty; an empty bin costs less than Evidently's 1e-4
  stand-in, which would make a small window's stray rows look like drift.
- Jensen-Shannon distance over the same bins, base 2 (0 = same, 1 = disjoint); empty bins
  need no epsilon (0·log 0 = 0).
- Wasserstein-1 against the profile's reference sketch, in the feature's units, and divided by
  the baseline's std (floored at 0.001, as Evidently does) as ``wasserstein_norm``.
- Kolmogorov-Smirnov statistic against the sketch, with the asymptotic two-sided p-value for
  the baseline's real row count (scipy's ``ks_2samp(method="asymp")``). Secondary only: at
  large n it rejects for shifts nobody cares about (evidently#50), so KS alone never makes a
  feature drift.

Categorical features get PSI and JS over the baseline's categories plus one bucket for
everything else (pooled rare values and values never seen); the baseline's counts are its
stored frequencies times its non-null rows. The score histogram is binned by
``fleet.types.score_bins``, the gateway's rule. A feature drifts when PSI, JS or (when the
policy sets a threshold) Wasserstein is over its threshold.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict

from fleet.analysis.drift.stats import js_distance, ks, psi, wasserstein
from fleet.catalog.policies.monitoring import DriftThresholds, MonitoringPolicy, RetrainTrigger
from fleet.catalog.profile import category_keys, feature_kind
from fleet.types import PREDICTION_BINS, score_bins

STD_FLOOR = 0.001  # Evidently's floor for the std that normalises Wasserstein
OTHER = "(other)"


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Statistic(_Frozen):
    value: float | None  # None: not computable here (no data, no sketch in the profile, categorical)
    threshold: float | None  # None: judges nothing (off in the policy)
    exceeded: bool


class FeatureDrift(_Frozen):
    feature: str
    kind: Literal["numeric", "categorical"]
    status: Literal["ok", "drift", "no_data", "no_baseline"]
    rows: int  # non-null values in the window
    null_rate: float | None  # in the window; None for an empty window
    baseline_null_rate: float
    psi: Statistic
    js: Statistic
    wasserstein: Statistic
    wasserstein_norm: float | None
    ks_statistic: float | None
    ks_pvalue: Statistic  # exceeded: p below the threshold — reported, never decisive
    bins: tuple[str, ...]  # bin or category labels of the two distributions below
    reference: tuple[float, ...]  # baseline proportions per bin
    current: tuple[float, ...]  # window proportions per bin

    @property
    def drifting(self) -> bool:
        return self.status == "drift"


class DistributionDrift(_Frozen):
    psi: Statistic
    js: Statistic
    bins: tuple[str, ...]
    reference: tuple[float, ...]
    current: tuple[float, ...]

    @property
    def drifting(self) -> bool:
        return self.psi.exceeded or self.js.exceeded


class PredictionDrift(_Frozen):
    rows: int
    score: DistributionDrift | None  # probability of the last class, in the profile's bins
    classes: DistributionDrift | None  # predicted class frequencies
    drifting: bool


class DriftReport(_Frozen):
    verdict: Literal["ok", "drift", "insufficient_data"]
    reason: str
    rows: int
    min_rows: int
    features: tuple[FeatureDrift, ...]
    drifting_features: tuple[str, ...]
    features_drifting_to_alert: int
    dataset_drift: bool  # at least features_drifting_to_alert features drift
    prediction: PredictionDrift | None
    thresholds: DriftThresholds

    def feature(self, name: str) -> FeatureDrift:
        for f in self.features:
            if f.feature == name:
                return f
        raise KeyError(f"no feature {name!r} in this report; features: {', '.join(f.feature for f in self.features)}")


class ConceptDrift(_Frozen):
    verdict: Literal["ok", "degraded", "insufficient_data", "no_baseline"]
    reason: str
    rows: int  # labelled rows
    min_rows: int
    accuracy: float | None
    baseline_accuracy: float | None
    accuracy_drop: float | None  # baseline − live; positive is worse
    f1: float | None
    baseline_f1: float | None
    f1_drop: float | None
    min_accuracy_drop: float


# -- features ---------------------------------------------------------------------------------
def _labels(inner: Sequence[float]) -> tuple[str, ...]:
    if not inner:
        return ("all",)
    edges = [f"{e:.4g}" for e in inner]
    middle = [f"[{a}, {b})" for a, b in zip(edges, edges[1:])]
    return (f"< {edges[0]}", *middle, f">= {edges[-1]}")


def _judge(value: float | None, threshold: float | None) -> Statistic:
    exceeded = value is not None and threshold is not None and value > threshold
    return Statistic(value=value, threshold=threshold, exceeded=exceeded)


def _none(threshold: float | None) -> Statistic:
    return Statistic(value=None, threshold=threshold, exceeded=False)


def _missing(name: str, kind: str, base: Mapping[str, Any], rows: int, t: DriftThresholds, status: str) -> FeatureDrift:
    return FeatureDrift(
        feature=name,
        kind=kind,
        status=status,
        rows=0,
        null_rate=1.0 if rows else None,
        baseline_null_rate=float(base.get("null_rate", 0.0)),
        psi=_none(t.psi),
        js=_none(t.js),
        wasserstein=_none(t.wasserstein),
        wasserstein_norm=None,
        ks_statistic=None,
        ks_pvalue=_none(t.ks_pvalue),
        bins=(),
        reference=(),
        current=(),
    )


def _matrix(window: Any, columns: list[str]) -> np.ndarray:
    """Columns → (features, rows) float64; values that are not numbers count as nulls."""
    try:
        # pandas keeps a float frame column-major, so the transpose is rows of features for free
        return window[columns].to_numpy(dtype=np.float64, na_value=np.nan).T
    except (TypeError, ValueError):  # text in a numeric column: the quality suite reports it
        import pandas as pd

        return np.stack(
            [pd.to_numeric(window[c], errors="coerce").to_numpy(dtype=np.float64, na_value=np.nan) for c in columns]
        )


def _numeric(window: Any, names: list[str], profiles: Mapping[str, Any], t: DriftThresholds) -> list[FeatureDrift]:
    """All numeric features at once: one sort per column feeds histogram, KS and Wasserstein."""
    rows = len(window)
    present = [n for n in names if n in window.columns]
    matrix = _matrix(window, present) if present else np.empty((0, rows))
    finite = np.isfinite(matrix)
    n_finite, n_low = finite.sum(axis=1), np.isneginf(matrix).sum(axis=1)
    ordered = np.sort(matrix, axis=1)  # −inf first, then values, then +inf and NaN
    column = {n: i for i, n in enumerate(present)}
    out: list[FeatureDrift] = []
    for name in names:
        base = profiles[name]
        if "histogram" not in base:
            out.append(_missing(name, "numeric", base, rows, t, "no_baseline"))
            continue
        i = column.get(name)
        if i is None or n_finite[i] == 0:
            out.append(_missing(name, "numeric", base, rows, t, "no_data"))
            continue
        v = ordered[i, n_low[i] : n_low[i] + n_finite[i]]
        inner = base["bin_edges"][1:-1]
        counts = np.diff(np.concatenate(([0], np.searchsorted(v, inner, side="left"), [v.size])))
        ref_counts = np.asarray(base["histogram"], float)
        ref, cur = ref_counts / ref_counts.sum(), counts / v.size
        w = w_norm = d = p = None
        if base.get("reference"):
            u = np.asarray(base["reference"], float)  # stored sorted
            w = wasserstein(u, v)
            w_norm = w / max(float(base["std"]), STD_FLOOR)
            d, p = ks(u, v, base.get("reference_count"), bounds=(float(base["min"]), float(base["max"])))
        psi_s, js_s = _judge(float(psi(ref_counts, counts)), t.psi), _judge(float(js_distance(ref, cur)), t.js)
        w_s = _judge(w, t.wasserstein)
        ks_s = Statistic(value=p, threshold=t.ks_pvalue, exceeded=p is not None and p < t.ks_pvalue)
        drifting = psi_s.exceeded or js_s.exceeded or w_s.exceeded
        out.append(
            FeatureDrift(
                feature=name,
                kind="numeric",
                status="drift" if drifting else "ok",
                rows=int(v.size),
                null_rate=1.0 - v.size / rows,
                baseline_null_rate=float(base.get("null_rate", 0.0)),
                psi=psi_s,
                js=js_s,
                wasserstein=w_s,
                wasserstein_norm=w_norm,
                ks_statistic=d,
                ks_pvalue=ks_s,
                bins=_labels(inner),
                reference=tuple(ref.tolist()),
                current=tuple(cur.tolist()),
            )
        )
    return out


def _categorical(window: Any, name: str, base: Mapping[str, Any], t: DriftThresholds) -> FeatureDrift:
    rows = len(window)
    if name not in window.columns:
        return _missing(name, "categorical", base, rows, t, "no_data")
    keys, null = category_keys(window[name])
    if keys.size == 0:
        return _missing(name, "categorical", base, rows, t, "no_data")
    known = list(base["categories"])
    index = {k: i for i, k in enumerate(known)}
    import pandas as pd

    counts = pd.Series(keys, dtype=object).value_counts()
    cur = np.zeros(len(known) + 1)
    for key, count in counts.items():  # one step per distinct value, not per row
        cur[index.get(key, len(known))] += count
    ref = np.array([*base["categories"].values(), base.get("other", 0.0)])
    # stored as frequencies among the baseline's non-null values; PSI wants the counts back
    ref_counts = ref * round(base.get("count", 0) * (1.0 - base.get("null_rate", 0.0)))
    if ref_counts.sum() == 0:
        return _missing(name, "categorical", base, rows, t, "no_baseline")
    psi_s = _judge(float(psi(ref_counts, cur)), t.psi)
    cur /= keys.size
    js_s = _judge(float(js_distance(ref, cur)), t.js)
    return FeatureDrift(
        feature=name,
        kind="categorical",
        status="drift" if psi_s.exceeded or js_s.exceeded else "ok",
        rows=int(keys.size),
        null_rate=float(null.mean()),
        baseline_null_rate=float(base.get("null_rate", 0.0)),
        psi=psi_s,
        js=js_s,
        wasserstein=_none(t.wasserstein),
        wasserstein_norm=None,
        ks_statistic=None,
        ks_pvalue=_none(t.ks_pvalue),
        bins=(*known, OTHER),
        reference=tuple(ref.tolist()),
        current=tuple(cur.tolist()),
    )


def feature_drift(profile: Mapping[str, Any], window: Any, thresholds: DriftThresholds) -> tuple[FeatureDrift, ...]:
    """Every profiled feature of ``window`` (a DataFrame) against ``profile``, in profile order."""
    profiles = profile["features"]
    numeric = [n for n, f in profiles.items() if feature_kind(f) == "numeric"]
    found = {f.feature: f for f in _numeric(window, numeric, profiles, thresholds)}
    for name, f in profiles.items():
        if feature_kind(f) == "categorical":
            found[name] = _categorical(window, name, f, thresholds)
    return tuple(found[name] for name in profiles)


def _distribution(ref: np.ndarray, cur: np.ndarray, bins: tuple[str, ...], t: DriftThresholds) -> DistributionDrift:
    """Two histograms of counts → their PSI and JS, and the proportions to show."""
    value = float(psi(ref, cur))
    ref, cur = ref / ref.sum(), cur / cur.sum()
    return DistributionDrift(
        psi=_judge(value, t.psi),
        js=_judge(float(js_distance(ref, cur)), t.js),
        bins=bins,
        reference=tuple(ref.tolist()),
        current=tuple(cur.tolist()),
    )


def prediction_drift(profile: Mapping[str, Any], window: Any, thresholds: DriftThresholds) -> PredictionDrift | None:
    """The window's ``score`` histogram and ``prediction`` class frequencies against the profile's."""
    base = profile.get("predictions")
    if not base:
        return None
    score = classes = None
    rows = 0
    # fleet.catalog.profile bins scores by PREDICTION_BINS; a histogram of another layout cannot be compared
    scored = len(base.get("positive_probability", {}).get("histogram", ())) == PREDICTION_BINS
    if "score" in window.columns and scored:
        s = window["score"].to_numpy(dtype=np.float64, na_value=np.nan)
        s = s[np.isfinite(s)]
        edges = np.asarray(base["positive_probability"]["bin_edges"], float)
        ref = np.asarray(base["positive_probability"]["histogram"], float)
        rows = s.size
        if s.size and ref.sum() > 0:
            cur = np.asarray(score_bins(s), float)  # the gateway's binning: 1.0 in the last bin
            labels = tuple(f"[{a:.2g}, {b:.2g})" for a, b in zip(edges, edges[1:]))
            score = _distribution(ref, cur, labels, thresholds)
    if "prediction" in window.columns and "class_frequencies" in base:
        c = window["prediction"].to_numpy(dtype=np.float64, na_value=np.nan)
        c = c[np.isfinite(c)].astype(np.int64)
        # stored as frequencies over the baseline's rows; PSI wants the counts back
        ref = np.asarray(base["class_frequencies"], float) * profile.get("rows", 0)
        rows = max(rows, c.size)
        if c.size and (c >= 0).all() and ref.sum() > 0:
            cur = np.bincount(c, minlength=ref.size).astype(float)
            ref = np.pad(ref, (0, cur.size - ref.size))  # a class the baseline never predicted
            classes = _distribution(ref, cur, tuple(str(k) for k in range(cur.size)), thresholds)
    drifting = any(d is not None and d.drifting for d in (score, classes))
    return PredictionDrift(rows=int(rows), score=score, classes=classes, drifting=drifting)


def drift_report(profile: Mapping[str, Any], window: Any, policy: MonitoringPolicy) -> DriftReport:
    """Inputs and predictions of ``window`` against ``profile``, judged by ``policy``."""
    t = policy.drift
    features = feature_drift(profile, window, t)
    prediction = prediction_drift(profile, window, t)
    drifting = tuple(f.feature for f in features if f.drifting)
    dataset = len(drifting) >= t.features_drifting_to_alert
    rows = len(window)
    if rows < policy.min_rows:
        verdict, reason = "insufficient_data", f"{rows} rows in the window, fewer than min_rows {policy.min_rows}"
    elif dataset or (prediction is not None and prediction.drifting):
        verdict = "drift"
        parts = [f"{len(drifting)} of {len(features)} features drift ({', '.join(drifting)})"] if drifting else []
        if prediction is not None and prediction.drifting:
            parts.append("the prediction distribution drifts")
        reason = "; ".join(parts)
    else:
        verdict = "ok"
        reason = f"{len(drifting)} of {len(features)} features drift, alert at {t.features_drifting_to_alert}"
    return DriftReport(
        verdict=verdict,
        reason=reason,
        rows=rows,
        min_rows=policy.min_rows,
        features=features,
        drifting_features=drifting,
        features_drifting_to_alert=t.features_drifting_to_alert,
        dataset_drift=dataset,
        prediction=prediction,
        thresholds=t,
    )


# -- concept drift ----------------------------------------------------------------------------
def _f1(pred: np.ndarray, labels: np.ndarray) -> float:
    """Binary labels: F1 of class 1 (as train.evaluate records it); more classes: macro F1."""
    classes = [1] if set(np.unique(np.concatenate((pred, labels))).tolist()) <= {0, 1} else np.unique(labels)
    scores = []
    for k in classes:
        tp = float(((pred == k) & (labels == k)).sum())
        precision = tp / max(float((pred == k).sum()), 1.0)
        recall = tp / max(float((labels == k).sum()), 1.0)
        scores.append(2 * precision * recall / max(precision + recall, 1e-7))
    return float(np.mean(scores))


def concept_drift(
    predictions: Any, labels: Any, baseline_metrics: Mapping[str, float], trigger: RetrainTrigger
) -> ConceptDrift:
    """Accuracy and F1 of predicted classes against feedback labels, vs the manifest's metrics.

    Rows whose label is null are left out. Degraded when accuracy fell by ``min_accuracy_drop``
    or more; the F1 drop is reported beside it.
    """
    pred = np.asarray(predictions, dtype=np.float64)
    lab = np.asarray(labels, dtype=np.float64)
    keep = np.isfinite(pred) & np.isfinite(lab)
    pred, lab = pred[keep].astype(np.int64), lab[keep].astype(np.int64)
    rows, need = int(pred.size), trigger.min_feedback_rows
    base_acc, base_f1 = baseline_metrics.get("accuracy"), baseline_metrics.get("f1")
    acc = float((pred == lab).mean()) if rows else None
    f1 = _f1(pred, lab) if rows else None
    acc_drop = base_acc - acc if acc is not None and base_acc is not None else None
    f1_drop = base_f1 - f1 if f1 is not None and base_f1 is not None else None
    if rows == 0 or rows < need:
        verdict, reason = "insufficient_data", f"{rows} labelled rows, fewer than min_feedback_rows {need}"
    elif base_acc is None:
        verdict, reason = "no_baseline", "the version's metrics hold no accuracy to compare with"
    elif acc_drop >= trigger.min_accuracy_drop:
        verdict = "degraded"
        reason = f"accuracy {acc:.4f} is {acc_drop:.4f} below the baseline {base_acc:.4f} (limit {trigger.min_accuracy_drop})"
    else:
        verdict = "ok"
        reason = f"accuracy {acc:.4f} vs baseline {base_acc:.4f} (drop {acc_drop:.4f} < {trigger.min_accuracy_drop})"
    return ConceptDrift(
        verdict=verdict,
        reason=reason,
        rows=rows,
        min_rows=need,
        accuracy=acc,
        baseline_accuracy=base_acc,
        accuracy_drop=acc_drop,
        f1=f1,
        baseline_f1=base_f1,
        f1_drop=f1_drop,
        min_accuracy_drop=trigger.min_accuracy_drop,
    )
