"""A model's policy (``models:``): its size, resources, batching, scaling, SLO, caching,
logging, loading, and which rollout and monitoring policies it follows."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, StringConstraints, model_validator

from fleet.catalog.policies.generation import Architecture, GenerationPolicy
from fleet.catalog.policies.spec import Fraction, Spec
from fleet.validation import expected

DEFAULT_IDLE_UNLOAD_S = 300.0  # a lazy version's idle time before it is stopped, unless its policy says


class Resources(Spec):
    gpu: int = Field(0, ge=0)
    gpu_memory_gib: float = Field(0.0, ge=0.0)
    cpu: float = Field(1.0, gt=0.0)
    memory_gib: float = Field(1.0, gt=0.0)

    @model_validator(mode="after")
    def _gpu_needs_memory(self) -> Resources:
        # placement packs GPUs by memory; 0 GiB would let a GPU model land anywhere
        if self.gpu > 0 and self.gpu_memory_gib <= 0:
            phrase = "a number > 0 when gpu > 0"
            raise expected(phrase, field="gpu_memory_gib", got=self.gpu_memory_gib)
        return self


class Batching(Spec):
    max_batch_size: int = Field(32, ge=1, le=4096)
    max_latency_ms: int = Field(50, ge=1, le=60000)  # BentoML drops (503) a request queued this long


ScalingTrigger = Literal["qps", "p99_ms", "queue_depth", "gpu_utilization"]


class Autoscaling(Spec):
    min_replicas: int = Field(1, ge=0)  # 0 allows scale-to-zero
    max_replicas: int = Field(ge=1)
    target_qps_per_replica: float = Field(gt=0.0)
    target_p99_ms: float = Field(gt=0.0)
    # what KEDA scales on (the replica count is the largest any of them asks for): requests per
    # second per replica, the p99 latency, requests in flight or waiting per replica at the
    # gateways, the GPUs' utilisation (DCGM) in percent
    triggers: list[ScalingTrigger] = Field(default_factory=lambda: ["qps", "p99_ms"])
    target_queue_depth_per_replica: float = Field(8.0, gt=0.0)
    target_gpu_utilization_pct: float = Field(70.0, gt=0.0, le=100.0)

    @model_validator(mode="after")
    def _min_below_max(self) -> Autoscaling:
        if self.min_replicas > self.max_replicas:
            phrase = f"an integer <= max_replicas ({self.max_replicas})"
            raise expected(phrase, field="min_replicas", got=self.min_replicas)
        if not self.triggers or len(set(self.triggers)) != len(self.triggers):
            raise expected("at least one trigger, each once", field="triggers", got=list(self.triggers))
        return self


class Slo(Spec):
    p99_ms: float = Field(gt=0.0)
    error_rate: Fraction  # fraction of requests, 0.01 = 1 %


class Cache(Spec):
    enabled: bool = False
    # answers are kept per tenant; shared: one tenant's answer serves another's same input
    # (X-Fleet-Cache: hit then tells a tenant that another sent that input within ttl_s)
    shared: bool = False
    ttl_s: float = Field(60.0, gt=0.0)
    max_mib: float = Field(64.0, gt=0.0)  # keys and answers held, per model and gateway


class InferenceLog(Spec):
    sample_rate: Fraction = 0.1  # fraction of requests whose inputs/outputs are logged
    # generative models: a sampled generation's prompt and output texts are logged too (lengths
    # always are); off by default, since prompts may hold what a tenant would not have stored
    texts: bool = False


OutcomeName = Annotated[str, StringConstraints(pattern=r"^[a-z][a-z0-9_]{0,39}$")]


class Outcome(Spec):
    """A numeric outcome of an answer, sent later as feedback: ``clicked`` (0 or 1), ``revenue``."""

    min: float | None = Field(None, allow_inf_nan=False)  # values below are refused; None: no bound
    max: float | None = Field(None, allow_inf_nan=False)  # an experiment's metric needs both

    @model_validator(mode="after")
    def _ordered(self) -> Outcome:
        if self.min is not None and self.max is not None and self.min > self.max:
            raise ValueError(f"min {self.min:g} is above max {self.max:g}; expected min <= max")
        return self


class ModelSpec(Spec):
    family: str = Field(min_length=1)  # shared code/features, e.g. "tabular-mlp"
    size_class: Literal["small", "medium", "large", "xlarge"]
    params_millions: float = Field(gt=0.0)
    dtype: Literal["fp32", "fp16", "bf16", "int8", "int4"] = "fp32"
    generative: bool = False
    resources: Resources = Field(default_factory=Resources)
    batching: Batching = Field(default_factory=Batching)
    autoscaling: Autoscaling
    slo: Slo
    timeout_ms: int = Field(5000, gt=0)  # hard upper bound for one request, queueing included
    # the shortest timeout a caller may ask (X-Fleet-Timeout-Ms, timeout_ms, a gRPC deadline):
    # below it 400. A caller's timeout shorter than timeout_ms that runs out is the caller's,
    # never the version's failure (fleet.gateway.dispatch)
    min_timeout_ms: int = Field(50, gt=0)
    concurrency: int = Field(32, ge=1)  # in-flight requests per replica
    max_queue: int = Field(256, ge=0)  # requests waiting for a slot (all replicas) before new ones get 503
    batch_aging_ms: int = Field(2000, ge=0)  # a batch request waiting this long is served as if interactive
    # the share of a version's slots (concurrency × replicas) one tenant may hold at once, at
    # least one slot: past it its requests wait while other tenants' are served, so a tenant
    # whose callers stall (or flood) holds its share, never the version (fleet.gateway.slots)
    tenant_share: float = Field(0.5, gt=0.0, le=1.0)
    max_rows: int = Field(10_000, ge=1)  # rows (first dimension) one request may carry; more is 413
    cache: Cache = Field(default_factory=Cache)
    inference_log: InferenceLog = Field(default_factory=InferenceLog)
    rollout: str = "default"  # name of a rollout policy
    monitoring: str = "default"  # name of a monitoring policy
    isolation: bool = False  # dedicated replicas, never shared with other models
    # placement inputs (fleet.planning.placement); None keeps the planner's defaults
    kv_cache_gib: float | None = Field(None, ge=0.0)  # KV cache per replica (generative models); wins over architecture
    # generative models: the KV cache is max_running × context_tokens positions of this shape
    architecture: Architecture | None = None
    generation: GenerationPolicy | None = None  # generative models only; their defaults when generative and unset
    peak_qps: float | None = Field(None, gt=0.0)  # expected peak; must fit max_replicas × target
    # eager: every routed version runs until undeployed. lazy: a version runs only while it is
    # used — the first request starts it (held up to max_hold_ms), idle_unload_s without a
    # request stops it (fleet.control.lazy); on Kubernetes, KEDA scales it to zero
    loading: Literal["eager", "lazy"] = "eager"
    idle_unload_s: float | None = Field(None, gt=0.0)  # lazy only; default DEFAULT_IDLE_UNLOAD_S
    max_hold_ms: int = Field(10_000, gt=0, le=600_000)  # a request waits at most this long for a cold version
    # requests one gateway process holds at once for a cold version, in all and per tenant:
    # past either, 503 with Retry-After at once (a tenant cannot fill the hold for the rest)
    max_held: int = Field(256, ge=1)
    max_held_per_tenant: int = Field(32, ge=1)
    # named numeric outcomes callers may send with POST /v1/feedback (clicked, revenue, ...):
    # what A/B experiments compare versions on; an undeclared name or a value out of range is refused
    outcomes: dict[OutcomeName, Outcome] = {}

    @property
    def unload_after_s(self) -> float | None:
        """Seconds without a request after which a version is stopped; None: never (eager)."""
        if self.loading != "lazy":
            return None
        return self.idle_unload_s if self.idle_unload_s is not None else DEFAULT_IDLE_UNLOAD_S

    @model_validator(mode="after")
    def _idle_unload_for_lazy(self) -> ModelSpec:
        if self.idle_unload_s is not None and self.loading != "lazy":
            raise expected(
                "lazy when idle_unload_s is set (an eager model's versions are never unloaded)",
                field="loading",
                got=self.loading,
            )
        return self

    @model_validator(mode="after")
    def _tenant_hold_within_hold(self) -> ModelSpec:
        if self.max_held_per_tenant > self.max_held:
            raise expected(
                f"at most max_held ({self.max_held})", field="max_held_per_tenant", got=self.max_held_per_tenant
            )
        return self

    @model_validator(mode="after")
    def _min_timeout_within_timeout(self) -> ModelSpec:
        if self.min_timeout_ms > self.timeout_ms:
            raise expected(
                f"at most timeout_ms ({self.timeout_ms}): a caller must be able to ask for some timeout",
                field="min_timeout_ms",
                got=self.min_timeout_ms,
            )
        return self

    @model_validator(mode="after")
    def _generation_for_generative(self) -> ModelSpec:
        if self.generation is not None and not self.generative:
            raise ValueError("generation: is set but generative is false; expected generative: true for a causal LM")
        if self.generative and self.generation is None:
            object.__setattr__(self, "generation", GenerationPolicy())
        return self

    @model_validator(mode="after")
    def _architecture_fits_generation(self) -> ModelSpec:
        arch, gen = self.architecture, self.generation
        if arch is None:
            return self
        if gen is None:  # not generative: no KV cache to size
            raise expected(
                "true when architecture: is set (it sizes a generative model's KV cache)", field="generative", got=False
            )
        if arch.context_tokens <= gen.max_tokens:
            raise expected(
                f"more than generation.max_tokens ({gen.max_tokens}): a prompt and its answer fit one context",
                field=("architecture", "context_tokens"),
                got=arch.context_tokens,
            )
        reserved = gen.max_running * arch.context_tokens
        if gen.kv_budget_tokens > reserved:
            raise expected(
                f"at most generation.max_running × architecture.context_tokens = {gen.max_running} × "
                f"{arch.context_tokens} = {reserved}, the KV positions placement reserves per replica",
                field=("generation", "kv_budget_tokens"),
                got=gen.kv_budget_tokens,
            )
        return self
