"""What the gateway says of itself: liveness, readiness, server metadata, its Prometheus
metrics (every worker's, whichever worker the scrape reached: ``fleet.gateway.workers``)
and the windowed stats canary analysis reads (``/admin/stats``).

``/metrics`` names every tenant, its traffic and cost, and every version (other tenants'
pins included): it answers only a scrape with the scrape token (``FLEET_METRICS_TOKEN``, what
Prometheus holds) or the admin token; anyone else gets 401 and is counted
(``fleet_auth_failures_total{surface="metrics"}``).

Readiness is a snapshot loaded: bad records are reported, not a reason to refuse traffic for
every good model. Their keys and reasons name tenants, versions and the store: shown with
the admin token only; anyone sees how many of each kind. Likewise the text of errors from
inside (the store's, Redis's) and where the quota backend lives: with the admin token only;
anyone sees whether the store is reachable and whether quotas are shared.
"""

from __future__ import annotations

import asyncio
import hmac
import time
from collections.abc import Iterator
from typing import Any

import httpx
from starlette.requests import Request
from starlette.responses import Response

from fleet.gateway import workers
from fleet.gateway.admin import json_response
from fleet.gateway.middleware import Settings
from fleet.gateway.telemetry import Telemetry
from fleet.gateway.view import FleetView
from fleet.records import BadRecord
from fleet.types import LATENCY_BUCKETS_MS, PREDICTION_BINS, QuotaBackend

SIBLING_SCRAPE_S = 2.0  # how long /metrics waits for a sibling worker's own metrics
_EXPOSITION = "text/plain; version=0.0.4"


def quota_state(backend: QuotaBackend) -> Iterator[tuple[tuple[str, ...], float]]:
    """``fleet_quota_backend{state}``: whether the budget is shared now, and the local share's divisor."""
    health = backend.health()
    yield ("shared",), 1.0 if health["shared"] else 0.0
    yield ("share_divisor",), float(health["share_divisor"])


class Health:
    def __init__(
        self,
        view: FleetView,
        telemetry: Telemetry,
        settings: Settings,
        quotas: QuotaBackend,
        server_info: dict[str, Any],
    ) -> None:
        self.view, self.telemetry, self.settings, self.quotas = view, telemetry, settings, quotas
        self.server_info = server_info
        self.me = workers.my_index()
        self.others = [(i, u) for i, u in workers.siblings() if i != self.me]

    async def live(self, _: Request) -> Response:
        return json_response({"live": True})

    async def server_metadata(self, _: Request) -> Response:
        return json_response(self.server_info)

    def observe_store(self) -> list[BadRecord]:
        """The store's state into the gauges (stale routing state, bad records by kind); the bad records."""
        view, telemetry = self.view, self.telemetry
        telemetry.stale.set(1 if view.stale else 0)
        bad = view.bad_records
        for kind in ("RouteTable", "Tenant", "ModelVersion"):
            telemetry.bad_records.labels(kind).set(sum(b.kind == kind for b in bad))
        return bad

    def admin(self, request: Request) -> bool:
        """Whether the request carries the admin token."""
        return _bearer(request, self.settings.admin_token)

    def scraper(self, request: Request) -> bool:
        """Whether the request carries the scrape token or the admin token."""
        return _bearer(request, self.settings.metrics_token) or self.admin(request)

    async def ready(self, request: Request) -> Response:
        view = self.view
        ok = view.snapshot.loaded_at > 0
        bad = self.observe_store()
        shown: object = {kind: sum(b.kind == kind for b in bad) for kind in sorted({b.kind for b in bad})}
        error: str | None = view.last_error or None
        quotas = self.quotas.health()
        if self.admin(request):
            shown = [{"key": b.key, "kind": b.kind, "reason": b.reason} for b in bad]
        else:  # what went wrong inside names hosts, buckets and keys: the admin token's to read
            error = error and "the store could not be read (the error is shown with the admin token)"
            quotas = {k: quotas[k] for k in ("backend", "shared", "share_divisor") if k in quotas}
        return json_response(
            {
                "ready": ok,
                "routing_state": "stale" if view.stale else "current",
                "store_reachable": view.healthy,
                "last_refresh_age_s": round(time.time() - view.last_success, 3),
                "store_error": error,
                "bad_records": shown,
                "gateway": self.settings.gateway_id,
                "quotas": quotas,
                "workers": self.settings.workers,
            },
            200 if ok else 503,
        )

    async def metrics(self, request: Request) -> Response:
        if not self.scraper(request):
            self.telemetry.auth_failures.labels("metrics").inc()
            return json_response(
                {
                    "error": "GET /metrics names every tenant and version: expected the scrape token "
                    "(FLEET_METRICS_TOKEN) or the admin token as Authorization: Bearer <token>"
                },
                401,
            )
        self.observe_store()
        own = self.telemetry.exposition()
        others = self.others
        if not others or request.query_params.get("worker"):
            return Response(own, media_type=_EXPOSITION)
        # the whole gateway, whichever worker the scrape reached (fleet.gateway.workers), with the
        # token the scrape came with
        auth = {"Authorization": request.headers["authorization"]}
        try:
            async with httpx.AsyncClient(timeout=SIBLING_SCRAPE_S, headers=auth) as client:
                answers = await asyncio.gather(*(client.get(f"{u}/metrics", params={"worker": "1"}) for _, u in others))
            for a in answers:
                a.raise_for_status()
        except httpx.HTTPError as exc:
            return json_response(
                {
                    "error": f"a sibling worker did not answer its metrics ({exc}); the sum would "
                    "read as a counter reset, so none is given"
                },
                503,
            )
        merged = await asyncio.to_thread(
            workers.merge_expositions,
            [(self.me or 0, own.decode()), *((i, a.text) for (i, _), a in zip(others, answers, strict=True))],
        )
        return Response(merged, media_type=_EXPOSITION)

    def stats(self, model: str, window_s: int) -> dict[str, Any]:
        """The model's windowed stats per version, as ``/admin/stats`` answers them."""
        start, end, versions = self.telemetry.stats.window(model, window_s)
        table = self.view.snapshot.routes.get(model)
        return {
            "model": model,
            "gateway": self.settings.gateway_id,
            # the route revision this gateway serves now (-1: none): how far a route change got
            "revision": table.revision if table is not None else -1,
            "start": start,
            "end": end,
            "latency_buckets_ms": list(LATENCY_BUCKETS_MS),
            "prediction_bins": PREDICTION_BINS,
            "versions": versions,
        }


def _bearer(request: Request, token: str | None) -> bool:
    """Whether ``request`` carries ``token`` as its bearer token (never, without a token set)."""
    scheme, _, value = request.headers.get("authorization", "").partition(" ")
    return bool(token) and scheme.lower() == "bearer" and hmac.compare_digest(value.strip().encode(), token.encode())  # type: ignore[union-attr]
