"""NodeGroups: the system node group and one managed node group per group of the placement plan.

Sizes, labels and taints come from ``fleet.placement`` unchanged: GPU groups carry the
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

from fleet.placement import POOL_LABEL, NodeGroupPlan

SYSTEM_GROUP = "system"
IMDS_HOP_LIMIT = 1
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
    system: SystemGroup
    groups: tuple[NodeGroupPlan, ...]
    root_volume_gib: int  # model nodes
    tags: dict[str, str]


def model_tag(group: NodeGroupPlan) -> str:
    """The ``model`` cost tag of a group: its one model, or ``shared``."""
    return group.models[0] if len(group.models) == 1 else "shared"


class NodeGroups(pulumi.ComponentResource):
    system: aws.eks.NodeGroup
    groups: dict[str, aws.eks.NodeGroup]

    def __init__(self, name: str, args: NodeGroupsArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__("serving-fleet:infra:NodeGroups", name, None, opts)
        # what the component waits for (node role policies, the CNI add-ons), each group waits
        # for: children do not inherit it
        self._after = list(opts.depends_on or []) if opts and isinstance(opts.depends_on, list) else []
        system = args.system
        self.system = self._group(
            name, args, SYSTEM_GROUP, [system.instance_type], CPU_AMI, "ON_DEMAND",
            (system.min_size, system.max_size), {POOL_LABEL: SYSTEM_GROUP}, [], system.root_volume_gib, args.tags,
        )  # fmt: skip
        self.groups = {}
        for group in args.groups:
            tags = {**args.tags, "model": model_tag(group), "fleet-node-group": group.name}
            taints = [{"key": k, "value": v, "effect": EKS_EFFECT[e]} for k, v, e in group.taints]
            ami = GPU_AMI if group.gpus_per_node else CPU_AMI
            self.groups[group.name] = self._group(
                name, args, group.name, [group.instance_type], ami, group.capacity_type,
                (group.min_size, group.max_size), dict(group.labels), taints, args.root_volume_gib, tags,
            )  # fmt: skip
        self.register_outputs({"system": self.system.id, "groups": {k: g.id for k, g in self.groups.items()}})

    def _group(
        self, name: str, args: NodeGroupsArgs, group: str, instance_types: list[str], ami: str, capacity: str,
        size: tuple[int, int], labels: dict[str, str], taints: list[dict], root_gib: int, tags: dict[str, str],
    ) -> aws.eks.NodeGroup:  # fmt: skip
        child = pulumi.ResourceOptions(parent=self)
        template = aws.ec2.LaunchTemplate(
            f"{name}-{group}",
            block_device_mappings=[{
                "device_name": "/dev/xvda",  # the root volume of the AL2023 EKS AMIs
                "ebs": {"volume_size": root_gib, "volume_type": "gp3", "encrypted": "true", "delete_on_termination": "true"},
            }],
            # IMDSv2 only, hop limit 1: pods in their own network namespace (one hop more) cannot
            # take the node's role; every workload has its own (IRSA), and host-network pods
            # (the VPC CNI) are not a hop away
            metadata_options={"http_endpoint": "enabled", "http_tokens": "required", "http_put_response_hop_limit": IMDS_HOP_LIMIT},
            tag_specifications=[{"resource_type": kind, "tags": tags} for kind in ("instance", "volume")],
            update_default_version=True,
            tags=tags,
            opts=child,
        )  # fmt: skip
        low, high = size
        return aws.eks.NodeGroup(
            f"{name}-{group}",
            cluster_name=args.cluster_name,
            version=args.kubernetes_version,
            node_group_name=group,
            node_role_arn=args.node_role_arn,
            subnet_ids=args.subnet_ids,
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
            opts=pulumi.ResourceOptions(parent=self, depends_on=self._after, ignore_changes=["scalingConfig.desiredSize"]),
        )

