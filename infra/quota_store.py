"""QuotaStore: the gateways' shared per-tenant quotas, an ElastiCache replication group.

Every gateway pod (and every worker process in it) counts tenants' requests and tokens in
one store, so a quota holds for the fleet rather than per process. The engine is Valkey,
which speaks the Redis protocol (clients use ``rediss://`` URLs and the redis package
unchanged) and is ElastiCache's engine going forward, listed 20 % below Redis OSS per node.

It lives in the private subnets, encrypted in transit (TLS required: plain connections are
refused) and at rest (the service's KMS key), behind the stack's secret ``redisAuthToken``
as its AUTH token. Its security group's only rule lets in TCP 6379 from the nodes' security
group: the EKS cluster security group, which EKS puts on every managed node (the launch
templates name none) and so on the system nodes the gateway runs on; pods use their node's
security groups (the VPC CNI without security groups for pods). ``nodes >= 2`` is Multi-AZ
with automatic failover (a replica in another AZ); 1 is a single node (dev).

``url`` is ``rediss://:<token>@<primary endpoint>:6379/0``, a secret Output: the gateway's
``FLEET_REDIS_URL``. The primary endpoint follows a failover, so the URL does not change.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from urllib.parse import quote

import pulumi
import pulumi_aws as aws

from fleet.planning.stack import RedisNodes
from infra import from_nodes_only

PORT = 6379
ENGINE = "valkey"
DATABASE = 0
SNAPSHOT_DAYS = 1  # a daily snapshot kept a day: quotas' counters survive losing every node
ID_MAX = 40  # ElastiCache's limit on a replication group's ID


def replication_group_id(name: str) -> str:
    """``name`` as ElastiCache takes an ID: lowercase letters, digits and single hyphens,
    starting with a letter, at most 40 characters (a longer name is cut and given a hash of
    itself, so two long names do not collide).

    >>> replication_group_id("serving-fleet-prod-quotas")
    'serving-fleet-prod-quotas'
    """
    cleaned = re.sub(r"-+", "-", re.sub(r"[^a-z0-9]", "-", name.lower())).strip("-")
    if not cleaned[:1].isalpha():
        cleaned = f"q-{cleaned}".rstrip("-")
    if len(cleaned) > ID_MAX:
        digest = hashlib.sha256(name.encode()).hexdigest()[:6]
        cleaned = f"{cleaned[: ID_MAX - 7].rstrip('-')}-{digest}"
    return cleaned


def redis_url(token: str, host: str, port: int = PORT) -> str:
    """The gateways' ``FLEET_REDIS_URL``: TLS (``rediss``), the AUTH token as the password of
    the default user (escaped, though infra/config.py allows only characters that need none)."""
    return f"rediss://:{quote(token, safe='')}@{host}:{port}/{DATABASE}"


@dataclass
class QuotaStoreArgs:
    vpc_id: pulumi.Input[str]
    private_subnet_ids: list[pulumi.Input[str]]
    node_security_group_id: pulumi.Input[str]  # the EKS cluster security group the nodes (and their pods) use
    settings: RedisNodes
    auth_token: pulumi.Input[str]  # a secret Output: the stack's redisAuthToken
    tags: dict[str, str]


class QuotaStore(pulumi.ComponentResource):
    group: aws.elasticache.ReplicationGroup
    primary_endpoint: pulumi.Output[str]
    url: pulumi.Output[str]  # secret

    def __init__(self, name: str, args: QuotaStoreArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__("serving-fleet:infra:QuotaStore", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        s, tags = args.settings, args.tags
        sg_id = from_nodes_only(
            f"{name}-quotas", args.vpc_id, PORT, args.node_security_group_id, "gateway quota store: TLS", tags, child
        )
        subnets = aws.elasticache.SubnetGroup(
            f"{name}-quotas",
            subnet_ids=args.private_subnet_ids,
            description="gateway quota store: the private subnets",
            tags=tags,
            opts=child,
        )
        replicated = s.nodes >= 2
        self.group = aws.elasticache.ReplicationGroup(
            f"{name}-quotas",
            replication_group_id=replication_group_id(f"{name}-quotas"),
            description="shared per-tenant quotas of the fleet's gateways",
            engine=ENGINE,
            engine_version=s.engine_version,
            node_type=s.node_type,
            num_cache_clusters=s.nodes,
            automatic_failover_enabled=replicated,
            multi_az_enabled=replicated,
            port=PORT,
            subnet_group_name=subnets.name,
            security_group_ids=[sg_id],
            at_rest_encryption_enabled=True,  # with the service's KMS key
            transit_encryption_enabled=True,
            transit_encryption_mode="required",  # "preferred" would still take plain-text clients
            auth_token=pulumi.Output.secret(args.auth_token),
            auth_token_update_strategy=s.auth_token_update_strategy,
            snapshot_retention_limit=SNAPSHOT_DAYS,
            tags=tags,
            opts=child,
        )
        self.primary_endpoint = self.group.primary_endpoint_address
        self.url = pulumi.Output.secret(
            pulumi.Output.all(args.auth_token, self.group.primary_endpoint_address).apply(
                lambda v: redis_url(v[0], v[1])
            )
        )
        self.register_outputs({"primary_endpoint": self.primary_endpoint, "url": self.url})
