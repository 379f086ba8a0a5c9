"""Cost tags: every taggable AWS resource says which team, model and environment it is for.

Cost allocation reports group spend by these tags, so a resource without them is spend
nobody owns. TAGGABLE lists the AWS types that take tags; any other AWS resource that
carries a ``tags`` property is checked too.
"""

from __future__ import annotations

from pulumi_policy import EnforcementLevel, ReportViolation, ResourceValidationArgs, ResourceValidationPolicy

COST_TAGS = ("team", "model", "env")
TAGGABLE = {
    "aws:athena/workgroup:Workgroup",
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
    "aws:eks/cluster:Cluster",
    "aws:eks/nodeGroup:NodeGroup",
    "aws:elasticache/replicationGroup:ReplicationGroup",
    "aws:elasticache/subnetGroup:SubnetGroup",
    "aws:iam/openIdConnectProvider:OpenIdConnectProvider",
    "aws:iam/policy:Policy",
    "aws:iam/role:Role",
    "aws:kms/key:Key",
    "aws:lb/listener:Listener",
    "aws:lb/loadBalancer:LoadBalancer",
    "aws:lb/targetGroup:TargetGroup",
    "aws:s3/bucket:Bucket",
    "aws:s3/bucketV2:BucketV2",
    "aws:vpc/securityGroupEgressRule:SecurityGroupEgressRule",
    "aws:vpc/securityGroupIngressRule:SecurityGroupIngressRule",
}


def _cost_tags(args: ResourceValidationArgs, report: ReportViolation) -> None:
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


cost_tags = ResourceValidationPolicy(
    name="cost-tags",
    description="Every taggable AWS resource has non-empty team, model and env tags.",
    validate=_cost_tags,
    enforcement_level=EnforcementLevel.MANDATORY,
)
