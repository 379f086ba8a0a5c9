"""Cluster: the EKS control plane, its OIDC provider (for IRSA) and the role its nodes use.

Access uses EKS access entries (``authentication_mode: API``) rather than the aws-auth
ConfigMap; whoever runs ``pulumi up`` becomes cluster admin, and so does every role in the
stack's ``adminRoleArns`` (an access entry with ``AmazonEKSClusterAdminPolicy``, cluster-wide):
the people who operate the cluster assume that role, rather than sharing the deployer's. Kubernetes secrets are
envelope-encrypted with a KMS key of the stack, and the control plane logs API, audit and
authenticator events.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

import pulumi
import pulumi_aws as aws

from infra.identity import service_trust

NODE_POLICIES = (
    "arn:aws:iam::aws:policy/AmazonEKSWorkerNodePolicy",
    "arn:aws:iam::aws:policy/AmazonEKS_CNI_Policy",
    "arn:aws:iam::aws:policy/AmazonEC2ContainerRegistryReadOnly",  # pull the Bento images
)


@dataclass
class ClusterArgs:
    name: str  # the EKS cluster name, unique per account and region
    version: str
    region: str
    subnet_ids: list[pulumi.Input[str]]  # private and public: EKS places its ENIs in them
    api_access_cidrs: list[str]
    tags: dict[str, str]
    admin_role_arns: list[str] = field(default_factory=list)  # the stack's adminRoleArns


def admin_policy_arn(principal_arn: str) -> str:
    """EKS's cluster-admin access policy, in the principal's partition (aws, aws-cn, aws-us-gov).

    >>> admin_policy_arn("arn:aws:iam::123456789012:role/ops")
    'arn:aws:eks::aws:cluster-access-policy/AmazonEKSClusterAdminPolicy'
    """
    partition = principal_arn.split(":")[1]
    return f"arn:{partition}:eks::aws:cluster-access-policy/AmazonEKSClusterAdminPolicy"


def kubeconfig(name: str, endpoint: str, ca: str, region: str) -> str:
    """A kubeconfig that gets its token from `aws eks get-token` (AWS CLI v2 on the PATH)."""
    return json.dumps(
        {
            "apiVersion": "v1",
            "kind": "Config",
            "current-context": name,
            "clusters": [{"name": name, "cluster": {"server": endpoint, "certificate-authority-data": ca}}],
            "contexts": [{"name": name, "context": {"cluster": name, "user": name}}],
            "users": [
                {
                    "name": name,
                    "user": {
                        "exec": {
                            "apiVersion": "client.authentication.k8s.io/v1beta1",
                            "command": "aws",
                            "args": ["eks", "get-token", "--cluster-name", name, "--region", region],
                            "interactiveMode": "Never",
                        }
                    },
                }
            ],
        }
    )


class Cluster(pulumi.ComponentResource):
    name: pulumi.Output[str]
    version: pulumi.Output[str]
    oidc_provider_arn: pulumi.Output[str]
    oidc_issuer: pulumi.Output[str]
    node_role_arn: pulumi.Output[str]
    security_group_id: pulumi.Output[str]
    kubeconfig: pulumi.Output[str]

    def __init__(self, name: str, args: ClusterArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__("serving-fleet:infra:Cluster", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        role = aws.iam.Role(
            f"{name}-control-plane", assume_role_policy=service_trust("eks.amazonaws.com"), tags=args.tags, opts=child
        )
        attached = aws.iam.RolePolicyAttachment(
            f"{name}-control-plane",
            role=role.name,
            policy_arn="arn:aws:iam::aws:policy/AmazonEKSClusterPolicy",
            opts=child,
        )
        key = aws.kms.Key(
            f"{name}-secrets",
            description=f"envelope encryption of Kubernetes secrets in {args.name}",
            enable_key_rotation=True,
            deletion_window_in_days=30,
            tags=args.tags,
            opts=child,
        )
        cluster = aws.eks.Cluster(
            f"{name}-eks",
            name=args.name,
            version=args.version,
            role_arn=role.arn,
            vpc_config={
                "subnet_ids": args.subnet_ids,
                "endpoint_private_access": True,  # nodes reach the API without leaving the VPC
                "endpoint_public_access": True,
                "public_access_cidrs": args.api_access_cidrs,
            },
            access_config={"authentication_mode": "API", "bootstrap_cluster_creator_admin_permissions": True},
            encryption_config={"provider": {"key_arn": key.arn}, "resources": ["secrets"]},
            enabled_cluster_log_types=["api", "audit", "authenticator"],
            tags=args.tags,
            opts=pulumi.ResourceOptions(parent=self, depends_on=[attached]),
        )
        for arn in args.admin_role_arns:
            # named by the ARN, not its place in the list: removing one role leaves the others alone
            key = hashlib.sha256(arn.encode()).hexdigest()[:8]
            entry = aws.eks.AccessEntry(
                f"{name}-admin-{key}",
                cluster_name=cluster.name,
                principal_arn=arn,
                type="STANDARD",
                tags=args.tags,
                opts=child,
            )
            aws.eks.AccessPolicyAssociation(
                f"{name}-admin-{key}",
                cluster_name=cluster.name,
                principal_arn=entry.principal_arn,
                policy_arn=admin_policy_arn(arn),
                access_scope={"type": "cluster"},
                opts=child,
            )
        issuer_url = cluster.identities.apply(lambda ids: ids[0].oidcs[0].issuer)
        oidc = aws.iam.OpenIdConnectProvider(
            f"{name}-oidc", url=issuer_url, client_id_lists=["sts.amazonaws.com"], tags=args.tags, opts=child
        )
        node_role = aws.iam.Role(
            f"{name}-nodes", assume_role_policy=service_trust("ec2.amazonaws.com"), tags=args.tags, opts=child
        )
        self.node_policy_attachments = [
            aws.iam.RolePolicyAttachment(
                f"{name}-nodes-{arn.rsplit('/', 1)[1]}", role=node_role.name, policy_arn=arn, opts=child
            )
            for arn in NODE_POLICIES
        ]
        self.name = cluster.name
        self.version = cluster.version  # node groups and add-ons follow it
        self.oidc_provider_arn = oidc.arn
        self.oidc_issuer = issuer_url.apply(lambda url: url.removeprefix("https://"))
        self.node_role_arn = node_role.arn
        self.security_group_id = cluster.vpc_config.cluster_security_group_id
        self.kubeconfig = pulumi.Output.secret(
            pulumi.Output.all(cluster.name, cluster.endpoint, cluster.certificate_authority.data).apply(
                lambda v: kubeconfig(v[0], v[1], v[2], args.region)
            )
        )
        self.register_outputs(
            {
                "name": self.name,
                "oidc_provider_arn": self.oidc_provider_arn,
                "node_role_arn": self.node_role_arn,
                "kubeconfig": self.kubeconfig,
            }
        )
