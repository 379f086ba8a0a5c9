"""What a monitoring run concludes: a pure decision over its quality, drift and accuracy readings.

Quality comes first: data that fails its expectations raises an alert and blocks
retraining — a model must never be trained on a broken batch, however much it "drifts".
Only on good data does drift (inputs or predictions) or a drop in accuracy on labelled
feedback start a retrain, and not within the policy's cooldown after the last one.

    decide(quality, drift, concept, policy, last_retrain_at=t, now=now)
        → Decision(action="retrain", reasons=("features drifting: income (PSI 0.41 > 0.2)",))
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Literal

from fleet.analysis.drift import ConceptDrift, DriftReport
from fleet.analysis.quality import QualityResult
from fleet.catalog.policies.monitoring import MonitoringPolicy

Action = Literal["skip", "alert", "retrain", "cooldown", "ok"]


@dataclass(frozen=True, slots=True)
class MonitoringDecision:
    action: Action
    reasons: tuple[str, ...]

    @property
    def summary(self) -> str:
        return f"{self.action}: " + "; ".join(self.reasons)


def decide(
    quality: QualityResult | None,
    drift: DriftReport | None,
    concept: ConceptDrift | None,
    policy: MonitoringPolicy,
    *,
    rows: int,
    last_retrain_at: datetime | None,
    now: datetime,
) -> MonitoringDecision:
    """skip (too little data) → alert (bad data) → retrain / cooldown (drift or accuracy drop) → ok."""
    if rows < policy.min_rows:
        return MonitoringDecision(
            "skip", (f"{rows} logged rows in the window, fewer than min_rows {policy.min_rows}; nothing judged",)
        )
    if quality is not None and not quality.passed:
        failed = [
            f"{o.expectation} on {o.column or 'the batch'}: {o.observed}" for o in quality.expectations if not o.passed
        ]
        return MonitoringDecision("alert", ("data quality failed, retraining blocked: " + "; ".join(failed[:5]),))
    reasons = []
    if drift is not None and drift.verdict == "drift" and policy.retrain.on_drift:
        shown = ", ".join(_feature_reason(drift, name) for name in drift.drifting_features[:5])
        if drift.drifting_features:
            reasons.append(f"features drifting: {shown}")
        if drift.prediction is not None and drift.prediction.drifting:
            reasons.append("predictions drifting")
        if not reasons:
            reasons.append(drift.reason)
    if concept is not None and concept.verdict == "degraded":
        reasons.append(
            f"accuracy on labelled feedback {concept.accuracy:.3f}, {concept.accuracy_drop:+.3f} vs the baseline "
            f"(retrain at a drop of {policy.retrain.min_accuracy_drop:g})"
        )
    if not reasons:
        return MonitoringDecision("ok", ("no drift, data quality passed",))
    cooldown = timedelta(hours=policy.retrain.cooldown_hours)
    if last_retrain_at is not None and now - last_retrain_at < cooldown:
        left = cooldown - (now - last_retrain_at)
        return MonitoringDecision(
            "cooldown",
            (
                *reasons,
                f"a retrain started {last_retrain_at:%Y-%m-%d %H:%M} UTC; next one "
                f"allowed in {left.total_seconds() / 3600:.1f} h",
            ),
        )
    return MonitoringDecision("retrain", tuple(reasons))


def _feature_reason(drift: DriftReport, name: str) -> str:
    feature = drift.feature(name)
    exceeded = [
        f"{label} {s.value:.3g} > {s.threshold:g}"
        for label, s in (("PSI", feature.psi), ("JS", feature.js), ("Wasserstein", feature.wasserstein))
        if s is not None and s.exceeded and s.value is not None and s.threshold is not None
    ]
    return f"{name} ({', '.join(exceeded) or 'drifting'})"
