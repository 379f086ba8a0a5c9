"""Cost tags: every taggable AWS resource says which team, model and environment it is for.

Cost allocation reports group spend by these tags, so a resource without them is spend
nobody owns. TAGGABLE lists the AWS types that take tags (their pulumi_aws class has a
``tags`` argument); any other AWS resource that carries a ``tags`` property is checked too.
The model nodes are not Pulumi resources: Karpenter launches them, tagged with their
EC2NodeClass's ``spec.tags``, so each EC2NodeClass must carry the cost tags there.
"""

from __future__ import annotations

from pulumi_policy import EnforcementLevel, ReportViolation, ResourceValidationArgs, ResourceValidationPolicy

from fleet_guardrails._common import get
from fleet_guardrails.karpenter import NODE_CLASS, pool_name

COST_TAGS = ("team", "model", "env")
TAGGABLE = {
    "aws:athena/workgroup:Workgroup",
    "aws:cloudwatch/eventRule:EventRule",
    "aws:glue/catalogDatabase:CatalogDatabase",
    "aws:ec2/eip:Eip",
    "aws:ec2/instance:Instance",
    "aws:ec2/internetGateway:InternetGateway",
    "aws:ec2/launchTemplate:LaunchTemplate",
    "aws:ec2/natGateway:NatGateway",
    "aws:ec2/routeTable:RouteTable",
    "aws:ec2/securityGroup:SecurityGroup",
    "aws:ec2/subnet:Subnet",
    "aws:ec2/volume:Volume",
    "aws:ec2/vpc:Vpc",
    "aws:ec2/vpcEndpoint:VpcEndpoint",
    "aws:ecr/repository:Repository",
    "aws:eks/addon:Addon",
    "aws:eks/accessEntry:AccessEntry",
    "aws:eks/cluster:Cluster",
    "aws:eks/nodeGroup:NodeGroup",
    "aws:elasticache/replicationGroup:ReplicationGroup",
    "aws:elasticache/subnetGroup:SubnetGroup",
    "aws:iam/openIdConnectProvider:OpenIdConnectProvider",
    "aws:iam/policy:Policy",
    "aws:iam/role:Role",
    "aws:kms/key:Key",
    "aws:lb/listener:Listener",
    "aws:lb/listenerRule:ListenerRule",
    "aws:lb/loadBalancer:LoadBalancer",
    "aws:lb/targetGroup:TargetGroup",
    "aws:rds/instance:Instance",
    "aws:rds/subnetGroup:SubnetGroup",
    "aws:s3/bucket:Bucket",
    "aws:s3/bucketV2:BucketV2",
    "aws:sqs/queue:Queue",
    "aws:vpc/securityGroupEgressRule:SecurityGroupEgressRule",
    "aws:vpc/securityGroupIngressRule:SecurityGroupIngressRule",
}


def _cost_tags(args: ResourceValidationArgs, report: ReportViolation) -> None:
    if args.resource_type == NODE_CLASS:
        _node_class_tags(args, report)
        return
    if not args.resource_type.startswith("aws:"):
        return
    if args.resource_type not in TAGGABLE and "tags" not in args.props:
        return
    # tagsAll also holds the provider's default tags, where the engine knows them already
    tags = {**(args.props.get("tagsAll") or {}), **(args.props.get("tags") or {})}
    missing = [k for k in COST_TAGS if not tags.get(k)]
    if missing:
        report(
            f"{args.resource_type.rsplit(':', 1)[1]} {args.name} lacks the cost tag(s) {', '.join(missing)}; "
            f"expected non-empty {', '.join(COST_TAGS)} tags on every taggable resource"
        )


def _node_class_tags(args: ResourceValidationArgs, report: ReportViolation) -> None:
    tags = get(args.props, "spec", "tags", default={})
    missing = [k for k in COST_TAGS if not tags.get(k)]
    if missing:
        report(
            f"EC2NodeClass {pool_name(args.props, args.name)} lacks the cost tag(s) {', '.join(missing)} in spec.tags; "
            f"expected non-empty {', '.join(COST_TAGS)}: Karpenter tags the instances and volumes it launches with them"
        )


cost_tags = ResourceValidationPolicy(
    name="cost-tags",
    description="Every taggable AWS resource, and the nodes of every Karpenter EC2NodeClass, has non-empty team, "
    "model and env tags.",
    validate=_cost_tags,
    enforcement_level=EnforcementLevel.MANDATORY,
)
