"""Contracts that cross module borders: backend protocols and the frozen data they pass.

Every pluggable backend is a Protocol here, with one module per implementation and a
factory that refuses unknown kinds.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol, runtime_checkable


@dataclass(frozen=True, slots=True)
class StoredObject:
    """Bytes read from the store with the ETag that a conditional write can match."""

    key: str
    data: bytes
    etag: str


@dataclass(frozen=True, slots=True)
class ObjectInfo:
    """One key as a listing shows it, without reading the object.

    ``token`` changes whenever the object does (S3: its ETag; file: size and mtime) but is
    not necessarily the ETag ``get`` returns: compare tokens with tokens from ``scan`` only.
    ``modified`` is when it was last written, in seconds since the epoch, on the store's clock.
    """

    key: str
    token: str
    modified: float


@runtime_checkable
class ObjectStore(Protocol):
    """A flat key → bytes store with conditional writes (the fleet's only durable state).

    Keys are ``/``-separated relative paths (``routes/demo.json``). ETags are opaque: compare
    them for equality, never parse them.
    """

    url: str

    def get(self, key: str) -> StoredObject:
        """Return the object; raise ``NotFound`` when the key does not exist."""

    def put(
        self,
        key: str,
        data: bytes,
        *,
        if_match: str | None = None,
        if_none_match: bool = False,
    ) -> str:
        """Write ``data`` and return its new ETag.

        ``if_match``: write only if the current ETag equals it (else ``PreconditionFailed``,
        also when the key is missing). ``if_none_match``: write only if the key does not
        exist yet (else ``PreconditionFailed``).
        """

    def list(self, prefix: str = "") -> Iterator[str]:
        """Yield every key starting with ``prefix``, in ascending byte order."""

    def scan(self, prefix: str = "") -> Iterator[ObjectInfo]:
        """``list`` with each key's change token and write time: one request per 1,000 keys on S3."""

    def get_if_changed(self, key: str, etag: str | None) -> StoredObject | None:
        """The object, or None when its ETag is still ``etag`` (on S3 a conditional GET: 304,
        no body); ``NotFound`` when the key does not exist."""

    def delete(self, key: str) -> None:
        """Remove the key; removing a missing key is not an error."""


@dataclass(frozen=True, slots=True)
class Deployment:
    """A model version running somewhere, reachable at one URL per replica."""

    model: str
    version: str
    endpoints: tuple[str, ...]


# -- what the gateway measured, as canary analysis reads it ---------------------------------

# Upper bounds (ms) of the latency histogram buckets, shared by the gateway's windowed stats,
# its Prometheus histograms (in seconds) and canary analysis. One open bucket (> the last
# bound) follows, so a histogram has len(LATENCY_BUCKETS_MS) + 1 counts.
LATENCY_BUCKETS_MS: tuple[float, ...] = (
    1,
    2,
    3,
    5,
    7.5,
    10,
    15,
    20,
    30,
    50,
    75,
    100,
    150,
    200,
    300,
    500,
    750,
    1000,
    2000,
    5000,
    10000,
)
N_LATENCY = len(LATENCY_BUCKETS_MS) + 1  # the finite buckets and the open one
# Bins of the predicted score (probability of the last class, or the only output) over
# [0, 1]: bin i holds scores in [i/10, (i+1)/10), the last bin includes 1.0. One rule
# (``score_bin``, and ``score_bins`` for many) for the gateway's stats, the metrics sources,
# the baseline profile, drift and retraining, so their histograms compare bin by bin.
PREDICTION_BINS = 10
# Upper bounds of the histogram of a generation's output length in tokens (``le`` as for
# latency; the open bucket follows): what the output-length gate compares, canary vs stable.
OUTPUT_TOKEN_BUCKETS: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
N_OUTPUT_TOKENS = len(OUTPUT_TOKEN_BUCKETS) + 1
_SMALL = 64  # below this many scores a Python loop beats numpy's call overhead


def output_bucket(tokens: int) -> int:
    """Index of the first ``OUTPUT_TOKEN_BUCKETS`` bound >= ``tokens``; past the last, the open one."""
    return bisect.bisect_left(OUTPUT_TOKEN_BUCKETS, tokens)


def latency_bucket(ms: float) -> int:
    """Index of the first bucket whose upper bound is >= ms; past the last bound, the open one.

    Prometheus's ``le`` rule: 10.0 → 5 (the ``le=10`` bucket), 10.1 → 6.
    """
    return bisect.bisect_left(LATENCY_BUCKETS_MS, ms)


def score_bin(score: float) -> int | None:
    """Bin of a score: i holds [i/10, (i+1)/10), 1.0 goes to the last bin; 0.35 → 3, 1.0 → 9.

    A finite score outside [0, 1] (rounding in a softmax) counts in the nearer end bin. NaN
    and ±inf are no score at all: None, never a bin (nor an exception on the request path).
    """
    if not math.isfinite(score):
        return None
    # clipped before int(): 1e308 * 10 is inf, which int() refuses
    return int(min(max(score * PREDICTION_BINS, 0.0), PREDICTION_BINS - 1))


def score_bins(scores: Sequence[float]) -> list[int]:
    """Counts per ``score_bin`` bin of many scores (NaN and ±inf are not counted).

    [0.0, 0.95, 1.0, nan] → [1, 0, 0, 0, 0, 0, 0, 0, 0, 2]. Takes a list or a 1-D array;
    numpy only from ``_SMALL`` scores up, where it pays for its call overhead.
    """
    if len(scores) < _SMALL:
        counts = [0] * PREDICTION_BINS
        for s in scores.tolist() if hasattr(scores, "tolist") else scores:
            i = score_bin(s)
            if i is not None:
                counts[i] += 1
        return counts
    import numpy as np  # only here: fleet.types is imported where numpy is not needed

    s = np.asarray(scores, dtype=np.float64)
    finite = np.isfinite(s)
    if not finite.all():
        s = s[finite]
    with np.errstate(over="ignore"):  # 1e308 * 10 is inf, clipped to the last bin like score_bin's
        idx = np.clip(s * PREDICTION_BINS, 0.0, PREDICTION_BINS - 1).astype(np.int64)
    return np.bincount(idx, minlength=PREDICTION_BINS).tolist()


# Failure classes counted against the version that failed (4xx are the caller's, not counted).
ERROR_CLASSES = ("5xx", "timeout", "unreachable")


@dataclass(frozen=True, slots=True)
class ArmWindow:
    """What one version served during one window: counters differenced over [start, end).

    ``requests`` counts every attempt on this version that was not the caller's fault
    (answered, failed with 5xx, timed out or unreachable) — a canary failure that the
    gateway retried on stable counts here as a request and an error, and once more on
    stable. ``latency_ms`` and ``predictions`` cover the answered requests only.
    """

    model: str
    version: str
    start: float  # unix seconds
    end: float
    requests: int
    errors: dict[str, int]  # ERROR_CLASSES → count
    latency_ms: tuple[int, ...]  # counts per LATENCY_BUCKETS_MS bucket + the open one
    predictions: tuple[int, ...]  # counts per PREDICTION_BINS score bin (one per output row)
    shadow_pairs: int = 0  # mirrored requests of which both answers arrived (shadow arm only)
    shadow_agreed: int = 0  # ... whose predicted classes were all the same
    # generations only (empty for tensor traffic); ``latency_ms`` is then the time to first token
    tpot_ms: tuple[int, ...] = ()  # time per output token after the first, per LATENCY_BUCKETS_MS bucket
    output_tokens: tuple[int, ...] = ()  # completion lengths per OUTPUT_TOKEN_BUCKETS bucket
    # exact-match feedback on generations, counted when the label arrives, for the version that answered
    labelled: int = 0
    matched: int = 0

    @property
    def error_count(self) -> int:
        return sum(self.errors.values())


@runtime_checkable
class MetricsSource(Protocol):
    """Where canary analysis reads what a version served: the gateways' own stats (embedded
    default) or the Prometheus HTTP API (production). ``max_window_s``: the longest window
    it can answer (the gateways keep the last 15 minutes); None: any."""

    max_window_s: int | None

    def window(self, model: str, version: str, start: float, end: float) -> ArmWindow:
        """The version's counters over [start, end) (unix seconds); zeros when it served nothing."""


class Refusal(NamedTuple):
    """Why a quota refused a request: ``rate`` (wait ``wait_s`` for the next token) or
    ``concurrency`` (too many of the tenant's requests in flight)."""

    reason: str
    wait_s: float


@runtime_checkable
class QuotaBackend(Protocol):
    """Per-tenant quotas. The gateway's default is in-process token buckets
    (``fleet.gateway.quota.buckets.TokenBuckets``); ``fleet.gateway.quota.redis.RedisQuotas`` shares
    one budget between every gateway and worker (``FLEET_REDIS_URL``)."""

    async def acquire(
        self, tenant: str, rps: float, burst: int, concurrency: int | None, lease: str, lease_s: float = 300.0
    ) -> Refusal | None:
        """Take one request's token (and with ``concurrency``, the in-flight lease ``lease``,
        which lapses after ``lease_s`` if never released): None when allowed, else why not."""

    def release(self, tenant: str, lease: str) -> None:
        """The request holding ``lease`` was answered (concurrency quotas only)."""

    async def check_tokens(self, tenant: str, per_minute: int) -> Refusal | None:
        """Whether the tenant has a token of its ``per_minute`` budget left (a generation may
        start): None when it has, else ``Refusal("tokens", seconds until it has one)``."""

    def charge_tokens(self, tenant: str, per_minute: int, n: int) -> None:
        """Spend ``n`` tokens a generation used (prompt, or completion as it streams); the
        budget may go into debt, which the next check waits out. Below 0: the unused part of
        a reservation given back."""

    async def reserve_tokens(self, tenant: str, per_minute: int, n: int) -> Refusal | None:
        """``check_tokens`` and, if a token is there, spend ``n`` (a generation's
        ``max_tokens``) in the same step: concurrent generations cannot all start on the
        budget's last token. What it does not use is given back (``charge_tokens(-k)``)."""

    def health(self) -> dict[str, Any]:
        """What ``/v2/health/ready`` shows: the backend, whether the budget is shared now."""

    @property
    def degraded(self) -> bool:
        """A shared budget is away (Redis down): this process enforces its local share in its
        place, so how many gateways share a quota matters now. Never for an in-process backend."""

    async def close(self) -> None:
        """Give back what is owed (leases of requests just answered), then disconnect."""
