"""The usage files: one gateway's counts for one UTC hour, and where each is stored.

While an hour is open a gateway appends **parts**, ``usage/<YYYY-MM-DDTHH>/<gateway id>/<n>.json``:
each holds only what it counted since the part before (written once, never rewritten, so a
versioned bucket keeps no old copies and the bytes written follow the traffic, not the
number of tenants ever seen). When the hour is let go (two hours later) or the gateway
stops, it writes the whole hour once as ``usage/<YYYY-MM-DDTHH>/<gateway id>.json`` and
deletes its parts. A reader (``gateway_hour``) takes the whole-hour file when there is one,
else the sum of the parts; a gateway that died mid-hour leaves parts, which read the same.

``usage/<YYYY-MM-DDTHH>/<gateway id>.json`` (``UsageHour``) holds, per tenant, model and
version, the requests that gateway answered, their inference rows, upstream seconds and (for
generative models) tokens; and per version the replica-seconds it sampled in each minute of
the hour and the price per replica-hour it metered them at. A version without a placement or
price says ``source: "none"`` (``UNKNOWN_PRICE``) and its cost is unknown, never 0.
``fleet.usage.meter`` writes these files; ``fleet.usage.rollup`` reads them.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, model_serializer, model_validator

PREFIX = "usage/"
HOUR_S = 3600
MINUTES = 60
NO_PRICE = "none"
HOUR_FMT = "%Y-%m-%dT%H"  # the hour as a key names it
_KEY = re.compile(r"usage/(\d{4}-\d{2}-\d{2}T\d{2})/([^/]+)\.json")
_PART = re.compile(r"usage/(\d{4}-\d{2}-\d{2}T\d{2})/([^/]+)/(\d{6})\.json")


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
    return f"{PREFIX}{hour.astimezone(UTC):{HOUR_FMT}}/{gateway_id}.json"


def part_key(hour: datetime, gateway_id: str, n: int) -> str:
    return f"{PREFIX}{hour.astimezone(UTC):{HOUR_FMT}}/{gateway_id}/{n:06d}.json"


def key_hour(key: str) -> str | None:
    """The hour (``YYYY-MM-DDTHH``) a usage file's key names; None for a key that names no usage file."""
    found = _KEY.fullmatch(key) or _PART.fullmatch(key)
    return None if found is None else found[1]


def key_gateway(key: str) -> tuple[str, bool] | None:
    """(the gateway a usage file's key names, whether it is a part); None for no usage file."""
    if found := _KEY.fullmatch(key):
        return found[2], False
    if found := _PART.fullmatch(key):
        return found[2], True
    return None


def merge(parts: list[UsageHour]) -> UsageHour:
    """The parts of one gateway's hour, summed into what its whole-hour file would hold."""
    traffic: dict[tuple[str, str, str], list] = {}
    versions: dict[tuple[str, str], VersionRecord] = {}
    for part in parts:
        for t in part.traffic:
            c = traffic.setdefault((t.tenant, t.model, t.version), [0, 0, 0.0, 0])
            c[0], c[1], c[2], c[3] = c[0] + t.requests, c[1] + t.rows, c[2] + t.upstream_s, c[3] + t.tokens
        for v in part.versions:
            before = versions.get((v.model, v.version))
            minutes = v.replica_s_by_minute
            if before is not None and before.replica_s_by_minute is not None:
                minutes = (
                    before.replica_s_by_minute
                    if minutes is None
                    else [a + b for a, b in zip(before.replica_s_by_minute, minutes, strict=True)]
                )
            price = v.price if v.price.known or before is None else before.price
            versions[v.model, v.version] = v.model_copy(update={"replica_s_by_minute": minutes, "price": price})
    return UsageHour(
        hour=parts[0].hour,
        gateway=parts[0].gateway,
        traffic=[
            TrafficRecord(tenant=k[0], model=k[1], version=k[2], requests=c[0], rows=c[1], upstream_s=c[2], tokens=c[3])
            for k, c in sorted(traffic.items())
        ],
        versions=[versions[k] for k in sorted(versions)],
    )


def since(after: UsageHour, before: UsageHour | None) -> UsageHour | None:
    """What ``after`` (a gateway's whole hour now) counted beyond ``before`` (the hour as its
    parts held it); None when nothing."""
    if before is None:
        return after if (after.traffic or after.versions) else None
    was = {(t.tenant, t.model, t.version): t for t in before.traffic}
    traffic = []
    for t in after.traffic:
        b = was.get((t.tenant, t.model, t.version))
        if b is None:
            traffic.append(t)
        elif (t.requests, t.rows, t.upstream_s, t.tokens) != (b.requests, b.rows, b.upstream_s, b.tokens):
            traffic.append(
                t.model_copy(
                    update={
                        "requests": t.requests - b.requests,
                        "rows": t.rows - b.rows,
                        "upstream_s": max(0.0, t.upstream_s - b.upstream_s),
                        "tokens": t.tokens - b.tokens,
                    }
                )
            )
    vwas = {(v.model, v.version): v for v in before.versions}
    versions = []
    for v in after.versions:
        b = vwas.get((v.model, v.version))
        if b is None:
            versions.append(v)
        elif v != b:
            minutes = v.replica_s_by_minute
            if minutes is not None and b.replica_s_by_minute is not None:
                minutes = [max(0.0, x - y) for x, y in zip(minutes, b.replica_s_by_minute, strict=True)]
            versions.append(v.model_copy(update={"replica_s_by_minute": minutes}))
    if not traffic and not versions:
        return None
    return after.model_copy(update={"traffic": traffic, "versions": versions})


def hour_start(ts: float) -> int:
    """The start (unix seconds) of the UTC hour that holds ``ts``."""
    return int(ts // HOUR_S) * HOUR_S


def utc(ts: float) -> datetime:
    return datetime.fromtimestamp(ts, UTC)
