"""Karpenter: the model nodes. The system nodes stay a managed node group (infra/nodegroups.py);
every node group of the placement plan is a Karpenter NodePool and EC2NodeClass
(fleet.planning.karpenter decides what they say).

Here: the node role Karpenter's nodes use (with an EKS access entry, so they join), the
controller's IRSA role (Karpenter's reference policy, infra/karpenter_iam.py), the
interruption queue with its EventBridge rules (spot interruption, rebalance, instance state
change, scheduled change, capacity-reservation interruption) and queue policy, the discovery
tag on the cluster security group, the Helm release (pinned, on the system nodes) and the
NodePools and EC2NodeClasses, which wait for the release (its CRDs).
"""

from __future__ import annotations

from dataclasses import dataclass

import pulumi
import pulumi_aws as aws
import pulumi_kubernetes as k8s

from fleet.planning.karpenter import DISCOVERY_TAG, KARPENTER_VERSION, NodePoolPlan, node_class, node_pool
from fleet.planning.placement import POOL_LABEL
from infra import waited_for
from infra.identity import IrsaRole, IrsaRoleArgs, service_trust
from infra.karpenter_iam import INTERRUPTION_EVENTS, QUEUE_RETENTION_S, controller_policy, queue_policy
from infra.nodegroups import SYSTEM_GROUP

CHART = "oci://public.ecr.aws/karpenter/karpenter"
NAMESPACE = "kube-system"  # Karpenter's recommended namespace: its priority class is system-cluster-critical
SERVICE_ACCOUNT = "karpenter"
NODE_POLICIES = (  # the reference template's KarpenterNodeRole
    "arn:aws:iam::aws:policy/AmazonEKS_CNI_Policy",
    "arn:aws:iam::aws:policy/AmazonEKSWorkerNodePolicy",
    "arn:aws:iam::aws:policy/AmazonEC2ContainerRegistryPullOnly",
    "arn:aws:iam::aws:policy/AmazonSSMManagedInstanceCore",
)
CONTROLLER_RESOURCES = {"requests": {"cpu": "250m", "memory": "512Mi"}, "limits": {"memory": "1Gi"}}


@dataclass
class KarpenterArgs:
    cluster: str  # the EKS cluster's name (known before it exists: the stack's name)
    cluster_name: pulumi.Input[str]  # the cluster's output: what waits for the cluster
    region: str
    kubeconfig: pulumi.Input[str]
    oidc_provider_arn: pulumi.Input[str]
    oidc_issuer: pulumi.Input[str]
    security_group_id: pulumi.Input[str]  # the cluster security group EKS puts on its nodes
    subnet_ids: list[pulumi.Input[str]]  # private subnets
    subnet_zones: list[pulumi.Input[str]]  # the AZ of each, in the same order
    pools: tuple[NodePoolPlan, ...]
    tags: dict[str, str]


def values(cluster: str, queue: str, role_arn: str) -> dict:
    """The chart's values: this cluster and its queue, the IRSA role, and the controller on the
    system nodes (its chart already keeps it off Karpenter's own nodes)."""
    return {
        "settings": {"clusterName": cluster, "interruptionQueue": queue},
        "serviceAccount": {"name": SERVICE_ACCOUNT, "annotations": {"eks.amazonaws.com/role-arn": role_arn}},
        "nodeSelector": {"kubernetes.io/os": "linux", POOL_LABEL: SYSTEM_GROUP},
        "controller": {"resources": CONTROLLER_RESOURCES},
    }


def offered_zones(offered: list[str], zones: list[str], pool: str, instance_type: str) -> list[int]:
    """Indices of the ``zones`` that offer ``instance_type``; none is a clear error from
    `pulumi preview` (zone names are known then), not a NodePool that never launches."""
    kept = [i for i, z in enumerate(zones) if z in offered]
    if not kept:
        raise pulumi.RunError(
            f"node pool {pool}: {instance_type} is offered in none of the stack's availability zones "
            f"({', '.join(zones)}); expected at least one: raise azCount, or choose another instance type"
        )
    return kept


class Karpenter(pulumi.ComponentResource):
    node_role: aws.iam.Role
    queue: aws.sqs.Queue
    release: k8s.helm.v3.Release

    def __init__(self, name: str, args: KarpenterArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__("serving-fleet:infra:Karpenter", name, None, opts)
        after = waited_for(opts)  # the system nodes and the add-ons: the controller runs there
        child = pulumi.ResourceOptions(parent=self)
        k = f"{name}-karpenter"
        self.node_role = aws.iam.Role(
            f"{k}-nodes", assume_role_policy=service_trust("ec2.amazonaws.com"), tags=args.tags, opts=child
        )
        attached = [
            aws.iam.RolePolicyAttachment(
                f"{k}-nodes-{arn.rsplit('/', 1)[1]}", role=self.node_role.name, policy_arn=arn, opts=child
            )
            for arn in NODE_POLICIES
        ]
        # nodes with this role may join the cluster (the API authentication mode has no aws-auth)
        access = aws.eks.AccessEntry(
            f"{k}-nodes",
            cluster_name=args.cluster_name,
            principal_arn=self.node_role.arn,
            type="EC2_LINUX",
            tags=args.tags,
            opts=child,
        )
        self.queue = aws.sqs.Queue(
            f"{k}-interruptions",
            name=args.cluster,  # settings.interruptionQueue names it
            message_retention_seconds=QUEUE_RETENTION_S,
            sqs_managed_sse_enabled=True,
            tags=args.tags,
            opts=child,
        )
        rules = []
        for rule, (source, detail) in INTERRUPTION_EVENTS.items():
            r = aws.cloudwatch.EventRule(
                f"{k}-{rule}",
                description=f"{detail} → Karpenter of {args.cluster}",
                event_pattern=pulumi.Output.json_dumps({"source": [source], "detail-type": [detail]}),
                tags=args.tags,
                opts=child,
            )
            aws.cloudwatch.EventTarget(
                f"{k}-{rule}", rule=r.name, arn=self.queue.arn, target_id="KarpenterInterruptionQueueTarget", opts=child
            )
            rules.append(r)
        account = aws.get_caller_identity_output(opts=pulumi.InvokeOutputOptions(parent=self)).account_id
        policy = pulumi.Output.all(account, self.node_role.arn, self.queue.arn).apply(
            lambda v: controller_policy(args.cluster, args.region, v[0], v[1], v[2])
        )
        role = IrsaRole(
            k,
            IrsaRoleArgs(args.oidc_provider_arn, args.oidc_issuer, NAMESPACE, SERVICE_ACCOUNT, policy, args.tags),
            opts=child,
        )
        aws.sqs.QueuePolicy(
            f"{k}-interruptions",
            queue_url=self.queue.url,
            policy=pulumi.Output.all(self.queue.arn, role.arn, *(r.arn for r in rules)).apply(
                lambda v: queue_policy(v[0], list(v[2:]), v[1])
            ),
            opts=child,
        )
        # the node classes select the cluster security group by this tag; EKS made the group,
        # so no other resource of the program manages its tags
        aws.ec2.Tag(
            f"{k}-discovery", resource_id=args.security_group_id, key=DISCOVERY_TAG, value=args.cluster, opts=child
        )
        provider = k8s.Provider(f"{k}-k8s", kubeconfig=args.kubeconfig, opts=child)
        on_cluster = pulumi.ResourceOptions(parent=self, provider=provider)
        self.release = k8s.helm.v3.Release(
            k,
            name="karpenter",
            chart=CHART,
            version=KARPENTER_VERSION,
            namespace=NAMESPACE,
            values=pulumi.Output.all(self.queue.name, role.arn).apply(lambda v: values(args.cluster, v[0], v[1])),
            atomic=True,
            timeout=900,
            opts=pulumi.ResourceOptions.merge(on_cluster, pulumi.ResourceOptions(depends_on=[*after, access])),
        )
        crs = pulumi.ResourceOptions.merge(
            on_cluster, pulumi.ResourceOptions(depends_on=[self.release, access, *attached])
        )
        self.node_pools: dict[str, k8s.apiextensions.CustomResource] = {}
        zones = pulumi.Output.all(*args.subnet_zones)
        for p in args.pools:
            subnets = self._subnets(args, p, zones)
            spec = pulumi.Output.all(self.node_role.name, subnets).apply(
                lambda v, p=p: node_class(p, cluster=args.cluster, role=v[0], subnet_ids=v[1], tags=args.tags)["spec"]
            )
            nodeclass = k8s.apiextensions.CustomResource(
                f"{k}-{p.name}-class",
                api_version="karpenter.k8s.aws/v1",
                kind="EC2NodeClass",
                metadata=node_class(p, cluster=args.cluster, role="", subnet_ids=[], tags={})["metadata"],
                spec=spec,
                opts=crs,
            )
            manifest = node_pool(p)
            self.node_pools[p.name] = k8s.apiextensions.CustomResource(
                f"{k}-{p.name}",
                api_version=manifest["apiVersion"],
                kind=manifest["kind"],
                metadata=manifest["metadata"],
                spec=manifest["spec"],
                opts=pulumi.ResourceOptions.merge(crs, pulumi.ResourceOptions(depends_on=[nodeclass])),
            )
        self.register_outputs({"queue": self.queue.name, "node_role": self.node_role.arn, "role": role.arn})

    def _subnets(self, args: KarpenterArgs, p: NodePoolPlan, zones: pulumi.Output) -> pulumi.Output:
        """The private subnets in zones that offer the pool's instance type (GPU types are missing
        from some zones; CPU types are everywhere)."""
        if not p.gpus_per_node:
            return pulumi.Output.all(*args.subnet_ids)
        offered = aws.ec2.get_instance_type_offerings_output(
            location_type="availability-zone",
            filters=[{"name": "instance-type", "values": [p.instance_type]}],
            opts=pulumi.InvokeOutputOptions(parent=self),
        ).locations
        kept = pulumi.Output.all(offered, zones).apply(lambda v: offered_zones(v[0], v[1], p.name, p.instance_type))
        return kept.apply(lambda idx: pulumi.Output.all(*(args.subnet_ids[i] for i in idx)))
