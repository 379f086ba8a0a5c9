"""What the gateway keeps of an answered request, none of which the caller waits for: the
shadow mirror's offer, the inference-log sample, the request's id for feedback joins, and
its usage (requests, rows, the model's seconds: ``fleet.usage.meter``).

Each is O(1) on the request path — an enqueue, an append and a dictionary insert — and
each lands in a buffer bounded in bytes (``fleet.gateway.shadow``, ``fleet.logs.inference``,
``fleet.logs.logged.LoggedRequests``).
"""

from __future__ import annotations

import random
import time

import numpy as np

from fleet.catalog.policies.models import ModelSpec
from fleet.catalog.registry import ModelVersion
from fleet.catalog.routes.table import RouteTable, should_shadow
from fleet.gateway.shadow import ShadowJob, ShadowMirror
from fleet.logs.inference import InferenceLog, Sample, feature_names
from fleet.logs.logged import LoggedRequests
from fleet.usage.meter import UsageMeter


class Recorder:
    def __init__(
        self, mirror: ShadowMirror, log: InferenceLog, logged: LoggedRequests, usage: UsageMeter | None = None
    ) -> None:
        self.mirror, self.log, self.logged, self.usage = mirror, log, logged, usage

    def served(
        self,
        *,
        model: str,
        version: str,
        tenant: str,
        request_id: str,
        routing_key: str,
        table: RouteTable,
        spec: ModelSpec,
        manifest: ModelVersion,
        features: np.ndarray,
        result: np.ndarray,
        total_ms: float,
        upstream_s: float = 0.0,
    ) -> None:
        if self.usage is not None:  # a prediction-cache hit counts its rows, with no time in the model
            self.usage.served(tenant, model, version, len(features), upstream_s)
        if table.shadow is not None and table.shadow.version != version and should_shadow(table, routing_key):
            self.mirror.offer(
                ShadowJob(model, table.shadow.version, version, features, result, total_ms, spec.timeout_ms / 1000)
            )
        if spec.inference_log.sample_rate and random.random() < spec.inference_log.sample_rate:
            rows = len(features)
            names = feature_names(manifest.baseline_profile, features.shape[-1] if features.ndim == 2 else 1)
            self.log.record(
                Sample(
                    time.time(),
                    request_id,
                    model,
                    version,
                    tenant,
                    total_ms,
                    features.reshape(rows, -1),
                    result.reshape(rows, -1),
                    names,
                )
            )
            self.logged.remember(model, tenant, request_id, rows)

    def failed(
        self,
        *,
        model: str,
        version: str,
        tenant: str,
        request_id: str,
        spec: ModelSpec,
        manifest: ModelVersion,
        features: np.ndarray,
        status: int,
        total_ms: float,
    ) -> None:
        """A request the version did not answer, sampled like an answer: the log's error rate
        per version is then a query (no prediction; never a feedback join)."""
        if spec.inference_log.sample_rate and random.random() < spec.inference_log.sample_rate:
            rows = len(features)
            names = feature_names(manifest.baseline_profile, features.shape[-1] if features.ndim == 2 else 1)
            empty = np.empty((rows, 0), np.float32)
            self.log.record(
                Sample(
                    time.time(), request_id, model, version, tenant, total_ms, features.reshape(rows, -1), empty, names,
                    status,
                )
            )  # fmt: skip
