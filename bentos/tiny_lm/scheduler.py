"""Iteration-level (continuous) batching: which sequences run at the next model step.

Pure and synchronous: ``Scheduler`` holds the waiting and running sequences and decides,
once per step, which leave the running batch (finished, cancelled, past their deadline) and
which join it. The engine (``engine.py``) does what the plan says with the model's KV cache
and reports back what it sampled; nothing here touches a tensor, a thread or a clock of its
own, so every decision is tested step by step (``tests/test_tiny_lm_engine.py``).

Admission is conservative, as in vLLM's first scheduler without preemption: a sequence
joins only if the KV cache can hold its prompt plus all the tokens it may generate
(``max_tokens``), so a running sequence is never evicted to make room. The budget is in
token positions (``kv_budget``); the cache's bytes follow from the model (layers × 2 ×
heads × head size × dtype). Within that, at most ``max_running`` sequences run and at most
``max_prefill`` prompt tokens are prefilled in one step, so a burst of long prompts does not
stall the sequences already generating (their time per output token).

Order: interactive before batch, then first come first served. A batch sequence that has
waited ``aging_s`` counts as interactive, so it cannot starve. Waiting is bounded
(``max_waiting``): past it ``submit`` raises ``QueueFull`` (the service answers 503, which
the gateway treats as shedding: nothing was computed).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

PRIORITIES = ("interactive", "batch")

# What a request asks (Params) and hears (Event), for every engine. Here, beside the scheduler,
# rather than in engine.py: this module imports no torch, so the service can import them in
# BentoML's server process, which never serves a request (torch is the worker's alone).


@dataclass(frozen=True)
class Params:
    max_tokens: int = 16
    min_tokens: int = 0  # end-of-sequence is not sampled before this many tokens (vLLM's min_tokens)
    temperature: float = 0.0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int | None = None
    priority: str = "interactive"
    timeout_s: float | None = None  # the whole answer; the engine drops the sequence after it


@dataclass(frozen=True)
class Event:
    """What a caller hears: ``text`` (new text, possibly empty) for each step that produced
    some, then one event with ``finish_reason`` and the counts and timings."""

    text: str
    completion_tokens: int
    finish_reason: str | None = None
    prompt_tokens: int = 0
    queue_s: float = 0.0  # submitted → joined the running batch
    ttft_s: float = 0.0  # submitted → first token
    tpot_s: float = 0.0  # mean time per output token after the first
    error: str | None = None


Sink = Callable[[Event], None]


def prompt_ids(encode: Callable[[str], list[int]], prompt: str | list[int], params: Params, context: int) -> list[int]:
    """The prompt's token ids, checked with ``params`` before anything is queued: ``ValueError``
    for no tokens or bad parameters, ``TooLong`` past the model's context (any engine)."""
    ids = encode(prompt) if isinstance(prompt, str) else list(prompt)
    if not ids:
        raise ValueError("the prompt encodes to no tokens; expected some text")
    if len(ids) + params.max_tokens > context:
        raise TooLong(
            f"the prompt ({len(ids)} tokens) plus max_tokens ({params.max_tokens}) is "
            f"{len(ids) + params.max_tokens} tokens; this model's context is {context}"
        )
    check_params(params)
    return ids


def check_params(params: Params) -> None:
    """``ValueError`` for sampling parameters no engine accepts (shared with ``vllm_engine``)."""
    if not 0.0 <= params.temperature <= 100.0 or not 0.0 < params.top_p <= 1.0:
        raise ValueError("expected 0 <= temperature <= 100 and 0 < top_p <= 1")
    if not 0 <= params.min_tokens <= params.max_tokens:
        raise ValueError(f"min_tokens is {params.min_tokens}; expected 0 to max_tokens ({params.max_tokens})")


class QueueFull(Exception):
    """More sequences wait than the scheduler holds: shed, nothing was computed."""


class TooLong(ValueError):
    """A sequence that could never fit the KV cache (prompt + max_tokens > the budget)."""


@dataclass(eq=False)
class Sequence:
    """One generation request as the scheduler sees it. ``eq=False``: identity, not value."""

    id: int
    prompt: list[int]
    max_tokens: int
    arrived: float  # the engine's clock (monotonic seconds) when it was submitted
    priority: str = "interactive"
    deadline: float | None = None  # the engine's clock after which it is dropped ("timeout")
    generated: list[int] = field(default_factory=list)
    cancelled: bool = False
    finish_reason: str | None = None  # "stop", "length", "cancelled", "timeout" once it ends
    started: float | None = None  # when it joined the running batch

    @property
    def reserve(self) -> int:
        """KV positions it may need at most: its prompt and every token it may generate."""
        return len(self.prompt) + self.max_tokens

    @property
    def done(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class Plan:
    """What the engine does before the next step: drop ``leave`` from the running batch
    (and their caches), prefill ``join`` and add them to it."""

    leave: tuple[Sequence, ...]
    join: tuple[Sequence, ...]


class Scheduler:
    def __init__(
        self,
        *,
        max_running: int = 32,
        kv_budget: int = 8192,
        max_waiting: int = 256,
        max_prefill: int = 2048,
        aging_s: float = 2.0,
    ) -> None:
        if min(max_running, kv_budget, max_waiting, max_prefill) < 1:
            raise ValueError("max_running, kv_budget, max_waiting and max_prefill must be at least 1")
        self.max_running, self.kv_budget, self.max_waiting = max_running, kv_budget, max_waiting
        self.max_prefill, self.aging_s = max_prefill, aging_s
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []

    # -- what callers ask ------------------------------------------------------------------
    def submit(self, seq: Sequence) -> None:
        if seq.priority not in PRIORITIES:
            raise ValueError(f"priority {seq.priority!r}; expected one of {', '.join(PRIORITIES)}")
        if seq.max_tokens < 1:
            raise ValueError(f"max_tokens is {seq.max_tokens}; expected at least 1")
        if seq.reserve > self.kv_budget:
            raise TooLong(
                f"the prompt ({len(seq.prompt)} tokens) plus max_tokens ({seq.max_tokens}) is "
                f"{seq.reserve} tokens; this replica's KV cache holds at most {self.kv_budget} per sequence"
            )
        if len(self.waiting) >= self.max_waiting:
            raise QueueFull(
                f"{len(self.waiting)} sequences are waiting, the most this replica holds; try again shortly"
            )
        self.waiting.append(seq)

    def cancel(self, seq: Sequence) -> None:
        """The caller left: the sequence leaves at the next plan, with its cache."""
        seq.cancelled = True

    @property
    def reserved(self) -> int:
        """KV positions held for the running sequences (what ``kv_budget`` bounds)."""
        return sum(s.reserve for s in self.running)

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

    # -- once per step ------------------------------------------------------------------------
    def plan(self, now: float) -> Plan:
        """Who leaves and who joins before the next step (and the state changed to match)."""
        leave = []
        for seq in self.running:
            self._expire(seq, now)
            if seq.done:
                leave.append(seq)
        if leave:
            self.running = [s for s in self.running if not s.done]
        dropped = []
        for seq in self.waiting:
            self._expire(seq, now)
            if seq.done:
                dropped.append(seq)
        if dropped:
            self.waiting = [s for s in self.waiting if not s.done]
        join: list[Sequence] = []
        reserved, prefill = self.reserved, 0
        for seq in sorted(self.waiting, key=lambda s: (self._rank(s, now), s.arrived, s.id)):
            if len(self.running) + len(join) >= self.max_running:
                break
            if reserved + seq.reserve > self.kv_budget:
                break  # in order: a large sequence first in line is not overtaken forever by small ones
            if join and prefill + len(seq.prompt) > self.max_prefill:
                break  # the first always joins (alone if its prompt exceeds max_prefill)
            join.append(seq)
            reserved += seq.reserve
            prefill += len(seq.prompt)
        if join:
            joined = set(map(id, join))
            self.waiting = [s for s in self.waiting if id(s) not in joined]
            for seq in join:
                seq.started = now
            self.running.extend(join)
        # a sequence dropped while waiting never had a cache: it is reported as leaving too
        return Plan(leave=tuple(leave) + tuple(dropped), join=tuple(join))

    def sampled(self, seqs: Iterable[Sequence], tokens: Iterable[int], eos: Iterable[int]) -> None:
        """Record one sampled token per running sequence; an end-of-sequence token or
        ``max_tokens`` ends it (the engine sets ``"stop"`` itself when a stop string matches)."""
        ends = set(eos)
        for seq, token in zip(seqs, tokens, strict=True):
            if seq.done:
                continue
            if token in ends:
                seq.finish_reason = "stop"
                continue
            seq.generated.append(token)
            if len(seq.generated) >= seq.max_tokens:
                seq.finish_reason = "length"

    # -- helpers --------------------------------------------------------------------------------
    def _rank(self, seq: Sequence, now: float) -> int:
        if seq.priority == "interactive" or now - seq.arrived >= self.aging_s:
            return 0
        return 1

    @staticmethod
    def _expire(seq: Sequence, now: float) -> None:
        if seq.done:
            return
        if seq.cancelled:
            seq.finish_reason = "cancelled"
        elif seq.deadline is not None and now >= seq.deadline:
            seq.finish_reason = "timeout"
