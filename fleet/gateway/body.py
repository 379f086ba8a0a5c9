"""Request bodies: read within byte budgets, decoded off the event loop when they are large.

``read`` streams a body into memory and stops at the per-request limit (413), before any of
an oversized body is read when its ``Content-Length`` already says so. ``BodyBudget`` bounds
the bytes of all bodies held at once (``gateway.inflight_body_mib``), and one tenant's
share of them (half): a body that would go past either is refused while it arrives — 429
for the tenant's share, 503 for the gateway's — instead of growing the gateway's memory
with the number of large requests in flight.

``Decoder`` runs a pure decode function (``fleet.gateway.protocol``) on the bytes: inline
when the body is small (a process hop costs more than decoding a few KiB), otherwise in a
worker process. Decoding a few MiB of JSON numbers holds a CPU for tens of milliseconds
and, in a thread, the GIL with it, so a thread would still stall every other request;
a process leaves the event loop only the copying. At most ``per_tenant`` large bodies of
one tenant are decoded or waiting at a time and at most ``max_waiting`` in all; past
that a request is refused at once (429 for the tenant's share, 503 for the gateway's),
so one tenant's flood of large bodies waits in its own line, never in everyone's. A
model's large answer (``answers.decode_answer``) is decoded in the same worker.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import multiprocessing
import os
from collections.abc import Callable, Iterator
from typing import TypeVar

import numpy as np
from starlette.requests import ClientDisconnect, Request

from fleet.errors import FleetError
from fleet.gateway.answers import decode_answer

log = logging.getLogger("fleet.gateway.body")

INLINE_BYTES = 64 * 1024  # bodies up to this size are decoded on the event loop
BODY_READ_S = 30.0  # a body must have arrived whole this long after it was first read (the default)
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


class BodyBudget:
    """Bytes of request bodies held at once: in all (``max_bytes``) and per tenant (half)."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes, self.per_tenant = max_bytes, max_bytes // 2
        self.held = 0
        self._tenants: dict[str, int] = {}

    @contextlib.contextmanager
    def holding(self, tenant: str) -> Iterator[Held]:
        """A body's reservation for as long as the request keeps its bytes."""
        held = Held(self, tenant)
        try:
            yield held
        finally:
            self.held -= held.bytes
            left = self._tenants.get(tenant, 0) - held.bytes
            if left > 0:
                self._tenants[tenant] = left
            else:
                self._tenants.pop(tenant, None)

    def _take(self, tenant: str, n: int) -> None:
        mine = self._tenants.get(tenant, 0)
        if mine + n > self.per_tenant:
            raise DecodeBusy(
                f"tenant {tenant!r} has {(mine + n) / 2**20:.1f} MiB of request bodies in flight, over its "
                f"share of {self.per_tenant / 2**20:.0f} MiB; send large batches one after another",
                429,
            )
        if self.held + n > self.max_bytes:
            raise DecodeBusy(
                f"the gateway holds {self.held / 2**20:.1f} MiB of request bodies, its budget is "
                f"{self.max_bytes / 2**20:.0f} MiB (gateway.inflight_body_mib); retry later",
                503,
            )
        self._tenants[tenant] = mine + n
        self.held += n


class Held:
    """What one request holds of the ``BodyBudget``."""

    def __init__(self, budget: BodyBudget, tenant: str) -> None:
        self.budget, self.tenant, self.bytes = budget, tenant, 0

    def add(self, n: int) -> None:
        self.budget._take(self.tenant, n)
        self.bytes += n


async def read(request: Request, limit: int, held: Held | None = None, within_s: float = BODY_READ_S) -> bytes:
    """The whole body, or ``BodyTooLarge`` as soon as it is known to exceed ``limit`` bytes;
    every chunk is counted in ``held`` (a ``BodyBudget`` reservation) before it is kept.
    ``BodyTooSlow`` (408) if it has not all arrived ``within_s`` seconds: a caller sending a
    byte at a time would otherwise hold its share of the bodies' budget for as long as it likes."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise BodyTooLarge(f"request body of {declared} bytes is over the limit of {limit} bytes")
    chunks, size = [], 0
    try:
        async with asyncio.timeout(within_s):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise BodyTooLarge(f"request body is over the limit of {limit} bytes")
                if held is not None:
                    held.add(len(chunk))
                chunks.append(chunk)
    except ClientDisconnect:  # nobody is waiting for the answer: counted as 499, not as the gateway's 500
        raise ClientGone("the client closed the connection before its body was read") from None
    except TimeoutError:
        raise BodyTooSlow(
            f"the request body did not arrive within {within_s:g} s ({size} bytes came); expected it sent "
            "at once (the gateway policy's body_read_s)"
        ) from None
    return b"".join(chunks)


class BodyTooSlow(FleetError):
    """The body did not arrive within the gateway policy's ``body_read_s``."""

    status = 408


class ClientGone(FleetError):
    """The caller went away first (nginx's 499): nobody's error, and no answer reaches anyone."""

    status = 499


def _worker_init(gateway_pid: int) -> None:
    """In each decode worker: ignore Ctrl-C (meant for the gateway, which stops the workers
    itself) and die with the gateway, however it dies — a SIGKILLed gateway must not leave
    workers behind (Linux's parent-death signal; elsewhere a thread watching the parent)."""
    import ctypes
    import signal
    import threading
    import time

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):

        def watch() -> None:
            while os.getppid() == gateway_pid:
                time.sleep(1.0)
            os._exit(0)

        threading.Thread(target=watch, daemon=True).start()
    if os.getppid() != gateway_pid:  # the gateway died before the signal was set
        os._exit(0)


class Decoder:
    """Runs ``decode(body, *args)`` inline or in a worker process, fairly across tenants."""

    def __init__(
        self,
        workers: int | None = None,
        *,
        inline_bytes: int = INLINE_BYTES,
        per_tenant: int = PER_TENANT,
        max_waiting: int = MAX_WAITING,
    ) -> None:
        self.workers = workers if workers is not None else max(1, min(4, (os.cpu_count() or 2) - 1))
        self.inline_bytes, self.per_tenant, self.max_waiting = inline_bytes, per_tenant, max_waiting
        self._pool: concurrent.futures.ProcessPoolExecutor | None = None
        self._busy: dict[str, int] = {}  # tenant → large bodies decoding or waiting
        self._total = 0

    def start(self) -> None:
        """Start the worker processes (spawned: forking a running event loop with threads is unsafe)."""
        if self.workers > 0 and self._pool is None:
            ctx = multiprocessing.get_context("spawn")
            self._pool = concurrent.futures.ProcessPoolExecutor(
                self.workers, mp_context=ctx, initializer=_worker_init, initargs=(os.getpid(),)
            )
            for _ in range(self.workers):  # pay the workers' imports now, not on the first large request
                self._pool.submit(_warm)

    def close(self) -> None:
        """Stop the workers and wait for them (a decode takes milliseconds)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    async def run(self, tenant: str, decode: Callable[..., T], body: bytes, *args: object) -> T:
        if len(body) <= self.inline_bytes or self._pool is None:
            return decode(body, *args)
        if self._busy.get(tenant, 0) >= self.per_tenant:
            raise DecodeBusy(
                f"tenant {tenant!r} already has {self.per_tenant} large requests being decoded; "
                "send large batches one after another",
                429,
            )
        if self._total >= self.max_waiting:
            raise DecodeBusy(f"the gateway is decoding {self._total} large requests (its limit); retry later", 503)
        self._busy[tenant] = self._busy.get(tenant, 0) + 1
        self._total += 1
        try:
            return await self._offload(decode, body, *args)
        finally:
            self._total -= 1
            left = self._busy[tenant] - 1
            if left:
                self._busy[tenant] = left
            else:
                del self._busy[tenant]

    async def answer(self, body: bytes, ref: str, rows: int) -> np.ndarray:
        """A model's answer decoded (``answers.decode_answer``): off the loop when it is large.

        Not limited per tenant: an answer exists only for a request that was admitted, and
        its size is bounded by the model's ``max_rows``."""
        if len(body) <= self.inline_bytes or self._pool is None:
            return decode_answer(body, ref, rows)
        return await self._offload(decode_answer, body, ref, rows)

    async def _offload(self, fn: Callable[..., T], body: bytes, *args: object) -> T:
        assert self._pool is not None
        try:
            return await asyncio.wrap_future(self._pool.submit(fn, body, *args))
        except concurrent.futures.process.BrokenProcessPool:
            log.error("a decode worker died; starting new ones")
            self._pool = None
            self.start()
            raise DecodeBusy("the gateway's decode worker restarted; retry the request", 503) from None


def _warm() -> None:
    import fleet.gateway.answers  # noqa: F401 - imports numpy and orjson in the worker
    import fleet.gateway.protocol  # noqa: F401
