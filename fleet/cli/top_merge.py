"""``fleet top``'s data, pure: the gateways' ``/admin/top`` answers merged into one row per version.

Counts are summed across gateways; rates are each gateway's count over the span it covered,
summed (gateways' windows end at their own now); quantiles are read from the summed
histograms as canary analysis reads them (``fleet.analysis.histograms``); a version's share
is its requests over its model's. Replicas are the same deployments seen by every gateway:
the largest count any gateway sees, not the sum. Top tenants are each gateway's busiest,
summed: a tenant just outside one gateway's list is missing from that gateway's part, so
a merged count is a lower bound (each gateway sends twice the tenants shown).

Nothing here does I/O; ``fleet.cli.top`` reads, ``fleet.cli.top_text`` words and
``fleet.cli.top_view`` shows.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from itertools import zip_longest
from typing import Any

from fleet.analysis.histograms import histogram_quantile
from fleet.types import ERROR_CLASSES, N_LATENCY, N_OUTPUT_TOKENS


@dataclass
class Gateway:
    id: str
    url: str
    ok: bool = True
    error: str = ""  # why it was not read (unreachable, refused, untrusted)
    stale: bool = False  # answered, but serving its last good routing state (the store unreadable)
    span_s: float = 0.0  # what its counters (sheds, refusals, tokens, tenants) cover


@dataclass
class Row:
    """One version of one model, across every gateway that answered."""

    model: str
    version: str
    role: str = ""  # stable 90% / canary 10% / shadow 5% / pinned / "" (seen, no longer routed)
    requests: int = 0
    rps: float = 0.0
    errors: dict[str, int] = field(default_factory=dict)
    error_rate: float | None = None
    p50_ms: float | None = None  # a generation's: time to first token
    p99_ms: float | None = None
    generative: bool = False
    tpot_p50_ms: float | None = None
    tokens_per_s: float | None = None  # completion tokens a second, the version's throughput
    share: float | None = None  # of the model's requests in the window
    replicas: int = 0
    ejected: int = 0
    in_flight: int = 0
    queue: int = 0
    held: int = 0
    shed: int = 0  # 503s: a full queue (or no replica)
    latency_ms: list[int] = field(default_factory=lambda: [0] * N_LATENCY)
    tpot_ms: list[int] = field(default_factory=list)
    output_tokens: list[int] = field(default_factory=list)
    by_gateway: dict[str, int] = field(default_factory=dict)  # requests


@dataclass
class Model:
    model: str
    revisions: list[int] = field(default_factory=list)  # the route revision each gateway serves
    requests: int = 0
    refused: int = 0  # 429s (quota) over the counters' span
    refused_per_s: float = 0.0


@dataclass
class Tenant:
    tenant: str
    requests: int = 0
    rps: float = 0.0
    refused: int = 0


@dataclass
class Progress:
    """A rollout or experiment in progress (or just ended), as its stored record says."""

    kind: str  # rollout | experiment
    model: str
    headline: str  # one line: what, phase/status, step, weight
    evidence: str = ""  # the last verdict's summary, or the experiment's interval
    gates: list[dict[str, str]] = field(default_factory=list)
    done: bool = False


@dataclass
class FleetTop:
    at: float
    window_s: int
    gateways: list[Gateway]
    rows: list[Row]
    models: dict[str, Model]
    tenants: list[Tenant]
    tenants_refused: list[Tenant]
    tenants_active: int = 0  # at least this many (the most any one gateway saw)
    refused: int = 0
    refused_per_s: float = 0.0
    span_s: float = 0.0
    progress: list[Progress] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return _finite(asdict(self))


def _finite(value: Any) -> Any:  # noqa: ANN401 - JSON has no NaN: None instead
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def _summed(histograms: list[list[int]], n: int) -> list[int]:
    """Histograms (trailing zeros trimmed by the gateways) added bucket by bucket, ``n`` long."""
    total = [sum(c) for c in zip_longest(*histograms, fillvalue=0)][:n]
    return total + [0] * (n - len(total))


def _quantile(q: float, counts: list[int]) -> float | None:
    value = histogram_quantile(q, counts) if sum(counts) else math.nan
    return None if math.isnan(value) else value


def _role(route: dict[str, Any], version: str) -> str:
    canary, shadow = route.get("canary"), route.get("shadow")
    if canary and canary[0] == version:
        return f"canary {canary[1]:g}%"
    if route.get("stable") == version:
        return f"stable {100 - (canary[1] if canary else 0):g}%"
    if shadow and shadow[0] == version:
        return f"shadow {shadow[1]:g}%"
    return "pinned" if route.get("pins") else ""


def merge(
    answers: list[tuple[Gateway, dict[str, Any] | None]],
    *,
    at: float,
    window_s: int,
    tenants: int = 10,
    progress: list[Progress] | None = None,
) -> FleetTop:
    """One view of the fleet from each gateway's ``/admin/top`` answer (None: not read).

    At fleet size this runs over 40 answers of 1,000 versions each every second: the loop
    keeps to dict lookups and additions, and histograms are added once per row at the end."""
    rows: dict[tuple[str, str], Row] = {}
    hists: dict[tuple[str, str], tuple[list, list, list]] = {}  # latency, tpot, output tokens: every gateway's
    models: dict[str, Model] = {}
    by_tenant: dict[str, Tenant] = {}
    counted: set[tuple[str, str]] = set()  # (tenant, gateway): a tenant in both of a gateway's lists counts once
    gateways, active, refused, refused_rate, spans = [], 0, 0, 0.0, []
    for gw, answer in answers:
        gateways.append(gw)
        if answer is None:
            continue
        gw.stale = bool(answer.get("stale"))
        gw.span_s = span = float(answer.get("counters_span_s") or 0.0)
        per_s = 1 / span if span else 0.0
        spans.append(span)
        # a gateway younger than the window counted only since it started
        start = max(float(answer["start"]), float(answer.get("since", 0.0)))
        per_window_s = 1 / max(float(answer["end"]) - start, 1e-3)
        for name, m in answer["models"].items():
            model = models.get(name)
            if model is None:
                model = models[name] = Model(name)
            model.revisions.append(int(m.get("revision", -1)))
            n_refused = int(m.get("refused", 0))
            model.refused += n_refused
            model.refused_per_s += n_refused * per_s
            for version, v in m["versions"].items():
                key = (name, version)
                row = rows.get(key)
                if row is None:
                    row = rows[key] = Row(name, version)
                    hists[key] = ([], [], [])
                if not row.role:
                    row.role = _role(m, version)
                get = v.get
                n = get("requests", 0)
                row.requests += n
                row.rps += n * per_window_s
                errors = get("errors")
                if errors:
                    for cls, c in errors.items():
                        row.errors[cls] = row.errors.get(cls, 0) + c
                latency, tpot, output = hists[key]
                if n:
                    latency.append(get("latency_ms", ()))
                    row.by_gateway[gw.id] = n
                if "completion_tokens" in v:
                    row.generative = True
                    tpot.append(get("tpot_ms", ()))
                    output.append(get("output_tokens", ()))
                    row.tokens_per_s = (row.tokens_per_s or 0.0) + v["completion_tokens"] * per_s
                replicas = get("replicas", 0)
                if replicas > row.replicas:  # the same deployments every gateway sees: not summed
                    row.replicas = replicas
                row.ejected = max(row.ejected, get("ejected", 0))
                row.in_flight += get("in_flight", 0)
                row.queue += get("queue", 0)
                row.held += get("held", 0)
                row.shed += get("shed", 0)
        t = answer.get("tenants", {})
        active = max(active, int(t.get("active", 0)))
        refused += int(t.get("refused", 0))
        refused_rate += int(t.get("refused", 0)) * per_s
        for entry in t.get("top", []) + t.get("top_refused", []):
            if (entry["tenant"], gw.id) in counted:
                continue
            counted.add((entry["tenant"], gw.id))
            tenant = by_tenant.setdefault(entry["tenant"], Tenant(entry["tenant"]))
            tenant.requests += int(entry.get("requests", 0))
            tenant.rps += int(entry.get("requests", 0)) * per_s
            tenant.refused += int(entry.get("refused", 0))
    for key, row in rows.items():
        latency, tpot, output = hists[key]
        row.latency_ms = _summed(latency, N_LATENCY)
        models[row.model].requests += row.requests
        failed = sum(row.errors.get(c, 0) for c in ERROR_CLASSES)
        row.error_rate = failed / row.requests if row.requests else None
        row.p50_ms, row.p99_ms = _quantile(0.5, row.latency_ms), _quantile(0.99, row.latency_ms)
        if row.generative:
            row.tpot_ms, row.output_tokens = _summed(tpot, N_LATENCY), _summed(output, N_OUTPUT_TOKENS)
            row.tpot_p50_ms = _quantile(0.5, row.tpot_ms)
    for row in rows.values():
        total = models[row.model].requests
        row.share = row.requests / total if total else None
    listed = list(by_tenant.values())
    return FleetTop(
        at=at,
        window_s=window_s,
        gateways=gateways,
        rows=sorted(rows.values(), key=lambda r: (r.model, r.version)),
        models=models,
        tenants=sorted((t for t in listed if t.requests), key=lambda t: -t.requests)[:tenants],
        tenants_refused=sorted((t for t in listed if t.refused), key=lambda t: -t.refused)[:tenants],
        tenants_active=active,
        refused=refused,
        refused_per_s=refused_rate,
        span_s=max(spans, default=0.0),
        progress=progress or [],
    )
