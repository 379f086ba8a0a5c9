"""The Karpenter controller's IAM policy and its interruption queue's resource policy (pure).

The controller policy is Karpenter's published reference (the getting-started
CloudFormation template of KARPENTER_VERSION, vendored as
tests/fixtures/karpenter/cloudformation.yaml): the same statements, Sids and conditions, one
inline policy. What it may create, tag, launch or terminate must carry this cluster's tags
(``kubernetes.io/cluster/<cluster>: owned``, ``eks:eks-cluster-name``, a
``karpenter.sh/nodepool``); it may pass only the Karpenter node role, and only to EC2; it reads
only this cluster's interruption queue. Reads (Describe*) are limited to the region.
"""

from __future__ import annotations

import json

# EventBridge rule → (source, detail-type) the controller acts on. The keys are short: a rule's
# auto-name is "<stack>-karpenter-<key>-" + 7 characters, and EventBridge allows 64.
INTERRUPTION_EVENTS = {
    "spot": ("aws.ec2", "EC2 Spot Instance Interruption Warning"),
    "rebalance": ("aws.ec2", "EC2 Instance Rebalance Recommendation"),
    "state-change": ("aws.ec2", "EC2 Instance State-change Notification"),
    "health": ("aws.health", "AWS Health Event"),
    "reservation": ("aws.ec2", "EC2 Capacity Reservation Instance Interruption Warning"),
}
QUEUE_RETENTION_S = 300  # an interruption warning older than five minutes is moot
QUEUE_CONSUMER_ACTIONS = ("sqs:ReceiveMessage", "sqs:DeleteMessage", "sqs:ChangeMessageVisibility")


def _ec2(region: str, kinds: tuple[str, ...], account: str = "*") -> list[str]:
    return [f"arn:aws:ec2:{region}:{account}:{k}/*" for k in kinds]


def controller_policy(cluster: str, region: str, account: str, node_role_arn: str, queue_arn: str) -> str:
    """Karpenter's reference controller policy, for ``cluster`` in ``region`` of ``account``."""
    owned = {f"aws:ResourceTag/kubernetes.io/cluster/{cluster}": "owned"}
    request_owned = {
        f"aws:RequestTag/kubernetes.io/cluster/{cluster}": "owned",
        "aws:RequestTag/eks:eks-cluster-name": cluster,
    }
    nodepool = {"aws:ResourceTag/karpenter.sh/nodepool": "*"}
    tagged_kinds = ("fleet", "instance", "volume", "network-interface", "launch-template", "spot-instances-request")
    profile = f"arn:aws:iam::{account}:instance-profile/*"
    profile_owned = {**owned, "aws:ResourceTag/topology.kubernetes.io/region": region}
    profile_request = {**request_owned, "aws:RequestTag/topology.kubernetes.io/region": region}
    statements = [
        {
            "Sid": "AllowScopedEC2InstanceAccessActions",
            "Effect": "Allow",
            "Resource": [
                f"arn:aws:ec2:{region}::image/*",
                f"arn:aws:ec2:{region}::snapshot/*",
                *_ec2(region, ("security-group", "subnet", "capacity-reservation", "placement-group")),
            ],
            "Action": ["ec2:RunInstances", "ec2:CreateFleet"],
        },
        {
            "Sid": "AllowScopedEC2LaunchTemplateAccessActions",
            "Effect": "Allow",
            "Resource": f"arn:aws:ec2:{region}:*:launch-template/*",
            "Action": ["ec2:RunInstances", "ec2:CreateFleet"],
            "Condition": {"StringEquals": owned, "StringLike": nodepool},
        },
        {
            "Sid": "AllowScopedEC2InstanceActionsWithTags",
            "Effect": "Allow",
            "Resource": _ec2(region, tagged_kinds),
            "Action": ["ec2:RunInstances", "ec2:CreateFleet", "ec2:CreateLaunchTemplate"],
            "Condition": {
                "StringEquals": request_owned,
                "StringLike": {"aws:RequestTag/karpenter.sh/nodepool": "*"},
            },
        },
        {
            "Sid": "AllowScopedResourceCreationTagging",
            "Effect": "Allow",
            "Resource": _ec2(region, tagged_kinds),
            "Action": "ec2:CreateTags",
            "Condition": {
                "StringEquals": {
                    **request_owned,
                    "ec2:CreateAction": ["RunInstances", "CreateFleet", "CreateLaunchTemplate"],
                },
                "StringLike": {"aws:RequestTag/karpenter.sh/nodepool": "*"},
            },
        },
        {
            "Sid": "AllowScopedResourceTagging",
            "Effect": "Allow",
            "Resource": f"arn:aws:ec2:{region}:*:instance/*",
            "Action": "ec2:CreateTags",
            "Condition": {
                "StringEquals": owned,
                "StringLike": nodepool,
                "StringEqualsIfExists": {"aws:RequestTag/eks:eks-cluster-name": cluster},
                "ForAllValues:StringEquals": {
                    "aws:TagKeys": ["eks:eks-cluster-name", "karpenter.sh/nodeclaim", "Name"]
                },
            },
        },
        {
            "Sid": "AllowScopedDeletion",
            "Effect": "Allow",
            "Resource": _ec2(region, ("instance", "launch-template")),
            "Action": ["ec2:TerminateInstances", "ec2:DeleteLaunchTemplate"],
            "Condition": {"StringEquals": owned, "StringLike": nodepool},
        },
        {
            "Sid": "AllowPassingInstanceRole",
            "Effect": "Allow",
            "Resource": node_role_arn,
            "Action": "iam:PassRole",
            "Condition": {"StringEquals": {"iam:PassedToService": ["ec2.amazonaws.com"]}},
        },
        {
            "Sid": "AllowScopedInstanceProfileCreationActions",
            "Effect": "Allow",
            "Resource": profile,
            "Action": ["iam:CreateInstanceProfile"],
            "Condition": {
                "StringEquals": profile_request,
                "StringLike": {"aws:RequestTag/karpenter.k8s.aws/ec2nodeclass": "*"},
            },
        },
        {
            "Sid": "AllowScopedInstanceProfileTagActions",
            "Effect": "Allow",
            "Resource": profile,
            "Action": ["iam:TagInstanceProfile"],
            "Condition": {
                "StringEquals": {**profile_owned, **profile_request},
                "StringLike": {
                    "aws:ResourceTag/karpenter.k8s.aws/ec2nodeclass": "*",
                    "aws:RequestTag/karpenter.k8s.aws/ec2nodeclass": "*",
                },
            },
        },
        {
            "Sid": "AllowScopedInstanceProfileActions",
            "Effect": "Allow",
            "Resource": profile,
            "Action": [
                "iam:AddRoleToInstanceProfile",
                "iam:RemoveRoleFromInstanceProfile",
                "iam:DeleteInstanceProfile",
            ],
            "Condition": {
                "StringEquals": profile_owned,
                "StringLike": {"aws:ResourceTag/karpenter.k8s.aws/ec2nodeclass": "*"},
            },
        },
        {
            "Sid": "AllowAPIServerEndpointDiscovery",
            "Effect": "Allow",
            "Resource": f"arn:aws:eks:{region}:{account}:cluster/{cluster}",
            "Action": "eks:DescribeCluster",
        },
        {
            "Sid": "AllowInterruptionQueueActions",
            "Effect": "Allow",
            "Resource": queue_arn,
            "Action": ["sqs:DeleteMessage", "sqs:GetQueueUrl", "sqs:ReceiveMessage"],
        },
        {
            "Sid": "AllowZonalShiftStatusReadOnly",
            "Effect": "Allow",
            "Resource": "*",
            "Action": ["arc-zonal-shift:GetManagedResource"],
            "Condition": {
                "StringEquals": {
                    "arc-zonal-shift:ResourceIdentifier": f"arn:aws:eks:{region}:{account}:cluster/{cluster}"
                }
            },
        },
        {
            "Sid": "AllowRegionalReadActions",
            "Effect": "Allow",
            "Resource": "*",
            "Action": [
                "ec2:DescribeCapacityReservations",
                "ec2:DescribeImages",
                "ec2:DescribeInstances",
                "ec2:DescribeInstanceStatus",
                "ec2:DescribeInstanceTypeOfferings",
                "ec2:DescribeInstanceTypes",
                "ec2:DescribeLaunchTemplates",
                "ec2:DescribePlacementGroups",
                "ec2:DescribeSecurityGroups",
                "ec2:DescribeSpotPriceHistory",
                "ec2:DescribeSubnets",
            ],
            "Condition": {"StringEquals": {"aws:RequestedRegion": region}},
        },
        {
            "Sid": "AllowSSMReadActions",
            "Effect": "Allow",
            "Resource": f"arn:aws:ssm:{region}::parameter/aws/service/*",
            "Action": "ssm:GetParameter",
        },
        {"Sid": "AllowPricingReadActions", "Effect": "Allow", "Resource": "*", "Action": "pricing:GetProducts"},
        {
            "Sid": "AllowUnscopedInstanceProfileListAction",
            "Effect": "Allow",
            "Resource": "*",
            "Action": "iam:ListInstanceProfiles",
        },
        {
            "Sid": "AllowInstanceProfileReadActions",
            "Effect": "Allow",
            "Resource": profile,
            "Action": "iam:GetInstanceProfile",
        },
    ]
    return json.dumps({"Version": "2012-10-17", "Statement": statements})


def queue_policy(queue_arn: str, rule_arns: list[str], controller_role_arn: str) -> str:
    """EventBridge (for this stack's rules only) and SQS may send; only the controller role may
    receive and delete; nothing over plain HTTP."""
    return json.dumps(
        {
            "Version": "2012-10-17",
            "Id": "EC2InterruptionPolicy",
            "Statement": [
                {
                    "Sid": "EventsSend",
                    "Effect": "Allow",
                    "Principal": {"Service": "events.amazonaws.com"},
                    "Action": "sqs:SendMessage",
                    "Resource": queue_arn,
                    "Condition": {"ArnEquals": {"aws:SourceArn": rule_arns}},
                },
                {  # as Karpenter's reference policy has it
                    "Sid": "SqsSend",
                    "Effect": "Allow",
                    "Principal": {"Service": "sqs.amazonaws.com"},
                    "Action": "sqs:SendMessage",
                    "Resource": queue_arn,
                },
                {
                    "Sid": "OnlyTheControllerConsumes",
                    "Effect": "Deny",
                    "Principal": "*",
                    "Action": list(QUEUE_CONSUMER_ACTIONS),
                    "Resource": queue_arn,
                    "Condition": {"ArnNotEquals": {"aws:PrincipalArn": controller_role_arn}},
                },
                {
                    "Sid": "DenyHTTP",
                    "Effect": "Deny",
                    "Principal": "*",
                    "Action": "sqs:*",
                    "Resource": queue_arn,
                    "Condition": {"Bool": {"aws:SecureTransport": "false"}},
                },
            ],
        }
    )
