"""Usage and cost per tenant, model and version over a window, from every gateway's hour files.

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

import math
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from typing import Any

from fleet import records
from fleet.errors import InvalidInput, NotFound
from fleet.types import ObjectStore
from fleet.usage.records import (
    HOUR_FMT,
    HOUR_S,
    PREFIX,
    UNKNOWN_PRICE,
    PriceRecord,
    TrafficRecord,
    UsageHour,
    hour_start,
    key_gateway,
    key_hour,
    merge,
    utc,
)


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
    files: int  # gateway-hours read (a whole-hour file, or the sum of its parts)
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


@dataclass
class _Traffic:
    """Traffic summed across gateways and hours: of one tenant's use of a version, or of a version."""

    requests: int = 0
    rows: int = 0  # inferences
    upstream_s: float = 0.0
    tokens: int = 0

    def add(self, t: _Traffic | TrafficRecord) -> None:
        self.requests += t.requests
        self.rows += t.rows
        self.upstream_s += t.upstream_s
        self.tokens += t.tokens


@dataclass
class _Hour:
    """One hour of a version, every gateway's file together."""

    replica_s_by_minute: list[float] | None = None  # the max over gateways; None: no gateway sampled it
    price: PriceRecord = UNKNOWN_PRICE  # the highest any gateway metered at
    traffic: bool = False  # some gateway served it in this hour


def _per_1k(usd: float | None, rows: int) -> float | None:
    return None if usd is None or rows <= 0 else usd / rows * 1000


def _version_order(key: tuple[str, str]) -> tuple:
    from fleet.names import version_key

    try:
        return key[0], 0, version_key(key[1]), ""
    except (ValueError, TypeError):
        return key[0], 1, None, key[1]


def _read_hours(store: ObjectStore, first: int, until: float) -> tuple[list[UsageHour], list[records.BadRecord]]:
    """Every gateway's hours in the window: its whole-hour file, or else the sum of its parts."""
    wanted = {f"{utc(h):{HOUR_FMT}}" for h in range(first, math.ceil(until), HOUR_S)}
    whole: dict[tuple[str, str], UsageHour] = {}
    parts: dict[tuple[str, str], list[UsageHour]] = {}
    bad: list[records.BadRecord] = []

    def keep(key: str) -> bool:
        return key_hour(key) in wanted

    for day in sorted({w[:11] for w in wanted}):  # one listing per day: "usage/2026-12-01T"
        good, unreadable = records.load_all(store, f"{PREFIX}{day}", UsageHour, keep=keep)
        bad += unreadable
        for key, rec in sorted(good.items()):
            gateway, is_part = key_gateway(key)  # type: ignore[misc]
            at = (f"{rec.hour:{HOUR_FMT}}", rec.gateway)
            if (key_hour(key), gateway) != at:
                found = records.BadRecord(
                    key,
                    f"{key!r} holds the usage of gateway {rec.gateway!r} for hour {rec.hour:{HOUR_FMT}}",
                    UsageHour.__name__,
                )
                records.report(found)
                bad.append(found)
            elif is_part:
                parts.setdefault(at, []).append(rec)
            else:
                whole[at] = rec
    hours = list(whole.values())
    hours += [merge(p) for at, p in parts.items() if at not in whole]  # parts a whole file replaced are left
    return hours, bad


def hour_files(
    store: ObjectStore, first: datetime, last: datetime
) -> tuple[dict[datetime, list[UsageHour]], list[records.BadRecord]]:
    """Every gateway's usage of the UTC hours ``first`` to ``last`` (both included) as the
    rollup reads them (a whole file, or the sum of a gateway's parts), by hour; and the files
    that could not be read. One listing per day."""
    files, bad = _read_hours(store, hour_start(first.timestamp()), hour_start(last.timestamp()) + 1)
    by_hour: dict[datetime, list[UsageHour]] = {}
    for f in files:
        by_hour.setdefault(f.hour.astimezone(UTC), []).append(f)
    return by_hour, bad


def gateway_hour(store: ObjectStore, hour: datetime, gateway: str) -> UsageHour:
    """One gateway's hour as the rollup reads it (its whole file, or its parts summed);
    ``NotFound`` when it wrote neither."""
    start = hour_start(hour.timestamp())
    for rec in _read_hours(store, start, start + 1)[0]:
        if rec.gateway == gateway:
            return rec
    raise NotFound(f"gateway {gateway!r} wrote no usage for hour {utc(start):{HOUR_FMT}} in {store.url}")


def _gather(
    files: list[UsageHour], model: str | None
) -> tuple[dict[tuple[str, str, str], _Traffic], dict[tuple[str, str], dict[datetime, _Hour]]]:
    """(tenant, model, version) → its traffic, and (model, version) → hour → that hour, from every file."""
    traffic: dict[tuple[str, str, str], _Traffic] = {}
    hours: dict[tuple[str, str], dict[datetime, _Hour]] = {}
    for f in files:
        for t in f.traffic:
            if model is not None and t.model != model:
                continue
            traffic.setdefault((t.tenant, t.model, t.version), _Traffic()).add(t)
            hours.setdefault((t.model, t.version), {}).setdefault(f.hour, _Hour()).traffic = True
        for v in f.versions:
            if model is not None and v.model != model:
                continue
            h = hours.setdefault((v.model, v.version), {}).setdefault(f.hour, _Hour())
            if v.replica_s_by_minute is not None:
                h.replica_s_by_minute = (
                    v.replica_s_by_minute
                    if h.replica_s_by_minute is None
                    else [max(a, b) for a, b in zip(h.replica_s_by_minute, v.replica_s_by_minute, strict=True)]
                )
            if v.price.known and (not h.price.known or v.price.usd_per_replica_hour > h.price.usd_per_replica_hour):
                h.price = v.price  # gateways that disagree: the highest price, so cost is never understated
    return traffic, hours


def _cost(hours: dict[datetime, _Hour]) -> tuple[float, float | None]:
    """(replica-seconds, USD or None when unknown) of a version over its hours."""
    replica_s: float = 0.0
    usd: float | None = 0.0
    for h in hours.values():
        if h.replica_s_by_minute is None:
            usd = None if h.traffic else usd  # traffic, but no gateway sampled its replicas
            continue
        seconds = sum(h.replica_s_by_minute)
        replica_s += seconds
        if seconds and usd is not None:
            price = h.price.usd_per_replica_hour
            usd = None if price is None else usd + seconds / HOUR_S * price
    return replica_s, usd


def rollup(
    store: ObjectStore, since: datetime, until: datetime, tenant: str | None = None, model: str | None = None
) -> Report:
    """Usage and cost from the hour files of every gateway, from the UTC hour that holds
    ``since`` up to ``until``; only ``model``'s versions, and only the versions ``tenant``
    used and that tenant's rows when given. Unreadable files are skipped and reported."""
    if since.tzinfo is None or until.tzinfo is None:
        raise InvalidInput("rollup needs timezone-aware datetimes for since and until")
    first = hour_start(since.timestamp())
    files, bad = _read_hours(store, first, until.timestamp())
    traffic, hours = _gather(files, model)
    per_version: dict[tuple[str, str], _Traffic] = {}
    for (_tenant, m, v), c in traffic.items():
        per_version.setdefault((m, v), _Traffic()).add(c)
    used = None if tenant is None else {(m, v) for t, m, v in traffic if t == tenant}
    versions = []
    for key in sorted(hours, key=_version_order):
        if used is not None and key not in used:
            continue
        replica_s, usd = _cost(hours[key])
        total = per_version.get(key, _Traffic())
        latest = hours[key][max(hours[key])].price
        versions.append(
            VersionUsage(
                key[0],
                key[1],
                total.requests,
                total.rows,
                total.upstream_s,
                replica_s,
                usd,
                _per_1k(usd, total.rows),
                latest,
                total.tokens,
                _per_1k(usd, total.tokens),
            )
        )
    by_version = {(v.model, v.version): v for v in versions}
    tenants = []
    for (t, m, v), c in sorted(traffic.items(), key=lambda i: (_version_order(i[0][1:]), i[0][0])):
        if tenant is not None and t != tenant:
            continue
        ver = by_version[m, v]
        share = c.upstream_s / ver.upstream_s if ver.upstream_s > 0 else None
        usd = None if share is None or ver.usd is None else share * ver.usd
        tenants.append(
            TenantUsage(
                t,
                m,
                v,
                c.requests,
                c.rows,
                c.upstream_s,
                share,
                None if share is None else share * ver.replica_s,
                usd,
                _per_1k(usd, c.rows),
                c.tokens,
                _per_1k(usd, c.tokens),
            )
        )
    return Report(utc(first), until, tuple(versions), tuple(tenants), len(files), tuple(bad))
