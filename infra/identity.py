"""IAM roles for service accounts (IRSA): each in-cluster workload gets only what it needs.

A role trusts exactly one Kubernetes service account (``system:serviceaccount:<ns>:<name>``)
through the cluster's OIDC provider, and carries one inline policy (or, for an EKS add-on,
the AWS managed policy made for it):

- gateway: read the models bucket; write only what the data plane and its admin API write
  (``GATEWAY_WRITES``: routes, tenants, audit events, version manifests, staged log files,
  its heartbeat, usage and activity records), delete only its heartbeat record, and never touch a version's
  artifact files (an explicit Deny); read the log tables' Glue catalog entries.
- flows (Prefect jobs: rollout, monitor, retrain, the log committer): read and write the
  models bucket; read, create and update the log tables in their Glue database.
- cluster-autoscaler: resize only this cluster's node groups.
- the EBS CSI driver (infra/addons.py): AWS's AmazonEBSCSIDriverPolicy.

Gateway and flows use the store's KMS key only through S3 (``kms:ViaService``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import pulumi
import pulumi_aws as aws


def service_trust(service: str) -> str:
    """Trust policy letting an AWS service (``eks.amazonaws.com``, ...) assume the role."""
    return json.dumps(
        {
            "Version": "2012-10-17",
            "Statement": [{"Effect": "Allow", "Principal": {"Service": service}, "Action": "sts:AssumeRole"}],
        }
    )


def irsa_trust(provider_arn: str, issuer: str, namespace: str, service_account: str) -> str:
    """Trust policy for one service account; ``issuer`` is the OIDC issuer without https://."""
    return json.dumps(
        {
            "Version": "2012-10-17",
            "Statement": [
                {
                    "Effect": "Allow",
                    "Principal": {"Federated": provider_arn},
                    "Action": "sts:AssumeRoleWithWebIdentity",
                    "Condition": {
                        "StringEquals": {
                            f"{issuer}:sub": f"system:serviceaccount:{namespace}:{service_account}",
                            f"{issuer}:aud": "sts.amazonaws.com",
                        }
                    },
                }
            ],
        }
    )


# What the gateway writes, by key prefix (fleet/gateway/ and what its admin API calls):
GATEWAY_WRITES = (
    "routes/*",  # Router: route tables (admin route set / pin / unpin / rollback)
    "tenants/*",  # Tenants: records and key hashes (admin tenant create / revoke)
    "events/*",  # fleet.audit: route revisions and version-state events
    "models/*/*/manifest.json",  # Registry.transition rewrites a version's manifest with its new state
    "logs/staging/*",  # the logs' Parquet, staged for the committer (a flow), which alone writes logs/tables/
    "gateways/*",  # its heartbeat record
    "changes/*",  # fleet.changes: the journal entry after each route or tenant write of the admin API
    "usage/*",  # fleet.usage.meter: its usage per hour (parts usage/<hour>/<gateway>/<n>.json, then the whole hour)
    "activity/*",  # fleet.logs.activity: when it last asked each version (lazy loading's idle clock)
)
GATEWAY_DELETES = (
    "gateways/*",  # its record, withdrawn at shutdown, and records of gateways dead for 5 minutes
    "usage/*/*/*",  # the parts of an hour, once it is written whole (usage/<hour>/<gateway>/<n>.json)
)
# IAM's * matches "/" too, so models/*/*/manifest.json alone would also match a file named
# manifest.json inside an artifact; the explicit Deny keeps artifacts out of reach whatever
# an Allow says.
ARTIFACTS = "models/*/*/artifact/*"
MANIFESTS = "models/*/*/manifest.json"


def _use_store_key(key_arn: str, region: str) -> dict:
    """SSE-KMS: data keys for writes, decryption for reads, and only when S3 asks on the role's behalf."""
    return {
        "Sid": "UseStoreKey",
        "Effect": "Allow",
        "Action": ["kms:Decrypt", "kms:GenerateDataKey"],
        "Resource": key_arn,
        "Condition": {"StringEquals": {"kms:ViaService": f"s3.{region}.amazonaws.com"}},
    }


# The log tables' catalog (infra/analytics.py): the gateway reads committed partitions, the
# committer creates the tables on its first run and commits (a new metadata location) after.
# CreateDatabase because every run first asks pyiceberg to create the namespace if it is
# missing, which calls it and takes "already exists" for yes; on these ARNs it can only ever
# name the database Pulumi made.
GLUE_READ = ("glue:GetDatabase", "glue:GetTable", "glue:GetTables")
GLUE_COMMIT = (*GLUE_READ, "glue:CreateTable", "glue:UpdateTable", "glue:CreateDatabase")


def _log_catalog(sid: str, actions: tuple[str, ...], catalog: list[str]) -> dict:
    """``actions`` on ``catalog``: the ARNs of the Glue catalog, the logs' database and its tables."""
    return {"Sid": sid, "Effect": "Allow", "Action": list(actions), "Resource": list(catalog)}


def gateway_policy(bucket_arn: str, key_arn: str, region: str, catalog: list[str]) -> str:
    """Read the whole store; write only the keys the data plane and the admin API write, never
    artifacts; read the log tables' catalog."""
    return json.dumps(
        {
            "Version": "2012-10-17",
            "Statement": [
                {"Sid": "ListStore", "Effect": "Allow", "Action": "s3:ListBucket", "Resource": bucket_arn},
                {"Sid": "ReadStore", "Effect": "Allow", "Action": "s3:GetObject", "Resource": f"{bucket_arn}/*"},
                {
                    "Sid": "WriteState",
                    "Effect": "Allow",
                    "Action": "s3:PutObject",
                    "Resource": [f"{bucket_arn}/{k}" for k in GATEWAY_WRITES],
                },
                {
                    "Sid": "DeleteOwnRecords",
                    "Effect": "Allow",
                    "Action": "s3:DeleteObject",
                    "Resource": [f"{bucket_arn}/{k}" for k in GATEWAY_DELETES],
                },
                {
                    "Sid": "NeverArtifacts",
                    "Effect": "Deny",
                    "Action": ["s3:PutObject", "s3:DeleteObject"],
                    "Resource": f"{bucket_arn}/{ARTIFACTS}",
                },
                _use_store_key(key_arn, region),
                _log_catalog("ReadLogTables", GLUE_READ, catalog),
            ],
        }
    )


def flows_policy(bucket_arn: str, key_arn: str, region: str, catalog: list[str]) -> str:
    """Read and write the whole store (the committer's logs/ included); create and commit the log tables."""
    return json.dumps(
        {
            "Version": "2012-10-17",
            "Statement": [
                {"Sid": "ListStore", "Effect": "Allow", "Action": "s3:ListBucket", "Resource": bucket_arn},
                {
                    "Sid": "ReadWriteStore",
                    "Effect": "Allow",
                    "Action": ["s3:GetObject", "s3:PutObject", "s3:DeleteObject"],
                    "Resource": f"{bucket_arn}/*",
                },
                _use_store_key(key_arn, region),
                _log_catalog("CommitLogTables", GLUE_COMMIT, catalog),
            ],
        }
    )


def model_policy(bucket_arn: str, key_arn: str, region: str) -> str:
    """A model replica's: read the registered versions' manifests and artifacts (its weights,
    fetched at start, bentos/weights.py), nothing else of the store."""
    return json.dumps(
        {
            "Version": "2012-10-17",
            "Statement": [
                {
                    "Sid": "ReadArtifacts",
                    "Effect": "Allow",
                    "Action": "s3:GetObject",
                    "Resource": [f"{bucket_arn}/{MANIFESTS}", f"{bucket_arn}/{ARTIFACTS}"],
                },
                _use_store_key(key_arn, region),
            ],
        }
    )


def autoscaler_policy(cluster_name: str) -> str:
    # EKS tags the autoscaling groups of its managed node groups with this key, so the
    # write actions reach this cluster's groups and no others
    owned = {"StringEquals": {f"aws:ResourceTag/k8s.io/cluster-autoscaler/{cluster_name}": "owned"}}
    return json.dumps(
        {
            "Version": "2012-10-17",
            "Statement": [
                {
                    "Sid": "Discover",
                    "Effect": "Allow",
                    "Resource": "*",
                    "Action": [
                        "autoscaling:DescribeAutoScalingGroups",
                        "autoscaling:DescribeAutoScalingInstances",
                        "autoscaling:DescribeLaunchConfigurations",
                        "autoscaling:DescribeScalingActivities",
                        "autoscaling:DescribeTags",
                        "ec2:DescribeImages",
                        "ec2:DescribeInstanceTypes",
                        "ec2:DescribeLaunchTemplateVersions",
                        "ec2:GetInstanceTypesFromInstanceRequirements",
                        "eks:DescribeNodegroup",
                    ],
                },
                {
                    "Sid": "ResizeOwnGroups",
                    "Effect": "Allow",
                    "Resource": "*",
                    "Condition": owned,
                    "Action": [
                        "autoscaling:SetDesiredCapacity",
                        "autoscaling:TerminateInstanceInAutoScalingGroup",
                    ],
                },
            ],
        }
    )


@dataclass
class IrsaRoleArgs:
    oidc_provider_arn: pulumi.Input[str]
    oidc_issuer: pulumi.Input[str]  # without https://
    namespace: str
    service_account: str
    policy: pulumi.Input[str] | None  # the inline policy document (JSON), if any
    tags: dict[str, str]
    managed_policies: tuple[str, ...] = ()  # ARNs of AWS managed policies to attach


class IrsaRole(pulumi.ComponentResource):
    """An IAM role that exactly one Kubernetes service account can assume."""

    arn: pulumi.Output[str]

    def __init__(self, name: str, args: IrsaRoleArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__("serving-fleet:infra:IrsaRole", name, None, opts)
        trust = pulumi.Output.all(args.oidc_provider_arn, args.oidc_issuer).apply(
            lambda v: irsa_trust(v[0], v[1], args.namespace, args.service_account)
        )
        role = aws.iam.Role(
            name,
            assume_role_policy=trust,
            tags=args.tags,
            description=f"IRSA for {args.namespace}/{args.service_account}",
            opts=pulumi.ResourceOptions(parent=self),
        )
        if args.policy is not None:
            aws.iam.RolePolicy(name, role=role.id, policy=args.policy, opts=pulumi.ResourceOptions(parent=self))
        for arn in args.managed_policies:
            aws.iam.RolePolicyAttachment(
                f"{name}-{arn.rsplit('/', 1)[1]}",
                role=role.name,
                policy_arn=arn,
                opts=pulumi.ResourceOptions(parent=self),
            )
        self.arn = role.arn
        self.namespace, self.service_account = args.namespace, args.service_account
        self.register_outputs({"arn": role.arn})
