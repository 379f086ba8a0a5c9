"""NodeGroups: the system node group, an EKS managed node group for the platform (gateway,
Prometheus, KEDA, Prefect, Karpenter's controller). The model nodes are Karpenter's
(infra/karpenter.py).

The cluster autoscaler moves the group between its min and max, so it owns the desired
size. EKS refuses a minimum above the desired size, so ignoring ``desiredSize`` (the usual
way to leave it to the autoscaler) makes a later `up` that raises ``min_size`` fail: the
engine sends the old desired size with the new minimum. Instead the program reads the
group's live desired size and sends it clamped into the new bounds (``desired_size``): the
autoscaler's choice stands, and a raised minimum raises it. The group has a launch template:
an encrypted gp3 root volume, IMDSv2 only, and the cost tags on the instances and volumes.
"""

from __future__ import annotations

from dataclasses import dataclass

import pulumi
import pulumi_aws as aws

from fleet.planning.placement import POOL_LABEL
from infra import waited_for

SYSTEM_GROUP = "system"
IMDS_HOP_LIMIT = 1
CPU_AMI = "AL2023_x86_64_STANDARD"


@dataclass
class SystemGroup:
    instance_type: str
    min_size: int
    max_size: int
    root_volume_gib: int


@dataclass
class NodeGroupsArgs:
    cluster: str  # the EKS cluster's name, to look the live group up (known before the cluster exists)
    cluster_name: pulumi.Input[str]  # the cluster's output: what waits for the cluster
    kubernetes_version: pulumi.Input[str]  # the cluster's: a version bump rolls the group after it
    node_role_arn: pulumi.Input[str]
    subnet_ids: list[pulumi.Input[str]]  # private subnets
    system: SystemGroup
    tags: dict[str, str]


def desired_size(min_size: int, max_size: int, live: int | None) -> int:
    """The desired size to send: the live one (the autoscaler's) within the new bounds, or the
    minimum for a group that does not exist yet. ``desired_size(3, 6, 2) == 3``."""
    return min_size if live is None else min(max(live, min_size), max_size)


def live_desired_size(cluster: str, group: str) -> int | None:
    """The group's desired size in AWS now, or None where it does not exist yet (or the program
    runs under Pulumi's mocks, where nothing is deployed: tests replace this function)."""
    from pulumi.runtime import mocks, settings

    if isinstance(settings.get_monitor(), mocks.MockMonitor):
        return None
    try:
        found = aws.eks.get_node_group(cluster_name=cluster, node_group_name=group)
    except Exception as exc:  # noqa: BLE001 - the provider's invoke error carries EKS's message
        if is_not_found(str(exc)):
            return None  # the first `up`: no cluster or group yet
        # anything else (credentials, throttling): sending the minimum would shrink a scaled-out group
        raise pulumi.RunError(
            f"could not read node group {group} of cluster {cluster} to keep its desired size: {exc}; "
            "expected to read it (or EKS's ResourceNotFoundException on a first `up`): run again"
        ) from None
    return int(found.scaling_configs[0].desired_size) if found.scaling_configs else None


def is_not_found(message: str) -> bool:
    """Does an invoke's error say the cluster or group does not exist (rather than that the
    lookup failed)? EKS answers ResourceNotFoundException; the provider words it as below."""
    return any(m in message for m in ("ResourceNotFoundException", "couldn't find resource", "No cluster found"))


class NodeGroups(pulumi.ComponentResource):
    system: aws.eks.NodeGroup

    def __init__(self, name: str, args: NodeGroupsArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__("serving-fleet:infra:NodeGroups", name, None, opts)
        after = waited_for(opts)  # the node role's policies, the CNI add-ons
        system = args.system
        tags = {**args.tags, "model": "shared", "fleet-node-group": SYSTEM_GROUP}
        child = pulumi.ResourceOptions(parent=self)
        template = aws.ec2.LaunchTemplate(
            f"{name}-{SYSTEM_GROUP}",
            block_device_mappings=[
                {
                    "device_name": "/dev/xvda",  # the root volume of the AL2023 EKS AMIs
                    "ebs": {
                        "volume_size": system.root_volume_gib,
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
        live = live_desired_size(args.cluster, SYSTEM_GROUP)
        self.system = aws.eks.NodeGroup(
            f"{name}-{SYSTEM_GROUP}",
            cluster_name=args.cluster_name,
            version=args.kubernetes_version,
            node_group_name=SYSTEM_GROUP,
            node_role_arn=args.node_role_arn,
            subnet_ids=args.subnet_ids,
            instance_types=[system.instance_type],
            ami_type=CPU_AMI,
            capacity_type="ON_DEMAND",
            scaling_config={
                "min_size": system.min_size,
                "max_size": system.max_size,
                "desired_size": desired_size(system.min_size, system.max_size, live),
            },
            update_config={"max_unavailable": 1},
            labels={POOL_LABEL: SYSTEM_GROUP},
            launch_template={"id": template.id, "version": template.latest_version.apply(str)},
            tags=tags,
            opts=pulumi.ResourceOptions(parent=self, depends_on=after),
        )
        self.register_outputs({"system": self.system.id})
