"""vLLM's engine behind the native engine's interface, without vLLM (its wheel is CUDA-only and
never in the lock): which engine and device a replica takes (pure), our parameters as vLLM's
``SamplingParams`` and engine arguments (pure), and the adapter's events, cancellation,
timeouts and refusals over a fake ``AsyncLLM`` that streams deltas as vLLM's does."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field

import pytest

from bentos.tiny_lm.engine import Params
from bentos.tiny_lm.engine_choice import EngineUnavailable, choose_engine, resolve_device
from bentos.tiny_lm.scheduler import QueueFull, TooLong
from bentos.tiny_lm.vllm_args import engine_args, gpu_memory_utilization, sampling_kwargs
from bentos.tiny_lm.vllm_engine import VLLMEngine
from tests.test_tiny_lm_engine import Collected


# -- which device, which engine ------------------------------------------------------------------------
def test_the_device_is_cuda_when_there_is_one_unless_told_otherwise() -> None:
    assert resolve_device(None, cuda_available=True) == "cuda"
    assert resolve_device("auto", cuda_available=False) == "cpu"
    assert resolve_device("cpu", cuda_available=True) == "cpu"
    assert resolve_device(" CUDA ", cuda_available=True) == "cuda"
    with pytest.raises(EngineUnavailable, match="FLEET_DEVICE=cuda, but torch sees no CUDA device"):
        resolve_device("cuda", cuda_available=False)
    with pytest.raises(ValueError, match="expected one of auto, cuda, cpu"):
        resolve_device("tpu", cuda_available=True)


def _never() -> str | None:
    raise AssertionError("vllm was imported although something else ruled it out")


@pytest.mark.parametrize(
    ("requested", "device", "vllm", "quantized", "faults", "engine", "says"),
    [
        (None, "cuda", None, False, False, "vllm", "CUDA, and vllm imports"),
        ("auto", "cuda", None, False, False, "vllm", "CUDA, and vllm imports"),
        ("vllm", "cuda", None, False, False, "vllm", "FLEET_ENGINE=vllm"),
        ("auto", "cpu", _never, False, False, "native", "CUDA-only"),
        (
            "auto",
            "cuda",
            "ModuleNotFoundError: No module named 'vllm'",
            False,
            False,
            "native",
            "No module named 'vllm'",
        ),
        ("auto", "cuda", _never, True, False, "native", "int8 weights"),
        ("auto", "cuda", _never, False, True, "native", "rehearsal faults"),
        ("native", "cuda", _never, False, False, "native", "FLEET_ENGINE=native"),
        ("NATIVE", "cpu", _never, False, False, "native", "FLEET_ENGINE=native"),
    ],
)
def test_vllm_on_cuda_when_it_imports_and_the_version_needs_nothing_native(
    requested: str | None, device: str, vllm: object, quantized: bool, faults: bool, engine: str, says: str
) -> None:
    probe = vllm if callable(vllm) else (lambda: vllm)
    choice = choose_engine(requested, device=device, vllm_import=probe, quantized=quantized, faults=faults)
    assert choice.engine == engine and says in choice.reason


def test_asking_for_vllm_where_it_cannot_run_fails_saying_why() -> None:
    with pytest.raises(EngineUnavailable, match="FLEET_ENGINE=vllm, but the replica runs on cpu"):
        choose_engine("vllm", device="cpu", vllm_import=_never)
    with pytest.raises(EngineUnavailable, match="does not import .ImportError: libcudart"):
        choose_engine("vllm", device="cuda", vllm_import=lambda: "ImportError: libcudart.so.13")
    with pytest.raises(EngineUnavailable, match="int8 weights"):
        choose_engine("vllm", device="cuda", vllm_import=_never, quantized=True)
    with pytest.raises(ValueError, match="expected one of auto, vllm, native"):
        choose_engine("tensorrt", device="cuda", vllm_import=_never)


# -- ours → vLLM's ---------------------------------------------------------------------------------------
def test_params_map_to_sampling_params_field_by_field() -> None:
    params = Params(
        max_tokens=24,
        min_tokens=4,
        temperature=0.7,
        top_p=0.9,
        stop=("\n", "END"),
        seed=42,
        priority="batch",
        timeout_s=3.0,
    )
    assert sampling_kwargs(params) == {
        "n": 1,
        "max_tokens": 24,
        "min_tokens": 4,
        "temperature": 0.7,
        "top_p": 0.9,
        "stop": ["\n", "END"],
        "seed": 42,
        "skip_special_tokens": True,
        "include_stop_str_in_output": False,
    }
    greedy = sampling_kwargs(Params())
    assert (
        greedy["temperature"] == 0.0 and greedy["seed"] is None and greedy["stop"] == [] and greedy["max_tokens"] == 16
    )


def test_engine_args_follow_the_policy_placement_and_environment() -> None:
    generation = {"max_running": 48, "kv_budget_tokens": 4096, "max_waiting": 256}
    args = engine_args(
        "/models/demo-lm",
        generation=generation,
        context=64,
        env={"FLEET_TENSOR_PARALLEL": "2"},
        gpu_memory_gib=14.0,
        gpu_total_bytes=140 * 2**30,
    )
    assert args == {
        "model": "/models/demo-lm",
        "tokenizer": "/models/demo-lm",
        "load_format": "auto",  # no files named: vLLM looks
        "dtype": "bfloat16",
        "max_model_len": 64,
        "max_num_seqs": 48,
        "tensor_parallel_size": 2,
        "gpu_memory_utilization": 0.1,
        "enforce_eager": False,
        "scheduling_policy": "priority",
        "seed": 0,
        "disable_log_stats": False,
    }
    # the fetched folder's safetensors, never a pickle beside them
    files = ["config.json", "model.safetensors", "pytorch_model.bin"]
    assert engine_args("/m", generation={}, context=64, env={}, files=files)["load_format"] == "safetensors"
    env = {"FLEET_GPU_MEMORY_UTILIZATION": "0.3", "FLEET_VLLM_ENFORCE_EAGER": "1", "FLEET_VLLM_DTYPE": "float16"}
    args = engine_args("/m", generation={}, context=2048, env=env, gpu_memory_gib=14.0, gpu_total_bytes=140 * 2**30)
    assert (
        args["gpu_memory_utilization"],
        args["enforce_eager"],
        args["dtype"],
        args["tensor_parallel_size"],
        args["max_num_seqs"],
    ) == (0.3, True, "float16", 1, 32)
    with pytest.raises(ValueError, match="FLEET_TENSOR_PARALLEL is '0'"):
        engine_args("/m", generation={}, context=64, env={"FLEET_TENSOR_PARALLEL": "0"})
    with pytest.raises(ValueError, match="FLEET_TENSOR_PARALLEL is 'two'"):
        engine_args("/m", generation={}, context=64, env={"FLEET_TENSOR_PARALLEL": "two"})
    # placement sized the KV cache for 16,384 tokens: a model that could take 131,072 is held to it
    assert (
        engine_args("/m", generation={}, context=131_072, env={"FLEET_CONTEXT_TOKENS": "16384"})["max_model_len"]
        == 16_384
    )
    assert (
        engine_args("/m", generation={}, context=2048, env={"FLEET_CONTEXT_TOKENS": "16384"})["max_model_len"] == 2048
    )
    with pytest.raises(ValueError, match="FLEET_CONTEXT_TOKENS is '-5'"):
        engine_args("/m", generation={}, context=64, env={"FLEET_CONTEXT_TOKENS": "-5"})


def test_gpu_memory_share_is_bounded_and_defaults_to_vllms() -> None:
    assert gpu_memory_utilization(None, 0.0, 140 * 2**30) == 0.9  # no gpu_memory_gib in the policy
    assert gpu_memory_utilization(None, 8.0, 0) == 0.9  # the GPU's memory unknown
    assert gpu_memory_utilization(None, 0.5, 140 * 2**30) == 0.05  # too small a share to start vLLM
    assert gpu_memory_utilization(None, 500.0, 140 * 2**30) == 0.95
    with pytest.raises(ValueError, match="expected a fraction"):
        gpu_memory_utilization("1.5", 8.0, 140 * 2**30)


# -- the adapter over a fake AsyncLLM -------------------------------------------------------------------------
EOS = 2


class Tokenizer:
    """One token per character (ids from 10), a BOS of 1 first, as the family's tokenizer does."""

    eos_token_id = EOS

    def __call__(self, text: str) -> dict:
        return {"input_ids": [1, *(10 + ord(c) % 50 for c in text)]}


@dataclass
class Completion:
    text: str
    token_ids: list[int]
    finish_reason: str | None = None


@dataclass
class Metrics:
    queued_ts: float = 100.0
    scheduled_ts: float = 100.25


@dataclass
class Output:
    request_id: str
    outputs: list[Completion]
    finished: bool
    metrics: Metrics | None = None


@dataclass
class FakeLLM:
    """Streams ``chunks`` (text, tokens) as deltas ``delay`` seconds apart, then finishes with
    ``finish`` (and EOS when it is "stop"), as vLLM's ``AsyncLLM.generate`` with
    ``RequestOutputKind.DELTA``; cancelling the caller aborts the request."""

    chunks: list[str] = field(default_factory=lambda: ["ab", "c", "de"])
    finish: str = "stop"
    delay: float = 0.0
    calls: list[tuple] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)
    shut: bool = False

    async def generate(self, prompt: dict, sampling: dict, request_id: str, *, priority: int = 0):  # noqa: ANN201
        self.calls.append((prompt, sampling, request_id, priority))
        try:
            for i, chunk in enumerate(self.chunks):
                await asyncio.sleep(self.delay)
                last = i == len(self.chunks) - 1
                tokens = [20 + ord(c) % 50 for c in chunk] + ([EOS] if last and self.finish == "stop" else [])
                yield Output(
                    request_id,
                    [Completion(chunk, tokens, self.finish if last else None)],
                    last,
                    Metrics() if last else None,
                )
        except asyncio.CancelledError:
            self.aborted.append(request_id)
            raise

    def shutdown(self) -> None:
        self.shut = True


@pytest.fixture
def started() -> object:
    engines: list[VLLMEngine] = []

    def make(llm: FakeLLM, *, max_running: int = 8, max_waiting: int = 8, context: int = 64) -> VLLMEngine:
        engine = VLLMEngine(
            Tokenizer(),
            {"max_model_len": context, "max_num_seqs": max_running},
            max_waiting=max_waiting,
            llm_factory=lambda: llm,
            sampling_factory=lambda kwargs: kwargs,
        )
        engine.start()
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.stop()


def test_text_streams_as_deltas_and_the_final_event_counts_as_the_native_engine_does(started: object) -> None:
    llm = FakeLLM()
    engine = started(llm)
    sink = Collected()
    seq = engine.submit("reverse abc>", Params(max_tokens=10, priority="batch", seed=7, temperature=0.5), sink)
    final = sink.final
    assert sink.text == "abcde" and [e.text for e in sink.events[:-1]] == ["ab", "c", "de"]
    assert [e.completion_tokens for e in sink.events[:-1]] == [2, 3, 5]  # EOS is not counted
    assert final.finish_reason == "stop" and final.text == "" and final.error is None
    assert final.prompt_tokens == len("reverse abc>") + 1 and final.completion_tokens == 5
    assert final.queue_s == pytest.approx(0.25) and final.ttft_s >= 0 and final.tpot_s >= 0
    ((prompt, sampling, request_id, priority),) = llm.calls
    assert prompt == {"prompt_token_ids": seq.prompt} and priority == 1 and request_id.startswith(f"fleet-{seq.id}-")
    assert sampling["seed"] == 7 and sampling["temperature"] == 0.5 and sampling["max_tokens"] == 10
    assert seq.done and seq.finish_reason == "stop"
    stats = engine.snapshot()
    assert (stats["running"], stats["waiting"], stats["kv_used_tokens"], stats["finished_stop"]) == (0, 0, 0, 1)
    assert stats["tokens_out"] == 5 and stats["tokens_in"] == len(seq.prompt)


def test_length_passes_through(started: object) -> None:
    engine = started(FakeLLM(chunks=["xy", "z"], finish="length"))
    sink = Collected()
    engine.submit("q", Params(max_tokens=3), sink)
    assert sink.final.finish_reason == "length" and sink.final.completion_tokens == 3 and sink.text == "xyz"


def test_a_caller_that_leaves_aborts_its_request(started: object) -> None:
    llm = FakeLLM(chunks=["a"] * 200, delay=0.02)
    engine = started(llm)
    sink = Collected()
    seq = engine.submit("reverse abc>", Params(max_tokens=40), sink)
    for _ in range(500):
        if sink.events:
            break
        threading.Event().wait(0.01)
    engine.cancel(seq)
    final = sink.final
    assert final.finish_reason == "cancelled" and 1 <= final.completion_tokens < 200
    assert llm.aborted == [llm.calls[0][2]] and seq.cancelled and seq.done
    assert engine.snapshot()["running"] == 0 and engine.snapshot()["finished_cancelled"] == 1


def test_a_request_past_its_deadline_is_aborted_with_timeout(started: object) -> None:
    llm = FakeLLM(chunks=["a"] * 200, delay=0.02)
    engine = started(llm)
    sink = Collected()
    engine.submit("reverse abc>", Params(max_tokens=40, timeout_s=0.1), sink)
    assert sink.final.finish_reason == "timeout" and len(llm.aborted) == 1


def test_what_cannot_fit_bad_parameters_and_a_full_queue_are_refused_before_anything_runs(started: object) -> None:
    llm = FakeLLM(chunks=["a"] * 200, delay=0.02)
    engine = started(llm, max_running=1, max_waiting=1, context=32)
    with pytest.raises(TooLong, match="this model's context is 32"):
        engine.submit("a" * 20, Params(max_tokens=20), Collected())
    with pytest.raises(ValueError, match="min_tokens is 9"):
        engine.submit("a", Params(max_tokens=8, min_tokens=9), Collected())
    with pytest.raises(ValueError, match="no tokens"):
        engine.submit([], Params(), Collected())
    sinks = [Collected(), Collected()]
    for s in sinks:
        engine.submit("a", Params(max_tokens=8), s)
    with pytest.raises(QueueFull, match="at most max_running \\+ max_waiting = 2"):
        engine.submit("a", Params(max_tokens=8), Collected())
    engine.stop()  # what is in flight hears that the service stops
    assert all(s.final.finish_reason == "error" and s.final.error == "the service is stopping" for s in sinks)
    assert llm.shut and not llm.calls[2:]


def test_an_engine_error_reaches_the_caller(started: object) -> None:
    class Broken(FakeLLM):
        async def generate(self, prompt: dict, sampling: dict, request_id: str, *, priority: int = 0):  # noqa: ANN201
            raise RuntimeError("CUDA error: an illegal memory access")
            yield  # an async generator

    engine = started(Broken())
    sink = Collected()
    engine.submit("a", Params(), sink)
    assert sink.final.finish_reason == "error" and "illegal memory access" in sink.final.error
