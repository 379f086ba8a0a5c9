"""Shadow traffic: mirror a share of requests to the shadow version, off the request path.

A generation is mirrored as a ``GenShadowJob``: the same request, answered whole by the
shadow (nothing streams to anyone), its output compared with the caller's character for
character (agree: the same text).

The caller's answer is sent before anything here runs: a request only ``offer``s a job to
a queue bounded in bytes (the inputs and answers it holds, ``gateway.shadow_queue_mib``);
a job that does not fit is dropped and counted. A few worker tasks call the shadow version
with its own deadline and compare its predicted classes with the answer the caller got.
A slow or dead shadow therefore costs the caller nothing but the enqueue.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from fleet.errors import FleetError
from fleet.gateway.telemetry import Telemetry

log = logging.getLogger("fleet.gateway.shadow")

QUEUE_BYTES = 64 * 1024 * 1024
WORKERS = 8
JOB_OVERHEAD = 300  # bytes per job beyond its arrays


@dataclass(frozen=True, slots=True)
class ShadowJob:
    model: str
    version: str  # the shadow version
    served_version: str
    features: np.ndarray
    served: np.ndarray  # what the caller got
    served_ms: float
    timeout_s: float

    @property
    def nbytes(self) -> int:
        return self.features.nbytes + self.served.nbytes + JOB_OVERHEAD


@dataclass(frozen=True, slots=True)
class GenShadowJob:
    """One generation to mirror: the request as the served version got it, and its answer."""

    model: str
    version: str  # the shadow version
    served_version: str
    payload: bytes  # the service's request body (prompt or messages, settings)
    served: str  # the text the caller got
    served_ms: float  # its time to first token
    timeout_s: float

    @property
    def nbytes(self) -> int:
        return len(self.payload) + len(self.served) * (1 if self.served.isascii() else 4) + JOB_OVERHEAD


@dataclass(frozen=True, slots=True)
class Generated:
    """What the shadow answered to a GenShadowJob."""

    text: str
    ttft_ms: float
    tpot_ms: float | None
    prompt_tokens: int
    completion_tokens: int


Call = Callable[
    ..., "asyncio.Future[np.ndarray]"
]  # Upstreams.predict(model, version, features, deadline, priority, held=[])
GenerateCall = Callable[[GenShadowJob, float], "asyncio.Future[Generated]"]


class ShadowMirror:
    def __init__(
        self,
        call: Call,
        on_result: Callable[..., None],
        max_bytes: int = QUEUE_BYTES,
        generate: GenerateCall | None = None,
    ) -> None:
        """``call(model, version, features, deadline, priority)`` asks the shadow version;
        ``generate(job, deadline)`` asks it for a generation (``Generated``);
        ``on_result(job, outcome, shadow_ms, result, error_class)`` records it (outcome:
        agree, disagree, error, dropped; error_class as in ERROR_CLASSES, for errors)."""
        self._call, self._on_result, self.generate = call, on_result, generate
        self.max_bytes = max_bytes
        self.bytes = 0  # held by queued jobs
        self._queue: asyncio.Queue[ShadowJob | GenShadowJob] = asyncio.Queue()
        self._workers: list[asyncio.Task[None]] = []

    def start(self, workers: int = WORKERS) -> None:
        self._workers = [asyncio.create_task(self._work()) for _ in range(workers)]

    def offer(self, job: ShadowJob | GenShadowJob) -> bool:
        if self.bytes + job.nbytes > self.max_bytes:
            self._on_result(job, "dropped", None, None, None)
            return False
        self.bytes += job.nbytes
        self._queue.put_nowait(job)
        return True

    @property
    def depth(self) -> int:
        return self._queue.qsize()

    async def _work(self) -> None:
        while True:
            job = await self._queue.get()
            try:
                await self._mirror(job)
            finally:
                self.bytes -= job.nbytes  # counted until its call is over: it is in memory till then

    async def _mirror(self, job: ShadowJob | GenShadowJob) -> None:
        start = time.monotonic()
        try:
            if isinstance(job, GenShadowJob):
                if self.generate is None:
                    raise RuntimeError("a generation was offered to a mirror that cannot generate")
                generated = await self.generate(job, start + job.timeout_s)
                outcome = "agree" if generated.text == job.served else "disagree"
                self._on_result(job, outcome, (time.monotonic() - start) * 1e3, generated, None)
                return
            held: list[float] = []  # a cold shadow's start is not its latency
            result = await self._call(job.model, job.version, job.features, start + job.timeout_s, "batch", held=held)
            start += sum(held)
        except FleetError as exc:
            log.debug("shadow %s:%s failed: %s", job.model, job.version, exc)
            kind = getattr(exc, "kind", None)
            self._on_result(job, "error", (time.monotonic() - start) * 1e3, None, kind)
            return
        except Exception:  # a bug must not kill the worker and silently stop mirroring
            log.exception("shadow call to %s:%s crashed", job.model, job.version)
            self._on_result(job, "error", (time.monotonic() - start) * 1e3, None, None)
            return
        shadow_ms = (time.monotonic() - start) * 1e3
        agreed = result.shape == job.served.shape and bool(
            np.array_equal(result.argmax(axis=-1), job.served.argmax(axis=-1))
        )
        self._on_result(job, "agree" if agreed else "disagree", shadow_ms, result, None)

    async def close(self) -> None:
        for task in self._workers:
            task.cancel()
        for task in self._workers:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._workers = []


def record(
    telemetry: Telemetry,
    job: ShadowJob | GenShadowJob,
    outcome: str,
    shadow_ms: float | None,
    result: np.ndarray | Generated | None,
    kind: str | None,
) -> None:
    """A mirrored call's outcome into telemetry (``ShadowMirror``'s ``on_result``): the
    comparison, and the shadow version's own answer or failure as any version's are counted."""
    if isinstance(result, Generated):  # the shadow's time to first token beside the caller's
        telemetry.shadow_result(job.model, job.version, outcome, result.ttft_ms, job.served_ms)
        telemetry.generated(
            job.model,
            job.version,
            ttft_ms=result.ttft_ms,
            tpot_ms=result.tpot_ms,
            prompt_tokens=result.prompt_tokens,
            completion_tokens=result.completion_tokens,
        )
        return
    telemetry.shadow_result(job.model, job.version, outcome, shadow_ms, job.served_ms)
    if result is not None and shadow_ms is not None:
        telemetry.answered(job.model, job.version, shadow_ms, result)
    elif outcome == "error" and kind is not None:  # a refused input (no kind) is not the shadow's failure
        telemetry.failed(job.model, job.version, kind)
