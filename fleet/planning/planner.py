"""Placement: which node pool runs each model, on how many GPUs (``plan``).

A replica gets the smallest power-of-two number of GPUs of one node (its tensor-parallel
degree) whose usable memory holds it; each GPU keeps GPU_HEADROOM free. With a stated
``architecture.heads`` the degree must divide the heads (and the key/value heads divide it,
or it them), as vLLM requires. Pools with ``gpu_slices > 1`` share each GPU between that many
small replicas (NVIDIA device-plugin time-slicing), so only replicas that fit one slice go
there. Each model goes to the pool where a replica costs least; isolated models get a node
group of their own. A placement carries the pool's GPU type and the degree to the engine
(``fleet.runtime.kubernetes.manifests.engine_env``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from fleet.catalog.policies.loader import Policies
from fleet.catalog.policies.models import ModelSpec
from fleet.planning.memory import memory, replica_gpu_memory_gib, tensor_parallel_ok
from fleet.planning.node_groups import GPU_HEADROOM, NODE_RESERVED, capacity, group_name, node_groups, usable_gpu_gib
from fleet.planning.placement import ModelPlacement, PlacementError, PlacementPlan
from fleet.planning.stack import NodePool


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


def plan(policies: Policies, pools: Sequence[NodePool], models: Iterable[str] | None = None) -> PlacementPlan:
    """Place ``models`` (default: every model in the policies) on ``pools``."""
    names = sorted(policies.models) if models is None else sorted(set(models))
    for name in names:
        policies.model(name)  # unknown names fail here, naming the known ones
    isolation = _isolation(policies, names)
    placed = [_place(name, policies.models[name], pools, isolation.get(name, ())) for name in names]
    groups = node_groups(placed, pools)
    used = {p.pool for p in placed}
    return PlacementPlan(tuple(placed), groups, tuple(p.name for p in pools if p.name not in used))


def _need(spec: ModelSpec) -> tuple[float, str]:
    """(GiB one replica needs on one GPU, how that number came about) for messages."""
    if spec.resources.gpu == 0:
        return 0.0, "CPU only"
    m = memory(spec)
    return m.gpu_gib, m.how


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
        node_group=group_name(best.pool.name, name if isolated_for else None),
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
