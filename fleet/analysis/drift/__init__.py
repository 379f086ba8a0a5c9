"""Drift monitoring: live inputs and predictions against a version's baseline profile.

    report = drift_report(version.baseline_profile, window, policies.monitoring_for(model))
    report.verdict                     # "ok" | "drift" | "insufficient_data"
    concept = concept_drift(window.prediction, labels, version.metrics, policy.retrain)
    create_markdown_artifact(drift_markdown(report, concept))
    store.put(f"reports/{model}/drift/….svg", drift_svg(report))

``stats`` holds the statistics (pure, vectorised, checked against scipy; its ``psi`` is the
fleet's one PSI, which canary analysis and retraining read too), ``report`` the frozen report
types and the functions that build them, ``render`` the markdown and the plot.
"""

from fleet.analysis.drift.render import drift_markdown, drift_svg, svg_data_uri
from fleet.analysis.drift.report import (
    ConceptDrift,
    DistributionDrift,
    DriftReport,
    FeatureDrift,
    PredictionDrift,
    Statistic,
    concept_drift,
    drift_report,
    feature_drift,
    prediction_drift,
)
from fleet.analysis.drift.stats import js_distance, ks, psi, wasserstein

__all__ = [
    "ConceptDrift",
    "DistributionDrift",
    "DriftReport",
    "FeatureDrift",
    "PredictionDrift",
    "Statistic",
    "concept_drift",
    "drift_markdown",
    "drift_report",
    "drift_svg",
    "feature_drift",
    "js_distance",
    "ks",
    "prediction_drift",
    "psi",
    "svg_data_uri",
    "wasserstein",
]
