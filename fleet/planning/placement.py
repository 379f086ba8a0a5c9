"""The placement plan: which node pool runs each model, on how many GPUs, and how big each node group is.

A pure planner (``fleet.planning.planner.plan``) makes it from frozen inputs: the models of
``policies/`` (parameters, dtype, KV cache, replica bounds, isolation of the model or of a
tenant entitled to it) and the node pools of a stack (instance type, GPUs and their memory,
vCPU, RAM, price; parsed in ``fleet.planning.stack``). ``fleet plan`` prints the
``PlacementPlan``, ``infra/`` sizes the EKS node groups from it and the Kubernetes runtime
takes each model's GPU request, node selector and tolerations from it.

How one replica's memory is sized is ``fleet.planning.memory``; which pool and how many GPUs,
``fleet.planning.planner``; how big each node group is, ``fleet.planning.node_groups``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from fleet.errors import FleetError

GPU_RESOURCE = "nvidia.com/gpu"  # extended resource the NVIDIA device plugin advertises
POOL_LABEL = "fleet.io/node-group"  # node label: the node group a node belongs to
DEDICATED_KEY = "fleet.io/dedicated"  # label and taint of a node group kept for one model
# Taint on every model node (Karpenter's NodePools, fleet.planning.karpenter): platform pods,
# which do not tolerate it, stay on the system nodes; every model pod tolerates it.
MODEL_NODE_KEY = "fleet.io/model-node"
MODEL_NODE_TOLERATION = {"key": MODEL_NODE_KEY, "operator": "Exists", "effect": "NoSchedule"}
SLICES_LABEL = "nvidia.com/device-plugin.config"  # picks the device plugin's sharing config


class PlacementError(FleetError):
    """No placement satisfies the policies with these pools."""

    status = 422


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
    kv_source: str = "none"  # one of fleet.planning.memory.KV_SOURCES
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
        """Kubernetes tolerations for the taints of its node group (a model node's, always)."""
        out = [dict(MODEL_NODE_TOLERATION)]
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
