"""Placement: which node pool runs each model, on how many GPUs, and how big each node group is.

A pure planner over frozen inputs: the models of ``policies/`` (parameters, dtype, KV cache,
replica bounds, isolation of the model or of a tenant entitled to it) and the node pools of
a stack (instance type, GPUs and their memory, vCPU, RAM, price; parsed in ``fleet.planning.stack``).
``plan`` returns a ``PlacementPlan``; ``fleet plan`` prints it, ``infra/`` sizes the EKS node groups
from it and the Kubernetes runtime takes each model's GPU request, node selector and
tolerations from it.

Memory of one replica, in GiB::

    weights  = params × bytes per parameter (fp32 4, fp16/bf16 2, int8 1, int4 0.5)
    kv       = the KV cache of a generative model, the first of:
               kv_cache_gib                                  (source "kv_cache_gib")
               max_running × context_tokens × layers × kv_width × 2 × KV bytes
                                                             (source "architecture")
               KV_DEFAULT_SHARE × weights                    (source "default share")
    estimate = (weights + kv) × (1 + RUNTIME_OVERHEAD)
    replica  = max(estimate, resources.gpu × resources.gpu_memory_gib)

``max_running`` is ``generation.max_running`` (sequences in one running batch), the rest is
``architecture`` (``fleet.catalog.policies.generation.Architecture``): kv_width = hidden × kv_heads / heads, 2 for a
key and a value, KV bytes of ``kv_dtype`` (default the model's dtype; fp16 for int8/int4
weights, whose quantization is weight-only). When the tensor-parallel degree exceeds
``kv_heads`` each key/value head is held on tp / kv_heads GPUs, and the KV cache grows by
that factor. The policy's own figure (e.g. a measured peak) wins when it is larger. Models
with ``resources.gpu: 0`` run on CPU pools; their weights and KV cache must fit
``resources.memory_gib``.

A replica gets the smallest power-of-two number of GPUs of one node (its tensor-parallel
degree) whose usable memory holds it; each GPU keeps GPU_HEADROOM free. With a stated
``architecture.heads`` the degree must divide the heads (and the key/value heads divide it,
or it them), as vLLM requires. Pools with ``gpu_slices > 1`` share each GPU between that many
small replicas (NVIDIA device-plugin time-slicing), so only replicas that fit one slice go
there. Each model goes to the pool where a replica costs least; isolated models get a node
group of their own. A placement carries the pool's GPU type and the degree to the engine
(``fleet.runtime.kubernetes.engine_env``).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from fleet.catalog.policies.loader import Policies
from fleet.catalog.policies.models import ModelSpec
from fleet.errors import FleetError
from fleet.planning.stack import NodePool

# NodePool, pools_from_config` keeps working.

BYTES_PER_PARAM = {"fp32": 4.0, "fp16": 2.0, "bf16": 2.0, "int8": 1.0, "int4": 0.5}
KV_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2, "fp8": 1, "int8": 1}  # per number of the KV cache
# Where a replica's KV-cache figure came from, in order of precedence ("none": not generative).
KV_SOURCES = ("kv_cache_gib", "architecture", "default share", "none")
# Activations, CUDA context and allocator fragmentation on top of weights and KV cache.
RUNTIME_OVERHEAD = 0.2
# KV cache of a generative model whose policy does not state kv_cache_gib: a share of its
# weights, about what a few concurrent sequences of a few thousand tokens take.
KV_DEFAULT_SHARE = 0.3
# Kept free on every GPU: a replica that grows a little must not OOM its neighbours.
GPU_HEADROOM = 0.1
# vCPU and RAM of a node kept for the kubelet, the OS and per-node daemons (CNI, device
# plugin, node exporter).
NODE_RESERVED = 0.1

GPU_RESOURCE = "nvidia.com/gpu"  # extended resource the NVIDIA device plugin advertises
POOL_LABEL = "fleet.io/node-group"  # node label: the node group a node belongs to
DEDICATED_KEY = "fleet.io/dedicated"  # label and taint of a node group kept for one model
SLICES_LABEL = "nvidia.com/device-plugin.config"  # picks the device plugin's sharing config


class PlacementError(FleetError):
    """No placement satisfies the policies with these pools."""

    status = 422


def usable_gpu_gib(pool: NodePool) -> float:
    """GPU memory of one of the pool's GPUs that replicas may fill (GPU_HEADROOM stays free)."""
    return pool.gpu_memory_gib * (1 - GPU_HEADROOM)


@dataclass(frozen=True)
class ModelPlacement:
    model: str
    family: str  # its image repository is the family's
    node_group: str
    pool: str
    instance_type: str
    gpus: int  # nvidia.com/gpu requested per replica: the TP degree, or 1 slice; 0 on CPU
    tensor_parallel: int  # GPUs one replica spans (0 on CPU)
    shared_gpu: bool  # the replica holds a time-sliced share of one GPU
    gpu_memory_gib: float  # what one replica needs in total
    cpu: float
    memory_gib: float
    min_replicas: int
    max_replicas: int
    target_qps_per_replica: float
    target_p99_ms: float
    isolated_for: tuple[str, ...] = ()  # why it has a node group of its own
    triggers: tuple[str, ...] = ("qps", "p99_ms")  # what KEDA scales it on (fleet.catalog.policies.models.Autoscaling)
    target_queue_depth_per_replica: float = 8.0
    target_gpu_utilization_pct: float = 70.0
    # what the replica runs on and how its memory adds up (defaults: a plan written before these)
    gpu_type: str | None = None  # the pool's GPU, e.g. A100-40GB; None on CPU
    weights_gib: float = 0.0
    kv_cache_gib: float = 0.0  # at the chosen tensor-parallel degree
    kv_source: str = "none"  # one of KV_SOURCES
    kv_tokens: int | None = None  # KV positions reserved: max_running × context_tokens (architecture only)
    context_tokens: int | None = None  # architecture.context_tokens
    gpu_memory_from: str = "estimate"  # "estimate", "resources" (the policy's own figure was larger) or "cpu"
    # share of each of its GPUs' memory a replica may fill: gpu_memory_gib / (tensor_parallel ×
    # the pool's gpu_memory_gib), at most 1 - GPU_HEADROOM (a slice's share of it when shared);
    # vLLM's gpu_memory_utilization. None on CPU
    gpu_memory_utilization: float | None = None
    # lazy loading (fleet.control.lazy): KEDA may scale a lazy model's versions to zero after this
    # many seconds without traffic, and the gateway scales one back up for a held request
    loading: str = "eager"
    idle_unload_s: float | None = None

    def target(self, trigger: str) -> float:
        """The target a scaling trigger holds this model at (per replica, ms or percent)."""
        return {
            "qps": self.target_qps_per_replica,
            "p99_ms": self.target_p99_ms,
            "queue_depth": self.target_queue_depth_per_replica,
            "gpu_utilization": self.target_gpu_utilization_pct,
        }[trigger]

    @property
    def node_selector(self) -> dict[str, str]:
        return {POOL_LABEL: self.node_group}

    @property
    def tolerations(self) -> list[dict[str, str]]:
        """Kubernetes tolerations for the taints of its node group."""
        out = []
        if self.gpus:
            out.append({"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"})
        if self.isolated_for:
            out.append({"key": DEDICATED_KEY, "operator": "Equal", "value": self.model, "effect": "NoSchedule"})
        return out


@dataclass(frozen=True)
class NodeGroupPlan:
    name: str
    pool: str
    instance_type: str
    gpus_per_node: int
    gpu_slices: int
    capacity_type: str
    min_size: int
    max_size: int
    hourly_usd: float  # one node
    models: tuple[str, ...]
    dedicated_to: str | None = None
    labels: dict[str, str] = field(default_factory=dict)
    taints: tuple[tuple[str, str, str], ...] = ()  # (key, value, Kubernetes effect)

    @property
    def max_gpus(self) -> int:
        return self.max_size * self.gpus_per_node

    @property
    def usd_per_hour(self) -> tuple[float, float]:
        """Cost of the group at its minimum and at its maximum size."""
        return self.min_size * self.hourly_usd, self.max_size * self.hourly_usd


@dataclass(frozen=True)
class PlacementPlan:
    models: tuple[ModelPlacement, ...]
    node_groups: tuple[NodeGroupPlan, ...]
    unused_pools: tuple[str, ...] = ()

    def placement(self, model: str) -> ModelPlacement:
        for p in self.models:
            if p.model == model:
                return p
        known = ", ".join(p.model for p in self.models) or "none"
        raise PlacementError(f"model {model!r} is not in the placement plan; planned models: {known}")

    @property
    def max_gpus(self) -> int:
        return sum(g.max_gpus for g in self.node_groups)

    @property
    def usd_per_hour(self) -> tuple[float, float]:
        """The model nodes only, at minimum and maximum size; ``fleet.planning.costs.stack_cost`` adds the
        system nodes, EKS, NAT and the load balancer for the whole stack."""
        return sum(g.usd_per_hour[0] for g in self.node_groups), sum(g.usd_per_hour[1] for g in self.node_groups)

    def to_dict(self) -> dict[str, Any]:
        return {
            "models": [
                {**asdict(p), "node_selector": p.node_selector, "tolerations": p.tolerations} for p in self.models
            ],
            "node_groups": [
                {**asdict(g), "max_gpus": g.max_gpus, "usd_per_hour": g.usd_per_hour} for g in self.node_groups
            ],
            "unused_pools": list(self.unused_pools),
            "max_gpus": self.max_gpus,
            "usd_per_hour": self.usd_per_hour,
        }


@dataclass(frozen=True)
class _Fit:
    pool: NodePool
    gpus: int  # device-plugin units per replica
    tensor_parallel: int
    shared: bool
    per_node: int  # replicas of this model alone that one node holds
    need: float  # GPU GiB of one replica at this degree (0 on CPU)

    @property
    def cost(self) -> float:
        return self.pool.hourly_usd / self.per_node


@dataclass(frozen=True)
class Memory:
    """What one replica needs, part by part, in GiB (see the module docstring)."""

    weights_gib: float
    kv_cache_gib: float
    kv_source: str  # one of KV_SOURCES
    kv_tokens: int | None  # max_running × context_tokens, when the architecture sized the cache
    context_tokens: int | None
    estimate_gib: float  # (weights + KV) × (1 + RUNTIME_OVERHEAD)
    declared_gib: float  # resources.gpu × gpu_memory_gib
    how: str  # the arithmetic, for messages

    @property
    def gpu_gib(self) -> float:
        """GPU memory of one replica: the estimate, or the policy's own figure when larger."""
        return max(self.estimate_gib, self.declared_gib)


def kv_dtype(spec: ModelSpec) -> str:
    """The KV cache's number format: ``architecture.kv_dtype``, else the model's dtype, else
    fp16 for int8/int4 weights (weight-only quantization keeps 16-bit activations and KV)."""
    if spec.architecture is not None and spec.architecture.kv_dtype is not None:
        return spec.architecture.kv_dtype
    return spec.dtype if spec.dtype in ("fp32", "fp16", "bf16") else "fp16"


def kv_cache_bytes(spec: ModelSpec, tensor_parallel: int = 1) -> int:
    """max_running × context_tokens × layers × kv_width × 2 (K and V) × KV bytes, times the
    replication of key/value heads when ``tensor_parallel`` exceeds kv_heads. Needs an
    architecture and a generation section (a generative model)."""
    arch, gen = spec.architecture, spec.generation
    if arch is None or gen is None:
        raise ValueError("kv_cache_bytes needs a generative model with an architecture")
    base = gen.max_running * arch.context_tokens * arch.layers * arch.kv_width * 2 * KV_BYTES[kv_dtype(spec)]
    return base * _kv_replication(spec, tensor_parallel)


def _kv_replication(spec: ModelSpec, tensor_parallel: int) -> int:
    arch = spec.architecture
    if arch is None or arch.heads is None:
        return 1
    kv_heads = arch.kv_heads or arch.heads
    return max(1, tensor_parallel // kv_heads)


def memory(spec: ModelSpec, tensor_parallel: int = 1) -> Memory:
    """One replica's memory at ``tensor_parallel`` GPUs (the degree matters only where it
    replicates key/value heads); weights and KV of a CPU model too, which must fit its RAM."""
    weights = _weights_gib(spec)
    tokens = context = None
    if not spec.generative:
        kv, source = 0.0, "none"
    elif spec.kv_cache_gib is not None:
        kv, source = spec.kv_cache_gib, "kv_cache_gib"
    elif spec.architecture is not None and spec.generation is not None:
        kv, source = kv_cache_bytes(spec, tensor_parallel) / 2**30, "architecture"
        context = spec.architecture.context_tokens
        tokens = spec.generation.max_running * context
    else:
        kv, source = KV_DEFAULT_SHARE * weights, "default share"
    estimate = (weights + kv) * (1 + RUNTIME_OVERHEAD)
    declared = spec.resources.gpu * spec.resources.gpu_memory_gib
    how = (
        f"{spec.params_millions:g}M params {spec.dtype} = {weights:.1f} GiB weights + {kv:.1f} GiB KV cache "
        f"({_kv_how(spec, source, tensor_parallel)}) + {RUNTIME_OVERHEAD:.0%} runtime overhead = {estimate:.1f} GiB"
    )
    if declared > estimate:
        how = f"resources.gpu × gpu_memory_gib = {declared:g} GiB, above the estimate of {how}"
    return Memory(weights, kv, source, tokens, context, estimate, declared, how)


def _kv_how(spec: ModelSpec, source: str, tensor_parallel: int) -> str:
    if source == "architecture":
        arch, gen = spec.architecture, spec.generation
        assert arch is not None and gen is not None
        times = _kv_replication(spec, tensor_parallel)
        copies = f" × {times} copies of each KV head at tensor parallel {tensor_parallel}" if times > 1 else ""
        return (
            f"{gen.max_running} sequences × {arch.context_tokens} tokens × {arch.layers} layers × "
            f"{arch.kv_width} × 2 × {KV_BYTES[kv_dtype(spec)]} bytes {kv_dtype(spec)}{copies}"
        )
    return {
        "kv_cache_gib": "kv_cache_gib",
        "default share": f"{KV_DEFAULT_SHARE:.0%} of the weights",
        "none": "not generative",
    }[source]


def replica_gpu_memory_gib(spec: ModelSpec, tensor_parallel: int = 1) -> float:
    """GPU memory one replica needs (see the module docstring); 0 for a CPU-only model."""
    return 0.0 if spec.resources.gpu == 0 else memory(spec, tensor_parallel).gpu_gib


def tensor_parallel_ok(spec: ModelSpec, tensor_parallel: int) -> bool:
    """Whether a replica may span ``tensor_parallel`` GPUs: with stated heads, the degree divides
    the query heads, and the key/value heads divide it or it them (vLLM's rule)."""
    arch = spec.architecture
    if arch is None or arch.heads is None:
        return True
    kv_heads = arch.kv_heads or arch.heads
    return arch.heads % tensor_parallel == 0 and (kv_heads % tensor_parallel == 0 or tensor_parallel % kv_heads == 0)


def _need(spec: ModelSpec) -> tuple[float, str]:
    """(GiB one replica needs on one GPU, how that number came about) for messages."""
    if spec.resources.gpu == 0:
        return 0.0, "CPU only"
    m = memory(spec)
    return m.gpu_gib, m.how


def plan(policies: Policies, pools: Sequence[NodePool], models: Iterable[str] | None = None) -> PlacementPlan:
    """Place ``models`` (default: every model in the policies) on ``pools``."""
    names = sorted(policies.models) if models is None else sorted(set(models))
    for name in names:
        policies.model(name)  # unknown names fail here, naming the known ones
    isolation = _isolation(policies, names)
    placed = [_place(name, policies.models[name], pools, isolation.get(name, ())) for name in names]
    groups = _node_groups(placed, pools)
    used = {p.pool for p in placed}
    return PlacementPlan(tuple(placed), groups, tuple(p.name for p in pools if p.name not in used))


def _weights_gib(spec: ModelSpec) -> float:
    return spec.params_millions * 1e6 * BYTES_PER_PARAM[spec.dtype] / 2**30


def _isolation(policies: Policies, names: Sequence[str]) -> dict[str, tuple[str, ...]]:
    """Model → why it must not share nodes: its own policy, or tenants that ask for isolation."""
    out = {}
    for name in names:
        reasons = ["model policy"] if policies.models[name].isolation else []
        reasons += [
            f"tenant {t}"
            for t, spec in sorted(policies.tenants.items())
            if spec.isolation and name in spec.entitlements
        ]
        if reasons:
            out[name] = tuple(reasons)
    return out


def _place(name: str, spec: ModelSpec, pools: Sequence[NodePool], isolated_for: tuple[str, ...]) -> ModelPlacement:
    need, how = _need(spec)
    if need == 0:  # on CPU: weights and KV cache live in the replica's RAM
        ram = memory(spec)
        if ram.estimate_gib > spec.resources.memory_gib:
            raise PlacementError(
                f"model {name} runs on CPU (resources.gpu 0) and needs {ram.estimate_gib:.1f} GiB of RAM per replica "
                f"({ram.how}); expected resources.memory_gib >= {math.ceil(ram.estimate_gib * 10) / 10:g}, got "
                f"{spec.resources.memory_gib:g}, or resources.gpu >= 1"
            )
    fits = [f for pool in pools if (f := _fit(spec, need, pool, dedicated=bool(isolated_for))) is not None]
    if not fits:
        raise PlacementError(_no_fit_message(name, spec, need, how, pools))
    best = min(fits, key=lambda f: f.cost)  # min() keeps the first of equals: config order breaks ties
    if "gpu_utilization" in spec.autoscaling.triggers and (not best.gpus or best.shared):
        where = (
            "no GPU" if not best.gpus else "a time-sliced share of a GPU, whose utilisation its neighbours' work is in"
        )
        raise PlacementError(
            f"model {name}: autoscaling trigger gpu_utilization needs GPUs of its own, but the model is placed on "
            f"{best.pool.name} ({best.pool.instance_type}, {where}); expected triggers among qps, p99_ms, queue_depth"
        )
    replicas_max = spec.autoscaling.max_replicas
    if spec.peak_qps is not None:
        needed = math.ceil(spec.peak_qps / spec.autoscaling.target_qps_per_replica)
        if needed > replicas_max:
            raise PlacementError(
                f"model {name}: peak_qps {spec.peak_qps:g} at target_qps_per_replica "
                f"{spec.autoscaling.target_qps_per_replica:g} needs {needed} replicas; "
                f"expected autoscaling.max_replicas >= {needed}, got {replicas_max}"
            )
    mem = memory(spec, max(best.tensor_parallel, 1))
    return ModelPlacement(
        model=name,
        family=spec.family,
        node_group=_group_name(best.pool.name, name if isolated_for else None),
        pool=best.pool.name,
        instance_type=best.pool.instance_type,
        gpus=best.gpus,
        tensor_parallel=best.tensor_parallel,
        shared_gpu=best.shared,
        gpu_memory_gib=round(best.need, 2),
        cpu=spec.resources.cpu,
        memory_gib=spec.resources.memory_gib,
        min_replicas=spec.autoscaling.min_replicas,
        max_replicas=replicas_max,
        target_qps_per_replica=spec.autoscaling.target_qps_per_replica,
        target_p99_ms=spec.autoscaling.target_p99_ms,
        isolated_for=isolated_for,
        triggers=tuple(spec.autoscaling.triggers),
        target_queue_depth_per_replica=spec.autoscaling.target_queue_depth_per_replica,
        target_gpu_utilization_pct=spec.autoscaling.target_gpu_utilization_pct,
        gpu_type=best.pool.gpu_type if best.gpus else None,
        weights_gib=round(mem.weights_gib, 6),
        kv_cache_gib=round(mem.kv_cache_gib, 6),
        kv_source=mem.kv_source,
        kv_tokens=mem.kv_tokens,
        context_tokens=mem.context_tokens,
        gpu_memory_from="cpu" if not best.gpus else "resources" if mem.declared_gib > mem.estimate_gib else "estimate",
        # rounded up to 4 decimals: never 0 (vLLM refuses it), never more than 0.0001 above the need
        gpu_memory_utilization=math.ceil(best.need / best.tensor_parallel / best.pool.gpu_memory_gib * 1e4) / 1e4
        if best.gpus
        else None,
        loading=spec.loading,
        idle_unload_s=spec.unload_after_s,
    )


def _fit(spec: ModelSpec, need: float, pool: NodePool, *, dedicated: bool) -> _Fit | None:
    """How a replica fits one node of ``pool``, or None. A dedicated group never slices GPUs."""
    slices = 1 if dedicated else pool.gpu_slices
    if need == 0:  # CPU-only models run on CPU pools, leaving GPU nodes to GPU work
        if pool.gpus:
            return None
        gpus, tp, shared = 0, 0, False
    elif pool.gpus == 0:
        return None
    elif slices > 1:
        if need > usable_gpu_gib(pool) / slices or spec.resources.gpu > 1:
            return None
        gpus, tp, shared = 1, 1, True
    else:
        tp = 1 << max(0, spec.resources.gpu - 1).bit_length()  # smallest power of two >= resources.gpu
        while tp <= pool.gpus:
            if tensor_parallel_ok(spec, tp):
                need = replica_gpu_memory_gib(spec, tp)  # grows past tp > kv_heads (replicated KV heads)
                if need / tp <= usable_gpu_gib(pool):
                    break
            tp *= 2
        else:
            return None
        gpus, shared = tp, False
    per_node = capacity(pool, slices)
    fits = [
        per_node[0] // gpus if gpus else math.inf,
        per_node[1] // spec.resources.cpu,
        per_node[2] // spec.resources.memory_gib,
    ]
    count = int(min(fits))
    return _Fit(pool, gpus, tp, shared, count, need) if count >= 1 else None


def capacity(pool: NodePool, slices: int) -> tuple[int, float, float]:
    """Device-plugin GPU units, vCPU and GiB of RAM that pods can use on one node."""
    return pool.gpus * slices, pool.vcpu * (1 - NODE_RESERVED), pool.memory_gib * (1 - NODE_RESERVED)


def _no_fit_message(name: str, spec: ModelSpec, need: float, how: str, pools: Sequence[NodePool]) -> str:
    host = f"{spec.resources.cpu:g} vCPU and {spec.resources.memory_gib:g} GiB RAM"
    if need == 0:
        cpu_pools = [p for p in pools if p.gpus == 0]
        if not cpu_pools:
            return f"model {name} runs on CPU ({host} per replica) and no node pool is CPU-only; add one with gpus: 0"
        big = max(cpu_pools, key=lambda p: (p.vcpu, p.memory_gib))
        return (
            f"model {name} needs {host} per replica and fits no CPU node pool; the largest is "
            f"{big.name} ({big.instance_type}: {big.vcpu} vCPU, {big.memory_gib:g} GiB RAM, "
            f"{1 - NODE_RESERVED:.0%} of it for pods)"
        )
    gpu_pools = [p for p in pools if p.gpus > 0]
    if not gpu_pools:
        return f"model {name} needs {need:.1f} GiB of GPU memory per replica ({how}) and no node pool has GPUs"
    big = max(gpu_pools, key=lambda p: (p.gpus * usable_gpu_gib(p), p.vcpu))
    return (
        f"model {name} needs {need:.1f} GiB of GPU memory per replica ({how}) plus {host}, and fits no "
        f"node pool; the largest is {big.name} ({big.instance_type}: {big.gpus} × {big.gpu_memory_gib:g} GiB, "
        f"{big.gpus * usable_gpu_gib(big):.1f} GiB usable after {GPU_HEADROOM:.0%} headroom per GPU, "
        f"{big.vcpu} vCPU, {big.memory_gib:g} GiB RAM); a replica's tensor parallelism stays within one node"
        + (
            f" and divides architecture.heads ({spec.architecture.heads})"
            if spec.architecture and spec.architecture.heads
            else ""
        )
    )


def _group_name(pool: str, dedicated_to: str | None) -> str:
    """``<pool>`` or ``<pool>-<model>``, kept a DNS label (EKS and label values allow 63)."""
    if dedicated_to is None:
        return pool
    name = f"{pool}-{dedicated_to}"
    if len(name) <= 63:
        return name
    return f"{name[:54].rstrip('-')}-{hashlib.sha256(name.encode()).hexdigest()[:8]}"


def _node_groups(placed: Sequence[ModelPlacement], pools: Sequence[NodePool]) -> tuple[NodeGroupPlan, ...]:
    by_pool = {p.name: p for p in pools}
    groups: dict[str, list[ModelPlacement]] = {}
    for p in placed:
        groups.setdefault(p.node_group, []).append(p)
    out = []
    for group, members in sorted(groups.items()):
        pool = by_pool[members[0].pool]
        dedicated_to = members[0].model if members[0].isolated_for else None
        slices = 1 if dedicated_to else pool.gpu_slices
        cap = capacity(pool, slices)
        at_max = _pack([demand(m) for m in members for _ in range(m.max_replicas)], cap)
        at_min = _pack([demand(m) for m in members for _ in range(m.min_replicas)], cap)
        min_size = max(at_min, pool.min_nodes)
        out.append(
            NodeGroupPlan(
                name=group,
                pool=pool.name,
                instance_type=pool.instance_type,
                gpus_per_node=pool.gpus,
                gpu_slices=slices,
                capacity_type=pool.capacity_type,
                min_size=min_size,
                max_size=max(at_max, min_size, 1),
                hourly_usd=pool.hourly_usd,
                models=tuple(m.model for m in members),
                dedicated_to=dedicated_to,
                labels=_labels(group, pool, slices, dedicated_to),
                taints=_taints(pool, dedicated_to),
            )
        )
    for pool in pools:
        total = sum(g.max_size for g in out if g.pool == pool.name)
        if total > pool.max_nodes:
            models = ", ".join(m for g in out if g.pool == pool.name for m in g.models)
            raise PlacementError(
                f"node pool {pool.name} needs {total} nodes to run every replica at max_replicas "
                f"({models}); expected at most max_nodes {pool.max_nodes}: raise max_nodes or lower max_replicas"
            )
    return tuple(out)


def demand(m: ModelPlacement) -> tuple[int, float, float]:
    return m.gpus, m.cpu, m.memory_gib


def _pack(demands: list[tuple[int, float, float]], cap: tuple[int, float, float]) -> int:
    """Nodes that first-fit-decreasing packing needs for ``demands`` (each fits one node)."""
    free: list[list[float]] = []
    for d in sorted(demands, reverse=True):
        for node in free:
            if all(x <= left + 1e-9 for x, left in zip(d, node)):
                node[:] = [left - x for x, left in zip(d, node)]
                break
        else:
            free.append([left - x for x, left in zip(d, cap)])
    return len(free)


def _labels(group: str, pool: NodePool, slices: int, dedicated_to: str | None) -> dict[str, str]:
    labels = {POOL_LABEL: group, "fleet.io/pool": pool.name}
    if pool.gpus:
        labels[SLICES_LABEL] = f"slices-{slices}" if slices > 1 else "whole"
    if dedicated_to:
        labels[DEDICATED_KEY] = dedicated_to
    return labels


def _taints(pool: NodePool, dedicated_to: str | None) -> tuple[tuple[str, str, str], ...]:
    taints = [(GPU_RESOURCE, "present", "NoSchedule")] if pool.gpus else []
    if dedicated_to:
        taints.append((DEDICATED_KEY, dedicated_to, "NoSchedule"))
    return tuple(taints)
