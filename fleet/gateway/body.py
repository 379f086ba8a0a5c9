"""Request bodies: read within a byte budget, decoded off the event loop when they are large.

``read`` streams a body into memory and stops at the budget (413), before the whole of an
oversized body has been received when its ``Content-Length`` already says so.

``Decoder`` runs a pure decode function (``fleet.gateway.protocol``) on the bytes: inline
when the body is small (a process hop costs more than decoding a few KiB), otherwise in a
worker process. Decoding a few MiB of JSON numbers holds a CPU for tens of milliseconds
and, in a thread, the GIL with it, so a thread would still stall every other request;
a process leaves the event loop only the copying. At most ``per_tenant`` large bodies of
one tenant are decoded or waiting at a time and at most ``max_waiting`` in all; past
that a request is refused at once (429 for the tenant's share, 503 for the gateway's),
so one tenant's flood of large bodies waits in its own line, never in everyone's.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import multiprocessing
import os
from collections.abc import Callable
from typing import TypeVar

from starlette.requests import Request

from fleet.errors import FleetError

log = logging.getLogger("fleet.gateway.body")

INLINE_BYTES = 64 * 1024  # bodies up to this size are decoded on the event loop
PER_TENANT = 2
MAX_WAITING = 32

T = TypeVar("T")


class BodyTooLarge(FleetError):
    status = 413


class DecodeBusy(FleetError):
    """Too many large bodies being decoded: a tenant's share (429) or the gateway's (503)."""

    status = 503

    def __init__(self, message: str, status: int, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.status, self.retry_after_s = status, retry_after_s


async def read(request: Request, limit: int) -> bytes:
    """The whole body, or ``BodyTooLarge`` as soon as it is known to exceed ``limit`` bytes."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise BodyTooLarge(f"request body of {declared} bytes is over the limit of {limit} bytes")
    body = bytearray()
    async for chunk in request.stream():
        if len(body) + len(chunk) > limit:
            raise BodyTooLarge(f"request body is over the limit of {limit} bytes")
        body += chunk
    return bytes(body)


def _worker_init() -> None:
    # the worker only decodes; an interrupt meant for the gateway (Ctrl-C) must not kill it mid-call
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)


class Decoder:
    """Runs ``decode(body, *args)`` inline or in a worker process, fairly across tenants."""

    def __init__(self, workers: int | None = None, *, inline_bytes: int = INLINE_BYTES, per_tenant: int = PER_TENANT,
                 max_waiting: int = MAX_WAITING) -> None:  # fmt: skip
        self.workers = workers if workers is not None else max(1, min(4, (os.cpu_count() or 2) - 1))
        self.inline_bytes, self.per_tenant, self.max_waiting = inline_bytes, per_tenant, max_waiting
        self._pool: concurrent.futures.ProcessPoolExecutor | None = None
        self._busy: dict[str, int] = {}  # tenant → large bodies decoding or waiting
        self._total = 0

    def start(self) -> None:
        """Start the worker processes (spawned: forking a running event loop with threads is unsafe)."""
        if self.workers > 0 and self._pool is None:
            ctx = multiprocessing.get_context("spawn")
            self._pool = concurrent.futures.ProcessPoolExecutor(self.workers, mp_context=ctx, initializer=_worker_init)
            for _ in range(self.workers):  # pay the workers' imports now, not on the first large request
                self._pool.submit(_warm)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

    @property
    def in_flight(self) -> int:
        return self._total

    async def run(self, tenant: str, decode: Callable[..., T], body: bytes, *args: object) -> T:
        if len(body) <= self.inline_bytes or self._pool is None:
            return decode(body, *args)
        if self._busy.get(tenant, 0) >= self.per_tenant:
            raise DecodeBusy(f"tenant {tenant!r} already has {self.per_tenant} large requests being decoded; "
                             "send large batches one after another", 429)  # fmt: skip
        if self._total >= self.max_waiting:
            raise DecodeBusy(f"the gateway is decoding {self._total} large requests (its limit); retry later", 503)
        self._busy[tenant] = self._busy.get(tenant, 0) + 1
        self._total += 1
        try:
            future = self._pool.submit(decode, body, *args)
            return await asyncio.wrap_future(future)
        except concurrent.futures.process.BrokenProcessPool:
            log.error("a decode worker died; starting new ones")
            self._pool = None
            self.start()
            raise DecodeBusy("the gateway's decode worker restarted; retry the request", 503) from None
        finally:
            self._total -= 1
            left = self._busy[tenant] - 1
            if left:
                self._busy[tenant] = left
            else:
                del self._busy[tenant]


def _warm() -> None:
    import fleet.gateway.protocol  # noqa: F401 - imports numpy and orjson in the worker
