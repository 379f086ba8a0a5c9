"""A monitoring policy (``monitoring:``): when a model's traffic is checked, for drift and
data quality, and when that asks for a retrain."""

from __future__ import annotations

from pydantic import Field

from fleet.catalog.policies.spec import Cron, Fraction, Spec


class DriftThresholds(Spec):
    psi: float = Field(0.2, gt=0.0)
    js: float = Field(0.1, gt=0.0, le=1.0)
    wasserstein: float | None = Field(None, gt=0.0)  # None: off (its scale is per feature)
    ks_pvalue: float = Field(0.01, gt=0.0, lt=1.0)
    features_drifting_to_alert: int = Field(1, ge=1)


class QualityThresholds(Spec):
    max_null_rate: Fraction = 0.01
    max_out_of_range_rate: Fraction = 0.01


class RetrainTrigger(Spec):
    on_drift: bool = True
    min_accuracy_drop: float = Field(0.05, ge=0.0)  # absolute
    min_feedback_rows: int = Field(100, ge=0)
    cooldown_hours: float = Field(24.0, ge=0.0)


class MonitoringPolicy(Spec):
    schedule: Cron
    window_hours: float = Field(gt=0.0)
    min_rows: int = Field(ge=1)
    drift: DriftThresholds = Field(default_factory=DriftThresholds)
    quality: QualityThresholds = Field(default_factory=QualityThresholds)
    retrain: RetrainTrigger = Field(default_factory=RetrainTrigger)
