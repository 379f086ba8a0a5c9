"""Does the system node group hold the platform and the gateways? Pure, for ``fleet plan`` and
infra/config.py alike.

The system nodes run everything that is not a model: the gateways (``gateway.cpu`` ×
``max_replicas`` at peak), Prometheus, Grafana, KEDA, the cluster autoscaler and Karpenter,
Prefect's server, worker and flow-run jobs, CoreDNS, and on every node the add-ons'
DaemonSets. The review that found dev short by a node and prod unable to place 12 gateways
summed the same requests; this module keeps that sum in the code:

- a node's allocatable is EKS's: capacity less kube-reserved (CPU 6 % of the first core, 1 %
  of the second, 0.5 % of the third and fourth, 0.25 % beyond; memory 255 MiB + 11 MiB per
  pod the instance's ENIs allow) and the 100 MiB hard-eviction threshold;
- the DaemonSets (vpc-cni 25m, kube-proxy 100m, the EBS CSI node plugin 30m / 120 MiB,
  node-exporter 50m / 64 MiB) come off every node;
- ``PLATFORM`` is what the platform's pods request at the pinned charts (their defaults, or
  what infra/charts.py sets), with Prometheus and the flow-run jobs at what they use here;
- gateways are placed first-fit, each whole on one node, beside the platform packed the same way.

At ``min_size`` the minimum gateways must fit, at ``max_size`` the maximum. A stack that does
not is refused with the node count it needs.
"""

from __future__ import annotations

from dataclasses import dataclass

# instance type → (vCPU, GiB, pods per node with the VPC CNI's default ENI mode)
INSTANCES: dict[str, tuple[int, float, int]] = {
    "t3.large": (2, 8, 35),
    "t3.xlarge": (4, 16, 58),
    "t3.2xlarge": (8, 32, 58),
    "m6i.large": (2, 8, 29),
    "m6i.xlarge": (4, 16, 58),
    "m6i.2xlarge": (8, 32, 58),
    "m6i.4xlarge": (16, 64, 234),
    "m7i.large": (2, 8, 29),
    "m7i.xlarge": (4, 16, 58),
    "m7i.2xlarge": (8, 32, 58),
    "m7i.4xlarge": (16, 64, 234),
}
DAEMONSETS = (25 + 100 + 30 + 50, 120 + 64)  # (millicores, MiB) on every node
# pod → (millicores, MiB, replicas): requests at the pinned charts (default, or as set)
PLATFORM: dict[str, tuple[int, int, int]] = {
    "prometheus": (500, 2048, 1),  # 15 s scrapes of every model pod and GPU: what it uses, not the chart's 0
    "alertmanager": (50, 128, 1),
    "prometheus-operator": (100, 128, 1),
    "kube-state-metrics": (50, 128, 1),
    "grafana": (100, 256, 1),
    "keda-operator": (100, 256, 1),
    "keda-metrics-apiserver": (100, 256, 1),
    "keda-admission-webhooks": (50, 128, 1),
    "cluster-autoscaler": (100, 600, 1),
    "karpenter": (250, 512, 2),  # as infra/karpenter.py asks (CONTROLLER_RESOURCES); the chart runs two, one leading
    "coredns": (100, 70, 2),  # the EKS add-on's requests
    "metrics-server": (100, 200, 1),
    "ebs-csi-controller": (60, 240, 2),
    "prefect-server": (500, 512, 1),  # the chart's default requests
    "prefect-worker": (100, 128, 1),
    "flow-run jobs": (500, 1024, 2),  # fleet-kubernetes jobs at the base template's requests, two at once
}


@dataclass(frozen=True)
class SystemFit:
    """How the pool at one size holds the platform and ``gateways`` gateway pods."""

    nodes: int
    gateways: int
    needed: int  # nodes the pods need at least
    cpu_used: float  # share of the pool's allocatable CPU the requests take
    memory_used: float

    @property
    def fits(self) -> bool:
        return self.needed <= self.nodes


def allocatable(instance_type: str) -> tuple[int, int]:
    """(millicores, MiB) a pod may request on one node of ``instance_type``, after the
    kubelet's reservations and the DaemonSets."""
    if instance_type not in INSTANCES:
        raise KeyError(instance_type)
    vcpu, gib, pods = INSTANCES[instance_type]
    cores = [60, 10, 5, 5] + [2.5] * max(0, vcpu - 4)
    cpu = vcpu * 1000 - sum(cores[:vcpu]) - DAEMONSETS[0]
    memory = int(gib * 1024) - (255 + 11 * pods) - 100 - DAEMONSETS[1]
    return int(cpu), memory


def _pods(gateways: int, gateway_cpu: float, gateway_memory_gib: float) -> list[tuple[int, int]]:
    pods = [(cpu, mem) for cpu, mem, n in PLATFORM.values() for _ in range(n)]
    pods += [(int(gateway_cpu * 1000), int(gateway_memory_gib * 1024))] * gateways
    return sorted(pods, reverse=True)


def fit(instance_type: str, nodes: int, gateways: int, gateway_cpu: float, gateway_memory_gib: float) -> SystemFit:
    """First-fit-decreasing of the platform's and the gateways' pods onto nodes of
    ``instance_type``; ``needed`` may exceed ``nodes`` (then it does not fit)."""
    cpu, memory = allocatable(instance_type)
    bins: list[list[int]] = []
    for pod_cpu, pod_mem in _pods(gateways, gateway_cpu, gateway_memory_gib):
        if pod_cpu > cpu or pod_mem > memory:
            return SystemFit(nodes, gateways, 10**6, float("inf"), float("inf"))
        for b in bins:
            if b[0] >= pod_cpu and b[1] >= pod_mem:
                b[0] -= pod_cpu
                b[1] -= pod_mem
                break
        else:
            bins.append([cpu - pod_cpu, memory - pod_mem])
    total = _pods(gateways, gateway_cpu, gateway_memory_gib)
    return SystemFit(
        nodes,
        gateways,
        len(bins),
        sum(c for c, _ in total) / (cpu * nodes),
        sum(m for _, m in total) / (memory * nodes),
    )


def problems(
    instance_type: str,
    min_size: int,
    max_size: int,
    gateways: tuple[int, int],
    gateway_cpu: float,
    gateway_memory_gib: float,
) -> list[str]:
    """What is wrong with the pool's sizes for (min, max) gateways, each naming the nodes
    needed; empty when both ends fit. An instance type this module does not know is not
    judged (its name is in the message of the caller that cares)."""
    if instance_type not in INSTANCES:
        return []
    out = []
    for label, nodes, n in (("min_size", min_size, gateways[0]), ("max_size", max_size, gateways[1])):
        f = fit(instance_type, nodes, n, gateway_cpu, gateway_memory_gib)
        if not f.fits:
            need = "a larger instance type" if f.needed >= 10**6 else f"at least {f.needed} × {instance_type}"
            out.append(
                f"{label} {nodes} × {instance_type} cannot hold the platform's pods and {n} gateway pods "
                f"of {gateway_cpu:g} CPU / {gateway_memory_gib:g} GiB: needs {need} "
                "(fleet.planning.system_pool sums what each pod requests)"
            )
    return out
