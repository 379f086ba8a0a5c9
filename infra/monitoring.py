"""The fleet's Grafana dashboard and Prometheus alert rules, built from the gateway's metrics.

Metric names are the gateway's (docs/architecture.md, "Prometheus"). Alert thresholds come
from each model's SLO in policies/, so changing an SLO changes its alert on the next
``pulumi up``. Pure functions: the Platform component turns them into a ConfigMap (picked up
by Grafana's dashboard sidecar) and a PrometheusRule.
"""

from __future__ import annotations

from fleet.catalog.policies.loader import Policies

DASHBOARD_UID = "serving-fleet"


def _panel(i: int, title: str, expr: str, unit: str, legend: str = "{{model}} {{version}}") -> dict:
    return {
        "id": i + 1,
        "type": "timeseries",
        "title": title,
        "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "gridPos": {"x": (i % 2) * 12, "y": (i // 2) * 8, "w": 12, "h": 8},
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "targets": [{"refId": "A", "expr": expr, "legendFormat": legend}],
    }


def dashboard() -> dict:
    """Grafana dashboard JSON: traffic, errors, latency, canary split, queueing, quota, staleness."""
    sel = 'model=~"$model"'
    panels = [
        ("Requests per second", f"sum by (model, version) (rate(fleet_requests_total{{{sel}}}[1m]))", "reqps"),
        (
            "Errors per second (5xx, timeout, unreachable)",
            f"sum by (model, version, class) (rate(fleet_version_errors_total{{{sel}}}[1m]))",
            "reqps",
        ),
        (
            "p99 latency at the gateway",
            f"histogram_quantile(0.99, sum by (model, version, le) (rate(fleet_request_duration_seconds_bucket{{{sel}}}[5m])))",
            "s",
        ),
        (
            "p99 latency of the model service",
            f"histogram_quantile(0.99, sum by (model, version, le) (rate(fleet_upstream_duration_seconds_bucket{{{sel}}}[5m])))",
            "s",
        ),
        (
            "Traffic share per version",
            f"sum by (model, version) (rate(fleet_version_requests_total{{{sel}}}[5m])) / ignoring(version) group_left "
            f"sum by (model) (rate(fleet_version_requests_total{{{sel}}}[5m]))",
            "percentunit",
        ),
        ("Queue depth", f"sum by (model, version, priority) (fleet_queue_depth{{{sel}}})", "short"),
        ("Quota rejections (429) per tenant", "sum by (tenant) (rate(fleet_quota_rejections_total[5m]))", "reqps"),
        (
            "Shadow agreement",
            f"sum by (model, version, outcome) (rate(fleet_shadow_requests_total{{{sel}}}[5m]))",
            "reqps",
        ),
        ("Gateways serving stale routing", "sum(fleet_routing_stale)", "short"),
        (
            "Inference log rows dropped",
            'sum by (model) (rate(fleet_inference_log_rows_total{outcome="dropped"}[5m]))',
            "short",
        ),
    ]
    return {
        "uid": DASHBOARD_UID,
        "title": "Serving fleet",
        "schemaVersion": 39,
        "timezone": "utc",
        "refresh": "30s",
        "time": {"from": "now-6h", "to": "now"},
        "tags": ["serving-fleet"],
        "templating": {
            "list": [
                {"name": "datasource", "type": "datasource", "query": "prometheus"},
                {
                    "name": "model",
                    "type": "query",
                    "datasource": {"type": "prometheus", "uid": "${datasource}"},
                    "query": "label_values(fleet_requests_total, model)",
                    "includeAll": True,
                    "multi": True,
                    "current": {},
                },
            ]
        },
        "panels": [_panel(i, *p) for i, p in enumerate(panels)],
    }


def alert_rules(policies: Policies, models: tuple[str, ...]) -> list[dict]:
    """PrometheusRule groups: one SLO group per served model, and the fleet-wide alerts."""
    groups = []
    for name in models:
        slo = policies.models[name].slo
        where = f'model="{name}"'
        requests = f"sum(rate(fleet_requests_total{{{where}}}[10m]))"
        p99 = f"histogram_quantile(0.99, sum by (le) (rate(fleet_request_duration_seconds_bucket{{{where}}}[10m])))"
        groups.append(
            {
                "name": f"slo-{name}",
                "rules": [
                    {
                        "alert": "FleetModelErrorRateHigh",
                        "for": "10m",
                        "labels": {"severity": "page", "model": name},
                        "expr": f'sum(rate(fleet_requests_total{{{where},code=~"5.."}}[10m])) / {requests} > {slo.error_rate:g}',
                        "annotations": {"summary": f"{name}: more than {slo.error_rate:.2%} of requests fail (SLO)"},
                    },
                    {
                        "alert": "FleetModelLatencyHigh",
                        "for": "10m",
                        "labels": {"severity": "page", "model": name},
                        "expr": f"{p99} * 1000 > {slo.p99_ms:g}",
                        "annotations": {"summary": f"{name}: p99 latency above its SLO of {slo.p99_ms:g} ms"},
                    },
                ],
            }
        )
    groups.append(
        {
            "name": "fleet",
            "rules": [
                {
                    "alert": "FleetRoutingStale",
                    "for": "5m",
                    "labels": {"severity": "page"},
                    "expr": "max(fleet_routing_stale) == 1",
                    "annotations": {
                        "summary": "a gateway cannot read the store and serves its last good routing state"
                    },
                },
                {
                    "alert": "FleetInferenceLogDropping",
                    "for": "15m",
                    "labels": {"severity": "ticket"},
                    "expr": 'sum(rate(fleet_inference_log_rows_total{outcome="dropped"}[15m])) > 0',
                    "annotations": {
                        "summary": "inference log rows are dropped: monitoring and drift checks see less traffic"
                    },
                },
                {
                    "alert": "FleetGatewayDown",
                    "for": "5m",
                    "labels": {"severity": "page"},
                    "expr": 'absent(up{job="fleet-gateway"} == 1)',
                    "annotations": {"summary": "no gateway is scraped as up"},
                },
            ],
        }
    )
    return groups
