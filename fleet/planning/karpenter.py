"""Karpenter for the model nodes: the placement plan's node groups as ``NodePool``s and
``EC2NodeClass``es (karpenter.sh/v1, karpenter.k8s.aws/v1, Karpenter KARPENTER_VERSION).

One NodePool and one EC2NodeClass per node group of the plan (``fleet.planning.node_groups``),
same name. Pure: ``node_pools`` decides sizes, capacity type and disk; ``node_pool`` and
``node_class`` write the objects; infra/karpenter.py applies them. The rules:

- **Taints**: every model NodePool carries MODEL_NODE_TAINT, CPU ones included, so platform
  pods (which do not tolerate it) never land on model nodes; model pods need
  MODEL_NODE_TOLERATION. GPU pools keep ``nvidia.com/gpu=present:NoSchedule``, dedicated
  groups ``fleet.io/dedicated=<model>:NoSchedule``.
- **Capacity type**: a pool of *small* models may run on spot (Karpenter prefers spot and
  falls back to on-demand); a pool with any *large* model is on-demand only. Large: a replica
  spanning more than one GPU, or weights of at least LARGE_WEIGHTS_GIB, or a node of at
  least LARGE_NODE_USD_PER_HOUR. Why: spot gives two minutes' warning, and a large replica
  takes longer than that to fetch and load its weights, so an interruption is an outage
  of that replica; a small one is back before the warning runs out.
- **Limits and canary surge**: a NodePool may grow to the nodes every member model needs at
  ``max_replicas`` (the stable at peak) plus room for ONE canary at its last step. Rollout
  steps end at 100 % (fleet.catalog.policies.spec), and KEDA's 300 s scale-down window keeps
  the stable at its peak while the canary takes the whole load, so that canary needs its own
  ``max_replicas``: the surge is the extra nodes that packing the member needing the most
  nodes for it takes. A second canary at peak in the same pool waits for a stable to scale
  down. The pool's ``max_nodes`` (the stack owner's cap) bounds the surge; what it cuts is
  ``surge_short`` and ``fleet plan`` says so. Limits are in cpu, memory, nvidia.com/gpu and
  nodes, from the pool's instance type (Karpenter counts node capacity against them).
- **Disruption**: consolidation WhenEmptyOrUnderutilized after CONSOLIDATE_AFTER; budgets
  let at most one node of a model pool go at a time, and none of a large pool for
  ``Underutilized`` (moving a large replica costs minutes of weights loading: only empty
  nodes are removed and drifted ones replaced). Karpenter evicts through the eviction API,
  so each version's PodDisruptionBudget (fleet.runtime.kubernetes.manifests: ``minAvailable``
  its floor) also holds: a node's drain waits while evicting would take a version below it. Karpenter's budgets count
  nodes, the PDBs count replicas; together at most one node's replicas move at a time and
  never more than the PDB allows of one version. ``expireAfter: Never``: an expiry is
  forceful and would evict at the minimum; nodes are replaced by drift (a new AMI), which
  is graceful and respects both.
- **Disk**: NVMe instance store (NVME_FAMILIES) is striped RAID0 by nodeadm and holds the
  kubelet, containerd and the weights cache; a requirement on
  ``karpenter.k8s.aws/instance-local-nvme`` makes Karpenter refuse a type whose NVMe is
  smaller than the cache. Elsewhere the gp3 root volume is sized for the cache (ROOT_OS_GIB +
  IMAGE_GIB per model + the cache) with GP3_THROUGHPUT_MIBPS and GP3_IOPS.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from fleet.planning.node_groups import capacity, demand, pack
from fleet.planning.placement import (
    GPU_RESOURCE,
    MODEL_NODE_KEY,
    ModelPlacement,
    NodeGroupPlan,
    PlacementPlan,
)
from fleet.planning.stack import NodePool

KARPENTER_VERSION = "1.14.1"  # chart and controller; CRD schemas vendored in tests/fixtures/karpenter
NODEPOOL_API = "karpenter.sh/v1"
NODECLASS_GROUP = "karpenter.k8s.aws"
NODECLASS_API = f"{NODECLASS_GROUP}/v1"
# On every model node: platform pods do not tolerate it, model pods do
# (fleet.planning.placement.MODEL_NODE_TOLERATION, in every ModelPlacement's tolerations).
MODEL_NODE_TAINT = (MODEL_NODE_KEY, "true", "NoSchedule")
DISCOVERY_TAG = "karpenter.sh/discovery"  # on the cluster security group: the node classes select it
INSTANCE_TYPE_LABEL = "node.kubernetes.io/instance-type"
CAPACITY_TYPE_LABEL = "karpenter.sh/capacity-type"
LOCAL_NVME_LABEL = "karpenter.k8s.aws/instance-local-nvme"  # GiB of instance store, as Karpenter labels it
SPOT, ON_DEMAND = "spot", "on-demand"
# the capacity-type rule's thresholds: a model class is large at any of them
LARGE_WEIGHTS_GIB = 10.0
LARGE_NODE_USD_PER_HOUR = 5.0
CONSOLIDATE_AFTER = "10m"  # a node empty or underused this long goes: short bursts keep theirs
# AL2023 EKS-optimised AMI; Karpenter picks the NVIDIA variant for GPU types. "latest" rolls
# nodes by drift (graceful, under the budgets) when AWS publishes an AMI; pin e.g.
# al2023@v20240807 to roll only when the alias changes.
AMI_ALIAS = "al2023@latest"
IMDS_HOP_LIMIT = 1  # pods (one hop away) cannot take the node's role: workloads use IRSA
ROOT_DEVICE = "/dev/xvda"  # the AL2023 AMIs' root
ROOT_OS_GIB = 20  # the OS and logs
IMAGE_GIB = 15  # a model's image (code only, on an inference base image) and its canary's layers
CACHE_COPIES = 2  # the stable's and a canary's weights side by side in the node-local cache
NVME_ROOT_GIB = 50  # with RAID0 the instance store holds images and the cache: the root is the OS
# gp3: 125 MiB/s and 3,000 IOPS come with the volume; 1,000 MiB/s (the most gp3 gives) needs
# 4,000 IOPS (at most 0.25 MiB/s per IOPS). 10 GiB of weights land in ~10 s at that rate
# (the instance's EBS bandwidth permitting) rather than ~80 s at the baseline.
GP3_THROUGHPUT_MIBPS = 1000
GP3_IOPS = 4000
# Families with NVMe instance store in every size (aws.amazon.com/ec2/instance-types); a CPU
# family with a "d" after its generation (m6id, c6gd, r5d) has it too.
NVME_FAMILIES = frozenset({"g4dn", "g5", "g6", "g6e", "gr6", "p3dn", "p4d", "p4de", "p5", "p5e", "p5en"})
_LOCAL_DISK_FAMILY = re.compile(r"^[a-z]+\d+[a-z]*d[a-z]*$")


def has_nvme(instance_type: str) -> bool:
    """``g5.xlarge`` → True, ``m6i.large`` → False, ``m6id.large`` → True."""
    family = instance_type.split(".")[0]
    return family in NVME_FAMILIES or _LOCAL_DISK_FAMILY.fullmatch(family) is not None


@dataclass(frozen=True)
class NodePoolPlan:
    """One Karpenter NodePool (and its EC2NodeClass) made from one node group of the plan."""

    name: str
    pool: str
    instance_type: str
    gpus_per_node: int
    vcpu: int
    memory_gib: float
    hourly_usd: float  # one node, on demand (spot is cheaper: the bounds are on-demand's)
    min_nodes: int  # what the models' min_replicas hold
    max_nodes: int  # every member at max_replicas
    surge_nodes: int  # room for one canary at its last step, within the pool's max_nodes
    surge_short: int  # surge nodes the pool's max_nodes cut
    large: bool
    capacity_types: tuple[str, ...]
    weights_cache_gib: float
    nvme: bool
    models: tuple[str, ...]
    labels: dict[str, str] = field(default_factory=dict)
    taints: tuple[tuple[str, str, str], ...] = ()

    @property
    def limit_nodes(self) -> int:
        return self.max_nodes + self.surge_nodes

    @property
    def limit_gpus(self) -> int:
        return self.limit_nodes * self.gpus_per_node

    @property
    def limits(self) -> dict[str, str]:
        """NodePool ``spec.limits``: the node capacity Karpenter may launch in all."""
        n = self.limit_nodes
        out = {"cpu": str(n * self.vcpu), "memory": f"{n * self.memory_gib:g}Gi", "nodes": str(n)}
        if self.gpus_per_node:
            out[GPU_RESOURCE] = str(self.limit_gpus)
        return out

    @property
    def usd_per_hour(self) -> tuple[float, float]:
        """On-demand cost at the minimum and at the limit."""
        return self.min_nodes * self.hourly_usd, self.limit_nodes * self.hourly_usd

    @property
    def root_volume_gib(self) -> int:
        if self.nvme:
            return NVME_ROOT_GIB
        return math.ceil(ROOT_OS_GIB + IMAGE_GIB * len(self.models) + self.weights_cache_gib)

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "pool": self.pool,
            "instance_type": self.instance_type,
            "capacity_types": list(self.capacity_types),
            "large": self.large,
            "taints": [list(t) for t in self.taints],
            "labels": self.labels,
            "nodes": [self.min_nodes, self.max_nodes, self.limit_nodes],
            "surge_nodes": self.surge_nodes,
            "surge_short": self.surge_short,
            "limits": self.limits,
            "weights_cache_gib": self.weights_cache_gib,
            "nvme": self.nvme,
            "models": list(self.models),
            "usd_per_hour": list(self.usd_per_hour),
        }


def is_large(members: Sequence[ModelPlacement], pool: NodePool) -> bool:
    """The capacity-type rule's "large" (module docstring)."""
    return pool.hourly_usd >= LARGE_NODE_USD_PER_HOUR or any(
        m.tensor_parallel > 1 or m.weights_gib >= LARGE_WEIGHTS_GIB for m in members
    )


def default_cache_gib(members: Sequence[ModelPlacement]) -> float:
    """The node-local weights cache: each member's weights CACHE_COPIES times (stable and canary)."""
    return round(sum(m.weights_gib for m in members) * CACHE_COPIES, 2)


def node_pools(
    plan: PlacementPlan, pools: Sequence[NodePool], weights_cache_gib: Mapping[str, float] | None = None
) -> tuple[NodePoolPlan, ...]:
    """A NodePoolPlan per node group of ``plan``; ``weights_cache_gib`` overrides the cache of
    the groups it names (default ``default_cache_gib``)."""
    by_pool = {p.name: p for p in pools}
    placed = {m.model: m for m in plan.models}
    surges = {g.name: _surge(g, [placed[n] for n in g.models], by_pool[g.pool]) for g in plan.node_groups}
    granted = _within_max_nodes(plan.node_groups, surges, by_pool)
    out = []
    for g in plan.node_groups:
        pool, members = by_pool[g.pool], [placed[n] for n in g.models]
        large = is_large(members, pool)
        cache = (weights_cache_gib or {}).get(g.name, default_cache_gib(members))
        out.append(
            NodePoolPlan(
                name=g.name,
                pool=g.pool,
                instance_type=g.instance_type,
                gpus_per_node=g.gpus_per_node,
                vcpu=pool.vcpu,
                memory_gib=pool.memory_gib,
                hourly_usd=g.hourly_usd,
                min_nodes=g.min_size,
                max_nodes=g.max_size,
                surge_nodes=granted[g.name],
                surge_short=surges[g.name] - granted[g.name],
                large=large,
                capacity_types=(ON_DEMAND,) if large or pool.capacity_type == "ON_DEMAND" else (SPOT, ON_DEMAND),
                weights_cache_gib=cache,
                nvme=has_nvme(g.instance_type),
                models=g.models,
                labels=dict(g.labels),
                taints=(*g.taints, MODEL_NODE_TAINT),
            )
        )
    return tuple(out)


def _surge(group: NodeGroupPlan, members: Sequence[ModelPlacement], pool: NodePool) -> int:
    """Extra nodes for the member whose canary, at its max_replicas beside every stable at its
    max_replicas, needs the most."""
    cap = capacity(pool, group.gpu_slices)
    stable = [demand(m) for m in members for _ in range(m.max_replicas)]
    with_canary = (pack(stable + [demand(m)] * m.max_replicas, cap) for m in members)
    return max(0, max(with_canary) - group.max_size)


def _within_max_nodes(
    groups: Sequence[NodeGroupPlan], surges: Mapping[str, int], pools: Mapping[str, NodePool]
) -> dict[str, int]:
    """The surge each group gets: what its pool's max_nodes leaves after every group's
    max_size, handed out in name order."""
    left = {name: p.max_nodes - sum(g.max_size for g in groups if g.pool == name) for name, p in pools.items()}
    granted = {}
    for g in sorted(groups, key=lambda g: g.name):
        granted[g.name] = min(surges[g.name], max(0, left[g.pool]))
        left[g.pool] -= granted[g.name]
    return granted


def node_pool(p: NodePoolPlan) -> dict:
    """The ``karpenter.sh/v1`` NodePool of ``p`` (its EC2NodeClass has the same name)."""
    requirements = [
        {"key": INSTANCE_TYPE_LABEL, "operator": "In", "values": [p.instance_type]},
        {"key": CAPACITY_TYPE_LABEL, "operator": "In", "values": list(p.capacity_types)},
    ]
    if p.nvme:  # a type whose NVMe cannot hold the cache is not launched (nothing falls back to EBS)
        requirements.append(
            {"key": LOCAL_NVME_LABEL, "operator": "Gt", "values": [str(math.ceil(p.weights_cache_gib))]}
        )
    budgets = [{"nodes": "1"}]
    if p.large:
        budgets.append({"nodes": "0", "reasons": ["Underutilized"]})
    return {
        "apiVersion": NODEPOOL_API,
        "kind": "NodePool",
        "metadata": {"name": p.name, "labels": {"app.kubernetes.io/managed-by": "serving-fleet"}},
        "spec": {
            "template": {
                "metadata": {"labels": dict(p.labels)},
                "spec": {
                    "nodeClassRef": {"group": NODECLASS_GROUP, "kind": "EC2NodeClass", "name": p.name},
                    "requirements": requirements,
                    "taints": [{"key": k, "value": v, "effect": e} for k, v, e in p.taints],
                    "expireAfter": "Never",
                },
            },
            "limits": p.limits,
            "disruption": {
                "consolidationPolicy": "WhenEmptyOrUnderutilized",
                "consolidateAfter": CONSOLIDATE_AFTER,
                "budgets": budgets,
            },
        },
    }


def node_class(
    p: NodePoolPlan,
    *,
    cluster: str,
    role: str,
    subnet_ids: Sequence[str],
    tags: Mapping[str, str],
    ami_alias: str = AMI_ALIAS,
) -> dict:
    """The ``karpenter.k8s.aws/v1`` EC2NodeClass of ``p``: ``role`` is the node role's name,
    ``subnet_ids`` the private subnets, the security group the cluster's (DISCOVERY_TAG)."""
    ebs: dict = {
        "volumeSize": f"{p.root_volume_gib}Gi",
        "volumeType": "gp3",
        "encrypted": True,
        "deleteOnTermination": True,
    }
    if not p.nvme:  # the weights cache is on this volume: provisioned throughput
        ebs.update(throughput=GP3_THROUGHPUT_MIBPS, iops=GP3_IOPS)
    spec: dict = {
        "role": role,
        "amiSelectorTerms": [{"alias": ami_alias}],
        "subnetSelectorTerms": [{"id": s} for s in subnet_ids],
        "securityGroupSelectorTerms": [{"tags": {DISCOVERY_TAG: cluster}}],
        "metadataOptions": {
            "httpEndpoint": "enabled",
            "httpProtocolIPv6": "disabled",
            "httpPutResponseHopLimit": IMDS_HOP_LIMIT,
            "httpTokens": "required",
        },
        "blockDeviceMappings": [{"deviceName": ROOT_DEVICE, "rootVolume": True, "ebs": ebs}],
        "tags": {
            **tags,
            "model": p.models[0] if len(p.models) == 1 else "shared",
            "fleet-node-group": p.name,
        },
    }
    if p.nvme:
        spec["instanceStorePolicy"] = "RAID0"
    return {
        "apiVersion": NODECLASS_API,
        "kind": "EC2NodeClass",
        "metadata": {"name": p.name, "labels": {"app.kubernetes.io/managed-by": "serving-fleet"}},
        "spec": spec,
    }
