"""The generation engine step by step: the scheduler's decisions (pure), and the KV cache
under continuous batching (a small seeded Llama on the CPU) — sequences that join and leave
the running batch at any step get exactly the tokens they get alone, and what leaves takes
its cache with it."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from bentos.tiny_lm.engine import Engine, Event, Params
from bentos.tiny_lm.scheduler import QueueFull, Scheduler, Sequence, TooLong


# -- the scheduler, pure ----------------------------------------------------------------------------
def seq(i: int, prompt: int = 4, max_tokens: int = 4, at: float = 0.0, **kw: object) -> Sequence:
    return Sequence(id=i, prompt=list(range(prompt)), max_tokens=max_tokens, arrived=at, **kw)  # type: ignore[arg-type]


def test_admission_is_bounded_by_running_sequences_and_the_kv_budget_in_arrival_order() -> None:
    s = Scheduler(max_running=2, kv_budget=20)
    a, b, c = seq(1, 4, 4, 0.0), seq(2, 4, 4, 0.1), seq(3, 4, 4, 0.2)
    for x in (c, a, b):  # submitted out of order: arrival decides
        s.submit(x)
    plan = s.plan(1.0)
    assert plan.join == (a, b) and s.reserved == 16 and s.waiting == [c]
    b.finish_reason = "length"
    plan = s.plan(1.1)  # b leaves, c joins in the same plan: 8 + 8 <= 20
    assert plan.leave == (b,) and plan.join == (c,) and s.running == [a, c]


def test_a_large_sequence_first_in_line_is_not_overtaken_by_small_ones() -> None:
    s = Scheduler(max_running=8, kv_budget=20)
    s.submit(first := seq(1, 4, 8))
    s.plan(0.0)
    s.submit(big := seq(2, 8, 8, 0.1))  # 16 + 12 > 20: waits
    s.submit(seq(3, 1, 1, 0.2))  # would fit, but is behind big
    assert s.plan(0.3).join == ()
    first.finish_reason = "stop"
    assert s.plan(0.4).join[0] is big


def test_interactive_goes_first_and_batch_that_waited_long_enough_counts_as_interactive() -> None:
    s = Scheduler(max_running=1, kv_budget=100, aging_s=2.0)
    s.submit(old_batch := seq(1, at=0.0, priority="batch"))
    s.submit(inter := seq(2, at=0.5))
    assert s.plan(1.0).join == (inter,)
    inter.finish_reason = "stop"
    s.submit(later := seq(3, at=1.5))
    assert s.plan(2.5).join == (old_batch,)  # waited 2.5 s >= aging: first by arrival now
    assert later in s.waiting


def test_cancelled_and_timed_out_sequences_leave_running_and_waiting() -> None:
    s = Scheduler(max_running=1, kv_budget=100)
    s.submit(run := seq(1))
    s.submit(wait := seq(2, deadline=5.0))
    s.plan(0.0)
    s.cancel(run)
    plan = s.plan(1.0)
    assert plan.leave == (run,) and run.finish_reason == "cancelled" and plan.join == (wait,)
    plan = s.plan(6.0)
    assert plan.leave == (wait,) and wait.finish_reason == "timeout" and s.idle


def test_a_sequence_dropped_while_waiting_is_reported_without_ever_running() -> None:
    s = Scheduler(max_running=1, kv_budget=100)
    s.submit(run := seq(1))
    s.submit(wait := seq(2))
    s.plan(0.0)
    s.cancel(wait)
    plan = s.plan(0.1)
    assert plan.leave == (wait,) and wait.started is None and s.running == [run]


def test_end_of_sequence_stops_and_max_tokens_ends_with_length() -> None:
    s = Scheduler()
    a, b = seq(1, max_tokens=2), seq(2, max_tokens=5)
    s.sampled([a, b], [7, 9], eos=[9])
    assert a.generated == [7] and not a.done and b.finish_reason == "stop" and b.generated == []
    s.sampled([a], [8], eos=[9])
    assert a.generated == [7, 8] and a.finish_reason == "length"


def test_prefill_per_step_is_bounded_but_the_first_always_joins() -> None:
    s = Scheduler(max_running=8, kv_budget=1000, max_prefill=10)
    s.submit(long := seq(1, 30))
    s.submit(short := seq(2, 4, at=0.1))
    assert s.plan(0.2).join == (long,)  # alone: its prompt exceeds max_prefill
    assert s.plan(0.3).join == (short,)


def test_what_can_never_fit_and_a_full_queue_are_refused_at_submit() -> None:
    s = Scheduler(kv_budget=10, max_waiting=1)
    with pytest.raises(TooLong, match="holds at most 10"):
        s.submit(seq(1, 8, 4))
    s.submit(seq(2))
    with pytest.raises(QueueFull):
        s.submit(seq(3))
    assert len(s.waiting) == 1


# -- the engine over a real model -------------------------------------------------------------------
@pytest.fixture(scope="module")
def lm() -> tuple[object, object]:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(["<pad>", "<s>", "</s>", "<unk>", *"abcdefghijklmnopqrstuvwxyz >"])}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(vocab),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=96,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    return LlamaForCausalLM(config).eval(), tokenizer


TWELVE = Params(max_tokens=12)  # frozen: one shared default
PROMPTS = ["reverse abc>", "reverse hello world>", "q", "reverse xyzzyabcdefgh>", "m n o p"]


class Collected:
    def __init__(self) -> None:
        self.events: list[Event] = []
        self.done = threading.Event()

    def __call__(self, event: Event) -> None:
        self.events.append(event)
        if event.finish_reason is not None:
            self.done.set()

    @property
    def text(self) -> str:
        return "".join(e.text for e in self.events)

    @property
    def final(self) -> Event:
        assert self.done.wait(10), "no final event"
        return self.events[-1]


def run(
    lm: tuple,
    prompts: list[str],
    params: Params = TWELVE,
    *,
    scheduler: Scheduler | None = None,
    steps_between: int = 0,
) -> tuple[Engine, list[Collected]]:
    engine = Engine(*lm, scheduler or Scheduler())
    sinks = []
    for prompt in prompts:
        sinks.append(Collected())
        engine.submit(prompt, params, sinks[-1])
        for _ in range(steps_between):
            engine.step()
    while engine.step():
        pass
    return engine, sinks


def solo(lm: tuple, prompt: str, params: Params = TWELVE) -> str:
    return run(lm, [prompt], params)[1][0].text


def test_batched_and_staggered_joins_give_each_sequence_the_tokens_it_gets_alone(lm: tuple) -> None:
    alone = [solo(lm, p) for p in PROMPTS]
    model, tokenizer = lm
    ids = tokenizer(PROMPTS[1], return_tensors="pt").input_ids  # and what transformers' generate gives
    ref = model.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=2, pad_token_id=0)
    assert tokenizer.decode(ref[0, ids.shape[1] :], skip_special_tokens=True) == alone[1]
    _, together = run(lm, PROMPTS, scheduler=Scheduler(max_running=8))
    assert [s.text for s in together] == alone
    engine, staggered = run(lm, PROMPTS, scheduler=Scheduler(max_running=3), steps_between=2)
    assert [s.text for s in staggered] == alone
    assert engine.stats.prefills >= 3 and engine._batch is None and engine.snapshot()["kv_reserved_tokens"] == 0


def test_a_cancelled_sequence_leaves_the_batch_with_its_cache_and_the_others_are_unchanged(lm: tuple) -> None:
    engine = Engine(*lm, Scheduler(max_running=8))
    sinks = [Collected() for _ in PROMPTS]
    seqs = [engine.submit(p, Params(max_tokens=12), s) for p, s in zip(PROMPTS, sinks, strict=True)]
    engine.step()
    engine.step()
    assert engine._batch is not None and len(engine._batch.seqs) == 5
    longest = engine._batch.length
    engine.cancel(seqs[3])  # the longest prompt: its columns go too
    engine.step()
    assert len(engine._batch.seqs) == 4 and seqs[3] not in engine._batch.seqs
    assert engine._batch.length < longest + 1  # cut from the left, not just one more column
    assert sinks[3].final.finish_reason == "cancelled" and sinks[3].done.is_set()
    for layer in engine._batch.cache.layers:
        assert layer.keys.shape[0] == 4 and layer.keys.shape[2] == engine._batch.length
    while engine.step():
        pass
    for i in (0, 1, 2, 4):
        assert sinks[i].text == solo(lm, PROMPTS[i])


def test_stop_strings_end_the_text_before_them_and_are_never_sent_in_part(lm: tuple) -> None:
    full = solo(lm, PROMPTS[1], Params(max_tokens=20))
    assert len(full) >= 4
    stop = full[2:4]  # two characters the model will produce: sent as one event only if no stop
    _, (sink,) = run(lm, [PROMPTS[1]], Params(max_tokens=20, stop=(stop,)))
    assert sink.text == full[: full.find(stop)] and sink.final.finish_reason == "stop"
    assert all(stop not in e.text and not e.text.endswith(stop[0]) or e.finish_reason for e in sink.events[:-1])


def test_a_seeded_sample_is_the_same_alone_and_in_a_batch(lm: tuple) -> None:
    params = Params(max_tokens=10, temperature=1.0, top_p=0.9, seed=42)
    alone = solo(lm, PROMPTS[0], params)
    _, sinks = run(lm, [PROMPTS[2], PROMPTS[0], PROMPTS[4]], params, scheduler=Scheduler(max_running=8))
    assert sinks[1].text == alone
    other = solo(lm, PROMPTS[0], Params(max_tokens=10, temperature=1.0, top_p=0.9, seed=43))
    greedy = solo(lm, PROMPTS[0], Params(max_tokens=10))
    assert len({alone, other, greedy}) > 1  # sampling samples


def test_events_count_tokens_and_time_and_the_final_one_says_why(lm: tuple) -> None:
    _, (sink,) = run(lm, [PROMPTS[0]], Params(max_tokens=5))
    final = sink.final
    assert final.finish_reason in ("length", "stop") and final.prompt_tokens == len(lm[1](PROMPTS[0])["input_ids"])
    assert 1 <= final.completion_tokens <= 5 and final.ttft_s > 0 and final.queue_s >= 0
    counts = [e.completion_tokens for e in sink.events]
    assert counts == sorted(counts)


def test_the_engine_thread_serves_callers_from_other_threads_and_cancels(lm: tuple) -> None:
    engine = Engine(*lm, Scheduler(max_running=4))
    engine.start()
    try:
        sinks = [Collected() for _ in range(6)]
        seqs = [engine.submit(PROMPTS[i % len(PROMPTS)], Params(max_tokens=40), s) for i, s in enumerate(sinks)]
        engine.cancel(seqs[5])
        for s in sinks:
            assert s.done.wait(60), "a sequence never finished"
        assert sinks[5].final.finish_reason == "cancelled"
        assert all(s.final.finish_reason in ("stop", "length") for s in sinks[:5])
        # the last to finish leaves the batch at the step after its final event
        deadline = time.monotonic() + 10
        while not (engine.scheduler.idle and engine.snapshot()["kv_used_tokens"] == 0) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert engine.scheduler.idle and engine.snapshot()["kv_used_tokens"] == 0
    finally:
        engine.stop()


def test_a_prompt_past_the_context_is_refused_before_it_queues(lm: tuple) -> None:
    engine = Engine(*lm)
    with pytest.raises(TooLong, match="context is 96"):
        engine.submit("a" * 90, Params(max_tokens=10), Collected())
    assert engine.scheduler.idle


def test_min_tokens_holds_end_of_sequence_back(lm: tuple) -> None:
    engine, (free,) = run(lm, [PROMPTS[2]], Params(max_tokens=30))
    assert free.final.finish_reason == "stop" and free.final.completion_tokens < 30  # this prompt ends early alone
    _, (held,) = run(lm, [PROMPTS[2]], Params(max_tokens=30, min_tokens=30))
    assert held.final.finish_reason == "length" and held.final.completion_tokens == 30


@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device (bench/generation_gpu.py serves it there)"
)
def test_on_cuda_the_engine_keeps_its_cache_on_the_gpu_and_gives_the_cpus_tokens(lm: tuple) -> None:
    import copy

    model, tokenizer = lm
    on_gpu = (copy.deepcopy(model).to("cuda"), tokenizer)
    engine = Engine(*on_gpu, Scheduler(max_running=3))
    sinks = [Collected() for _ in PROMPTS]
    for prompt, sink in zip(PROMPTS, sinks, strict=True):
        engine.submit(prompt, Params(max_tokens=12, min_tokens=2), sink)
        engine.step()
        if engine._batch is not None:
            assert engine._batch.mask.is_cuda and engine._batch.last.is_cuda
            assert all(layer.keys.is_cuda for layer in engine._batch.cache.layers)
    while engine.step():
        pass
    held = [solo(lm, p, Params(max_tokens=12, min_tokens=2)) for p in PROMPTS]
    assert [s.text for s in sinks] == held  # staggered joins on the GPU, each alone on the CPU
