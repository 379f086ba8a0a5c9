"""Usage and cost per tenant, model and version: what the gateways served, what the replicas cost.

What is counted
    Per tenant, model and version, by each gateway: requests answered, inference rows and
    upstream seconds (time spent in the model service). **An inference is one row**: the
    first dimension of a request's input, so a batch of 32 rows is 32 inferences. Per
    version: replica-seconds, integrated from the replica counts the gateway samples about
    once a second (count × seconds since the previous sample; a gap is capped at
    ``MAX_GAP_S`` so a paused or suspended process invents no replica-hours), and the
    placement's price per replica-hour (``Price``; ``prices_from_plan`` takes it from
    ``fleet.planning.costs.inference_costs``: the replica's share of a node at the stack file's
    ``nodePools[].hourly_usd``, what ``fleet plan`` prints).

Where it goes
    ``UsageMeter`` counts in memory on the gateway's event loop (``served``, ``replicas``: a
    few dict operations, no I/O, no lock). ``flush`` (a thread, every ``flush_s`` seconds,
    and at shutdown) rewrites ``usage/<YYYY-MM-DDTHH>/<gateway id>.json`` for each UTC hour
    this gateway counted in, with its cumulative counts for that hour, so a crash loses at
    most one flush interval. Each file names every version's price and its source; a
    version without a placement or price says ``source: "none"`` and its cost is *unknown*
    (``None``, printed ``-``), never 0. ``collector()`` exposes the same counts to
    Prometheus (``fleet_usage_*_total``, ``fleet_version_replica_seconds_total``,
    ``fleet_version_price_usd_per_replica_hour``).

Several gateways
    Each gateway counts the requests it answered, and only those: requests, rows and
    upstream seconds are SUMMED across the gateways' files. Every gateway sees the same
    replicas: replica-seconds are the MAX across gateways, never the sum. The max is taken
    minute by minute (each file keeps a version's replica-seconds per minute of its hour),
    so two gateways running side by side count each minute once, and a gateway that
    restarts mid-hour (a new id, so a new file) does not lose the minutes of its old self.

Cost
    A version's cost over a window is the sum over its hours of replica-seconds / 3600 × that
    hour's price per replica-hour. Idle replica time is part of it: replicas cost money
    whether or not they answer. Cost per 1,000 inferences is cost / rows × 1000. A tenant's
    share of a version's cost is its share of the version's upstream seconds in the window,
    and that share covers the idle time too. The rollup reads whole UTC hours (the hour that
    holds ``since`` up to ``until``). A version is priced unknown when any hour of it lacks a
    price (with replica time to price) or has traffic but no gateway sampled its replicas.
"""

from __future__ import annotations

import logging
import math
import re
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector
from pydantic import BaseModel, ConfigDict, Field, model_serializer, model_validator

from fleet import records
from fleet.errors import ConfigError, FleetError, InvalidInput
from fleet.types import ObjectStore

if TYPE_CHECKING:
    from fleet.planning.placement import PlacementPlan
    from fleet.planning.stack import NodePool

log = logging.getLogger("fleet.usage.meter")

PREFIX = "usage/"
HOUR_S = 3600
MINUTES = 60
FLUSH_S = 30.0
MAX_GAP_S = 10.0  # replica-seconds integrate at most this long a gap between two samples
MAX_UPSTREAM_S = 86400.0  # an upstream time outside [0, this) is a bug upstream: not added
NO_PRICE = "none"
_HOUR_FMT = "%Y-%m-%dT%H"
_GATEWAY_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_KEY = re.compile(r"usage/(\d{4}-\d{2}-\d{2}T\d{2})/([^/]+)\.json")


@dataclass(frozen=True, slots=True)
class Price:
    """What one replica of a model costs per hour, on which instance, and where that came from."""

    usd_per_replica_hour: float
    instance: str
    source: str


# -- the hour files ------------------------------------------------------------------------


class _Record(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)


Seconds = Annotated[float, Field(ge=0.0)]


class PriceRecord(_Record):
    """A version's price as a file names it: ``source: "none"`` (and no number) when unknown."""

    usd_per_replica_hour: float | None = Field(None, ge=0.0)
    instance: str | None = None
    source: str = Field(min_length=1)

    @model_validator(mode="after")
    def _known_or_none(self) -> PriceRecord:
        if (self.usd_per_replica_hour is None) != (self.source == NO_PRICE):
            raise ValueError(f'a price has a number and a source, or neither (source "{NO_PRICE}")')
        return self

    @property
    def known(self) -> bool:
        return self.usd_per_replica_hour is not None


UNKNOWN_PRICE = PriceRecord(source=NO_PRICE)


class TrafficRecord(_Record):
    tenant: str = Field(min_length=1)
    model: str = Field(min_length=1)
    version: str = Field(min_length=1)
    requests: int = Field(ge=0)
    rows: int = Field(ge=0)  # inferences
    upstream_s: Seconds
    tokens: int = Field(0, ge=0)  # generative models: prompt and completion tokens

    @model_serializer(mode="wrap")
    def _tokens_when_any(self, handler: Callable[[TrafficRecord], dict[str, Any]]) -> dict[str, Any]:
        """``tokens`` only when some were counted: a reader of the release before it (which
        forbids unknown fields) still reads every hour of tensor traffic."""
        data = handler(self)
        if not data.get("tokens"):
            data.pop("tokens", None)
        return data


class VersionRecord(_Record):
    model: str = Field(min_length=1)
    version: str = Field(min_length=1)
    # replica-seconds in each minute of the hour; None: this gateway sampled no replica count of it
    replica_s_by_minute: list[Seconds] | None = Field(None, min_length=MINUTES, max_length=MINUTES)
    price: PriceRecord


class UsageHour(_Record):
    """``usage/<YYYY-MM-DDTHH>/<gateway>.json``: one gateway's cumulative counts for one UTC hour."""

    hour: datetime  # its start, UTC
    gateway: str = Field(min_length=1)
    traffic: list[TrafficRecord]
    versions: list[VersionRecord]

    @model_validator(mode="after")
    def _whole_utc_hour(self) -> UsageHour:
        if (
            self.hour.tzinfo is None
            or self.hour.utcoffset() != timedelta(0)
            or self.hour.minute
            or self.hour.second
            or self.hour.microsecond
        ):
            raise ValueError("hour must be the start of a UTC hour, e.g. 2026-12-01T14:00:00Z")
        return self


def hour_key(hour: datetime, gateway_id: str) -> str:
    return f"{PREFIX}{hour.astimezone(UTC):{_HOUR_FMT}}/{gateway_id}.json"


def _hour_start(ts: float) -> int:
    return int(ts // HOUR_S) * HOUR_S


def _utc(ts: float) -> datetime:
    return datetime.fromtimestamp(ts, UTC)


# -- the meter -------------------------------------------------------------------------------


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
        self._traffic: dict[
            int, dict[tuple[str, str, str], list]
        ] = {}  # hour → (tenant, model, version) → [requests, rows, upstream s]
        self._replica: dict[
            int, dict[tuple[str, str], list[float]]
        ] = {}  # hour → (model, version) → replica-s per minute
        self._cur: dict[tuple[str, str, str], list] = {}  # the hour ``served`` counts into
        self._cur_start, self._cur_end = -math.inf, -math.inf
        self._last_sample: float | None = None
        # hours written for the last time and let go: still in the Prometheus counters
        self._closed_traffic: dict[tuple[str, str, str], list] = {}
        self._closed_replica: dict[tuple[str, str], float] = {}
        self._written: dict[int, bytes] = {}
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
            c = self._cur[key] = [0, 0, 0.0, 0]
        c[0] += 1
        c[1] += rows
        c[3] += max(0, tokens)
        if 0.0 <= upstream_s < MAX_UPSTREAM_S:  # False for NaN
            c[2] += upstream_s
        else:
            self.invalid_upstream += 1

    def _roll(self, now: float) -> None:
        hour = _hour_start(now)
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
            hour = _hour_start(t)
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

    def flush(self) -> int:
        """Rewrite the file of every hour counted in and changed since its last write; return
        the files written. A failed write is logged and retried at the next flush; an hour
        ended more than an hour ago is let go once written (nothing counts into it anymore)."""
        with self._flush_lock:
            current = _hour_start(self._clock())
            written = 0
            for hour in sorted(set(self._traffic) | set(self._replica)):
                try:
                    data = records.dump(self.record(hour))
                except InvalidInput as exc:  # a count no JSON can hold: a bug, kept in memory and logged
                    log.error("usage of hour %s not written: %s", _utc(hour), exc)
                    continue
                if data != self._written.get(hour):
                    key = hour_key(_utc(hour), self.gateway_id)
                    try:
                        self.store.put(key, data)  # only this gateway writes its own files
                    except (FleetError, OSError) as exc:
                        if not self.failing:
                            log.warning("cannot write usage file %s, keeping its counts to retry: %s", key, exc)
                        self.failing = True
                        continue
                    self.failing = False
                    self._written[hour] = data
                    written += 1
                if hour <= current - 2 * HOUR_S:
                    self._let_go(hour)
            if self.invalid_upstream:
                log.warning(
                    "%d answered requests had an upstream time that is not a number of seconds; counted with 0 s",
                    self.invalid_upstream,
                )
            return written

    def record(self, hour: int) -> UsageHour:
        """This gateway's counts for the hour that starts at ``hour`` (unix seconds) as its file holds them."""
        traffic = {k: tuple(v) for k, v in list(self._traffic.get(hour, {}).items())}
        replica = {k: list(v) for k, v in list(self._replica.get(hour, {}).items())}
        versions = sorted({(m, v) for _, m, v in traffic} | set(replica))
        prices = {m: self._price_record(m) for m in {m for m, _ in versions}}
        return UsageHour(
            hour=_utc(hour),
            gateway=self.gateway_id,
            traffic=[
                TrafficRecord(tenant=t, model=m, version=v, requests=c[0], rows=c[1], upstream_s=c[2], tokens=c[3])
                for (t, m, v), c in sorted(traffic.items())
            ],
            versions=[
                VersionRecord(model=m, version=v, replica_s_by_minute=replica.get((m, v)), price=prices[m])
                for m, v in versions
            ],
        )

    def _let_go(self, hour: int) -> None:
        with self._lock:
            for key, c in self._traffic.pop(hour, {}).items():
                total = self._closed_traffic.setdefault(key, [0, 0, 0.0, 0])
                for i in range(4):
                    total[i] += c[i]
            for key, minutes in self._replica.pop(hour, {}).items():
                self._closed_replica[key] = self._closed_replica.get(key, 0.0) + sum(minutes)
            self._written.pop(hour, None)

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
        """Stop the thread and write what is left; return the files written."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
        return self.flush()

    # Prometheus --------------------------------------------------------------------------

    def totals(self) -> tuple[dict[tuple[str, str, str], tuple[int, int, float, int]], dict[tuple[str, str], float]]:
        """Since this meter started: (tenant, model, version) → (requests, rows, upstream s, tokens),
        and (model, version) → replica-seconds."""
        with self._lock:
            traffic = {k: list(v) for k, v in self._closed_traffic.items()}
            replica = dict(self._closed_replica)
            for per_hour in list(self._traffic.values()):
                for key, c in list(per_hour.items()):
                    total = traffic.setdefault(key, [0, 0, 0.0, 0])
                    for i, x in enumerate(tuple(c)):
                        total[i] += x
            for per_hour_r in list(self._replica.values()):
                for key, minutes in list(per_hour_r.items()):
                    replica[key] = replica.get(key, 0.0) + sum(list(minutes))
        return {k: (v[0], v[1], v[2], v[3]) for k, v in traffic.items()}, replica

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
        for key, (n, r, s, k) in sorted(traffic.items()):
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


# -- prices from the placement ----------------------------------------------------------------


def prices_from_plan(result: PlacementPlan, pools: Sequence[NodePool], where: str) -> dict[str, Price]:
    """Model → its price per replica-hour in ``result`` (what ``fleet plan`` prints as USD/h per
    replica: the replica's share of a node, at the node's ``hourly_usd`` in the stack file
    ``where``)."""
    from fleet.planning.costs import inference_costs
    from fleet.planning.stack import STACK_POOLS_KEY

    groups = {g.name: g for g in result.node_groups}
    out = {}
    for m, cost in zip(result.models, inference_costs(result, pools), strict=True):
        group = groups[m.node_group]
        share = cost.replica_usd_per_hour / group.hourly_usd if group.hourly_usd else 0.0
        source = (
            f"placement: {share:.4g} of a {m.instance_type} node per replica at {where}: "
            f"{STACK_POOLS_KEY}[{m.pool}].hourly_usd {group.hourly_usd:g}"
        )
        out[m.model] = Price(cost.replica_usd_per_hour, m.instance_type, source)
    return out


def prices_from_stack(stack: str, policies: Path) -> dict[str, Price]:
    """``prices_from_plan`` of the plan ``fleet plan -s <stack> --policies <policies>`` prints."""
    from fleet.catalog.policies.loader import load_policies
    from fleet.planning.planner import plan
    from fleet.planning.stack import placement_inputs, read_stack_file, stack_file

    path = stack_file(stack)
    loaded = load_policies(policies)
    pools, models = placement_inputs(read_stack_file(path), str(path), loaded)
    return prices_from_plan(plan(loaded, pools, models), pools, path.name)


# -- the rollup ------------------------------------------------------------------------------


@dataclass(frozen=True)
class VersionUsage:
    """A version over the window, every tenant together; ``usd`` None when unknown."""

    model: str
    version: str
    requests: int
    rows: int  # inferences
    upstream_s: float
    replica_s: float  # MAX across gateways, minute by minute; idle time included
    usd: float | None
    usd_per_1k_inferences: float | None
    price: PriceRecord  # of the latest hour in the window
    tokens: int = 0  # generation: prompt and completion
    usd_per_1k_tokens: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "price": self.price.model_dump()}


@dataclass(frozen=True)
class TenantUsage:
    """A tenant's use of a version; its ``share`` of the version's upstream seconds is its
    share of the version's replica time and cost (idle time included)."""

    tenant: str
    model: str
    version: str
    requests: int
    rows: int
    upstream_s: float
    share: float | None  # None: the version spent no upstream time at all
    replica_s: float | None  # share × the version's replica-seconds
    usd: float | None
    usd_per_1k_inferences: float | None
    tokens: int = 0
    usd_per_1k_tokens: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Report:
    since: datetime  # the start of the first hour read
    until: datetime
    versions: tuple[VersionUsage, ...]
    tenants: tuple[TenantUsage, ...]
    files: int  # hour files read
    skipped: tuple[records.BadRecord, ...]  # hour files that could not be read: left out

    def version(self, model: str, version: str) -> VersionUsage:
        return next(v for v in self.versions if (v.model, v.version) == (model, version))

    def to_dict(self) -> dict[str, Any]:
        return {
            "since": self.since.isoformat(),
            "until": self.until.isoformat(),
            "inference": "one input row (the first dimension of a request's input)",
            "versions": [v.to_dict() for v in self.versions],
            "tenants": [t.to_dict() for t in self.tenants],
            "files": self.files,
            "skipped": [{"key": b.key, "reason": b.reason} for b in self.skipped],
        }


def _per_1k(usd: float | None, rows: int) -> float | None:
    return None if usd is None or rows <= 0 else usd / rows * 1000


def _version_order(key: tuple[str, str]) -> tuple:
    from fleet.names import version_key

    try:
        return key[0], 0, version_key(key[1]), ""
    except (ValueError, TypeError):
        return key[0], 1, None, key[1]


def _read_hours(store: ObjectStore, first: int, until: float) -> tuple[list[UsageHour], list[records.BadRecord]]:
    wanted = {f"{_utc(h):{_HOUR_FMT}}" for h in range(first, math.ceil(until), HOUR_S)}
    hours: list[UsageHour] = []
    bad: list[records.BadRecord] = []

    def keep(key: str) -> bool:
        found = _KEY.fullmatch(key)
        return found is not None and found[1] in wanted

    for day in sorted({w[:11] for w in wanted}):  # one listing per day: "usage/2026-12-01T"
        good, unreadable = records.load_all(store, f"{PREFIX}{day}", UsageHour, keep=keep)
        bad += unreadable
        for key, rec in good.items():
            if key != hour_key(rec.hour, rec.gateway):
                found = records.BadRecord(
                    key,
                    f"{key!r} holds the usage of gateway {rec.gateway!r} for hour {rec.hour:{_HOUR_FMT}}",
                    UsageHour.__name__,
                )
                records.report(found)
                bad.append(found)
            else:
                hours.append(rec)
    return hours, bad


def rollup(
    store: ObjectStore, since: datetime, until: datetime, tenant: str | None = None, model: str | None = None
) -> Report:
    """Usage and cost from the hour files of every gateway, from the UTC hour that holds
    ``since`` up to ``until``; only ``model``'s versions, and only the versions ``tenant``
    used and that tenant's rows when given. Unreadable files are skipped and reported."""
    if since.tzinfo is None or until.tzinfo is None:
        raise InvalidInput("rollup needs timezone-aware datetimes for since and until")
    first = _hour_start(since.timestamp())
    files, bad = _read_hours(store, first, until.timestamp())
    traffic: dict[tuple[str, str, str], list] = {}
    # (model, version) → hour → [replica-s per minute (max over gateways) or None, best price, traffic seen]
    hours: dict[tuple[str, str], dict[datetime, list]] = {}
    for f in files:
        for t in f.traffic:
            if model is not None and t.model != model:
                continue
            c = traffic.setdefault((t.tenant, t.model, t.version), [0, 0, 0.0, 0])
            c[0] += t.requests
            c[1] += t.rows
            c[2] += t.upstream_s
            c[3] += t.tokens
            hours.setdefault((t.model, t.version), {}).setdefault(f.hour, [None, UNKNOWN_PRICE, False])[2] = True
        for v in f.versions:
            if model is not None and v.model != model:
                continue
            h = hours.setdefault((v.model, v.version), {}).setdefault(f.hour, [None, UNKNOWN_PRICE, False])
            if v.replica_s_by_minute is not None:
                h[0] = (
                    v.replica_s_by_minute
                    if h[0] is None
                    else [max(a, b) for a, b in zip(h[0], v.replica_s_by_minute, strict=True)]
                )
            if v.price.known and (not h[1].known or v.price.usd_per_replica_hour > h[1].usd_per_replica_hour):
                h[1] = v.price  # gateways that disagree: the highest price, so cost is never understated
    per_version: dict[tuple[str, str], list] = {}
    for (_tenant, m, v), c in traffic.items():
        total = per_version.setdefault((m, v), [0, 0, 0.0, 0])
        for i in range(4):
            total[i] += c[i]
    used = None if tenant is None else {(m, v) for t, m, v in traffic if t == tenant}
    versions = []
    for key in sorted(hours, key=_version_order):
        if used is not None and key not in used:
            continue
        replica_s, usd = 0.0, 0.0
        for minutes, price, seen in hours[key].values():
            if minutes is None:
                usd = None if seen else usd  # traffic, but no gateway sampled its replicas
                continue
            seconds = sum(minutes)
            replica_s += seconds
            if seconds and usd is not None:
                usd = None if not price.known else usd + seconds / HOUR_S * price.usd_per_replica_hour
        requests, rows, upstream_s, tokens = per_version.get(key, (0, 0, 0.0, 0))
        latest = hours[key][max(hours[key])][1]
        versions.append(
            VersionUsage(
                key[0],
                key[1],
                requests,
                rows,
                upstream_s,
                replica_s,
                usd,
                _per_1k(usd, rows),
                latest,
                tokens,
                _per_1k(usd, tokens),
            )
        )
    by_version = {(v.model, v.version): v for v in versions}
    tenants = []
    for (t, m, v), (requests, rows, upstream_s, tokens) in sorted(
        traffic.items(), key=lambda i: (_version_order(i[0][1:]), i[0][0])
    ):
        if tenant is not None and t != tenant:
            continue
        ver = by_version[m, v]
        share = upstream_s / ver.upstream_s if ver.upstream_s > 0 else None
        usd = None if share is None or ver.usd is None else share * ver.usd
        tenants.append(
            TenantUsage(
                t,
                m,
                v,
                requests,
                rows,
                upstream_s,
                share,
                None if share is None else share * ver.replica_s,
                usd,
                _per_1k(usd, rows),
                tokens,
                _per_1k(usd, tokens),
            )
        )
    return Report(_utc(first), until, tuple(versions), tuple(tenants), len(files), tuple(bad))


# -- where a gateway gets its prices ----------------------------------------------------------


def write_prices(prices: Mapping[str, Price]) -> str:
    """``prices`` as the JSON a gateway reads from ``FLEET_PRICES_FILE`` (``read_prices``)."""
    import json

    return json.dumps({m: asdict(p) for m, p in sorted(prices.items())}, indent=2, sort_keys=True)


def read_prices(path: Path) -> dict[str, Price]:
    """Model → price from a JSON file ``{model: {usd_per_replica_hour, instance, source}}``
    (what ``write_prices`` writes; in Kubernetes, the infra's ConfigMap)."""
    import json

    try:
        raw = json.loads(path.read_text())
        return {
            str(m): Price(float(p["usd_per_replica_hour"]), str(p["instance"]), str(p["source"]))
            for m, p in raw.items()
            if math.isfinite(float(p["usd_per_replica_hour"])) and float(p["usd_per_replica_hour"]) >= 0
        }
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ConfigError(
            f"{path}: not a price file ({exc}); expected JSON {{model: {{usd_per_replica_hour, instance, source}}}}}}}}"
        ) from None


def gateway_prices(policies: Path) -> tuple[dict[str, Price], str]:
    """(the prices a gateway meters cost with, where they came from): ``FLEET_PRICES_FILE``,
    else the placement of the stack ``FLEET_PRICE_STACK`` names (default ``dev``, what a
    local fleet would cost placed as the dev stack), else none (cost unknown)."""
    import os

    from fleet.planning.stack import stack_file

    file = os.environ.get("FLEET_PRICES_FILE", "").strip()
    if file:
        return read_prices(Path(file)), file
    stack = os.environ.get("FLEET_PRICE_STACK", "").strip()
    path = stack_file(stack or "dev")
    if not stack and not path.is_file():
        return {}, "none (set FLEET_PRICES_FILE or FLEET_PRICE_STACK)"
    try:
        return prices_from_stack(str(path), policies), str(path)
    except ConfigError as exc:
        if stack:
            raise
        log.warning("no prices for usage costs: %s", exc)
        return {}, "none"
