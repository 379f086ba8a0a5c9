"""Every physical name the program makes fits what AWS (and Kubernetes, and Helm) accept.

Pulumi's mocks never run auto-naming, so a name that is too long passes every other test and
fails only at ``pulumi preview``: the gateway's target group was auto-named
``serving-fleet-<stack>-gateway-`` + 7 random characters (33 in dev, 34 in prod), over the
32 AWS allows. Here each name is computed the way the provider does and checked against the
limit of its type:

- pulumi-aws (the Terraform bridge's ``AutoName``): ``<resource name>-`` + 7 random
  characters when the name field is not set (``-`` and 7 from ``tfbridge.AutoName(field,
  maxlen, "-")``; the bridge refuses a name whose prefix plus the 7 exceed ``maxlen``);
  ``*Prefix`` fields: Terraform's unique suffix of 26 characters;
- pulumi-kubernetes: ``<resource name>-`` + 8 random characters without ``metadata.name``;
- Helm: a release name of at most 53 characters.

Every AWS type the program registers must be in ``LIMITS`` or ``NO_NAME``, so a new resource
type is looked at once, not silently skipped.
"""

from __future__ import annotations

import re

import pytest
from infra_harness import Build, Registered, example

PULUMI_SUFFIX = 1 + 7  # "-" + 7 random characters (pulumi-aws AutoName)
K8S_SUFFIX = 1 + 8  # "-" + 8 (pulumi-kubernetes)
TF_PREFIX_SUFFIX = 26  # Terraform's id.PrefixedUniqueId: timestamp + counter

# type → (name field, AWS's maximum length, where that limit is stated)
LIMITS: dict[str, tuple[str, int, str]] = {
    "aws:lb/targetGroup:TargetGroup": ("name", 32, "ELB CreateTargetGroup: Name, 32 characters"),
    "aws:lb/loadBalancer:LoadBalancer": ("name", 32, "ELB CreateLoadBalancer: Name, 32 characters"),
    "aws:iam/role:Role": ("name", 64, "IAM CreateRole: RoleName, 64"),
    "aws:iam/rolePolicy:RolePolicy": ("name", 128, "IAM PutRolePolicy: PolicyName, 128"),
    "aws:iam/policy:Policy": ("name", 128, "IAM CreatePolicy: PolicyName, 128"),
    "aws:iam/instanceProfile:InstanceProfile": ("name", 128, "IAM CreateInstanceProfile, 128"),
    "aws:s3/bucket:Bucket": ("bucket", 63, "S3 bucket naming rules, 63"),
    "aws:ecr/repository:Repository": ("name", 256, "ECR CreateRepository: repositoryName, 256"),
    "aws:ec2/securityGroup:SecurityGroup": ("name", 255, "EC2 CreateSecurityGroup: GroupName, 255"),
    "aws:ec2/launchTemplate:LaunchTemplate": ("name", 128, "EC2 CreateLaunchTemplate: LaunchTemplateName, 128"),
    "aws:kms/alias:Alias": ("name", 256, "KMS CreateAlias: AliasName, 256"),
    "aws:athena/workgroup:Workgroup": ("name", 128, "Athena CreateWorkGroup: Name, 128"),
    "aws:athena/namedQuery:NamedQuery": ("name", 128, "Athena CreateNamedQuery: Name, 128"),
    "aws:glue/catalogDatabase:CatalogDatabase": ("name", 255, "Glue CreateDatabase: Name, 255"),
    "aws:elasticache/subnetGroup:SubnetGroup": ("name", 255, "ElastiCache CreateCacheSubnetGroup, 255"),
    "aws:elasticache/replicationGroup:ReplicationGroup": (
        "replicationGroupId",
        40,
        "ElastiCache CreateReplicationGroup: ReplicationGroupId, 40",
    ),
    "aws:eks/cluster:Cluster": ("name", 100, "EKS CreateCluster: name, 100"),
    "aws:eks/nodeGroup:NodeGroup": ("nodeGroupName", 63, "EKS CreateNodegroup: nodegroupName, 63"),
    "aws:sqs/queue:Queue": ("name", 80, "SQS CreateQueue: QueueName, 80"),
    "aws:cloudwatch/eventRule:EventRule": ("name", 64, "EventBridge PutRule: Name, 64"),
    "aws:rds/instance:Instance": ("identifier", 63, "RDS CreateDBInstance: DBInstanceIdentifier, 63"),
    "aws:rds/subnetGroup:SubnetGroup": ("name", 255, "RDS CreateDBSubnetGroup: DBSubnetGroupName, 255"),
    "aws:rds/parameterGroup:ParameterGroup": ("name", 255, "RDS CreateDBParameterGroup, 255"),
    "aws:secretsmanager/secret:Secret": ("name", 512, "Secrets Manager CreateSecret: Name, 512"),
}
# Types whose AWS objects have no name of ours (ids, ARNs or names AWS gives).
NO_NAME = {
    "aws:autoscaling/attachment:Attachment",
    "aws:ec2/eip:Eip",
    "aws:ec2/internetGateway:InternetGateway",
    "aws:ec2/natGateway:NatGateway",
    "aws:ec2/routeTable:RouteTable",
    "aws:ec2/routeTableAssociation:RouteTableAssociation",
    "aws:ec2/subnet:Subnet",
    "aws:ec2/tag:Tag",
    "aws:ec2/vpc:Vpc",
    "aws:ec2/vpcEndpoint:VpcEndpoint",
    "aws:ecr/lifecyclePolicy:LifecyclePolicy",
    "aws:eks/accessEntry:AccessEntry",
    "aws:eks/accessPolicyAssociation:AccessPolicyAssociation",
    "aws:eks/addon:Addon",
    "aws:eks/podIdentityAssociation:PodIdentityAssociation",
    "aws:iam/openIdConnectProvider:OpenIdConnectProvider",
    "aws:iam/rolePolicyAttachment:RolePolicyAttachment",
    "aws:kms/key:Key",
    "aws:lb/listener:Listener",
    "aws:lb/listenerRule:ListenerRule",
    "aws:cloudwatch/eventTarget:EventTarget",
    "aws:sqs/queuePolicy:QueuePolicy",
    "aws:s3/bucketLifecycleConfiguration:BucketLifecycleConfiguration",
    "aws:s3/bucketLogging:BucketLogging",
    "aws:s3/bucketOwnershipControls:BucketOwnershipControls",
    "aws:s3/bucketPolicy:BucketPolicy",
    "aws:s3/bucketPublicAccessBlock:BucketPublicAccessBlock",
    "aws:s3/bucketServerSideEncryptionConfiguration:BucketServerSideEncryptionConfiguration",
    "aws:s3/bucketVersioning:BucketVersioning",
    "aws:vpc/securityGroupEgressRule:SecurityGroupEgressRule",
    "aws:vpc/securityGroupIngressRule:SecurityGroupIngressRule",
}
# Kubernetes: most names are DNS subdomains (253); these are DNS labels (63): a Service's
# name becomes a DNS label, a Namespace's too.
K8S_LABEL_KINDS = {"Service", "Namespace"}
HELM_RELEASE_MAX = 53  # helm: "release name ... must not be longer than 53"


def physical_name(r: Registered) -> tuple[str, int, str] | None:
    """(the name AWS will see, at its longest; the limit; the limit's source), or None when
    the type has no name of ours."""
    if r.type in NO_NAME:
        return None
    field, limit, source = LIMITS[r.type]
    given = r.inputs.get(field)
    if isinstance(given, str) and given:
        return given, limit, source
    prefix = r.inputs.get(f"{field}Prefix")
    if isinstance(prefix, str) and prefix:
        return prefix + "x" * TF_PREFIX_SUFFIX, limit, source + " (name prefix + 26)"
    return r.name + "-" + "x" * (PULUMI_SUFFIX - 1), limit, source + " (auto-named: name + '-' + 7)"


@pytest.fixture(scope="module", params=("dev", "prod"))
def stack(request: pytest.FixtureRequest) -> Build:
    return example(request.param)


def test_every_aws_type_is_classified(stack: Build) -> None:
    types = {r.type for r in stack.resources if r.type.startswith("aws:")}
    unknown = sorted(types - set(LIMITS) - NO_NAME)
    assert not unknown, f"add these to LIMITS (with AWS's name limit) or NO_NAME: {unknown}"


def test_every_aws_name_fits_its_limit(stack: Build) -> None:
    too_long = []
    for r in stack.resources:
        if not r.type.startswith("aws:") or r.type not in LIMITS:
            continue
        name, limit, source = physical_name(r)
        if len(name) > limit:
            too_long.append(f"{r.type} {r.name!r}: {name!r} is {len(name)} characters, over {limit} ({source})")
    assert not too_long, "\n".join(too_long)


def test_every_kubernetes_name_fits(stack: Build) -> None:
    too_long = []
    for r in stack.resources:
        if r.type == "kubernetes:helm.sh/v3:Release":
            name = r.inputs.get("name") or r.name + "-" + "x" * (K8S_SUFFIX - 1)
            if len(name) > HELM_RELEASE_MAX:
                too_long.append(f"release {name!r}: {len(name)} > {HELM_RELEASE_MAX}")
            continue
        if not r.type.startswith("kubernetes:") or not r.custom:
            continue
        kind = r.type.rsplit(":", 1)[-1]
        metadata = r.inputs.get("metadata") or {}
        name = metadata.get("name") or r.name + "-" + "x" * (K8S_SUFFIX - 1)
        limit = 63 if kind in K8S_LABEL_KINDS else 253
        if len(name) > limit or not re.fullmatch(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?", name):
            too_long.append(f"{kind} {name!r}: {len(name)} characters (at most {limit}, lowercase DNS)")
    assert not too_long, "\n".join(too_long)


def test_the_check_sees_an_auto_named_target_group_of_todays_shape() -> None:
    """The shape the review found: no name given, so pulumi-aws makes one of 33 characters."""
    tg = Registered("aws:lb/targetGroup:TargetGroup", "serving-fleet-dev-gateway", "urn", "", True, {}, {}, "id")
    name, limit, _ = physical_name(tg)
    assert len(name) == 33 > limit == 32
