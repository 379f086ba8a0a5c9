"""Metrics sources: what a version served, as canary analysis reads it, chosen by ``FLEET_METRICS``.

``gateway`` (default): the windowed stats of every live gateway, summed — windows ending
now. ``prometheus``: the Prometheus HTTP API at ``FLEET_PROMETHEUS_URL``. Any other kind is
refused, never replaced by a default. ``MemoryMetrics`` is the fake for tests of flow logic.
"""

from __future__ import annotations

import os

from fleet.analysis.sources._common import (
    BadMetricsAnswer,
    MetricsUnavailable,
    empty_window,
    sum_windows,
)
from fleet.analysis.sources.memory import MemoryMetrics
from fleet.errors import ConfigError
from fleet.types import MetricsSource, ObjectStore

KINDS = ("gateway", "prometheus")

__all__ = [
    "KINDS",
    "BadMetricsAnswer",
    "MemoryMetrics",
    "MetricsSource",
    "MetricsUnavailable",
    "empty_window",
    "open_metrics",
    "sum_windows",
]


def open_metrics(kind: str | None = None, *, store: ObjectStore | None = None) -> MetricsSource:
    """Open the metrics source ``kind``, or ``$FLEET_METRICS``, or ``gateway``.

    ``gateway`` needs ``FLEET_ADMIN_TOKEN`` and finds the gateways in ``store`` (default:
    ``open_store()``); ``prometheus`` needs ``FLEET_PROMETHEUS_URL``.
    """
    kind = kind or os.environ.get("FLEET_METRICS") or "gateway"
    if kind == "gateway":
        token = os.environ.get("FLEET_ADMIN_TOKEN")
        if not token:
            raise ConfigError(
                "FLEET_METRICS=gateway needs FLEET_ADMIN_TOKEN (the gateways' admin token); it is not set"
            )
        from fleet.analysis.sources.gateway import GatewayMetrics
        from fleet.store import open_store

        return GatewayMetrics(store if store is not None else open_store(), token)
    if kind == "prometheus":
        url = os.environ.get("FLEET_PROMETHEUS_URL")
        if not url:
            raise ConfigError("FLEET_METRICS=prometheus needs FLEET_PROMETHEUS_URL, e.g. http://prometheus:9090")
        from fleet.analysis.sources.prometheus import PrometheusMetrics

        return PrometheusMetrics(url)
    raise ConfigError(f"FLEET_METRICS {kind!r} is not a metrics source; expected one of {', '.join(KINDS)}")
