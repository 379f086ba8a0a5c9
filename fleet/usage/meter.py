"""The gateway's usage meter: what it served and what its replicas cost, counted and flushed.

What is counted
    Per tenant, model and version, by each gateway: requests answered, inference rows and
    upstream seconds (time spent in the model service). **An inference is one row**: the
    first dimension of a request's input, so a batch of 32 rows is 32 inferences. Per
    version: replica-seconds, integrated from the replica counts the gateway samples about
    once a second (count × seconds since the previous sample; a gap is capped at
    ``MAX_GAP_S`` so a paused or suspended process invents no replica-hours), and the
    placement's price per replica-hour (``fleet.usage.prices.Price``).

Where it goes
    ``UsageMeter`` counts in memory on the gateway's event loop (``served``, ``replicas``: a
    few dict operations, no I/O, no lock). ``flush`` (a thread, every ``flush_s`` seconds,
    and at shutdown) appends a part, ``usage/<YYYY-MM-DDTHH>/<gateway id>/<n>.json``, with
    what was counted since the last part, for each UTC hour that changed; an hour let go
    (and every hour at shutdown) is written whole once, its parts then deleted
    (``fleet.usage.records``). A crash loses at most one flush interval. Replica-seconds are
    kept per minute of the hour, so the rollup (``fleet.usage.rollup``) can take the max
    across gateways minute by minute. ``collector()`` exposes the same counts to Prometheus
    (``fleet_usage_*_total``, ``fleet_version_replica_seconds_total``,
    ``fleet_version_price_usd_per_replica_hour``); a tenant's series only while the meter
    holds an hour it was counted in (the last two or three).
"""

from __future__ import annotations

import logging
import math
import re
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from fleet import records
from fleet.errors import FleetError, InvalidInput, PreconditionFailed
from fleet.types import ObjectStore
from fleet.usage.prices import Price
from fleet.usage.records import (
    HOUR_S,
    MINUTES,
    UNKNOWN_PRICE,
    PriceRecord,
    TrafficRecord,
    UsageHour,
    VersionRecord,
    hour_key,
    hour_start,
    merge,
    part_key,
    since,
    utc,
)

log = logging.getLogger("fleet.usage.meter")

FLUSH_S = 30.0
MAX_GAP_S = 10.0  # replica-seconds integrate at most this long a gap between two samples
MAX_UPSTREAM_S = 86400.0  # an upstream time outside [0, this) is a bug upstream: not added
_GATEWAY_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


@dataclass(slots=True)
class _Counts:
    """What one (tenant, model, version) was served: added to in place on the event loop."""

    requests: int = 0
    rows: int = 0  # inferences
    upstream_s: float = 0.0
    tokens: int = 0

    def add(self, other: _Counts) -> None:
        self.requests += other.requests
        self.rows += other.rows
        self.upstream_s += other.upstream_s
        self.tokens += other.tokens

    def values(self) -> tuple[int, int, float, int]:
        return self.requests, self.rows, self.upstream_s, self.tokens


class UsageMeter:
    """One gateway's usage counts, by UTC hour, flushed to the store.

    Threads: ``served`` and ``replicas`` run on the event loop only; ``flush`` and the
    collector run elsewhere and only read what the loop writes (snapshots of dicts and
    lists, atomic under the GIL), so the hot path takes no lock. A flush may catch one
    request half counted (its requests but not yet its rows); the next flush has it whole.
    """

    def __init__(
        self,
        store: ObjectStore,
        gateway_id: str,
        prices: Callable[[str], Price | None],
        *,
        clock: Callable[[], float] = time.time,
        flush_s: float = FLUSH_S,
        max_gap_s: float = MAX_GAP_S,
    ) -> None:
        if not isinstance(gateway_id, str) or not _GATEWAY_ID.fullmatch(gateway_id):
            raise InvalidInput(
                f"gateway id {gateway_id!r} cannot name a usage file; expected letters, digits, '.', '_' or '-'"
            )
        self.store, self.gateway_id, self.flush_s, self.max_gap_s = store, gateway_id, flush_s, max_gap_s
        self._prices, self._clock = prices, clock
        self._traffic: dict[int, dict[tuple[str, str, str], _Counts]] = {}  # hour → (tenant, model, version) → counts
        self._replica: dict[
            int, dict[tuple[str, str], list[float]]
        ] = {}  # hour → (model, version) → replica-s per minute
        self._cur: dict[tuple[str, str, str], _Counts] = {}  # the hour ``served`` counts into
        self._cur_start, self._cur_end = -math.inf, -math.inf
        self._last_sample: float | None = None
        # hours written for the last time and let go: still in the Prometheus counters
        self._closed_traffic: dict[tuple[str, str, str], _Counts] = {}
        self._closed_replica: dict[tuple[str, str], float] = {}
        self._written: dict[int, UsageHour] = {}  # hour → the hour as its parts (or whole file) hold it
        self._parts: dict[int, list[str]] = {}  # hour → the parts written of it
        self._lock = threading.Lock()  # letting hours go vs a scrape; never taken on the event loop
        self._flush_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.failing = False  # the last write failed
        self.invalid_upstream = 0  # upstream times refused (NaN, inf, negative): counted 0 s

    # hot path: the event loop ------------------------------------------------------------

    def served(self, tenant: str, model: str, version: str, rows: int, upstream_s: float, tokens: int = 0) -> None:
        """One answered request of ``rows`` inferences that spent ``upstream_s`` in the model
        service (and, for a generation, ``tokens``: prompt and completion)."""
        now = self._clock()
        if now >= self._cur_end:
            self._roll(now)
        key = (tenant, model, version)
        c = self._cur.get(key)
        if c is None:
            c = self._cur[key] = _Counts()
        c.requests += 1
        c.rows += rows
        c.tokens += max(0, tokens)
        if 0.0 <= upstream_s < MAX_UPSTREAM_S:  # False for NaN
            c.upstream_s += upstream_s
        else:
            self.invalid_upstream += 1

    def _roll(self, now: float) -> None:
        hour = hour_start(now)
        counts = self._traffic.get(hour)
        if counts is None:
            counts = self._traffic[hour] = {}
        self._cur = counts  # before the bounds: flush sees the new hour only once nothing counts into the old
        self._cur_start, self._cur_end = hour, hour + HOUR_S

    def replicas(self, counts: Mapping[tuple[str, str], int], now: float | None = None) -> None:
        """Replica counts of the routed versions, ``(model, version) → replicas``, about once a
        second; ``now`` in unix seconds (the meter's clock by default). The counts are taken to
        have held since the previous sample, at most ``max_gap_s`` back."""
        if now is None:
            now = self._clock()
        last, self._last_sample = self._last_sample, now
        if last is None or now <= last:
            return
        t = now - min(now - last, self.max_gap_s)
        while t < now:
            minute_start = (t // MINUTES) * MINUTES
            end = min(minute_start + MINUTES, now)
            hour = hour_start(t)
            minute = int((minute_start - hour) // MINUTES)
            per_hour = self._replica.get(hour)
            if per_hour is None:
                per_hour = self._replica[hour] = {}
            span = end - t
            for key, n in counts.items():
                minutes = per_hour.get(key)
                if minutes is None:
                    minutes = per_hour[key] = [0.0] * MINUTES
                if n > 0:
                    minutes[minute] += n * span
            t = end

    # the flush thread --------------------------------------------------------------------

    def flush(self, whole: bool = False) -> int:
        """Append a part for every hour counted in since the last one; write an hour let go
        (every hour, with ``whole``) as one file and delete its parts. Returns the files
        written. A failed write is logged and retried at the next flush; an hour ended more
        than an hour ago is let go once written (nothing counts into it anymore)."""
        with self._flush_lock:
            current = hour_start(self._clock())
            written = 0
            for hour in sorted(set(self._traffic) | set(self._replica)):
                closing = whole or hour <= current - 2 * HOUR_S
                try:
                    now = self.record(hour)
                    data = records.dump(now)
                except InvalidInput as exc:  # a count no JSON can hold: a bug, kept in memory and logged
                    log.error("usage of hour %s not written: %s", utc(hour), exc)
                    continue
                try:
                    written += self._close(hour, now, data) if closing else self._append(hour, now)
                except (FleetError, OSError) as exc:
                    if not self.failing:
                        log.warning("cannot write usage of hour %s, keeping its counts to retry: %s", utc(hour), exc)
                    self.failing = True
                    continue
                self.failing = False
                if hour <= current - 2 * HOUR_S:
                    self._let_go(hour)
            if self.invalid_upstream:
                log.warning(
                    "%d answered requests had an upstream time that is not a number of seconds; counted with 0 s",
                    self.invalid_upstream,
                )
            return written

    def _append(self, hour: int, now: UsageHour) -> int:
        """Write what the hour counted since its last part as a new part; 1 if one was written."""
        part = since(now, self._written.get(hour))
        if part is None:
            return 0
        parts = self._parts.setdefault(hour, [])
        key = part_key(utc(hour), self.gateway_id, len(parts))
        try:
            self.store.put(key, records.dump(part), if_none_match=True)  # a part is never rewritten
        except PreconditionFailed:
            # an earlier write of this part landed though its answer was lost (only this process
            # writes its parts): what it holds is written, the rest goes in the next part
            landed = UsageHour.model_validate_json(self.store.get(key).data)
            before = self._written.get(hour)
            parts.append(key)
            self._written[hour] = landed if before is None else merge([before, landed])
            return 1 + self._append(hour, now)
        parts.append(key)
        self._written[hour] = now
        return 1

    def _close(self, hour: int, now: UsageHour, data: bytes) -> int:
        """Write the hour whole (unless its whole file is already current), then delete its
        parts; 1 if a file was written."""
        parts = self._parts.get(hour, [])
        if not parts and self._written.get(hour) == now:
            return 0  # its whole file is current
        self.store.put(hour_key(utc(hour), self.gateway_id), data)  # only this gateway writes its own files
        self._written[hour] = now
        for key in parts:  # after the whole file: a reader that finds both takes the whole file
            self.store.delete(key)
        self._parts[hour] = []
        return 1

    def record(self, hour: int) -> UsageHour:
        """This gateway's counts for the hour that starts at ``hour`` (unix seconds) as its file holds them."""
        traffic = {k: v.values() for k, v in list(self._traffic.get(hour, {}).items())}
        replica = {k: list(v) for k, v in list(self._replica.get(hour, {}).items())}
        versions = sorted({(m, v) for _, m, v in traffic} | set(replica))
        prices = {m: self._price_record(m) for m in {m for m, _ in versions}}
        return UsageHour(
            hour=utc(hour),
            gateway=self.gateway_id,
            traffic=[
                TrafficRecord(tenant=t, model=m, version=v, requests=n, rows=r, upstream_s=s, tokens=k)
                for (t, m, v), (n, r, s, k) in sorted(traffic.items())
            ],
            versions=[
                VersionRecord(model=m, version=v, replica_s_by_minute=replica.get((m, v)), price=prices[m])
                for m, v in versions
            ],
        )

    def _let_go(self, hour: int) -> None:
        with self._lock:
            for key, c in self._traffic.pop(hour, {}).items():
                self._closed_traffic.setdefault(key, _Counts()).add(c)
            for key, minutes in self._replica.pop(hour, {}).items():
                self._closed_replica[key] = self._closed_replica.get(key, 0.0) + sum(minutes)
            self._written.pop(hour, None)
            self._parts.pop(hour, None)

    def price(self, model: str) -> Price | None:
        try:
            return self._prices(model)
        except Exception as exc:  # noqa: BLE001 - a broken price source must not stop the counts
            log.warning("no price for model %s: %s", model, exc)
            return None

    def _price_record(self, model: str) -> PriceRecord:
        p = self.price(model)
        if p is None or not math.isfinite(p.usd_per_replica_hour) or p.usd_per_replica_hour < 0:
            return UNKNOWN_PRICE
        return PriceRecord(
            usd_per_replica_hour=p.usd_per_replica_hour, instance=p.instance, source=p.source or "unnamed"
        )

    def start(self) -> None:
        """Flush every ``flush_s`` seconds in a daemon thread until ``close``."""
        self._thread = threading.Thread(target=self._run, name="usage-meter", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.flush_s):
            try:
                self.flush()
            except Exception:  # noqa: BLE001 - the thread outlives one bad flush
                log.exception("usage flush failed")

    def close(self, timeout_s: float = 30.0) -> int:
        """Stop the thread and write every hour whole; return the files written."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
        return self.flush(whole=True)

    # Prometheus --------------------------------------------------------------------------

    def recent(self) -> set[tuple[str, str, str]]:
        """The (tenant, model, version) counted in the hours this meter still holds (the last
        two or three): what ``/metrics`` shows per tenant."""
        return {key for per_hour in list(self._traffic.values()) for key in list(per_hour)}

    def totals(self) -> tuple[dict[tuple[str, str, str], tuple[int, int, float, int]], dict[tuple[str, str], float]]:
        """Since this meter started: (tenant, model, version) → (requests, rows, upstream s, tokens),
        and (model, version) → replica-seconds."""
        with self._lock:
            traffic = {k: _Counts(*v.values()) for k, v in self._closed_traffic.items()}
            replica = dict(self._closed_replica)
            for per_hour in list(self._traffic.values()):
                for key, c in list(per_hour.items()):
                    traffic.setdefault(key, _Counts()).add(_Counts(*c.values()))
            for per_hour_r in list(self._replica.values()):
                for key, minutes in list(per_hour_r.items()):
                    replica[key] = replica.get(key, 0.0) + sum(list(minutes))
        return {k: v.values() for k, v in traffic.items()}, replica

    def collector(self) -> Collector:
        """A collector to ``register`` into the gateway's ``CollectorRegistry``."""
        return _UsageCollector(self)


class _UsageCollector(Collector):
    def __init__(self, meter: UsageMeter) -> None:
        self._meter = meter

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        traffic, replica = self._meter.totals()
        labels = ["tenant", "model", "version"]
        requests = CounterMetricFamily(
            "fleet_usage_requests", "Requests answered, by tenant and version", labels=labels
        )
        rows = CounterMetricFamily(
            "fleet_usage_rows", "Inference rows answered (the first dimension of each input)", labels=labels
        )
        upstream = CounterMetricFamily(
            "fleet_usage_upstream_seconds", "Seconds spent in the model service", labels=labels
        )
        tokens = CounterMetricFamily("fleet_usage_tokens", "Generation: prompt and completion tokens", labels=labels)
        # a tenant not counted for two hours is left out (10,000 tenants that came once would
        # otherwise stay in every scrape); counted again, it comes back with its whole total
        recent = self._meter.recent()
        for key, (n, r, s, k) in sorted(traffic.items()):
            if key not in recent:
                continue
            requests.add_metric(list(key), n)
            rows.add_metric(list(key), r)
            upstream.add_metric(list(key), s)
            if k:
                tokens.add_metric(list(key), k)
        replica_s = CounterMetricFamily(
            "fleet_version_replica_seconds",
            "Replica-seconds of a version as this gateway sampled its replica count",
            labels=["model", "version"],
        )
        price = GaugeMetricFamily(
            "fleet_version_price_usd_per_replica_hour",
            "The placement's price of one replica-hour (absent when unknown)",
            labels=["model", "version"],
        )
        versions = sorted(set(replica) | {(m, v) for _, m, v in traffic})
        for key in versions:
            replica_s.add_metric(list(key), replica.get(key, 0.0))
        prices = {m: self._meter._price_record(m) for m in {m for m, _ in versions}}
        for m, v in versions:
            if prices[m].usd_per_replica_hour is not None:
                price.add_metric([m, v], prices[m].usd_per_replica_hour)
        yield from (requests, rows, upstream, tokens, replica_s, price)

    def describe(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        return iter(())  # collected only at scrape time; nothing to check at registration
