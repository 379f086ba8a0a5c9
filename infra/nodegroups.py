"""NodeGroups: the system node group and one managed node group per group of the placement plan.

Sizes, labels and taints come from ``fleet.planning.placement`` unchanged: GPU groups carry the
``nvidia.com/gpu`` NoSchedule taint (only pods that asked for GPUs tolerate it), dedicated
groups also the ``fleet.io/dedicated=<model>`` one. The cluster autoscaler moves each group
between its min and max; ``desiredSize`` is left to it after creation. Every group has a
launch template: a larger encrypted root volume (images and weights are big), IMDSv2 only,
and the cost tags on the instances and volumes themselves.
"""

from __future__ import annotations

from dataclasses import dataclass

import pulumi
import pulumi_aws as aws

from fleet.planning.placement import POOL_LABEL, NodeGroupPlan
from infra import waited_for

SYSTEM_GROUP = "system"
IMDS_HOP_LIMIT = 1
# The cluster autoscaler treats a node with this label as a GPU node and waits for the
# device plugin to advertise its GPUs before calling it ready; without it, it sees a node
# with no GPUs, decides the pending pods still do not fit and adds more nodes.
ACCELERATOR_LABEL = "k8s.amazonaws.com/accelerator"
ACCELERATORS = {
    "g4dn": "nvidia-tesla-t4",
    "g5": "nvidia-a10g",
    "g6": "nvidia-l4",
    "g6e": "nvidia-l40s",
    "p3": "nvidia-tesla-v100",
    "p4d": "nvidia-a100",
    "p4de": "nvidia-a100",
    "p5": "nvidia-h100",
}
# A GPU group whose node costs at least this much an hour starts at zero nodes (EKS minimum
# and desired 0): creating a group with a minimum of 1 fails where the account has no quota
# for the type, and nothing is paid for until a model's pods ask. The autoscaler brings the
# nodes pending pods need (a model's min_replicas still holds them once there).
SCALE_FROM_ZERO_USD_PER_HOUR = 5.0
GPU_AMI = "AL2023_x86_64_NVIDIA"  # NVIDIA driver and container toolkit preinstalled
CPU_AMI = "AL2023_x86_64_STANDARD"
# Kubernetes effect → the EKS API's spelling
EKS_EFFECT = {"NoSchedule": "NO_SCHEDULE", "NoExecute": "NO_EXECUTE", "PreferNoSchedule": "PREFER_NO_SCHEDULE"}


@dataclass
class SystemGroup:
    instance_type: str
    min_size: int
    max_size: int
    root_volume_gib: int


@dataclass
class NodeGroupsArgs:
    cluster_name: pulumi.Input[str]
    kubernetes_version: pulumi.Input[str]  # the cluster's: a version bump rolls the groups after it
    node_role_arn: pulumi.Input[str]
    subnet_ids: list[pulumi.Input[str]]  # private subnets
    subnet_zones: list[pulumi.Input[str]]  # the AZ of each, in the same order
    system: SystemGroup
    groups: tuple[NodeGroupPlan, ...]
    root_volume_gib: int  # model nodes
    tags: dict[str, str]


def accelerator(instance_type: str) -> str:
    """The ``k8s.amazonaws.com/accelerator`` value of a GPU instance type (``nvidia`` if its family is not listed)."""
    return ACCELERATORS.get(instance_type.split(".")[0], "nvidia")


def eks_min_size(group: NodeGroupPlan) -> int:
    """The group's EKS minimum: 0 for an expensive GPU group, else the plan's."""
    return 0 if group.gpus_per_node and group.hourly_usd >= SCALE_FROM_ZERO_USD_PER_HOUR else group.min_size


def offered_zones(offered: list[str], zones: list[str], group: str, instance_type: str) -> list[int]:
    """Indices of the ``zones`` that offer ``instance_type``; none is a clear error, not a group
    that never starts. Zone names are known at preview (subnet IDs of a new stack are not), so
    the error comes from `pulumi preview`, before anything is built."""
    kept = [i for i, z in enumerate(zones) if z in offered]
    if not kept:
        raise pulumi.RunError(
            f"node group {group}: {instance_type} is offered in none of the stack's availability zones "
            f"({', '.join(zones)}); expected at least one: raise azCount, or choose another instance type"
        )
    return kept


def model_tag(group: NodeGroupPlan) -> str:
    """The ``model`` cost tag of a group: its one model, or ``shared``."""
    return group.models[0] if len(group.models) == 1 else "shared"


class NodeGroups(pulumi.ComponentResource):
    system: aws.eks.NodeGroup
    groups: dict[str, aws.eks.NodeGroup]

    def __init__(self, name: str, args: NodeGroupsArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__("serving-fleet:infra:NodeGroups", name, None, opts)
        self._after = waited_for(opts)  # the node role's policies, the CNI add-ons
        system = args.system
        self.system = self._group(
            name,
            args,
            SYSTEM_GROUP,
            [system.instance_type],
            CPU_AMI,
            "ON_DEMAND",
            (system.min_size, system.max_size),
            {POOL_LABEL: SYSTEM_GROUP},
            [],
            system.root_volume_gib,
            args.tags,
        )
        self.groups = {}
        for group in args.groups:
            tags = {**args.tags, "model": model_tag(group), "fleet-node-group": group.name}
            taints = [{"key": k, "value": v, "effect": EKS_EFFECT[e]} for k, v, e in group.taints]
            ami, labels, subnets = CPU_AMI, dict(group.labels), None
            if group.gpus_per_node:
                ami, labels[ACCELERATOR_LABEL] = GPU_AMI, accelerator(group.instance_type)
                # only the AZs that have the type: a group spanning one without it fails to launch there
                offered = aws.ec2.get_instance_type_offerings_output(
                    location_type="availability-zone",
                    filters=[{"name": "instance-type", "values": [group.instance_type]}],
                    opts=pulumi.InvokeOutputOptions(parent=self),
                ).locations
                kept = pulumi.Output.all(offered, pulumi.Output.all(*args.subnet_zones)).apply(
                    lambda v, g=group: offered_zones(v[0], v[1], g.name, g.instance_type)
                )
                subnets = kept.apply(lambda idx: pulumi.Output.all(*(args.subnet_ids[i] for i in idx)))
            self.groups[group.name] = self._group(
                name,
                args,
                group.name,
                [group.instance_type],
                ami,
                group.capacity_type,
                (eks_min_size(group), group.max_size),
                labels,
                taints,
                args.root_volume_gib,
                tags,
                subnets,
            )
        self.register_outputs({"system": self.system.id, "groups": {k: g.id for k, g in self.groups.items()}})

    def _group(
        self,
        name: str,
        args: NodeGroupsArgs,
        group: str,
        instance_types: list[str],
        ami: str,
        capacity: str,
        size: tuple[int, int],
        labels: dict[str, str],
        taints: list[dict],
        root_gib: int,
        tags: dict[str, str],
        subnets: pulumi.Input[list[str]] | None = None,
    ) -> aws.eks.NodeGroup:
        child = pulumi.ResourceOptions(parent=self)
        template = aws.ec2.LaunchTemplate(
            f"{name}-{group}",
            block_device_mappings=[
                {
                    "device_name": "/dev/xvda",  # the root volume of the AL2023 EKS AMIs
                    "ebs": {
                        "volume_size": root_gib,
                        "volume_type": "gp3",
                        "encrypted": "true",
                        "delete_on_termination": "true",
                    },
                }
            ],
            # IMDSv2 only, hop limit 1: pods in their own network namespace (one hop more) cannot
            # take the node's role; every workload has its own (IRSA), and host-network pods
            # (the VPC CNI) are not a hop away
            metadata_options={
                "http_endpoint": "enabled",
                "http_tokens": "required",
                "http_put_response_hop_limit": IMDS_HOP_LIMIT,
            },
            tag_specifications=[{"resource_type": kind, "tags": tags} for kind in ("instance", "volume")],
            update_default_version=True,
            tags=tags,
            opts=child,
        )
        low, high = size
        return aws.eks.NodeGroup(
            f"{name}-{group}",
            cluster_name=args.cluster_name,
            version=args.kubernetes_version,
            node_group_name=group,
            node_role_arn=args.node_role_arn,
            subnet_ids=subnets if subnets is not None else args.subnet_ids,
            instance_types=instance_types,
            ami_type=ami,
            capacity_type=capacity,
            scaling_config={"min_size": low, "max_size": high, "desired_size": low},
            update_config={"max_unavailable": 1},
            labels=labels,
            taints=taints,
            launch_template={"id": template.id, "version": template.latest_version.apply(str)},
            tags=tags,
            # the cluster autoscaler owns the desired size once the group exists
            opts=pulumi.ResourceOptions(
                parent=self, depends_on=self._after, ignore_changes=["scalingConfig.desiredSize"]
            ),
        )
