"""What the gateway measures: Prometheus metrics for people and dashboards, windowed stats
for canary analysis. Names and labels are the contract in docs/architecture.md.

Each app has its own ``CollectorRegistry`` (several gateways can live in one test process).
Queue depth and the bytes each bounded buffer holds are read at scrape time instead of
being kept up to date on every request.

Label values are only ever what is real, so nobody can grow ``/metrics`` by sending
requests: ``model`` is a model the gateway serves (``unknown`` before that is known, e.g.
for a request without a valid key or to a model that is not served), ``tenant`` an
authenticated tenant (``unknown`` otherwise), ``version`` a version routing chose
(``none`` before).

What is kept is bounded at fleet size. The tenant label is on the counters a user reads per
tenant (``fleet_requests_total``, ``fleet_quota_rejections_total``) and nowhere else: one
sample per tenant, version and status code, not a histogram's 24. A tenant's samples are
dropped after ``TENANT_IDLE_S`` without a request (Prometheus reads the counter starting
again as a reset, which ``rate`` and ``increase`` handle). A version out of every route for
``FORGET_AFTER_S`` — the windowed stats' whole horizon, so no window can still read it — has
its windowed stats and every series labelled with it freed.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from fleet.gateway.stats import HORIZON_S, WindowedStats
from fleet.types import LATENCY_BUCKETS_MS, OUTPUT_TOKEN_BUCKETS, PREDICTION_BINS, score_bins

# a ``*_created`` sample beside every counter and histogram doubles the per-tenant lines of
# /metrics; nothing here reads it (Prometheus detects resets without it)
disable_created_metrics()

_SECONDS = tuple(b / 1000 for b in LATENCY_BUCKETS_MS) + (float("inf"),)


class _QueueDepth(Collector):
    def __init__(self, depths: Callable[[], Iterator[tuple[str, str, str, int]]]) -> None:
        self._depths = depths

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(
            "fleet_queue_depth", "Requests waiting for an upstream slot", labels=["model", "version", "priority"]
        )
        for model, version, priority, depth in self._depths():
            family.add_metric([model, version, priority], depth)
        yield family


class _Gauges(Collector):
    """A gauge family whose samples are read from a callable when scraped."""

    def __init__(
        self, name: str, doc: str, labels: list[str], read: Callable[[], Iterator[tuple[tuple[str, ...], float]]]
    ) -> None:
        self._name, self._doc, self._labels, self._read = name, doc, labels, read

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(self._name, self._doc, labels=self._labels)
        for labels, value in self._read():
            family.add_metric(list(labels), value)
        yield family


UNKNOWN = "unknown"
FORGET_AFTER_S = float(HORIZON_S)  # a version out of every route keeps its series this long
TENANT_IDLE_S = 900.0  # a tenant's samples without a request for this long are dropped
PRUNE_S = 30.0  # how often both are looked at (from ``watch_loop``)
HOLD_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 30.0, 60.0, float("inf"))


class Telemetry:
    def __init__(
        self,
        queue_depths: Callable[[], Iterator[tuple[str, str, str, int]]],
        buffers: Callable[[], Iterator[tuple[tuple[str, ...], float]]] = lambda: iter(()),
        in_flight: Callable[[], Iterator[tuple[tuple[str, ...], float]]] = lambda: iter(()),
        quota_state: Callable[[], Iterator[tuple[tuple[str, ...], float]]] = lambda: iter(()),
    ) -> None:
        r = self.registry = CollectorRegistry()
        self.stats = WindowedStats()
        self.requests = Counter(
            "fleet_requests", "Answered requests by HTTP status", ["model", "version", "tenant", "code"], registry=r
        )
        self.duration = Histogram(
            "fleet_request_duration_seconds",
            "Whole request in the gateway",
            ["model", "version"],
            buckets=_SECONDS,
            registry=r,
        )
        self.upstream = Histogram(
            "fleet_upstream_duration_seconds",
            "The model service's part of a request (a generation's: to its first token)",
            ["model", "version"],
            buckets=_SECONDS,
            registry=r,
        )
        self.version_requests = Counter(
            "fleet_version_requests", "Attempts counted for canary analysis", ["model", "version"], registry=r
        )
        self.version_errors = Counter(
            "fleet_version_errors", "Failures of a version by class", ["model", "version", "class"], registry=r
        )
        self.caller_timeouts = Counter(
            "fleet_caller_timeouts",
            "Requests whose caller's own deadline, shorter than the model's, ran out: not the version's failure",
            ["model", "version"],
            registry=r,
        )
        self.predictions = Counter(
            "fleet_predictions", "Output rows per score bin", ["model", "version", "bin"], registry=r
        )
        self.cache = Counter("fleet_cache_requests", "Prediction cache lookups", ["model", "result"], registry=r)
        self.quota = Counter("fleet_quota_rejections", "Requests refused with 429", ["tenant"], registry=r)
        self.shadow = Counter(
            "fleet_shadow_requests", "Mirrored requests by outcome", ["model", "version", "outcome"], registry=r
        )
        self.shadow_duration = Histogram(
            "fleet_shadow_duration_seconds",
            "Latency of shadow calls",
            ["model", "version"],
            buckets=_SECONDS,
            registry=r,
        )
        self.shadow_served = Histogram(
            "fleet_shadow_served_duration_seconds",
            "Latency of the served answer that a shadow call is compared with",
            ["model", "version"],
            buckets=_SECONDS,
            registry=r,
        )
        self.stale = Gauge(
            "fleet_routing_stale", "1 while the store cannot be read (serving the last good state)", registry=r
        )
        self.bad_records = Gauge(
            "fleet_store_bad_records",
            "Stored records this gateway cannot read and skips (see /v2/health/ready, fleet doctor)",
            ["kind"],
            registry=r,
        )
        self.log_rows = Counter("fleet_inference_log_rows", "Inference log rows", ["model", "outcome"], registry=r)
        self.auth_failures = Counter(
            "fleet_auth_failures",
            "Requests refused for a missing, unknown, revoked or expired key",
            ["surface"],
            registry=r,
        )
        self.rejections = Counter(
            "fleet_upstream_rejections",
            "Inputs a version refused with 4xx: passed on to the caller, not counted against it",
            ["model", "version"],
            registry=r,
        )
        self.stalled = Counter(
            "fleet_callers_stalled",
            "Answers cut because the caller did not take their bytes within the write deadline (stream_write_s)",
            ["kind"],
            registry=r,
        )
        self.busy = Counter(
            "fleet_decode_refusals",
            "Large bodies refused: too many decoding or held at once, for a tenant or the gateway",
            ["scope"],
            registry=r,
        )
        loop_buckets = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, float("inf"))
        self.loop_lag = Histogram(
            "fleet_event_loop_lag_seconds",
            "How late the event loop ran a 20 ms timer",
            buckets=loop_buckets,
            registry=r,
        )
        self.loop_held = Histogram(
            "fleet_event_loop_held_seconds",
            "The part of that lateness the gateway spent computing (not waiting for a CPU)",
            buckets=loop_buckets,
            registry=r,
        )
        r.register(_QueueDepth(queue_depths))
        r.register(
            _Gauges("fleet_buffer_bytes", "Bytes held by each bounded buffer (see its budget)", ["buffer"], buffers)
        )
        # with fleet_queue_depth, what KEDA's queue_depth trigger scales on (requests per replica)
        r.register(
            _Gauges(
                "fleet_version_in_flight",
                "Requests a version's replicas are answering for this gateway",
                ["model", "version"],
                in_flight,
            )
        )
        r.register(
            _Gauges(
                "fleet_quota_backend",
                "shared: 1 while quotas are shared through Redis, 0 while this gateway enforces its local "
                "share; share_divisor: the gateways a quota is divided by then",
                ["state"],
                quota_state,
            )
        )
        self.ttft = Histogram(
            "fleet_time_to_first_token_seconds",
            "Generation: the version asked → its first token",
            ["model", "version"],
            buckets=_SECONDS,
            registry=r,
        )
        self.tpot = Histogram(
            "fleet_time_per_output_token_seconds",
            "Generation: mean time per token after the first",
            ["model", "version"],
            buckets=_SECONDS,
            registry=r,
        )
        self.output_tokens = Histogram(
            "fleet_generation_output_tokens",
            "Generation: completion tokens of an answer",
            ["model", "version"],
            buckets=(*OUTPUT_TOKEN_BUCKETS, float("inf")),
            registry=r,
        )
        self.queue = Histogram(
            "fleet_generation_queue_seconds",
            "Generation: the replica's wait before a sequence joined its running batch",
            ["model", "version"],
            buckets=_SECONDS,
            registry=r,
        )
        self.tokens = Counter(
            "fleet_generated_tokens",
            "Generation: tokens by kind (prompt, completion)",
            ["model", "version", "kind"],
            registry=r,
        )
        self.labels = Counter(
            "fleet_feedback_labels",
            "Generation: exact-match feedback labels on a version's answers, by outcome (match, mismatch)",
            ["model", "version", "outcome"],
            registry=r,
        )
        # lazy loading (fleet.gateway.activate): versions started by a request, and requests held for them
        self.cold_starts = Counter(
            "fleet_cold_starts",
            "Starts of a cold (lazy, unloaded) version by a request, by outcome (started, failed)",
            ["model", "version", "outcome"],
            registry=r,
        )
        self.hold = Histogram(
            "fleet_activation_hold_seconds",
            "How long a request waited for its cold version to start",
            ["model", "version"],
            buckets=HOLD_BUCKETS_S,
            registry=r,
        )
        self.held = Gauge(
            "fleet_requests_held",
            "Requests waiting now for their cold version to start",
            ["model", "version"],
            registry=r,
        )
        self._children: dict[tuple[str, str], tuple] = {}
        self._finished: dict[tuple[str, str, str, int], tuple] = {}
        self._durations: dict[tuple[str, str], Any] = {}
        self._used: dict[str, int] = {}  # tenant → the prune tick of its last request
        self._tick = 0
        self._unrouted: dict[tuple[str, str], float] = {}  # version → when it left every route (monotonic)
        self._routed: set[tuple[str, str]] = set()

    def _version(self, model: str, version: str) -> tuple:
        """The labelled children of one version, looked up once (``labels()`` is not free)."""
        children = self._children.get((model, version))
        if children is None:
            children = self._children[model, version] = (
                self.version_requests.labels(model, version),
                self.upstream.labels(model, version),
                [self.predictions.labels(model, version, str(i)) for i in range(PREDICTION_BINS)],
            )
        return children

    def answered(self, model: str, version: str, upstream_ms: float, result: np.ndarray) -> None:
        """A version answered: windowed stats, upstream latency and the predicted scores."""
        scores = result[:, -1] if result.ndim == 2 else result.ravel()
        bins = score_bins(scores)
        self.stats.answered(model, version, upstream_ms, bins)
        requests, upstream, predictions = self._version(model, version)
        requests.inc()
        upstream.observe(upstream_ms / 1000)
        for i, n in enumerate(bins):
            if n:
                predictions[i].inc(n)

    def generated(
        self,
        model: str,
        version: str,
        *,
        ttft_ms: float,
        tpot_ms: float | None,
        prompt_tokens: int,
        completion_tokens: int,
        queue_s: float | None = None,
    ) -> None:
        """A version finished a generation. Its time to first token is its latency, in canary
        analysis's windowed stats and in ``fleet_upstream_duration_seconds`` alike (what a
        caller waits for before anything happens; both sources of analysis read the same)."""
        self.stats.generated(model, version, ttft_ms, tpot_ms, completion_tokens)
        requests, upstream, _ = self._version(model, version)
        requests.inc()
        upstream.observe(ttft_ms / 1000)
        self.output_tokens.labels(model, version).observe(completion_tokens)
        self.ttft.labels(model, version).observe(ttft_ms / 1000)
        if tpot_ms is not None:
            self.tpot.labels(model, version).observe(tpot_ms / 1000)
        if queue_s is not None:
            self.queue.labels(model, version).observe(queue_s)
        self.tokens.labels(model, version, "prompt").inc(prompt_tokens)
        self.tokens.labels(model, version, "completion").inc(completion_tokens)

    def labelled(self, model: str, version: str, matched: bool) -> None:
        """Exact-match feedback on an answer of ``version`` (canary analysis's exact_match gate)."""
        self.stats.labelled(model, version, matched)
        self.labels.labels(model, version, "match" if matched else "mismatch").inc()

    def failed(self, model: str, version: str, error_class: str) -> None:
        self.stats.failed(model, version, error_class)
        self._version(model, version)[0].inc()
        self.version_errors.labels(model, version, error_class).inc()

    def caller_timeout(self, model: str, version: str) -> None:
        """A caller's own, shorter deadline ran out while ``version`` worked: not its failure."""
        self.caller_timeouts.labels(model, version).inc()

    def finished_counters(self) -> tuple[list[tuple[str, str, str, int]], list[Any]]:
        """(model, version, tenant, status) of every request counter this gateway holds, and
        the counters, in the same order: a copy of the keys, for ``fleet.gateway.top``."""
        return list(self._finished), list(self._finished.values())

    def finished(self, model: str, version: str, tenant: str, status: int, total_ms: float) -> None:
        key = (model, version, tenant, status)
        counter = self._finished.get(key)
        if counter is None:
            counter = self._finished[key] = self.requests.labels(model, version, tenant, str(status))
        counter.inc()
        self._used[tenant] = self._tick
        duration = self._durations.get((model, version))
        if duration is None:
            duration = self._durations[model, version] = self.duration.labels(model, version)
        duration.observe(total_ms / 1000)

    def quota_refused(self, tenant: str) -> None:
        self.quota.labels(tenant).inc()
        self._used[tenant] = self._tick

    def routed(self, versions: set[tuple[str, str]], now: float | None = None) -> None:
        """The versions the routes name now (each new snapshot); a version that left them is
        forgotten ``FORGET_AFTER_S`` later unless routed again."""
        now = time.monotonic() if now is None else now
        for mv in self._routed - versions:
            self._unrouted.setdefault(mv, now)
        for mv in versions:
            self._unrouted.pop(mv, None)
        self._routed = set(versions)

    def prune(self, now: float | None = None) -> None:
        """Free what a version out of every route, or an idle tenant, holds (every ``PRUNE_S``)."""
        now = time.monotonic() if now is None else now
        self._tick += 1
        for mv, since in list(self._unrouted.items()):
            if now - since >= FORGET_AFTER_S:
                self.forget(*mv)
        idle_ticks = max(1, int(TENANT_IDLE_S / PRUNE_S))
        idle = {t for t, tick in self._used.items() if self._tick - tick > idle_ticks}
        if idle:
            for key in [k for k in self._finished if k[2] in idle]:
                del self._finished[key]
            for tenant in idle:
                del self._used[tenant]
                self.requests.remove_by_labels({"tenant": tenant})
                self.quota.remove_by_labels({"tenant": tenant})

    def forget(self, model: str, version: str) -> None:
        """Drop a version's windowed stats and every series labelled with it."""
        self._unrouted.pop((model, version), None)
        self.stats.forget(model, version)
        self._children.pop((model, version), None)
        self._durations.pop((model, version), None)
        for key in [k for k in self._finished if k[:2] == (model, version)]:
            del self._finished[key]
        for metric in self._versioned():
            metric.remove_by_labels({"model": model, "version": version})

    def _versioned(self) -> Iterator[Any]:
        for metric in vars(self).values():
            if isinstance(metric, (Counter, Gauge, Histogram)) and {"model", "version"} <= set(metric._labelnames):
                yield metric

    def shadow_result(self, model: str, version: str, outcome: str, shadow_ms: float | None, served_ms: float) -> None:
        self.shadow.labels(model, version, outcome).inc()
        if shadow_ms is not None:
            self.shadow_duration.labels(model, version).observe(shadow_ms / 1000)
            self.shadow_served.labels(model, version).observe(served_ms / 1000)
        if outcome in ("agree", "disagree"):
            self.stats.shadow_pair(model, version, outcome == "agree")

    async def watch_loop(self, interval_s: float = 0.02) -> None:
        """Measure the event loop forever: how late a timer fires (lag), and how much of that
        the process was computing (held: CPU time it used meanwhile). Lag alone also counts a
        machine too busy to schedule the gateway; held is what the gateway itself did."""
        next_prune = time.monotonic() + PRUNE_S
        while True:
            t0, c0 = time.monotonic(), time.process_time()
            await asyncio.sleep(interval_s)
            lag = max(0.0, time.monotonic() - t0 - interval_s)
            self.loop_lag.observe(lag)
            self.loop_held.observe(max(0.0, min(lag, time.process_time() - c0)))
            if t0 >= next_prune:
                self.prune()
                next_prune = t0 + PRUNE_S

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
