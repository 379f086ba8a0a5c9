"""vLLM's engine behind the native engine's interface, for replicas on CUDA.

``VLLMEngine`` offers what ``service.py`` uses of ``engine.Engine``: ``submit(prompt, params,
sink) -> Sequence`` (raising ``TooLong``, ``QueueFull`` or ``ValueError`` before anything
runs), ``cancel(seq)``, ``snapshot()`` for ``/engine``, ``start()`` / ``stop()``,
``tokenizer`` and ``name``; and the same events (``engine.Event``): text as it is generated,
then one final event with the finish reason (``stop``, ``length``, ``cancelled``,
``timeout``, ``error``), the token counts and the timings. Underneath runs vLLM's
``AsyncLLM`` (the v1 engine: paged KV cache, continuous batching with preemption, CUDA
graphs) on an event loop of its own thread, so callers submit from any thread and hear
through their sink, as with the native engine.

Which engine a replica runs is ``engine_choice.choose_engine``'s; the arguments vLLM gets
are ``vllm_args``'s. vLLM is imported only by ``start()`` (and by
``engine_choice.try_import_vllm``): its wheel is CUDA-only, so it is declared for the GPU
image alone (``GPU_PACKAGES`` in ``__init__.py``, which ``fleet package`` adds for a policy
with ``resources.gpu > 0``) and is never in the project's lock.

Ours → vLLM's, in the adapter:

* ``Params`` → ``SamplingParams`` (``vllm_args.sampling_kwargs``): vLLM holds back text that
  may start a stop string, as ours does. Output comes as
  deltas (``RequestOutputKind.DELTA``). ``priority``: interactive 0, batch 1 under
  ``scheduling_policy="priority"`` — without the native scheduler's aging, so under
  sustained interactive load a batch request waits. ``timeout_s``: the request is aborted
  at its deadline (``timeout``); a caller that leaves aborts it (``cancelled``). The prompt
  goes in as token ids from the version's own tokenizer, so ``prompt_tokens`` is what the
  native engine counts; an end-of-sequence token is not counted in ``completion_tokens``.
* ``snapshot()``: running (has produced a token), waiting, KV positions those hold
  (prompt + generated: vLLM's blocks round it up), the cache's capacity in positions
  (blocks × block size), tokens in and out, finishes by reason. vLLM's own step counts and
  cache use are in its logs.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from itertools import count
from typing import Any

try:  # in the repo, a package; in a Bento, files at its root
    from .scheduler import Event, Params, QueueFull, Sequence, Sink, prompt_ids
    from .vllm_args import sampling_kwargs
except ImportError:
    from scheduler import Event, Params, QueueFull, Sequence, Sink, prompt_ids  # type: ignore[no-redef]
    from vllm_args import sampling_kwargs  # type: ignore[no-redef]

PRIORITY = {"interactive": 0, "batch": 1}  # vLLM: lower goes first
START_TIMEOUT_S = 900.0  # loading, profiling memory, compiling and capturing CUDA graphs


def _vllm_factories(args: Mapping[str, Any]) -> tuple[Callable[[], Any], Callable[[dict], Any]]:
    """The real thing: an ``AsyncLLM`` from the engine arguments, and ``SamplingParams`` that
    stream deltas. Imported here, never at module import."""
    from vllm import AsyncEngineArgs, SamplingParams
    from vllm.sampling_params import RequestOutputKind

    try:
        from vllm.v1.engine.async_llm import AsyncLLM
    except ImportError:  # an older layout: AsyncLLMEngine is the same client
        from vllm import AsyncLLMEngine as AsyncLLM  # type: ignore[no-redef]

    def llm() -> Any:  # noqa: ANN401
        return AsyncLLM.from_engine_args(AsyncEngineArgs(**args))

    def sampling(kwargs: dict) -> Any:  # noqa: ANN401
        return SamplingParams(**kwargs, output_kind=RequestOutputKind.DELTA)

    return llm, sampling


# -- the adapter ---------------------------------------------------------------------------------------
@dataclass(eq=False)
class _Request:
    seq: Sequence
    params: Params
    sink: Sink
    request_id: str
    task: asyncio.Task | None = None
    timer: asyncio.TimerHandle | None = None
    first_token: float | None = None
    queue_s: float | None = None
    ended: bool = False


@dataclass
class Stats:
    tokens_out: int = 0
    tokens_in: int = 0
    finished: dict[str, int] = field(default_factory=dict)


class VLLMEngine:
    """``engine.Engine``'s interface over vLLM's ``AsyncLLM``.

    ``llm_factory`` / ``sampling_factory``: what builds the ``AsyncLLM`` and a
    ``SamplingParams`` from ``sampling_kwargs``; by default vLLM's own (tests pass fakes)."""

    name = "vllm"

    def __init__(
        self,
        tokenizer: Any,
        args: Mapping[str, Any],
        *,
        max_waiting: int = 256,  # noqa: ANN401
        eos: Iterable[int] | None = None,
        clock: Callable[[], float] = time.monotonic,
        llm_factory: Callable[[], Any] | None = None,
        sampling_factory: Callable[[dict], Any] | None = None,
        start_timeout_s: float = START_TIMEOUT_S,
    ) -> None:
        self.tokenizer = tokenizer
        self.args = dict(args)
        self.context = int(self.args["max_model_len"])
        self.max_running = int(self.args.get("max_num_seqs", 32))
        self.max_waiting = max_waiting
        ids = [tokenizer.eos_token_id] if eos is None else list(eos)
        self.eos = frozenset(i for i in ids if i is not None)
        self.clock = clock
        self.start_timeout_s = start_timeout_s
        self._llm_factory, self._sampling_factory = llm_factory, sampling_factory
        self.stats = Stats()
        self._ids = count(1)
        self._live: dict[int, _Request] = {}
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._llm: Any = None
        self._stopping = False

    # -- life ---------------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the event loop's thread and vLLM on it; returns once vLLM is ready (or raises)."""
        if self._llm_factory is None or self._sampling_factory is None:
            llm, sampling = _vllm_factories(self.args)
            self._llm_factory = self._llm_factory or llm
            self._sampling_factory = self._sampling_factory or sampling
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="vllm-engine", daemon=True)
        self._thread.start()
        factory = self._llm_factory

        async def create() -> Any:  # noqa: ANN401 - on the loop: vLLM's output handler runs there
            return factory()

        try:
            self._llm = asyncio.run_coroutine_threadsafe(create(), self._loop).result(timeout=self.start_timeout_s)
        except BaseException:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
            self._loop = None
            raise

    def stop(self) -> None:
        """Every sequence still in flight ends with ``error`` ("the service is stopping"); vLLM shuts down."""
        loop = self._loop
        if loop is None:
            return
        self._stopping = True

        async def shutdown() -> None:
            with self._lock:
                live = list(self._live.values())
            for req in live:
                self._abort(req, "error")
            tasks = [r.task for r in live if r.task is not None]
            if tasks:
                await asyncio.wait(tasks, timeout=10)
            with contextlib.suppress(Exception):
                if self._llm is not None and hasattr(self._llm, "shutdown"):
                    self._llm.shutdown()

        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(shutdown(), loop).result(timeout=30)
        loop.call_soon_threadsafe(loop.stop)
        if self._thread is not None:
            self._thread.join(timeout=10)
        self._loop = None

    # -- callers (any thread) --------------------------------------------------------------------------
    def encode(self, prompt: str) -> list[int]:
        return list(self.tokenizer(prompt)["input_ids"])

    def submit(self, prompt: str | list[int], params: Params, sink: Sink) -> Sequence:
        """As ``Engine.submit``: raises ``TooLong``, ``QueueFull`` or ``ValueError`` before
        anything is queued; events go to ``sink`` from the engine's thread."""
        loop = self._loop
        if loop is None or self._llm is None or self._sampling_factory is None:
            raise RuntimeError("the vLLM engine is not started")
        ids = prompt_ids(self.encode, prompt, params, self.context)
        sampling = self._sampling_factory(sampling_kwargs(params))
        now = self.clock()
        seq = Sequence(
            id=next(self._ids),
            prompt=ids,
            max_tokens=params.max_tokens,
            arrived=now,
            priority=params.priority,
            deadline=None if params.timeout_s is None else now + params.timeout_s,
        )
        req = _Request(seq, params, sink, f"fleet-{seq.id}-{secrets.token_hex(4)}")
        with self._lock:
            if len(self._live) >= self.max_running + self.max_waiting:
                raise QueueFull(
                    f"{len(self._live)} sequences are in flight; this replica holds at most "
                    f"max_running + max_waiting = {self.max_running + self.max_waiting}"
                )
            self._live[seq.id] = req
            self.stats.tokens_in += len(ids)
        asyncio.run_coroutine_threadsafe(self._drive(req, sampling), loop)
        return seq

    def cancel(self, seq: Sequence) -> None:
        """The caller is gone: vLLM aborts the request (its KV blocks are freed)."""
        with self._lock:
            req = self._live.get(seq.id)
        if req is None or self._loop is None:
            return
        seq.cancelled = True
        self._loop.call_soon_threadsafe(self._abort, req, "cancelled")

    def snapshot(self) -> dict[str, float]:
        """Gauges and counters for metrics (read from any thread; a moment's view)."""
        with self._lock:
            live = list(self._live.values())
        running = [r.seq for r in live if r.first_token is not None]
        config = getattr(getattr(self._llm, "vllm_config", None), "cache_config", None)
        blocks, block_size = getattr(config, "num_gpu_blocks", None), getattr(config, "block_size", None)
        return {
            "running": len(running),
            "waiting": len(live) - len(running),
            "kv_reserved_tokens": sum(s.reserve for s in running),
            "kv_used_tokens": sum(len(s.prompt) + len(s.generated) for s in running),
            "kv_budget_tokens": int(blocks * block_size) if blocks and block_size else 0,
            "tokens_out": self.stats.tokens_out,
            "tokens_in": self.stats.tokens_in,
            **{f"finished_{reason}": n for reason, n in self.stats.finished.items()},
        }

    # -- on the engine's loop ------------------------------------------------------------------------------
    def _abort(self, req: _Request, reason: str) -> None:
        """End ``req`` early (``cancelled``, ``timeout``, or ``error`` when stopping)."""
        if req.ended:
            return
        if req.seq.finish_reason is None:
            req.seq.finish_reason = reason
        if req.task is not None:
            req.task.cancel()  # vLLM's generate() aborts the request as it unwinds
        # else: _drive has not started yet, and ends at once seeing the reason

    async def _drive(self, req: _Request, sampling: Any) -> None:  # noqa: ANN401
        seq = req.seq
        req.task = asyncio.current_task()
        if seq.finish_reason is not None:  # cancelled before it started
            self._finish(req, seq.finish_reason, None)
            return
        loop = asyncio.get_running_loop()
        if seq.deadline is not None:
            req.timer = loop.call_later(max(0.0, seq.deadline - self.clock()), self._abort, req, "timeout")
        reason: str | None = None
        error: str | None = None
        try:
            outputs = self._llm.generate(
                {"prompt_token_ids": list(seq.prompt)}, sampling, req.request_id, priority=PRIORITY.get(seq.priority, 0)
            )
            async for out in outputs:
                finished = self._output(req, out)
                if finished is not None:
                    reason, error = finished
        except asyncio.CancelledError:
            reason = seq.finish_reason or "error"
            if reason == "error":
                error = "the service is stopping" if self._stopping else "cancelled inside the engine"
        except Exception as exc:  # noqa: BLE001 - the caller hears of it; the engine goes on
            reason, error = "error", f"{type(exc).__name__}: {exc}"
        finally:
            if req.timer is not None:
                req.timer.cancel()
        if reason is None:  # the stream ended without a finished output
            reason, error = (
                seq.finish_reason or "error",
                None if seq.finish_reason else "vLLM's stream ended unfinished",
            )
        self._finish(req, reason, error)

    def _output(self, req: _Request, out: Any) -> tuple[str, str | None] | None:  # noqa: ANN401
        """One ``RequestOutput`` (a delta): its text to the caller. The finish reason and error
        once it is finished, else None."""
        seq = req.seq
        completion = out.outputs[0] if out.outputs else None
        if completion is not None:
            tokens = list(completion.token_ids or ())
            if tokens and req.first_token is None:
                req.first_token = self.clock()
                seq.started = req.first_token
            new = [t for t in tokens if t not in self.eos]
            seq.generated.extend(new)
            self.stats.tokens_out += len(new)
            if completion.text:
                req.sink(Event(completion.text, len(seq.generated), prompt_tokens=len(seq.prompt)))
        if not out.finished:
            return None
        metrics = getattr(out, "metrics", None)
        queued, scheduled = getattr(metrics, "queued_ts", 0.0) or 0.0, getattr(metrics, "scheduled_ts", 0.0) or 0.0
        if queued > 0 and scheduled >= queued:
            req.queue_s = scheduled - queued
        why = getattr(completion, "finish_reason", None)
        if why in ("stop", "length"):
            return why, None
        if why == "abort":
            return seq.finish_reason or "cancelled", None
        return "error", f"vLLM finished the request with {why!r}"

    def _finish(self, req: _Request, reason: str, error: str | None) -> None:
        if req.ended:
            return
        req.ended = True
        seq = req.seq
        seq.finish_reason = reason
        with self._lock:
            self._live.pop(seq.id, None)
            self.stats.finished[reason] = self.stats.finished.get(reason, 0) + 1
        now = self.clock()
        n = len(seq.generated)
        ttft = (req.first_token - seq.arrived) if req.first_token is not None else 0.0
        tpot = (now - req.first_token) / (n - 1) if req.first_token is not None and n > 1 else 0.0
        # the queue: vLLM's own timestamps (queued → first scheduled) when it reports them, else
        # the time to the first token, which bounds it
        queue = req.queue_s if req.queue_s is not None else (ttft if req.first_token is not None else now - seq.arrived)
        req.sink(Event("", n, reason, len(seq.prompt), queue, ttft, tpot, error))
