"""``GET /admin/top``: what ``fleet top`` shows, for every model this gateway serves, in one answer.

One request per gateway per refresh, not one per model. For each routed or recently served
version: the windowed counts canary analysis reads (``fleet.gateway.stats``: requests,
failures by class, the latency histogram and, for generations, time per output token and
output lengths), its replicas (the routing snapshot's endpoints; ``ejected`` ones skipped by
the replica order now), requests in flight and waiting for a slot (the version's ``Slots``)
or held for a cold start. Per model: the route (revision, stable, canary and its weight,
shadow). Per tenant, bounded: the ``tenants`` busiest by requests and the most refused
(429), never every tenant.

Counters the window does not hold — 503s a version's queue shed, 429s, completion tokens,
each tenant's requests — are the gateway's cumulative counters (``fleet_requests_total``,
``fleet_generated_tokens_total``) less their value at a sample taken at least ``window_s``
earlier: they are read only while someone asks, at most every ``COUNTERS_S``, and a reading
is kept as a base at most every ``SAMPLE_GAP_S`` for ``MAX_WINDOW_S``, so the span a
difference covers (``counters_span_s``, from ``window_s`` to ``window_s + SAMPLE_GAP_S``; at
the first look the time since the gateway started, as vmstat's first line is since boot)
is said, never assumed.

Cost: the answer is computed once per ``CACHE_S`` whatever the number of viewers, and the
sums run in a thread (the loop only copies the series and counters it is handed), so a
viewer's refresh never holds the event loop for the milliseconds 500 models and 10,000
tenants take (``bench/top.py``). To sum every model in one pass — ``WindowedStats.window``
per model is a pass over every series each, 85 ms at 500 models — this module reads the
stats' series and slot layout and ``Telemetry``'s request counters directly (same package);
``tests/test_top.py`` checks its sums against ``window``'s.
"""

from __future__ import annotations

import asyncio
import heapq
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from fleet.gateway.stats import _ERR, _LABELLED, _LAT, _OUT, _PRED, _REQ, _TPOT, HORIZON_S
from fleet.gateway.telemetry import Telemetry
from fleet.gateway.upstream import Upstreams
from fleet.gateway.view import FleetView
from fleet.types import ERROR_CLASSES, LATENCY_BUCKETS_MS, OUTPUT_TOKEN_BUCKETS

MAX_WINDOW_S = 60  # a live view's window; /admin/stats serves the long ones
MAX_TENANTS = 50
CACHE_S = 0.5  # viewers asking within this share one computation
COUNTERS_S = 2.0  # the counters (requests by tenant and status, tokens) are read at most this often
SAMPLE_GAP_S = 5.0  # and kept as a base at most this often (each holds a number per active tenant)


@dataclass(slots=True)
class _Sample:
    """Cumulative counters at one moment (monotonic seconds)."""

    at: float
    tenants: dict[str, float] = field(default_factory=dict)  # requests, any status
    refused: dict[str, float] = field(default_factory=dict)  # 429s by tenant
    refused_models: dict[str, float] = field(default_factory=dict)  # 429s by model
    shed: dict[tuple[str, str], float] = field(default_factory=dict)  # 503s by version
    tokens: dict[tuple[str, str], float] = field(default_factory=dict)  # completion tokens by version


@dataclass(slots=True)
class _Counts:
    """What the counters grew by between two samples ``span_s`` apart."""

    span_s: float
    tenants: dict[str, float]
    refused: dict[str, float]
    refused_models: dict[str, float]
    shed: dict[tuple[str, str], float]
    tokens: dict[tuple[str, str], float]
    shown: dict[int, dict[str, Any]] = field(default_factory=dict)  # n → the tenants part of the answer

    def tenants_part(self, n: int) -> dict[str, Any]:
        """The ``n`` busiest tenants and the ``n`` most refused: ranked once per reading."""
        part = self.shown.get(n)
        if part is None:
            tenants, refused = self.tenants, self.refused
            part = self.shown[n] = {
                "active": len(tenants),
                "requests": int(sum(tenants.values())),
                "refused": int(sum(refused.values())),
                "top": [
                    {"tenant": t, "requests": int(c), "refused": int(refused.get(t, 0))}
                    for t, c in heapq.nlargest(n, tenants.items(), key=lambda kv: kv[1])
                ],
                "top_refused": [
                    {"tenant": t, "refused": int(c), "requests": int(tenants.get(t, 0))}
                    for t, c in heapq.nlargest(n, refused.items(), key=lambda kv: kv[1])
                ],
            }
        return part


def _delta(now: dict, base: dict) -> dict:
    """Per key, what a counter grew by since ``base``; one that went down was reset (a pruned
    tenant's series came back from zero): all of it is new."""
    out = {}
    for k, v in now.items():
        d = v - base.get(k, 0.0)
        d = v if d < 0 else d
        if d:
            out[k] = d
    return out


def _trim(counts: list[int]) -> list[int]:
    """A histogram without its trailing zero buckets (the reader pads): most latencies fill a few."""
    end = len(counts)
    while end and not counts[end - 1]:
        end -= 1
    return counts[:end]


class TopStats:
    def __init__(
        self,
        view: FleetView,
        telemetry: Telemetry,
        upstreams: Upstreams,
        gateway_id: str,
        *,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.view, self.telemetry, self.upstreams, self.gateway_id = view, telemetry, upstreams, gateway_id
        self._clock, self._mono = clock, monotonic
        self._samples: deque[_Sample] = deque([_Sample(monotonic())])  # the start: every counter at zero
        self.since = clock()  # a window reaching back before it counted nothing (rates divide by less)
        self._last = self._samples[0]  # the counters last read
        self._read_at = -float("inf")  # when (monotonic): never yet
        self._deltas: dict[int, _Counts] = {}  # window → what the counters grew by (from ``_last``)
        self._cache: dict[tuple, tuple[float, asyncio.Future[dict[str, Any]]]] = {}
        self._lock = asyncio.Lock()

    async def answer(self, window_s: int, tenants: int = 10, match: str = "") -> dict[str, Any]:
        """The top answer over the last ``window_s`` seconds with the ``tenants`` busiest tenants;
        ``match``: only the models whose name holds it (the viewer's filter)."""
        key, now = (window_s, tenants, match), self._mono()
        hit = self._cache.get(key)
        if hit is None or now - hit[0] >= CACHE_S:
            self._cache = {k: v for k, v in self._cache.items() if now - v[0] < CACHE_S}
            hit = self._cache[key] = (now, asyncio.ensure_future(self._compute(window_s, tenants, match)))
        return await asyncio.shield(hit[1])

    async def _compute(self, window_s: int, n: int, match: str) -> dict[str, Any]:
        async with self._lock:  # one at a time: the samples are shared
            # on the loop: references and copies of two dicts only (no tuple per item); the sums in a thread
            pools = list(self.upstreams.pools().items())
            loads = {mv: (p.slots.in_use, p.slots.waiting(), _ejected(p)) for mv, p in pools if match in mv[0]}
            series = self.telemetry.stats.series_of(match)
            finished = None
            if self._mono() - self._read_at >= COUNTERS_S:
                finished = self.telemetry.finished_counters()
            view = (self.view.snapshot, self.view.stale)
            return await asyncio.to_thread(self._build, window_s, n, match, view, loads, series, finished)

    def _build(
        self, window_s: int, n: int, match: str, view: tuple, loads: dict, series: list, finished: tuple | None
    ) -> dict[str, Any]:
        now, (snap, stale) = self._clock(), view
        end_sec = int(now) + 1
        start_sec = end_sec - window_s
        counts = self._counts(window_s, finished)
        held = {
            (s.labels["model"], s.labels["version"]): s.value
            for family in self.telemetry.held.collect()
            for s in family.samples
        }
        models: dict[str, dict[str, Any]] = {}
        for model, table in snap.routes.items():
            if match in model:
                models[model] = {
                    "revision": table.revision,
                    "stable": table.stable,
                    "canary": [table.canary.version, table.canary.weight] if table.canary else None,
                    "shadow": [table.shadow.version, table.shadow.percent] if table.shadow else None,
                    "pins": len(table.pins),
                    "versions": {v: {"requests": 0} for v in sorted(table.referenced_versions())},
                }
        generative = self._last.tokens
        for (model, version), s in series:
            seconds, slots = s.seconds, s.slots
            got = [slots[i] for sec in range(start_sec, end_sec) if seconds[i := sec % HORIZON_S] == sec]
            got = [g for g in got if g is not None]
            if not got:
                continue
            t = list(map(sum, zip(*(g[:_PRED] for g in got), strict=True)))
            entry: dict[str, Any] = {"requests": t[_REQ], "latency_ms": _trim(t[_LAT:_PRED])}
            errors = {c: e for c, e in zip(ERROR_CLASSES, t[_ERR:_LAT], strict=True) if e}
            if errors:
                entry["errors"] = errors
            if (model, version) in generative:  # a generative version: its generation histograms too
                g = list(map(sum, zip(*(g[_TPOT:_LABELLED] for g in got), strict=True)))
                entry["tpot_ms"] = _trim(g[: _OUT - _TPOT])
                entry["output_tokens"] = _trim(g[_OUT - _TPOT :])
            m = models.setdefault(model, {"revision": -1, "versions": {}})
            m["versions"].setdefault(version, {}).update(entry)
        for model, m in models.items():
            refused = counts.refused_models.get(model, 0)
            m["refused"] = int(refused)
            for version, entry in m["versions"].items():
                mv = (model, version)
                entry["replicas"] = len(snap.endpoints.get(mv, ()))
                in_flight, queue, ejected = loads.get(mv, (0, 0, 0))
                # zeros left out: at 500 models most of these are, and the answer goes out every second
                for name, value in (
                    ("ejected", ejected),
                    ("in_flight", in_flight),
                    ("queue", queue),
                    ("held", int(held.get(mv, 0))),
                    ("shed", int(counts.shed.get(mv, 0))),
                ):
                    if value:
                        entry[name] = value
                if mv in generative:
                    entry["completion_tokens"] = int(counts.tokens.get(mv, 0))
        return {
            "gateway": self.gateway_id,
            "at": now,
            "stale": stale,
            "start": float(start_sec),
            "end": min(now, float(end_sec)),
            "since": self.since,
            "window_s": window_s,
            "counters_span_s": round(counts.span_s, 3),
            "latency_buckets_ms": list(LATENCY_BUCKETS_MS),
            "output_token_buckets": list(OUTPUT_TOKEN_BUCKETS),
            "models": models,
            "tenants": counts.tenants_part(n),
        }

    def _counts(self, window_s: int, finished: tuple | None) -> _Counts:
        """What the counters grew by over (about) the window: read anew when ``finished`` is
        given (the request counters' keys and values), else the last reading's."""
        if finished is not None:
            self._last = self._sample(self._mono(), *finished)
            self._read_at = self._last.at
            self._deltas.clear()
        counts = self._deltas.get(window_s)
        if counts is None:
            last, base = self._last, self._base(self._last.at, window_s)
            counts = self._deltas[window_s] = _Counts(
                span_s=last.at - base.at,
                tenants=_delta(last.tenants, base.tenants),
                refused=_delta(last.refused, base.refused),
                refused_models=_delta(last.refused_models, base.refused_models),
                shed=_delta(last.shed, base.shed),
                tokens=_delta(last.tokens, base.tokens),
            )
        return counts

    def _sample(self, mono: float, keys: list, counters: list) -> _Sample:
        """The counters now; kept as a base for later looks when the last kept one is ``SAMPLE_GAP_S`` old."""
        s = _Sample(mono)
        tenants, refused, refused_models, shed = s.tenants, s.refused, s.refused_models, s.shed
        for (model, version, tenant, status), counter in zip(keys, counters, strict=True):
            value = counter._value.get()  # prometheus_client has no public getter; this one is thread-safe
            tenants[tenant] = tenants.get(tenant, 0.0) + value
            if status == 429:
                refused[tenant] = refused.get(tenant, 0.0) + value
                refused_models[model] = refused_models.get(model, 0.0) + value
            elif status == 503:
                shed[model, version] = shed.get((model, version), 0.0) + value
        for family in self.telemetry.tokens.collect():  # generations only: a series per version and kind
            for x in family.samples:
                if x.labels.get("kind") == "completion" and x.name.endswith("_total"):
                    s.tokens[x.labels["model"], x.labels["version"]] = x.value
        samples = self._samples
        if mono - samples[-1].at >= SAMPLE_GAP_S:
            samples.append(s)
        # the oldest goes once the next one can serve every window
        while len(samples) > 1 and mono - samples[1].at >= MAX_WINDOW_S:
            samples.popleft()
        return s

    def _base(self, at: float, window_s: int) -> _Sample:
        """The newest kept sample at least ``window_s`` older than ``at``, else the oldest."""
        for s in reversed(self._samples):
            if at - s.at >= window_s:
                return s
        return self._samples[0]


def _ejected(pool: Any) -> int:  # noqa: ANN401 - fleet.gateway.replicas.Pool
    now = time.monotonic()
    return sum(1 for r in pool.replicas if r.ejected(now))
