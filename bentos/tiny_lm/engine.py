"""Generation with a KV cache and continuous batching, over any Hugging Face causal LM.

Why not ``transformers``' own: its continuous batching (``generate_batch``) is built for CUDA
and ran at 0.6x of one sequence at a time on this CPU, while one static batch of 16 through
``generate`` ran 12x faster — but a static batch makes every caller wait for the slowest
and lets no one join. Here the running batch changes at every step (``scheduler.py``
decides who leaves and who joins; this module does it to the tensors):

* the running batch's KV cache is one ``DynamicCache`` whose rows are the sequences,
  left-padded to a common length, with a 2-D attention mask marking real positions and
  each sequence's own position ids (so RoPE sees 0, 1, 2, ... whatever the padding);
* sequences that join are prefilled together (left-padded to their longest prompt), their
  first token sampled, and their cache concatenated to the running one (the shorter side
  padded on the left);
* sequences that leave (finished, cancelled, past their deadline) are dropped from every
  layer's keys and values (``index_select`` on the batch), and columns no remaining
  sequence uses any more are cut from the left, so the cache's length follows the longest
  live sequence, not the batch's history;
* one decode step feeds every running sequence its last token.

Sampling is per sequence: greedy at ``temperature == 0``, else temperature and nucleus
(``top_p``) with a ``torch.Generator`` of its own seeded by ``seed`` — so a seeded request
samples the same text whatever else shares its batch. Text is decoded incrementally; stop
strings end a sequence and are not returned, and text that may be the start of a stop
string, or an incomplete UTF-8 character, is held back until it is known.

``Engine.step()`` is synchronous and is what tests drive; ``start()`` runs it on a thread
of its own while there is work (torch releases the GIL in its kernels). Callers submit
from any thread and get events through the ``sink`` they pass (the service hands them to
its event loop).

The device is the model's: the service moves the model to CUDA when it serves there, and
every tensor the engine makes (ids, masks, positions, indices) is made on that device;
sampling draws on the CPU with the sequence's own generator, so a seed makes the same
draws on either device (the probabilities may differ in their last bits). On CUDA the service prefers vLLM's engine when it is
installed (``vllm_engine.py``), which offers the same interface.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import count
from typing import Any

import torch

try:  # in the repo, a package; in a Bento, files at its root
    from .scheduler import (  # noqa: F401 - re-exported: what a request asks and hears lives beside the scheduler
        Event,
        Params,
        Plan,
        QueueFull,
        Scheduler,
        Sequence,
        Sink,
        TooLong,
        check_params,
        prompt_ids,
    )
except ImportError:
    from scheduler import (  # type: ignore[no-redef]  # noqa: F401
        Event,
        Params,
        Plan,
        QueueFull,
        Scheduler,
        Sequence,
        Sink,
        TooLong,
        check_params,
        prompt_ids,
    )

REPLACEMENT = "\ufffd"  # what a tokenizer decodes half a UTF-8 character to


@dataclass(eq=False)
class _Live:
    """What the engine keeps beside the scheduler's ``Sequence``."""

    seq: Sequence
    params: Params
    sink: Sink
    generator: torch.Generator | None
    text: str = ""  # decoded so far (stop strings cut off)
    sent: int = 0  # characters of ``text`` sent
    first_token: float | None = None
    ended: bool = False


@dataclass
class _Batch:
    """The running sequences' KV cache: row i is ``seqs[i]``, left-padded."""

    seqs: list[Sequence]
    cache: Any  # DynamicCache
    mask: torch.Tensor  # [B, T] 1 where a position is real
    pos: torch.Tensor  # [B] next position id of each
    last: torch.Tensor  # [B] the token each is fed next

    @property
    def length(self) -> int:
        return int(self.mask.shape[1])


def _layers(cache: Any) -> list[Any]:  # noqa: ANN401 - a transformers Cache
    return list(cache.layers)


def _pad_left(t: torch.Tensor, dim: int, n: int) -> torch.Tensor:
    if n == 0:
        return t
    shape = list(t.shape)
    shape[dim] = n
    return torch.cat([t.new_zeros(shape), t], dim=dim)


@dataclass
class Stats:
    steps: int = 0
    prefills: int = 0
    tokens_out: int = 0
    tokens_in: int = 0
    finished: dict[str, int] = field(default_factory=dict)


class Engine:
    name = "native"  # what /engine and /metadata report (vllm_engine.VLLMEngine: "vllm")

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        scheduler: Scheduler | None = None,
        *,  # noqa: ANN401
        clock: Callable[[], float] = time.monotonic,
        step_delay_s: float = 0.0,
    ) -> None:
        """``step_delay_s``: a fault built into a version on purpose (slow tokens: every decode
        step waits this long), to rehearse a rollback; 0 otherwise. A slow first token is the
        service's (``fleet_faults.json``), per answer, so it does not stall the others."""
        self.model, self.tokenizer = model.eval(), tokenizer
        self.scheduler = scheduler or Scheduler()
        self.clock = clock
        self.step_delay_s = step_delay_s
        self.device = next(model.parameters()).device
        eos = model.generation_config.eos_token_id if model.generation_config is not None else None
        eos = eos if eos is not None else tokenizer.eos_token_id
        self.eos = frozenset([eos] if isinstance(eos, int) else (eos or []))
        self.pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.context = int(getattr(model.config, "max_position_embeddings", 0) or 2**31)
        self.stats = Stats()
        self._ids = count(1)
        self._live: dict[int, _Live] = {}
        self._batch: _Batch | None = None
        self._lock = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopping = False

    # -- callers (any thread) -------------------------------------------------------------
    def encode(self, prompt: str) -> list[int]:
        return list(self.tokenizer(prompt)["input_ids"])

    def submit(self, prompt: str | list[int], params: Params, sink: Sink) -> Sequence:
        """Queue a generation; raises ``TooLong`` (it can never fit), ``QueueFull`` (shed) or
        ``ValueError`` (bad parameters). Events go to ``sink`` from the engine's thread."""
        ids = prompt_ids(self.encode, prompt, params, self.context)
        now = self.clock()
        seq = Sequence(
            id=next(self._ids),
            prompt=ids,
            max_tokens=params.max_tokens,
            arrived=now,
            priority=params.priority,
            deadline=None if params.timeout_s is None else now + params.timeout_s,
        )
        generator = None
        if params.temperature > 0:
            generator = torch.Generator(device="cpu")
            generator.manual_seed(params.seed if params.seed is not None else secrets.randbits(63))
        with self._lock:
            self.scheduler.submit(seq)  # raises QueueFull / TooLong before anything is kept
            self._live[seq.id] = _Live(seq, params, sink, generator)
            self._lock.notify()
        return seq

    def cancel(self, seq: Sequence) -> None:
        """The caller is gone: the sequence and its cache leave at the next step."""
        with self._lock:
            self.scheduler.cancel(seq)
            self._lock.notify()

    def snapshot(self) -> dict[str, float]:
        """Gauges and counters for metrics (read from any thread; a moment's view)."""
        sched, batch = self.scheduler, self._batch
        used = int(batch.mask.sum()) if batch is not None else 0
        return {
            "running": len(sched.running),
            "waiting": len(sched.waiting),
            "kv_reserved_tokens": sched.reserved,
            "kv_used_tokens": used,
            "kv_budget_tokens": sched.kv_budget,
            "steps": self.stats.steps,
            "prefills": self.stats.prefills,
            "tokens_out": self.stats.tokens_out,
            "tokens_in": self.stats.tokens_in,
            **{f"finished_{reason}": n for reason, n in self.stats.finished.items()},
        }

    # -- the loop ----------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="generation-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        with self._lock:
            self._stopping = True
            self._lock.notify()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def _run(self) -> None:
        while True:
            with self._lock:
                while self.scheduler.idle and not self._stopping:
                    self._lock.wait()
                if self._stopping:
                    break
            try:
                self.step()
            except Exception as exc:  # noqa: BLE001 - every caller hears of it; the loop goes on
                self._fail_all(f"{type(exc).__name__}: {exc}")
        self._fail_all("the service is stopping")

    def _fail_all(self, reason: str) -> None:
        with self._lock:
            victims = [*self.scheduler.running, *self.scheduler.waiting]
            self.scheduler.running.clear()
            self.scheduler.waiting.clear()
            self._batch = None
        for seq in victims:
            seq.finish_reason = seq.finish_reason or "error"
            live = self._live.pop(seq.id, None)
            if live is not None and not live.ended:
                live.ended = True
                live.sink(Event("", len(seq.generated), "error", len(seq.prompt), error=reason))

    @torch.inference_mode()
    def step(self) -> bool:
        """One iteration: drop who leaves, prefill who joins, one decode step for all.
        False when there was nothing to do."""
        with self._lock:
            plan = self.scheduler.plan(self.clock())
        self._leave(plan)
        if plan.join:
            self._join(list(plan.join))
        batch = self._batch
        if batch is None:
            return bool(plan.leave)
        busy = [not s.done for s in batch.seqs]
        if any(busy):
            logits = self._decode(batch)
            self._sampled(batch.seqs, logits, busy)
        self.stats.steps += 1
        return True

    # -- the KV cache -------------------------------------------------------------------------
    def _leave(self, plan: Plan) -> None:
        for seq in plan.leave:
            self._end(seq)
        batch = self._batch
        if batch is None or not plan.leave:
            return
        gone = set(map(id, plan.leave))
        keep = [i for i, s in enumerate(batch.seqs) if id(s) not in gone]
        if not keep:
            self._batch = None
            return
        if len(keep) == len(batch.seqs):
            return
        index = torch.tensor(keep, device=self.device)
        mask = batch.mask.index_select(0, index)
        cut = int((mask.sum(0) > 0).nonzero()[0])  # leading columns nobody uses any more
        for layer in _layers(batch.cache):
            layer.keys = layer.keys.index_select(0, index)[:, :, cut:]
            layer.values = layer.values.index_select(0, index)[:, :, cut:]
        self._batch = _Batch(
            [batch.seqs[i] for i in keep],
            batch.cache,
            mask[:, cut:].contiguous(),
            batch.pos.index_select(0, index),
            batch.last.index_select(0, index),
        )

    def _join(self, seqs: list[Sequence]) -> None:
        from transformers import DynamicCache

        width = max(len(s.prompt) for s in seqs)
        ids = torch.full((len(seqs), width), self.pad, dtype=torch.long)
        mask = torch.zeros((len(seqs), width), dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, width - len(s.prompt) :] = torch.tensor(s.prompt)
            mask[i, width - len(s.prompt) :] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache(config=self.model.config)
        out = self.model(
            input_ids=ids, attention_mask=mask, position_ids=positions, cache=cache, use_cache=True, logits_to_keep=1
        )
        self.stats.prefills += 1
        self.stats.tokens_in += sum(len(s.prompt) for s in seqs)
        pos = mask.sum(-1)
        joined = _Batch(list(seqs), out.cache, mask, pos, torch.zeros(len(seqs), dtype=torch.long, device=self.device))
        self._sampled(seqs, out.logits[:, -1, :], [True] * len(seqs), joined)
        self._batch = joined if self._batch is None else self._merge(self._batch, joined)

    def _merge(self, a: _Batch, b: _Batch) -> _Batch:
        """One batch of both, the shorter cache padded on the left."""
        width = max(a.length, b.length)
        pa, pb = width - a.length, width - b.length
        for la, lb in zip(_layers(a.cache), _layers(b.cache), strict=True):
            la.keys = torch.cat([_pad_left(la.keys, 2, pa), _pad_left(lb.keys, 2, pb)], dim=0)
            la.values = torch.cat([_pad_left(la.values, 2, pa), _pad_left(lb.values, 2, pb)], dim=0)
        mask = torch.cat([_pad_left(a.mask, 1, pa), _pad_left(b.mask, 1, pb)], dim=0)
        return _Batch(a.seqs + b.seqs, a.cache, mask, torch.cat([a.pos, b.pos]), torch.cat([a.last, b.last]))

    def _decode(self, batch: _Batch) -> torch.Tensor:
        if self.step_delay_s:
            time.sleep(self.step_delay_s)
        batch.mask = torch.cat([batch.mask, batch.mask.new_ones((batch.mask.shape[0], 1))], dim=1)
        out = self.model(
            input_ids=batch.last[:, None],
            attention_mask=batch.mask,
            position_ids=batch.pos[:, None],
            cache=batch.cache,
            use_cache=True,
            logits_to_keep=1,
        )
        batch.cache = out.cache
        batch.pos = batch.pos + 1
        return out.logits[:, -1, :]

    # -- tokens → text → callers ------------------------------------------------------------------
    def _sampled(
        self, seqs: list[Sequence], logits: torch.Tensor, busy: list[bool], batch: _Batch | None = None
    ) -> None:
        batch = batch or self._batch
        assert batch is not None
        tokens = self._sample(seqs, logits, busy)
        batch.last = torch.tensor(tokens, dtype=torch.long, device=self.device)
        now = self.clock()
        with self._lock:
            self.scheduler.sampled(
                [s for s, b in zip(seqs, busy, strict=True) if b],
                [t for t, b in zip(tokens, busy, strict=True) if b],
                self.eos,
            )
        for seq, is_busy in zip(seqs, busy, strict=True):
            if not is_busy:
                continue
            live = self._live.get(seq.id)
            if live is None:
                continue
            if live.first_token is None:
                live.first_token = now
            self.stats.tokens_out += 1
            self._emit(live)
            if seq.done:
                self._end(seq)

    def _sample(self, seqs: list[Sequence], logits: torch.Tensor, busy: list[bool]) -> list[int]:
        early = [
            i
            for i, s in enumerate(seqs)
            if (live := self._live.get(s.id)) and len(s.generated) < live.params.min_tokens
        ]
        if early and self.eos:
            logits = logits.clone()
            rows = torch.tensor(early, device=logits.device)[:, None]
            logits[rows, torch.tensor(sorted(self.eos), device=logits.device)[None, :]] = float("-inf")
        greedy = logits.argmax(-1).tolist()
        tokens = []
        for i, seq in enumerate(seqs):
            live = self._live.get(seq.id)
            if not busy[i] or live is None or live.params.temperature == 0:
                tokens.append(greedy[i])
                continue
            p = live.params
            probs = torch.softmax(logits[i].float() / p.temperature, dim=-1).cpu()
            if p.top_p < 1.0:
                ordered, order = probs.sort(descending=True)
                keep = ordered.cumsum(0) - ordered < p.top_p  # the smallest set whose mass reaches top_p
                probs = torch.zeros_like(probs).scatter(0, order[keep], ordered[keep])
            tokens.append(int(torch.multinomial(probs, 1, generator=live.generator)))
        return tokens

    def _emit(self, live: _Live) -> None:
        seq = live.seq
        text = self.tokenizer.decode(seq.generated, skip_special_tokens=True)
        hold = 0
        for stop in live.params.stop:
            at = text.find(stop)
            if at >= 0:
                text = text[:at]
                seq.finish_reason = "stop"
        if not seq.done:
            # what may be the start of a stop string, or half a character, waits for the next token
            for stop in live.params.stop:
                for k in range(min(len(stop) - 1, len(text)), 0, -1):
                    if text.endswith(stop[:k]):
                        hold = max(hold, k)
                        break
            while hold < len(text) and text[len(text) - hold - 1 : len(text) - hold] == REPLACEMENT:
                hold += 1
        live.text = text
        upto = len(text) - hold
        if upto > live.sent:
            delta, live.sent = text[live.sent : upto], upto
            live.sink(Event(delta, len(seq.generated), prompt_tokens=len(seq.prompt)))

    def _end(self, seq: Sequence) -> None:
        live = self._live.pop(seq.id, None)
        if live is None or live.ended:
            return
        live.ended = True
        if live.sent < len(live.text) and seq.finish_reason in ("stop", "length"):
            live.sink(Event(live.text[live.sent :], len(seq.generated), prompt_tokens=len(seq.prompt)))
            live.sent = len(live.text)
        now = self.clock()
        reason = seq.finish_reason or "error"
        self.stats.finished[reason] = self.stats.finished.get(reason, 0) + 1
        n = len(seq.generated)
        ttft = (live.first_token - seq.arrived) if live.first_token is not None else 0.0
        tpot = (now - live.first_token) / (n - 1) if live.first_token is not None and n > 1 else 0.0
        queue = (seq.started - seq.arrived) if seq.started is not None else now - seq.arrived
        live.sink(Event("", n, reason, len(seq.prompt), queue, ttft, tpot))
