"""The usage files: one gateway's cumulative counts for one UTC hour, and where each is stored.

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


def key_hour(key: str) -> str | None:
    """The hour (``YYYY-MM-DDTHH``) a usage file's key names; None for a key that names no usage file."""
    found = _KEY.fullmatch(key)
    return None if found is None else found[1]


def hour_start(ts: float) -> int:
    """The start (unix seconds) of the UTC hour that holds ``ts``."""
    return int(ts // HOUR_S) * HOUR_S


def utc(ts: float) -> datetime:
    return datetime.fromtimestamp(ts, UTC)
