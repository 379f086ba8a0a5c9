"""Metrics from the gateways themselves: ``GET /admin/stats/{model}?window_s=N`` on every
live gateway (``fleet.catalog.gateway_directory.live``), summed into one ArmWindow per version.

The endpoint answers "the last N seconds", so this source serves windows that end (about)
now — which is what a rollout asks for at each tick. ``window(model, version, start, end)``
asks for ``window_s = ceil(end - start)`` and refuses an ``end`` more than ``END_SLACK_S``
away from the clock, and windows longer than the gateways keep (``MAX_WINDOW_S``), rather
than answer for a different range than the one asked. The returned ArmWindow carries the
range the gateways actually covered (whole seconds, the current one included).

Every live gateway must answer: a sum that left one out would understate the canary's
failures, so one unreachable gateway makes the whole read ``MetricsUnavailable`` — and so
does one whose announced URL is not trusted (``fleet.catalog.gateway_directory``: loopback or
``FLEET_GATEWAY_NETWORKS``). Each is asked with a scoped credential for ``stats`` on that
gateway, never with the admin token itself.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import quote

import httpx
from pydantic import BaseModel, ConfigDict, Field, NonNegativeInt, ValidationError, model_validator

from fleet.analysis.sources._common import BadMetricsAnswer, MetricsUnavailable, sum_windows
from fleet.catalog import gateway_directory
from fleet.errors import ConfigError, InvalidInput
from fleet.types import (
    ERROR_CLASSES,
    LATENCY_BUCKETS_MS,
    N_LATENCY,
    N_OUTPUT_TOKENS,
    PREDICTION_BINS,
    ArmWindow,
    ObjectStore,
)

MAX_WINDOW_S = 900  # the gateways keep one-second slots for the last 15 minutes
END_SLACK_S = 5.0


class _VersionStats(BaseModel):
    model_config = ConfigDict(frozen=True, extra="ignore")

    requests: int = Field(ge=0)
    errors: dict[str, NonNegativeInt]
    latency_ms: list[NonNegativeInt] = Field(min_length=N_LATENCY, max_length=N_LATENCY)
    predictions: list[NonNegativeInt] = Field(min_length=PREDICTION_BINS, max_length=PREDICTION_BINS)
    shadow_pairs: int = Field(0, ge=0)
    shadow_agreed: int = Field(0, ge=0)
    # generations only: absent from tensor traffic and from gateways before they existed
    tpot_ms: list[NonNegativeInt] = Field(default_factory=list, max_length=N_LATENCY)
    output_tokens: list[NonNegativeInt] = Field(default_factory=list, max_length=N_OUTPUT_TOKENS)
    labelled: int = Field(0, ge=0)  # exact-match feedback on generations
    matched: int = Field(0, ge=0)

    @model_validator(mode="after")
    def _whole_histograms(self) -> _VersionStats:
        if (
            self.tpot_ms
            and len(self.tpot_ms) != N_LATENCY
            or self.output_tokens
            and len(self.output_tokens) != N_OUTPUT_TOKENS
        ):
            raise ValueError(f"tpot_ms and output_tokens have {N_LATENCY} and {N_OUTPUT_TOKENS} buckets, or none")
        if self.matched > self.labelled:
            raise ValueError(f"matched {self.matched} is above labelled {self.labelled}")
        return self


class _Stats(BaseModel):
    model_config = ConfigDict(frozen=True, extra="ignore")

    model: str
    gateway: str
    start: float
    end: float
    latency_buckets_ms: list[float]
    prediction_bins: int
    versions: dict[str, _VersionStats]


class GatewayMetrics:
    max_window_s: int | None = MAX_WINDOW_S

    def __init__(
        self, store: ObjectStore, admin_token: str, *, timeout_s: float = 5.0, clock: Callable[[], float] = time.time
    ) -> None:
        self.store = store
        self._token = admin_token
        self._timeout = httpx.Timeout(timeout_s)
        self._clock = clock

    def window(self, model: str, version: str, start: float, end: float) -> ArmWindow:
        now = self._clock()
        if abs(end - now) > END_SLACK_S:
            raise InvalidInput(
                f"gateway stats cover windows ending now; asked for one ending at {end:.1f}, "
                f"{now - end:+.1f} s from now (use FLEET_METRICS=prometheus for past windows)"
            )
        # the gateways count whole seconds back from the current one: cover start's second too
        window_s = max(1, math.floor(end) - math.floor(start) + 1)
        if window_s > MAX_WINDOW_S:
            raise InvalidInput(f"window of {window_s} s; gateways keep at most the last {MAX_WINDOW_S} s")
        live = gateway_directory.live(self.store)
        if not live:
            raise MetricsUnavailable(
                f"no live gateway registered in {self.store.url} (gateways/*.json with a recent heartbeat)"
            )
        networks = gateway_directory.trusted_networks()
        for g in live:
            if not gateway_directory.trusted(g, networks):
                raise MetricsUnavailable(
                    f"gateway {g.id} announces {g.url}, which is not on loopback or in "
                    "FLEET_GATEWAY_NETWORKS; its stats are not read (nor summed without it)"
                )
        with httpx.Client(timeout=self._timeout) as client:
            with ThreadPoolExecutor(max_workers=min(16, len(live))) as pool:
                answers = list(pool.map(lambda g: self._read(client, g, model, window_s), live))
        parts = [_arm(a, model, version) for a in answers]
        return sum_windows(parts, model, version, start, end)

    def _read(self, client: httpx.Client, record: gateway_directory.GatewayRecord, model: str, window_s: int) -> _Stats:
        url = f"{record.url.rstrip('/')}/admin/stats/{quote(model, safe='')}"
        try:
            r = client.get(
                url,
                params={"window_s": window_s},
                headers={"Authorization": gateway_directory.credential(self._token, "stats", record.id)},
            )
        except httpx.HTTPError as exc:
            raise MetricsUnavailable(f"gateway at {url} could not be reached: {exc}") from None
        if r.status_code in (401, 403):
            raise ConfigError(f"gateway at {url} refused the admin token ({r.status_code}); check FLEET_ADMIN_TOKEN")
        if r.status_code >= 500:
            raise MetricsUnavailable(f"gateway at {url} answered {r.status_code}: {r.text[:200]}")
        if r.status_code != 200:
            raise BadMetricsAnswer(f"gateway at {url} answered {r.status_code}: {r.text[:200]}")
        try:
            stats = _Stats.model_validate_json(r.content)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            raise BadMetricsAnswer(f"gateway at {url}: stats JSON invalid at {where}: {first['msg']}") from None
        _check_layout(stats, url, model)
        return stats


def _check_layout(stats: _Stats, url: str, model: str) -> None:
    """Counts can only be added when every gateway bins like this code does."""
    if stats.model != model:
        raise BadMetricsAnswer(f"gateway at {url} answered for model {stats.model!r}, asked for {model!r}")
    if tuple(stats.latency_buckets_ms) != tuple(float(b) for b in LATENCY_BUCKETS_MS):
        raise BadMetricsAnswer(
            f"gateway at {url} uses latency buckets {stats.latency_buckets_ms}; expected {list(LATENCY_BUCKETS_MS)}"
        )
    if stats.prediction_bins != PREDICTION_BINS:
        raise BadMetricsAnswer(
            f"gateway at {url} uses {stats.prediction_bins} prediction bins; expected {PREDICTION_BINS}"
        )
    for version, v in stats.versions.items():
        unknown = set(v.errors) - set(ERROR_CLASSES)
        if unknown:
            expected = ", ".join(ERROR_CLASSES)
            raise BadMetricsAnswer(
                f"gateway at {url}: {version} has error classes {sorted(unknown)}; expected {expected}"
            )


def _arm(stats: _Stats, model: str, version: str) -> ArmWindow:
    v = stats.versions.get(version)
    if v is None:  # served nothing in this window on this gateway: zeros over its range
        v = _VersionStats(requests=0, errors={}, latency_ms=[0] * N_LATENCY, predictions=[0] * PREDICTION_BINS)
    return ArmWindow(
        model=model,
        version=version,
        start=stats.start,
        end=stats.end,
        requests=v.requests,
        errors={c: v.errors.get(c, 0) for c in ERROR_CLASSES},
        latency_ms=tuple(v.latency_ms),
        predictions=tuple(v.predictions),
        shadow_pairs=v.shadow_pairs,
        shadow_agreed=v.shadow_agreed,
        tpot_ms=tuple(v.tpot_ms),
        output_tokens=tuple(v.output_tokens),
        labelled=v.labelled,
        matched=v.matched,
    )
