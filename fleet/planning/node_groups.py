"""Node groups: how many nodes of each pool the placed models need, and their labels and taints.
Each becomes a Karpenter NodePool (fleet.planning.karpenter), which adds the canary surge.

A node group is a pool's nodes shared by the models placed on it, or kept for one isolated
model (``dedicated_to``, tainted). Its size is what first-fit-decreasing packing of every
replica needs: at ``min_replicas`` (at least the pool's ``min_nodes``) and at ``max_replicas``
(at most the pool's ``max_nodes``). On every node NODE_RESERVED of the vCPU and RAM stays with
the kubelet and the daemons, and GPU_HEADROOM of each GPU's memory stays free.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from fleet.planning.placement import (
    DEDICATED_KEY,
    GPU_RESOURCE,
    POOL_LABEL,
    SLICES_LABEL,
    ModelPlacement,
    NodeGroupPlan,
    PlacementError,
)
from fleet.planning.stack import NodePool

# Kept free on every GPU: a replica that grows a little must not OOM its neighbours.
GPU_HEADROOM = 0.1
# vCPU and RAM of a node kept for the kubelet, the OS and per-node daemons (CNI, device
# plugin, node exporter).
NODE_RESERVED = 0.1


def usable_gpu_gib(pool: NodePool) -> float:
    """GPU memory of one of the pool's GPUs that replicas may fill (GPU_HEADROOM stays free)."""
    return pool.gpu_memory_gib * (1 - GPU_HEADROOM)


def capacity(pool: NodePool, slices: int) -> tuple[int, float, float]:
    """Device-plugin GPU units, vCPU and GiB of RAM that pods can use on one node."""
    return pool.gpus * slices, pool.vcpu * (1 - NODE_RESERVED), pool.memory_gib * (1 - NODE_RESERVED)


def group_name(pool: str, dedicated_to: str | None) -> str:
    """``<pool>`` or ``<pool>-<model>``, kept a DNS label (EKS and label values allow 63)."""
    if dedicated_to is None:
        return pool
    name = f"{pool}-{dedicated_to}"
    if len(name) <= 63:
        return name
    return f"{name[:54].rstrip('-')}-{hashlib.sha256(name.encode()).hexdigest()[:8]}"


def node_groups(placed: Sequence[ModelPlacement], pools: Sequence[NodePool]) -> tuple[NodeGroupPlan, ...]:
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
        at_max = pack([demand(m) for m in members for _ in range(m.max_replicas)], cap)
        at_min = pack([demand(m) for m in members for _ in range(m.min_replicas)], cap)
        min_size = max(at_min, pool.min_nodes)
        out.append(
            NodeGroupPlan(
                name=group,
                pool=pool.name,
                instance_type=pool.instance_type,
                gpus_per_node=pool.gpus,
                gpu_slices=slices,
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


def pack(demands: list[tuple[int, float, float]], cap: tuple[int, float, float]) -> int:
    """Nodes that first-fit-decreasing packing needs for ``demands`` (each fits one node); also
    what a canary's surge adds (fleet.planning.karpenter)."""
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
