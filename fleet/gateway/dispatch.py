"""Dispatch: ask the chosen version, and who is blamed when it cannot answer — one loop for
every protocol. A tensor request (``fleet.gateway.tensors``) and a generation
(``fleet.gateway.generation.stream``) differ only in their ``Exchange``: what a replica is
sent and how its answer is read; the order of versions, the hold for a cold start, the
slots, replica order and ejection, the retry of a version that sheds, the deadline and the
blame are this module's and ``Upstreams.ask``'s, the same for both.

A canary that fails (refused connection, 5xx, a broken answer, no replica; for a generation
anything before its first event) is asked no more for this request: stable answers instead,
once, and the failure still counts against the canary. The other way round never happens —
a failed stable request is not sent to the canary, which would expose the canary to traffic
the split kept off it; the caller gets the stable's error. A timeout is not retried (the
deadline is spent). A lazy version still starting when its hold ends (``Starting``) is not
its failure; stable may answer a canary's request meanwhile.

Deadlines: the whole answer is due ``timeout_ms`` after the dispatch began (the hold for a
cold start counts against it). With ``first_ms`` (a generation's first token) the version's
answer is due that long after the request, not counting a cold start's hold (itself bounded
by ``max_hold_ms``), and never after the whole answer's deadline.

Blame (what canary analysis reads, ``ERROR_CLASSES``): only the version's own failures
count — ``unreachable``, ``5xx`` (a broken answer included) and ``timeout``. A timeout is the
version's only when the model's own deadline ran out (the policy's ``timeout_ms``, or its
``first_token_timeout_ms`` for a generation's first token); a caller that asked for less
(``X-Fleet-Timeout-Ms``, a gRPC deadline) and whose deadline came first gets
``CallerTimeout``: a 504 counted apart (``fleet_caller_timeouts_total``), never in the
version's error rate, its replica's health, rollout gates or experiment guardrails — else
any tenant entitled to a canary could fail it on purpose with tiny timeouts. A version
refusing the input with a 4xx (``Rejected``) is the caller's error: passed on as a 4xx and
counted in ``fleet_upstream_rejections_total``, never as the version's error. A whole answer
is counted as the version's success here; a stream's, once it ends (whoever reads it).
"""

from __future__ import annotations

import time
from typing import TypeVar

from fleet.catalog.routes.table import Choice, RouteTable
from fleet.errors import FleetError
from fleet.gateway.activate import Starting
from fleet.gateway.answers import UpstreamError
from fleet.gateway.telemetry import Telemetry
from fleet.gateway.upstream import (
    HELD_AT_LEAST_S,
    CallerTimeout,
    Exchange,
    NoReplica,
    Rejected,
    Upstreams,
    UpstreamTimeout,
)

R = TypeVar("R")


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
        exchange: Exchange[R],
        timeout_ms: float,
        priority: str,
        tenant: str = "",
        weight: float = 1.0,
        first_ms: float | None = None,
        own_ms: float | None = None,
    ) -> tuple[str, R]:
        """(the version that answered, the exchange's result), or the error the caller gets.

        ``timeout_ms``: the request's; ``own_ms``: the model's own (the policy's ``timeout_ms``;
        None: the request's is the model's). ``first_ms``: the policy's first-token deadline."""
        started = time.monotonic()
        deadline = started + timeout_ms / 1000
        own = started + max(timeout_ms, own_ms or 0.0) / 1000  # the version's own deadline, never before the request's
        second = fallback(table, choice)
        order = (choice.version,) if second is None else (choice.version, second)
        failure: FleetError | None = None
        held = 0.0  # seconds spent waiting for cold versions to start
        for i, version in enumerate(order):
            began = time.monotonic()
            try:  # a cold lazy version is held while it starts, within the request's timeout
                pool = await self.upstreams.ready(model, version, deadline, tenant)
            except Starting as exc:  # still starting: not its failure; stable may answer a canary's request
                held += time.monotonic() - began
                failure = exc
                continue
            except NoReplica as exc:  # nothing runs, or a cold version could not start
                self.telemetry.failed(model, version, "unreachable")
                failure = exc
                continue
            waited = time.monotonic() - began
            held += waited
            by = deadline if first_ms is None else min(started + held + first_ms / 1000, deadline)
            owns = own if first_ms is None else min(started + held + first_ms / 1000, own)
            try:
                result = await self.upstreams.ask(pool, exchange, by, priority, i == len(order) - 1, tenant, weight)
            except UpstreamTimeout:
                late = timeout_ms if first_ms is None else min(first_ms, timeout_ms)
                if by < owns:  # the caller's deadline came before the version's own
                    self.telemetry.caller_timeout(model, version)
                    raise CallerTimeout(
                        f"{model}:{version} did not answer within the {timeout_ms:.0f} ms this request allowed "
                        "(X-Fleet-Timeout-Ms or the call's deadline, shorter than the model's own); not counted "
                        "against the version"
                    ) from None
                self.telemetry.failed(model, version, "timeout")
                raise UpstreamTimeout(exchange.late.format(ref=f"{model}:{version}", ms=late)) from None
            except Rejected:
                self.telemetry.rejections.labels(model, version).inc()
                raise
            except UpstreamError as exc:
                self.telemetry.failed(model, version, exc.kind)
                failure = exc
                continue
            if not exchange.streams:  # a cold start's hold is the request's wait, not the version's latency
                hold = waited if waited > HELD_AT_LEAST_S else 0.0
                self.telemetry.answered(model, version, (time.monotonic() - began - hold) * 1e3, result)
            return version, result
        assert failure is not None
        raise failure
