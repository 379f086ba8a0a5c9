"""BentoML service for one version of a generative (causal LM) model.

A thin shell around an engine over the version's ``save_pretrained`` folder (the node cache's
verified copy, fetched from the store at start when it is not there: ``weights.model_dir``;
vLLM loads it from there too, never from the image) — the family's
own trained model, or any Hugging Face causal LM registered the same way. The engine is
``engine.Engine`` (our KV cache and continuous batching, on CPU or CUDA) or, on CUDA with
``vllm`` installed, ``vllm_engine.VLLMEngine`` (vLLM's ``AsyncLLM`` behind the same
interface); ``FLEET_DEVICE`` (auto | cuda | cpu) and ``FLEET_ENGINE`` (auto | vllm | native)
decide, as ``engine_choice.resolve_device`` / ``choose_engine`` say. Which one serves, on
which device and why, is in ``/engine``, ``/metadata`` and the replica's log. The folder's
files are checked against the manifest's listing (``fleet_build.json`` ``files``) at import
and again before the weights load, as in every family; nothing is fetched from a hub
(``HF_HUB_OFFLINE``).

Routes (the fleet's generation contract; ``fleet.gateway.generation.stream`` calls them):

* ``POST /generate`` ``{"prompt": "..." | "messages": [{"role", "content"}], "max_tokens": 16,
  "min_tokens": 0, "temperature": 0, "top_p": 1,
  "stop": [], "seed": null, "priority": "interactive", "timeout_s": null}`` → ``{"text",
  "finish_reason", "prompt_tokens", "completion_tokens", "queue_s", "ttft_s", "tpot_s"}``;
* ``POST /generate_stream``, the same body → server-sent events, one ``data: {"text": ...,
  "completion_tokens": n, "prompt_tokens": p}`` per step that produced text, then one with ``finish_reason`` and
  the counts and timings. A caller that disconnects cancels its sequence: it leaves the
  running batch, and its KV cache is freed, at the next step;
* ``GET /engine`` → the engine's gauges and counters (running, waiting, KV cache use), with
  ``engine`` (native or vllm) and ``device``.

A prompt that can never fit (prompt + ``max_tokens`` past the context or the KV budget) is
400; past ``max_waiting`` waiting sequences the service sheds with 503 (nothing computed).
"""

from __future__ import annotations

from phases import mark  # noqa: I001 - first: the imports below are a phase of the start it measures

mark("import")

import asyncio  # noqa: E402
import json
import os
import threading
import time
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import Annotated, Literal

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers is imported: a Bento never reaches a hub

import bentoml
from bentoml.exceptions import BadInput, ServiceUnavailable
from engine_choice import choose_engine, resolve_device, try_import_vllm  # noqa: I001 - the Bento holds these files at its root
from integrity import verify_folder
from pydantic import BaseModel, Field
from scheduler import Event, Params, QueueFull, Scheduler, TooLong
from vllm_args import engine_args, gpu_total_bytes
from vllm_engine import VLLMEngine
from weights import model_dir

mark("imported")

BUILD = json.loads((Path(__file__).with_name("fleet_build.json")).read_text())
mark("fetch")
MODEL_DIR = model_dir(BUILD)  # the node cache's verified copy, fetched from the store if not there
mark("fetched")
REMEDY = (
    f"expected the files of {BUILD['model']}:{BUILD['version']} as registered; on a fleet machine "
    f"`fleet package {BUILD['model']} {BUILD['version']}` caches them again from the registry; in the "
    "cluster the replica fetches them again at its next start"
)
GENERATION = {
    "max_running": 32,
    "kv_budget_tokens": 8192,
    "max_waiting": 256,
    "max_prefill_tokens": 2048,
    "max_tokens": 256,
    **BUILD.get("generation", {}),
}
QUANTIZATION = "fleet_quantization.json"  # {"library": "torchao", "method": "int8-weight-only"}
FAULTS = "fleet_faults.json"  # {"first_token_ms", "token_ms"}: a rehearsal's slow version
ACCELERATOR = BUILD.get("accelerator", {})  # {"gpus", "gpu_memory_gib"} of a policy with resources.gpu > 0
MAX_STOP, MAX_STOP_CHARS, MAX_PROMPT_CHARS, MAX_MESSAGES = 4, 64, 32_768, 64


class Message(BaseModel):
    role: Literal["system", "user", "assistant"]
    content: Annotated[str, Field(max_length=MAX_PROMPT_CHARS)]


def verify_model(path: str) -> None:
    verify_folder(path, BUILD["files"], BUILD["artifact_sha256"], remedy=REMEDY)


if MODEL_DIR is not None:  # None while `bentoml build` imports this module
    verify_model(MODEL_DIR)
mark("verified")


# The engine in the replica's /metrics (bentoml.metrics: prometheus_client in BentoML's
# multiprocess mode), beside BentoML's own: its gauges, sampled every ENGINE_SAMPLE_S. How long
# each sequence waited to join the batch is in its final event (queue_s), which the gateway
# keeps as fleet_generation_queue_seconds.
ENGINE_SAMPLE_S = 0.5
ENGINE_GAUGES = {
    "running": "Sequences in the running batch",
    "waiting": "Sequences waiting to join the running batch",
    "kv_reserved_tokens": "KV-cache positions reserved by running sequences (prompt + max_tokens each)",
    "kv_used_tokens": "KV-cache positions holding keys and values now",
    "kv_budget_tokens": "KV-cache positions a replica may reserve (generation.kv_budget_tokens)",
}


def _event(e: Event) -> dict:
    out: dict = {"text": e.text, "completion_tokens": e.completion_tokens, "prompt_tokens": e.prompt_tokens}
    if e.finish_reason is not None:
        out |= {
            "finish_reason": e.finish_reason,
            "queue_s": round(e.queue_s, 6),
            "ttft_s": round(e.ttft_s, 6),
            "tpot_s": round(e.tpot_s, 6),
        }
        if e.error:
            out["error"] = e.error
    return out


@bentoml.service(name=BUILD["service_name"], resources=BUILD["resources"], traffic=BUILD["traffic"])
class TextGenerator:
    def __init__(self) -> None:
        mark("worker")
        # torch and transformers: imported by BentoML's worker only (its server process imports
        # this module just to read the service's settings, and never needs them)
        import torch
        from engine import Engine
        from transformers import AutoConfig, AutoTokenizer

        path = MODEL_DIR
        verify_model(path)
        device = resolve_device(os.environ.get("FLEET_DEVICE"), torch.cuda.is_available())
        tokenizer = AutoTokenizer.from_pretrained(path)
        quantization = Path(path) / QUANTIZATION
        self.quantization = json.loads(quantization.read_text()) if quantization.exists() else None
        # faults built into a version on purpose (fleet models train --fault-*), to rehearse a rollback
        faults_file = Path(path) / FAULTS
        self.faults = json.loads(faults_file.read_text()) if faults_file.exists() else {}
        choice = choose_engine(
            os.environ.get("FLEET_ENGINE"),
            device=device,
            vllm_import=try_import_vllm,
            quantized=self.quantization is not None,
            faults=any(self.faults.values()),
        )
        self.device, self.engine_reason = device, choice.reason
        if choice.engine == "vllm":
            context = int(getattr(AutoConfig.from_pretrained(path), "max_position_embeddings", 0) or 2048)
            args = engine_args(
                path,
                generation=GENERATION,
                context=context,
                env=os.environ,
                gpu_memory_gib=float(ACCELERATOR.get("gpu_memory_gib", 0.0)),
                gpu_total_bytes=gpu_total_bytes(),
                files=BUILD["files"],
            )
            self.engine = VLLMEngine(tokenizer, args, max_waiting=GENERATION["max_waiting"])
        else:
            self.engine = Engine(
                self._native_model(path, device),
                tokenizer,
                Scheduler(
                    max_running=GENERATION["max_running"],
                    kv_budget=GENERATION["kv_budget_tokens"],
                    max_waiting=GENERATION["max_waiting"],
                    max_prefill=GENERATION["max_prefill_tokens"],
                ),
                step_delay_s=self.faults.get("token_ms", 0.0) / 1000,
            )
        self.engine.start()
        mark("loaded")
        threading.Thread(target=self._sample_engine, name="engine-gauges", daemon=True).start()
        print(
            f"{BUILD['model']}:{BUILD['version']}: the {self.engine.name} engine on {device} ({choice.reason})",
            flush=True,
        )

    def _sample_engine(self) -> None:
        # made here, in the serving process: at import they would be registered again by every
        # build that imports this module (a second one in a process: DuplicateTimeseries)
        gauges = {
            key: bentoml.metrics.Gauge(f"fleet_engine_{key}", doc, multiprocess_mode="livesum")
            for key, doc in ENGINE_GAUGES.items()
        }
        while True:
            snapshot = self.engine.snapshot()
            for key, gauge in gauges.items():
                if key in snapshot:
                    gauge.set(snapshot[key])
            time.sleep(ENGINE_SAMPLE_S)

    def _native_model(self, path: str, device: str):  # noqa: ANN202 - a transformers model
        import torch
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device)
        if self.quantization is not None:  # fleet models quantize: int8 weights in memory, by torchao
            from torchao.quantization import Int8WeightOnlyConfig, quantize_

            if self.quantization.get("method") != "int8-weight-only":
                raise RuntimeError(
                    f"{QUANTIZATION} asks for {self.quantization.get('method')!r}; this service knows int8-weight-only"
                )
            quantize_(model, Int8WeightOnlyConfig())
        return model

    def _prompt(self, prompt: str | None, messages: list[Message] | None) -> str:
        """The text the model continues: ``prompt``, or ``messages`` through the tokenizer's chat
        template — or, for a model without one, the last user message (a completion model)."""
        if (prompt is None) == (messages is None):
            raise BadInput("expected exactly one of prompt and messages")
        if prompt is not None:
            return prompt
        assert messages is not None
        tokenizer = self.engine.tokenizer
        if getattr(tokenizer, "chat_template", None):
            chat = [m.model_dump() for m in messages]
            return tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        users = [m.content for m in messages if m.role == "user"]
        if not users:
            raise BadInput("messages hold no user message; expected at least one")
        return users[-1]

    async def _events(self, prompt: str, params: Params) -> AsyncGenerator[Event, None]:
        """The engine's events for one sequence, on this event loop; leaving early cancels it."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Event] = asyncio.Queue()
        try:
            seq = self.engine.submit(prompt, params, lambda e: loop.call_soon_threadsafe(queue.put_nowait, e))
        except (TooLong, ValueError) as exc:
            raise BadInput(str(exc)) from None
        except QueueFull as exc:
            raise ServiceUnavailable(str(exc)) from None
        # a rehearsal's slow first token (fleet models train --fault-first-token-ms): this answer's
        # first event waits that much longer; the engine and the other answers do not
        first_delay_s = self.faults.get("first_token_ms", 0.0) / 1000
        try:
            while True:
                event = await queue.get()
                if first_delay_s:
                    await asyncio.sleep(first_delay_s)
                    first_delay_s = 0.0
                yield event
                if event.finish_reason is not None:
                    return
        finally:  # the caller left (or the stream broke): free the sequence's place and cache
            if not seq.done:
                self.engine.cancel(seq)

    @bentoml.api
    async def generate(
        self,
        prompt: Annotated[str, Field(min_length=1, max_length=MAX_PROMPT_CHARS)] | None = None,
        messages: Annotated[list[Message], Field(min_length=1, max_length=MAX_MESSAGES)] | None = None,
        max_tokens: Annotated[int, Field(ge=1, le=GENERATION["max_tokens"])] = 16,
        min_tokens: Annotated[int, Field(ge=0, le=GENERATION["max_tokens"])] = 0,
        temperature: Annotated[float, Field(ge=0.0, le=100.0)] = 0.0,
        top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0,
        stop: Annotated[
            list[Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]], Field(max_length=MAX_STOP)
        ] = [],  # noqa: B006
        seed: Annotated[int, Field(ge=0, lt=2**63)] | None = None,
        priority: Annotated[str, Field(pattern="^(interactive|batch)$")] = "interactive",
        timeout_s: Annotated[float, Field(gt=0.0, le=3600.0)] | None = None,
    ) -> dict:
        """The whole answer at once."""
        params = Params(max_tokens, min_tokens, temperature, top_p, tuple(stop), seed, priority, timeout_s)
        text, last = [], None
        async for event in self._events(self._prompt(prompt, messages), params):
            text.append(event.text)
            last = event
        assert last is not None
        if last.finish_reason == "error":
            raise RuntimeError(f"generation failed: {last.error}")
        return {**_event(last), "text": "".join(text)}

    @bentoml.api
    async def generate_stream(
        self,
        prompt: Annotated[str, Field(min_length=1, max_length=MAX_PROMPT_CHARS)] | None = None,
        messages: Annotated[list[Message], Field(min_length=1, max_length=MAX_MESSAGES)] | None = None,
        max_tokens: Annotated[int, Field(ge=1, le=GENERATION["max_tokens"])] = 16,
        min_tokens: Annotated[int, Field(ge=0, le=GENERATION["max_tokens"])] = 0,
        temperature: Annotated[float, Field(ge=0.0, le=100.0)] = 0.0,
        top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0,
        stop: Annotated[
            list[Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]], Field(max_length=MAX_STOP)
        ] = [],  # noqa: B006
        seed: Annotated[int, Field(ge=0, lt=2**63)] | None = None,
        priority: Annotated[str, Field(pattern="^(interactive|batch)$")] = "interactive",
        timeout_s: Annotated[float, Field(gt=0.0, le=3600.0)] | None = None,
    ) -> AsyncGenerator[str, None]:
        """Server-sent events: text as it is generated, then the finish (see the module)."""
        params = Params(max_tokens, min_tokens, temperature, top_p, tuple(stop), seed, priority, timeout_s)
        async for event in self._events(self._prompt(prompt, messages), params):
            yield f"data: {json.dumps(_event(event), separators=(',', ':'))}\n\n"

    @bentoml.api(route="/engine")
    def engine_stats(self) -> dict:
        return {
            **self.engine.snapshot(),
            "engine": self.engine.name,
            "device": self.device,
            "model": BUILD["model"],
            "version": BUILD["version"],
        }

    @bentoml.api
    def metadata(self) -> dict:
        return {k: BUILD[k] for k in ("model", "version", "artifact_sha256")} | {
            "device": self.device,
            "engine": self.engine.name,
            "engine_reason": self.engine_reason,
            "generation": GENERATION,
            "faults": self.faults,
            "quantization": self.quantization,
        }
