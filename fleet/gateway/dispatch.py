"""Dispatch: ask the chosen version, and who is blamed when it cannot answer.

A canary that fails (refused connection, 5xx, a broken answer, no replica) is asked no
more for this request: stable answers instead, once, and the failure still counts against
the canary. The other way round never happens — a failed stable request is not sent to the
canary, which would expose the canary to traffic the split kept off it; the caller gets
the stable's error. A timeout is not retried (the deadline is spent).

Blame (what canary analysis reads, ``ERROR_CLASSES``): only the version's own failures
count — ``unreachable``, ``5xx`` (a broken answer included) and ``timeout``. A version
refusing the input with a 4xx (``Rejected``) is the caller's error: passed on as a 4xx and
counted in ``fleet_upstream_rejections_total``, never as the version's error.
"""

from __future__ import annotations

import time

import numpy as np

from fleet.catalog.routes.table import Choice, RouteTable
from fleet.errors import FleetError
from fleet.gateway.activate import Starting
from fleet.gateway.telemetry import Telemetry
from fleet.gateway.upstream import NoReplica, Rejected, UpstreamError, Upstreams, UpstreamTimeout


def fallback(table: RouteTable, choice: Choice) -> str | None:
    """The version to ask when ``choice`` fails: stable for a request the split sent to the
    canary, nothing otherwise (pins, named versions and stable itself are not retried)."""
    if choice.reason == "canary" and table.stable is not None and table.stable != choice.version:
        return table.stable
    return None


class Dispatcher:
    def __init__(self, upstreams: Upstreams, telemetry: Telemetry) -> None:
        self.upstreams, self.telemetry = upstreams, telemetry

    async def __call__(
        self,
        model: str,
        table: RouteTable,
        choice: Choice,
        features: np.ndarray,
        timeout_ms: float,
        priority: str,
        tenant: str = "",
        weight: float = 1.0,
    ) -> tuple[str, np.ndarray, float]:
        """(the version that answered, its answer, the seconds it took), or the error the caller gets."""
        deadline = time.monotonic() + timeout_ms / 1000
        second = fallback(table, choice)
        order = [choice.version] if second is None else [choice.version, second]
        failure: FleetError | None = None
        for i, version in enumerate(order):
            started = time.monotonic()
            timing: list[float] = []
            held: list[float] = []  # a cold version's start: the request's wait, not the version's latency
            try:
                result = await self.upstreams.predict(
                    model, version, features, deadline, priority, i == len(order) - 1, tenant, weight, timing, held
                )
            except UpstreamTimeout:
                self.telemetry.failed(model, version, "timeout")
                raise UpstreamTimeout(
                    f"{model}:{version} did not answer within {timeout_ms:.0f} ms "
                    "(X-Fleet-Timeout-Ms, capped by the model's timeout_ms)"
                ) from None
            except Rejected:
                self.telemetry.rejections.labels(model, version).inc()
                raise
            except UpstreamError as exc:
                self.telemetry.failed(model, version, exc.kind)
                failure = exc
                continue
            except (
                Starting
            ) as exc:  # a cold version still starting: not its failure; stable may answer a canary's request
                failure = exc
                continue
            except NoReplica as exc:  # nothing runs, or a cold version could not start
                self.telemetry.failed(model, version, "unreachable")
                failure = exc
                continue
            self.telemetry.answered(model, version, (time.monotonic() - started - sum(held)) * 1e3, result)
            return version, result, timing[0] if timing else 0.0
        assert failure is not None
        raise failure
