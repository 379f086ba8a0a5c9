"""Declarative fleet policies: the pydantic models behind ``policies/*.yaml`` and their loader.

A policy file holds any of the sections ``models``, ``tenants``, ``rollout`` and
``monitoring`` (each a mapping name -> spec). Sections merge across files. Every problem is
reported as ``<file>: <key.path>: got <value> — expected <what>``, all of them in one
``ConfigError`` (one problem per line), so a bad file is fixed in one pass.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any, Literal

import semver
from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError, model_validator

from fleet.errors import ConfigError, NotFound
from fleet.names import NAME_RE
from fleet.validation import checked, expected, explain, hint, problem, read_yaml, show

_CRON_ITEM = re.compile(r"(\*|(\d+)(?:-(\d+))?)(?:/(\d+))?")


def _is_cron(value: str) -> bool:
    """Five fields of comma-separated items: ``*``, ``N`` or ``N-M``, each optionally ``/step``."""
    fields = value.split()
    limits = ((0, 59), (0, 23), (1, 31), (1, 12), (0, 7))  # minute hour day month weekday
    if len(fields) != 5:
        return False
    for field, (lo, hi) in zip(fields, limits):
        for item in field.split(","):
            m = _CRON_ITEM.fullmatch(item)
            if m is None:
                return False
            start, end, step = m.group(2), m.group(3), m.group(4)
            numbers = [int(n) for n in (start, end) if n is not None]
            if any(not lo <= n <= hi for n in numbers) or (end is not None and int(start) > int(end)):
                return False
            if step is not None and int(step) == 0:
                return False
    return True


def _is_canary_ramp(steps: list[int]) -> bool:
    return all(a < b for a, b in zip(steps, steps[1:])) and steps[-1] == 100


SEMVER = "a semver version like '1.2.3'"
DEFAULT_IDLE_UNLOAD_S = 300.0  # a lazy version's idle time before it is stopped, unless its policy says
VersionOrAny = checked(str, f"'*' (any version) or {SEMVER}", lambda v: v == "*" or semver.Version.is_valid(v))
Cron = checked(
    str,
    "a 5-field cron expression like '*/15 * * * *' (minute 0-59, hour 0-23, day 1-31, "
    "month 1-12, weekday 0-7; only the characters 0-9 * / , -)",
    _is_cron,
)
Percent = Annotated[int, Field(ge=1, le=100)]
Steps = checked(
    Annotated[list[Percent], Field(min_length=1)],
    "strictly increasing canary weights (percent of traffic) ending at 100, e.g. [10, 50, 100]",
    _is_canary_ramp,
)
Fraction = Annotated[float, Field(ge=0.0, le=1.0)]


class _Spec(BaseModel):
    # strict: YAML already yields typed values, so "yes" or "10" in a number field is a typo
    # to report, not a value to coerce.
    model_config = ConfigDict(frozen=True, extra="forbid", strict=True, allow_inf_nan=False)


class Resources(_Spec):
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


class Batching(_Spec):
    max_batch_size: int = Field(32, ge=1, le=4096)
    max_latency_ms: int = Field(50, ge=1, le=60000)  # BentoML drops (503) a request queued this long


ScalingTrigger = Literal["qps", "p99_ms", "queue_depth", "gpu_utilization"]


class Autoscaling(_Spec):
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


class Slo(_Spec):
    p99_ms: float = Field(gt=0.0)
    error_rate: Fraction  # fraction of requests, 0.01 = 1 %


class Cache(_Spec):
    enabled: bool = False
    ttl_s: float = Field(60.0, gt=0.0)
    max_mib: float = Field(64.0, gt=0.0)  # keys and answers held, per model and gateway


class InferenceLog(_Spec):
    sample_rate: Fraction = 0.1  # fraction of requests whose inputs/outputs are logged
    # generative models: a sampled generation's prompt and output texts are logged too (lengths
    # always are); off by default, since prompts may hold what a tenant would not have stored
    texts: bool = False


class GenerationPolicy(_Spec):
    """How a generative model's replicas batch, and what one request may ask (``generation:``).

    Per replica: the running batch holds at most ``max_running`` sequences and
    ``kv_budget_tokens`` KV-cache positions (each running sequence reserves its prompt plus
    its ``max_tokens``); past ``max_waiting`` waiting ones it sheds (503)."""

    max_running: int = Field(32, ge=1, le=4096)
    kv_budget_tokens: int = Field(8192, ge=16)
    max_waiting: int = Field(256, ge=1)
    max_prefill_tokens: int = Field(2048, ge=1)  # prompt tokens prefilled in one step, beside the decode
    max_tokens: int = Field(256, ge=1)  # the most one request may ask for (400 above)
    default_max_tokens: int = Field(16, ge=1)
    first_token_timeout_ms: int = Field(5000, gt=0)  # deadline for the first token; timeout_ms bounds the whole answer

    @model_validator(mode="after")
    def _default_within_max(self) -> GenerationPolicy:
        if self.default_max_tokens > self.max_tokens:
            raise ValueError(f"default_max_tokens {self.default_max_tokens} is above max_tokens {self.max_tokens}")
        return self


KvDtype = Literal["fp32", "fp16", "bf16", "fp8", "int8"]


class Architecture(_Spec):
    """The shape of a generative model that its KV cache follows (``architecture:``; placement).

    One sequence position holds a key and a value of ``kv_width`` numbers in every layer:
    ``kv_width = hidden × kv_heads / heads`` (grouped-query attention: ``kv_heads`` key/value
    heads serve ``heads`` query heads; both unset, or equal, is plain multi-head attention,
    ``kv_width = hidden``). ``context_tokens`` is the longest sequence (prompt and output) the
    cache is sized for. ``kv_dtype`` defaults to the model's dtype, or fp16 for int8/int4
    weights (weight-only quantization keeps a 16-bit KV cache)."""

    layers: int = Field(ge=1, le=1024)  # transformer blocks
    hidden: int = Field(ge=1)  # model (embedding) width
    heads: int | None = Field(None, ge=1)  # query heads; needed with kv_heads
    kv_heads: int | None = Field(None, ge=1)  # key/value heads (GQA, MQA: 1); default heads
    context_tokens: int = Field(ge=1)  # positions one sequence may reach, prompt and output
    kv_dtype: KvDtype | None = None  # of the KV cache; default: see the class docstring

    @model_validator(mode="after")
    def _heads_divide(self) -> Architecture:
        if self.kv_heads is not None and self.heads is None:
            raise expected(f"the number of query heads when kv_heads is set (kv_heads {self.kv_heads})", field="heads")
        if self.heads is not None and self.hidden % self.heads:
            raise expected(f"a number of heads that divides hidden ({self.hidden})", field="heads", got=self.heads)
        if self.kv_heads is not None and self.heads is not None and self.heads % self.kv_heads:
            raise expected(
                f"a number of key/value heads that divides heads ({self.heads}), e.g. 8 for 64 heads",
                field="kv_heads",
                got=self.kv_heads,
            )
        return self

    @property
    def kv_width(self) -> int:
        """Numbers in one layer's key (or value) of one position: hidden × kv_heads / heads."""
        if self.heads is None or self.kv_heads is None:
            return self.hidden
        return self.hidden * self.kv_heads // self.heads


OutcomeName = Annotated[str, StringConstraints(pattern=r"^[a-z][a-z0-9_]{0,39}$")]


class Outcome(_Spec):
    """A numeric outcome of an answer, sent later as feedback: ``clicked`` (0 or 1), ``revenue``."""

    min: float | None = Field(None, allow_inf_nan=False)  # values below are refused; None: no bound
    max: float | None = Field(None, allow_inf_nan=False)  # an experiment's metric needs both

    @model_validator(mode="after")
    def _ordered(self) -> Outcome:
        if self.min is not None and self.max is not None and self.min > self.max:
            raise ValueError(f"min {self.min:g} is above max {self.max:g}; expected min <= max")
        return self


class ModelSpec(_Spec):
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
    concurrency: int = Field(32, ge=1)  # in-flight requests per replica
    max_queue: int = Field(256, ge=0)  # requests waiting for a slot (all replicas) before new ones get 503
    batch_aging_ms: int = Field(2000, ge=0)  # a batch request waiting this long is served as if interactive
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


class GatewaySpec(_Spec):
    """Byte budgets of one gateway process: the ``gateway:`` section, one per fleet.

    Each bounds memory that tenants' traffic fills; past it the oldest entries are evicted
    (or new ones dropped and counted), never the process's memory grown.
    """

    max_body_mib: float = Field(4.0, gt=0.0, le=256.0)  # an inference or feedback request body (413)
    inflight_body_mib: float = Field(64.0, gt=0.0)  # all bodies held at once; a tenant gets half (503 / 429)
    admin_max_body_kib: float = Field(64.0, gt=0.0, le=4096.0)  # an admin API request body (413)
    shadow_queue_mib: float = Field(64.0, gt=0.0)  # inputs and answers waiting to be mirrored
    inference_log_buffer_mib: float = Field(64.0, gt=0.0)  # sampled rows not yet written to the store
    feedback_index_mib: float = Field(16.0, gt=0.0)  # recent sampled request ids, for feedback joins

    @staticmethod
    def mib(value: float) -> int:
        return int(value * 1024 * 1024)


class RuntimeSpec(_Spec):
    """The local runtime's budget: the ``runtime:`` section, one per fleet.

    ``memory_budget_mib``: what the replicas of every version on this machine may hold
    together (their processes' proportional set size). Starting a lazy version past it first
    stops the least recently used idle lazy versions; one that still does not fit is refused
    (503 naming the budget). Eager versions count against it but are never stopped for it.
    ``artifact_cache_mib``: what the verified artifacts cached for packaging may hold on disk
    (``fleet.runtime.cache``); none by default.
    """

    memory_budget_mib: float | None = Field(None, gt=0.0)
    # the local artifact cache (FLEET_CACHE_DIR): least recently used entries past it are removed
    artifact_cache_mib: float | None = Field(None, gt=0.0)


class QuotaPolicy(_Spec):
    rps: float = Field(gt=0.0)  # sustained requests per second
    burst: int = Field(ge=1)  # token-bucket size; may be below rps for smooth-only traffic
    concurrency: int | None = Field(None, ge=1)  # requests in flight at once, across every gateway
    tokens_per_minute: int | None = Field(None, ge=1)  # generation: prompt + completion tokens, across every gateway


class TenantSpec(_Spec):
    # no pins: a tenant's pin lives in the route table only (`fleet route pin`), where the
    # router reads it; a second copy here would drift from it
    entitlements: dict[str, Annotated[list[VersionOrAny], Field(min_length=1)]]  # model -> versions
    quota: QuotaPolicy
    weight: float = Field(1.0, gt=0.0, le=1000.0)  # share of a saturated version against other tenants
    isolation: bool = False


class Gates(_Spec):
    max_error_rate_increase: float = Field(ge=0.0)  # absolute: 0.01 = one percentage point
    confidence: float = Field(gt=0.5, lt=1.0)  # of the statistical comparison, e.g. 0.95
    max_p99_ratio: float = Field(ge=1.0)  # canary p99 / baseline p99
    max_prediction_psi: float = Field(gt=0.0)  # drift of canary predictions vs baseline
    min_shadow_agreement: Fraction | None = None  # None: no shadow-agreement gate
    # generative models (the latency gate is then on the time to first token); None: no gate
    max_tpot_p99_ratio: float | None = Field(None, ge=1.0)  # canary / baseline p99 time per output token
    max_output_length_psi: float | None = Field(None, gt=0.0)  # drift of the canary's output lengths
    # exact-match feedback (POST /v1/feedback with the expected text): the canary's match rate may
    # fall at most this far below the stable's. Judged once both arms have min_labels labels;
    # until then (or when no labels come) it neither holds nor fails a step.
    max_exact_match_drop: float | None = Field(None, ge=0.0, le=1.0)
    min_labels: int = Field(30, ge=1)


class RolloutPolicy(_Spec):
    steps: Steps
    analysis_window_s: float = Field(gt=0.0)
    min_samples: int = Field(ge=1)  # per step and arm, before any verdict
    gates: Gates
    shadow_percent: float = Field(0.0, ge=0.0, le=100.0)
    shadow_duration_s: float = Field(0.0, ge=0.0)
    # no bake_time_s: the 100 % step is judged against the stable's baseline before promotion,
    # like every step, and rollback_window_s keeps the previous stable warm after it
    manual_approval: bool = False
    rollback_window_s: float = Field(600.0, ge=0.0)
    hold_deadline_s: float = Field(gt=0.0)  # "not enough data" for longer than this fails the step
    offline_tolerance: float = Field(0.01, ge=0.0)  # allowed eval-metric drop vs the champion
    # how the steps are judged: "fixed" re-tests each step at gates.confidence every tick
    # (fleet.analysis.canary); "sequential" uses always-valid tests (fleet.analysis.sequential), whose error
    # rates hold however often they are looked at
    method: Literal["fixed", "sequential"] = "fixed"
    max_false_rollback_rate: float = Field(0.01, gt=0.0, lt=0.5)  # sequential: of a canary no worse than stable
    power: float = Field(0.8, gt=0.5, lt=1.0)  # sequential: of not promoting a canary exactly at a margin
    expected_rps: float | None = Field(None, gt=0.0)  # the model's traffic, for `fleet rollout --dry-run`


class DriftThresholds(_Spec):
    psi: float = Field(0.2, gt=0.0)
    js: float = Field(0.1, gt=0.0, le=1.0)
    wasserstein: float | None = Field(None, gt=0.0)  # None: off (its scale is per feature)
    ks_pvalue: float = Field(0.01, gt=0.0, lt=1.0)
    features_drifting_to_alert: int = Field(1, ge=1)


class QualityThresholds(_Spec):
    max_null_rate: Fraction = 0.01
    max_out_of_range_rate: Fraction = 0.01


class RetrainTrigger(_Spec):
    on_drift: bool = True
    min_accuracy_drop: float = Field(0.05, ge=0.0)  # absolute
    min_feedback_rows: int = Field(100, ge=0)
    cooldown_hours: float = Field(24.0, ge=0.0)


class MonitoringPolicy(_Spec):
    schedule: Cron
    window_hours: float = Field(gt=0.0)
    min_rows: int = Field(ge=1)
    drift: DriftThresholds = Field(default_factory=DriftThresholds)
    quality: QualityThresholds = Field(default_factory=QualityThresholds)
    retrain: RetrainTrigger = Field(default_factory=RetrainTrigger)


def _reference_problems(models: dict, tenants: dict, rollout: dict, monitoring: dict) -> list[tuple[str, str, str]]:
    """(section, entry name, report line) for each name that points nowhere."""
    problems = []
    for name, spec in models.items():
        for kind, policies in (("rollout", rollout), ("monitoring", monitoring)):
            ref = getattr(spec, kind)
            if ref not in policies:
                set_ = kind in spec.model_fields_set
                what = f"got {ref!r}" if set_ else f"not set, and no {kind} policy 'default' exists"
                known = f"a {kind} policy name ({', '.join(policies) or 'none defined'})"
                problems.append(("models", name, problem(f"models.{name}.{kind}", what, known)))
    for name, spec in tenants.items():
        for model in spec.entitlements:
            if model not in models:
                known = f"a model name ({', '.join(models) or 'none defined'})"
                where = f"tenants.{name}.entitlements"
                problems.append(("tenants", name, problem(where, f"got {model!r}", known)))
    return problems


class Policies(_Spec):
    models: dict[str, ModelSpec] = Field(default_factory=dict)
    tenants: dict[str, TenantSpec] = Field(default_factory=dict)
    rollout: dict[str, RolloutPolicy] = Field(default_factory=dict)
    monitoring: dict[str, MonitoringPolicy] = Field(default_factory=dict)
    gateway: GatewaySpec = Field(default_factory=GatewaySpec)
    runtime: RuntimeSpec = Field(default_factory=RuntimeSpec)

    @model_validator(mode="after")
    def _references_resolve(self) -> Policies:
        problems = _reference_problems(self.models, self.tenants, self.rollout, self.monitoring)
        if problems:
            raise ValueError("; ".join(line for _, _, line in problems))
        return self

    def model(self, name: str) -> ModelSpec:
        try:
            return self.models[name]
        except KeyError:
            known = ", ".join(sorted(self.models)) or "none"
            raise NotFound(f"unknown model {name!r}; known models: {known}") from None

    def rollout_for(self, model_name: str) -> RolloutPolicy:
        return self.rollout[self.model(model_name).rollout]

    def monitoring_for(self, model_name: str) -> MonitoringPolicy:
        return self.monitoring[self.model(model_name).monitoring]


SECTIONS: dict[str, type[_Spec]] = {
    "models": ModelSpec,
    "tenants": TenantSpec,
    "rollout": RolloutPolicy,
    "monitoring": MonitoringPolicy,
}


SINGLETONS: dict[str, type[_Spec]] = {"gateway": GatewaySpec, "runtime": RuntimeSpec}


def load_policies(path: str | Path = "policies") -> Policies:
    """Load one YAML file, or every ``*.yaml``/``*.yml`` directly in a directory (sorted)."""
    path = Path(path)
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.is_file() and p.suffix in (".yaml", ".yml"))
        if not files:
            raise ConfigError(f"{path}: no policy files (*.yaml, *.yml) in this directory")
    elif path.is_file():
        files = [path]
    else:
        raise ConfigError(f"{path}: not found; expected a policy directory or YAML file")
    entries: dict[str, dict[str, Any]] = {section: {} for section in SECTIONS}
    origin: dict[tuple[str, str], Path] = {}
    gateway: dict[str, _Spec] = {}  # the one-per-fleet sections (SINGLETONS) that a file set
    problems = [line for file in files for line in _load_file(file, entries, origin, gateway)]
    if not problems:  # references are only worth checking once every entry parsed
        problems = [f"{origin[s, n]}: {line}" for s, n, line in _reference_problems(**entries)]
    if problems:
        raise ConfigError("\n".join(problems))
    return Policies(**entries, **gateway)


def _load_file(file: Path, entries: dict[str, dict], origin: dict[tuple, Path], gateway: dict[str, _Spec]) -> list[str]:
    """Validate one file's entries into ``entries`` (and its ``gateway:`` and ``runtime:``
    sections into ``gateway``); return its problems as report lines."""
    data, unreadable = read_yaml(file)
    if unreadable:
        return [unreadable]
    if data is None:
        return []  # an empty (or all-comments) file defines nothing
    known = [*SECTIONS, *SINGLETONS]
    accepted = ", ".join(known)
    if not isinstance(data, dict):
        return [problem(file, f"got {show(data)}", f"a mapping with sections {accepted}")]
    problems = []
    for section, named in data.items():
        if section in SINGLETONS:
            problems += _load_singleton(file, section, named, origin, gateway)
        elif section not in SECTIONS:
            what = f"unknown top-level key {section!r}"
            problems.append(problem(file, what, f"one of {accepted}{hint(section, known)}"))
        elif isinstance(named, dict):
            problems += _load_section(file, section, named, entries[section], origin)
        elif named is not None:  # an empty section is fine
            where = f"{file}: {section}"
            problems.append(problem(where, f"got {show(named)}", "a mapping of name -> spec"))
    return problems


def _load_singleton(file: Path, section: str, raw: Any, origin: dict, into: dict[str, _Spec]) -> list[str]:
    """A ``gateway:`` or ``runtime:`` section: one mapping of settings for the fleet, in one file only."""
    if raw is None:
        return []
    if (section, "") in origin:
        return [
            problem(
                f"{file}: {section}", f"already defined in {origin[section, '']}", f"one {section} section in one file"
            )
        ]
    origin[section, ""] = file
    cls = SINGLETONS[section]
    try:
        into[section] = cls.model_validate(raw)
    except ValidationError as e:
        return [f"{file}: {line}" for line in explain(e, cls, (section,))]
    return []


def _load_section(file: Path, section: str, named: dict, into: dict, origin: dict) -> list[str]:
    problems = []
    for name, raw in named.items():
        where = f"{file}: {section}.{name}"
        if not isinstance(name, str) or not NAME_RE.fullmatch(name):
            expected = "1-63 lowercase letters, digits or '-', starting and ending with one"
            problems.append(problem(f"{file}: {section}", f"got name {name!r}", expected))
        elif (section, name) in origin:
            what = f"already defined in {origin[section, name]}"
            problems.append(problem(where, what, "each name defined in one file only"))
        else:
            origin[section, name] = file
            try:
                into[name] = SECTIONS[section].model_validate(raw)
            except ValidationError as e:
                lines = explain(e, SECTIONS[section], (section, name))
                problems += [f"{file}: {line}" for line in lines]
    return problems
