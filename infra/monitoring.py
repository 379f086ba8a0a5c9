"""The fleet's Grafana dashboard and Prometheus alert rules, built from the gateway's metrics.

Metric names are the gateway's (docs/architecture.md, "Prometheus"). Alert thresholds come
from each model's SLO in policies/, so changing an SLO changes its alert on the next
``pulumi up``; every alert links its section of docs/runbook.md. Also the chart values that
keep kube-prometheus-stack from alerting on what EKS hides. Pure functions: the Platform
component turns them into a ConfigMap (picked up by Grafana's dashboard sidecar) and a
PrometheusRule.
"""

from __future__ import annotations

from fleet.catalog.policies.loader import Policies
from infra.alerting import RUNBOOK

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


# EKS runs the control plane itself: its controller manager, scheduler and etcd cannot be
# scraped, and kube-proxy serves its metrics on 127.0.0.1 only. With the chart's defaults
# Prometheus would try, and KubeControllerManagerDown, KubeSchedulerDown, KubeProxyDown and
# etcd's alerts would fire forever. Off: their scrape targets and their rule groups (the
# chart's keys, values.yaml of kube-prometheus-stack 79.7.1).
EKS_UNSCRAPEABLE = ("kubeControllerManager", "kubeScheduler", "kubeEtcd", "kubeProxy")
EKS_OFF_RULES = ("kubeControllerManager", "kubeSchedulerAlerting", "kubeSchedulerRecording", "etcd", "kubeProxy")


def eks_values() -> dict:
    """kube-prometheus-stack values that turn off what EKS does not let Prometheus see."""
    return {
        "defaultRules": {"rules": dict.fromkeys(EKS_OFF_RULES, False)},
        **{target: {"enabled": False} for target in EKS_UNSCRAPEABLE},
    }


# An error budget burnt 14.4 times as fast as the SLO allows is 2 % of a 30-day budget in an
# hour: worth a page (Google's SRE workbook, "Alerting on SLOs"); capped so a loose SLO
# still pages when half the requests fail.
FAST_BURN = 14.4
FAST_BURN_CAP = 0.5
LATENCY_PAGE_FACTOR = 2.0  # p99 at twice its SLO pages; above the SLO, a warning
CRITICAL, WARNING = "critical", "warning"  # the chart's severities, which Alertmanager routes by (infra/alerting.py)


def runbook_anchor(alert: str) -> str:
    """The runbook section of ``alert``: its heading in docs/runbook.md is the alert's name,
    and GitHub's anchor of a one-word heading is the word in lower case."""
    return alert.lower()


def _errors(where: str, window: str) -> str:
    total = f"sum(rate(fleet_requests_total{{{where}}}[{window}]))"
    return f'sum(rate(fleet_requests_total{{{where},code=~"5.."}}[{window}])) / {total}'


def _p99(where: str, window: str) -> str:
    return f"histogram_quantile(0.99, sum by (le) (rate(fleet_request_duration_seconds_bucket{{{where}}}[{window}])))"


def _rule(alert: str, severity: str, expr: str, for_: str, summary: str, runbook: str, **labels: str) -> dict:
    return {
        "alert": alert,
        "for": for_,
        "labels": {"severity": severity, **labels},
        "expr": expr,
        "annotations": {"summary": summary, "runbook_url": f"{runbook}#{runbook_anchor(alert)}"},
    }


def _slo_rules(name: str, error_rate: float, p99_ms: float, runbook: str) -> list[dict]:
    where = f'model="{name}"'
    fast = min(FAST_BURN * error_rate, FAST_BURN_CAP)
    return [
        _rule(
            "FleetModelErrorRateHigh",
            WARNING,
            f"{_errors(where, '10m')} > {error_rate:g}",
            "10m",
            f"{name}: more than {error_rate:.2%} of requests fail (its SLO)",
            runbook,
            model=name,
        ),
        _rule(
            "FleetModelErrorRateHigh",
            CRITICAL,
            f"{_errors(where, '5m')} > {fast:g} and {_errors(where, '1h')} > {fast:g}",
            "2m",
            f"{name}: more than {fast:.2%} of requests fail over 5 minutes and an hour: the error budget burns fast",
            runbook,
            model=name,
        ),
        _rule(
            "FleetModelLatencyHigh",
            WARNING,
            f"{_p99(where, '10m')} * 1000 > {p99_ms:g}",
            "10m",
            f"{name}: p99 latency above its SLO of {p99_ms:g} ms",
            runbook,
            model=name,
        ),
        _rule(
            "FleetModelLatencyHigh",
            CRITICAL,
            f"{_p99(where, '5m')} * 1000 > {LATENCY_PAGE_FACTOR * p99_ms:g}",
            "10m",
            f"{name}: p99 latency above {LATENCY_PAGE_FACTOR * p99_ms:g} ms, twice its SLO",
            runbook,
            model=name,
        ),
    ]


def alert_rules(policies: Policies, models: tuple[str, ...], runbook: str = RUNBOOK) -> list[dict]:
    """PrometheusRule groups: one SLO group per served model, and the fleet-wide alerts. Each
    alert has a severity (critical pages, warning is posted) and a ``runbook_url``:
    ``runbook`` (the address of docs/runbook.md) and the alert's section."""
    groups = [
        {"name": f"slo-{name}", "rules": _slo_rules(name, slo.error_rate, slo.p99_ms, runbook)}
        for name in models
        for slo in [policies.models[name].slo]
    ]
    fleet = [
        _rule(
            "FleetGatewayDown",
            CRITICAL,
            'absent(up{job="fleet-gateway"} == 1)',
            "5m",
            "no gateway is scraped as up: no request reaches a model",
            runbook,
        ),
        _rule(
            "FleetRoutingStale",
            CRITICAL,
            "max(fleet_routing_stale) == 1",
            "5m",
            "a gateway cannot read the store and serves its last good routing state",
            runbook,
        ),
        _rule(
            "FleetInferenceLogDropping",
            WARNING,
            'sum(rate(fleet_inference_log_rows_total{outcome="dropped"}[15m])) > 0',
            "15m",
            "inference log rows are dropped: monitoring and drift checks see less traffic",
            runbook,
        ),
    ]
    groups.append({"name": "fleet", "rules": fleet})
    return groups
