"""Caches: an ElastiCache Redis or Valkey store is encrypted in transit and at rest.

The gateways' quota store holds tenants' names and usage and its AUTH token crosses the
network on every connection, so a replication group must turn on both encryptions, and TLS
must be required rather than preferred ("preferred" still takes plain-text clients). Both
are set explicitly: Redis OSS's default for encryption at rest is off, and at-rest
encryption cannot be turned on after creation. A standalone Redis or Valkey cluster
(``aws.elasticache.Cluster`` outside a replication group) cannot encrypt at rest at all, so
it is refused too. Who may reach a cache is no-open-ingress's business (network.py): port
6379 open to 0.0.0.0/0 is refused like any port but 443.
"""

from __future__ import annotations

from pulumi_policy import EnforcementLevel, ReportViolation, ResourceValidationArgs, ResourceValidationPolicy

REPLICATION_GROUP = "aws:elasticache/replicationGroup:ReplicationGroup"
CLUSTER = "aws:elasticache/cluster:Cluster"
REDIS_ENGINES = {"redis", "valkey"}


def _encrypted(args: ResourceValidationArgs, report: ReportViolation) -> None:
    props = args.props
    if args.resource_type == REPLICATION_GROUP:
        if props.get("atRestEncryptionEnabled") is not True:
            report(
                f"ElastiCache replication group {args.name}: at_rest_encryption_enabled is "
                f"{props.get('atRestEncryptionEnabled')!r}; expected true (it cannot be turned on later)"
            )
        if props.get("transitEncryptionEnabled") is not True:
            report(
                f"ElastiCache replication group {args.name}: transit_encryption_enabled is "
                f"{props.get('transitEncryptionEnabled')!r}; expected true (TLS, and AUTH needs it)"
            )
        elif props.get("transitEncryptionMode") == "preferred":
            report(
                f"ElastiCache replication group {args.name}: transit_encryption_mode is 'preferred', which still "
                "accepts plain-text clients; expected 'required'"
            )
    elif args.resource_type == CLUSTER and not props.get("replicationGroupId"):
        if str(props.get("engine") or "").lower() in REDIS_ENGINES:
            report(
                f"ElastiCache cluster {args.name}: a standalone {props.get('engine')} cluster cannot encrypt at rest; "
                "expected a ReplicationGroup with at_rest_encryption_enabled and transit_encryption_enabled true"
            )


cache_encrypted = ResourceValidationPolicy(
    name="cache-encrypted",
    description="ElastiCache Redis/Valkey replication groups encrypt at rest and require TLS; no standalone Redis clusters.",
    validate=_encrypted,
    enforcement_level=EnforcementLevel.MANDATORY,
)
