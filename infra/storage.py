"""ModelStore: the fleet's object store (models bucket) and the bucket its access logs go to.

Both buckets are private (every public-access block on, ACLs disabled), versioned, encrypted
at rest and refuse plain-HTTP requests (``private_bucket``, which infra/analytics.py uses
too). The models bucket holds what ``FLEET_STORE`` points at — model versions, routes,
tenants, the logs' Iceberg tables — encrypted with a KMS key of the stack; overwritten and
deleted objects stay recoverable for ``noncurrent_days`` (a day for the high-churn prefixes,
``CHURN_PREFIXES``, and everything under ``logs/``). The logs bucket takes the load
balancer's and the models bucket's access logs, encrypted with SSE-S3 (the load balancer
cannot write with a KMS key) and expired after ``log_days``.

Under ``logs/`` (``log_rules``): the gateways stage Parquet in ``logs/staging/<table>/...``,
and the committer (a flow) commits it into the Iceberg tables at ``logs/tables/<table>/``
(``data/`` and ``metadata/``), deleting what it committed and dropping partitions older than
the retention itself. Lifecycle is the backstop: a staged file left behind expires after
``STAGED_DAYS``, a rejected one after the retention, a table's data file ``DATA_GRACE_DAYS``
after the retention (the committer has dropped its partition by then, so no snapshot it
keeps still reads it). Metadata files never expire by lifecycle: a table whose current
metadata file were gone could not be read at all.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

import pulumi
import pulumi_aws as aws

from fleet.logs.committer import RETENTION_DAYS
from fleet.logs.staging import REJECTED as LOG_REJECTED
from fleet.logs.staging import STAGING as LOG_STAGING
from fleet.logs.tables import TABLES as LOG_TABLES
from fleet.logs.tables import WAREHOUSE as LOG_TABLE_ROOT

# Prefixes rewritten every few seconds (the change journal, heartbeats, the idle clock) or
# written and deleted (usage parts): their old copies are kept a day, not ``noncurrent_days``
# (S3 honours the shorter of two overlapping expirations), and the delete markers left when
# nothing else remains are removed.
CHURN_PREFIXES = ("changes/", "gateways/", "activity/", "usage/")
CHURN_NONCURRENT_DAYS = 1

# The logs' Iceberg tables (fleet.logs.tables; their committer is a flow) and where their
# objects live in the store: LOG_STAGING, LOG_TABLE_ROOT/<table>/{data,metadata}/, LOG_REJECTED.
LOGS = "logs/"
STAGED_DAYS = 7  # a staged file not committed by then was abandoned
DATA_GRACE_DAYS = 7  # a table's data files expire this long after the retention: a backstop, never first
LOG_NONCURRENT_DAYS = 1  # a committed staged file, a replaced or expired data file: gone for good a day later

ALB_LOG_PREFIX = "alb"
S3_LOG_PREFIX = "s3-access/models/"


@dataclass
class ModelStoreArgs:
    log_days: int  # the access logs (logs bucket)
    noncurrent_days: int
    tags: dict[str, str]
    log_retention_days: int  # the log tables' rows (serving-fleet:logs.retention_days)


def table_data_prefix(table: str) -> str:
    """Where the Iceberg table ``table`` keeps its data files (its metadata is beside, in metadata/)."""
    return f"{LOG_TABLE_ROOT}{table}/data/"


def log_rules(retention_days: int) -> list[dict]:
    """Lifecycle rules of the models bucket for ``logs/`` (the tables' rows are kept ``retention_days``).

    A table's data files never expire before the committer's own retention (its
    ``FLEET_LOG_RETENTION_DAYS``, default ``RETENTION_DAYS``; the flows' environment does not
    carry the stack's value yet) plus the grace: a shorter stack retention would otherwise
    delete files the table still reads.

    Rules may overlap (S3 honours the shorter of two expirations); none that expires current
    objects reaches a table's ``metadata/``."""
    keep_briefly = {"noncurrent_version_expiration": {"noncurrent_days": LOG_NONCURRENT_DAYS}}
    data_days = max(retention_days, RETENTION_DAYS) + DATA_GRACE_DAYS

    def expire(rule_id: str, prefix: str, days: int) -> dict:
        return {"id": rule_id, "status": "Enabled", "filter": {"prefix": prefix}, "expiration": {"days": days}}

    return [
        {
            "id": "logs",
            "status": "Enabled",
            "filter": {"prefix": LOGS},
            **keep_briefly,
            # delete markers left once their noncurrent versions are gone (the committer deletes a lot)
            "expiration": {"expired_object_delete_marker": True},
            "abort_incomplete_multipart_upload": {"days_after_initiation": 1},
        },
        {**expire("logs-staging", LOG_STAGING, STAGED_DAYS), **keep_briefly},
        {**expire("logs-rejected", LOG_REJECTED, retention_days), **keep_briefly},
        *(
            {**expire(f"logs-{table}-data", table_data_prefix(table), data_days), **keep_briefly}
            for table in LOG_TABLES
        ),
    ]


def tls_only(bucket_arn: str) -> dict:
    """Statement denying every request that does not use TLS."""
    return {
        "Sid": "DenyPlainHttp",
        "Effect": "Deny",
        "Principal": "*",
        "Action": "s3:*",
        "Resource": [bucket_arn, f"{bucket_arn}/*"],
        "Condition": {"Bool": {"aws:SecureTransport": "false"}},
    }


def log_delivery(bucket_arn: str, account: str, elb_account_arn: str) -> list[dict]:
    """Statements letting the load balancer and S3 server access logging write their logs."""
    alb = f"{bucket_arn}/{ALB_LOG_PREFIX}/AWSLogs/{account}/*"
    return [
        # regions older than August 2022 deliver as the regional ELB account, newer ones as the service
        {
            "Sid": "AlbLogs",
            "Effect": "Allow",
            "Action": "s3:PutObject",
            "Resource": alb,
            "Principal": {"AWS": elb_account_arn, "Service": "logdelivery.elasticloadbalancing.amazonaws.com"},
        },
        {
            "Sid": "S3AccessLogs",
            "Effect": "Allow",
            "Action": "s3:PutObject",
            "Resource": f"{bucket_arn}/{S3_LOG_PREFIX}*",
            "Principal": {"Service": "logging.s3.amazonaws.com"},
            "Condition": {"StringEquals": {"aws:SourceAccount": account}},
        },
    ]


def private_bucket(
    owner: pulumi.Resource,
    name: str,
    tags: dict[str, str],
    *,
    encryption: dict,
    lifecycle: list[dict],
    delivery: Callable[[pulumi.Output[str]], pulumi.Output[list]] | None = None,
) -> tuple[aws.s3.Bucket, aws.s3.BucketPolicy]:
    """A bucket (a child of ``owner``) with ACLs disabled, every public-access block on,
    versioning, default ``encryption``, ``lifecycle`` rules and a policy refusing plain HTTP
    (plus the statements ``delivery`` gives for the bucket's ARN)."""
    child = pulumi.ResourceOptions(parent=owner)
    bucket = aws.s3.Bucket(name, tags=tags, opts=child)
    aws.s3.BucketOwnershipControls(name, bucket=bucket.id, rule={"object_ownership": "BucketOwnerEnforced"}, opts=child)
    blocked = aws.s3.BucketPublicAccessBlock(
        name,
        bucket=bucket.id,
        block_public_acls=True,
        block_public_policy=True,
        ignore_public_acls=True,
        restrict_public_buckets=True,
        opts=child,
    )
    aws.s3.BucketVersioning(name, bucket=bucket.id, versioning_configuration={"status": "Enabled"}, opts=child)
    aws.s3.BucketServerSideEncryptionConfiguration(name, bucket=bucket.id, rules=[encryption], opts=child)
    aws.s3.BucketLifecycleConfiguration(name, bucket=bucket.id, rules=lifecycle, opts=child)
    allowed = delivery(bucket.arn) if delivery else []

    def policy(arn: str, more: list[dict]) -> str:
        return json.dumps({"Version": "2012-10-17", "Statement": [tls_only(arn), *more]})

    bucket_policy = aws.s3.BucketPolicy(
        name,
        bucket=bucket.id,
        policy=pulumi.Output.all(bucket.arn, allowed).apply(lambda v: policy(v[0], v[1])),
        # a policy put before the block could be public
        opts=pulumi.ResourceOptions(parent=owner, depends_on=[blocked]),
    )
    return bucket, bucket_policy


class ModelStore(pulumi.ComponentResource):
    models_bucket: pulumi.Output[str]
    models_bucket_arn: pulumi.Output[str]
    logs_bucket: pulumi.Output[str]
    key_arn: pulumi.Output[str]

    def __init__(self, name: str, args: ModelStoreArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__("serving-fleet:infra:ModelStore", name, None, opts)
        invoke = pulumi.InvokeOutputOptions(parent=self)
        account = aws.get_caller_identity_output(opts=invoke).account_id
        elb_account = aws.elb.get_service_account_output(opts=invoke).arn
        key = aws.kms.Key(
            f"{name}-models",
            description="encryption of the fleet's models bucket",
            enable_key_rotation=True,
            deletion_window_in_days=30,
            tags=args.tags,
            opts=pulumi.ResourceOptions(parent=self),
        )
        aws.kms.Alias(
            f"{name}-models",
            name=f"alias/{name}-models",
            target_key_id=key.key_id,
            opts=pulumi.ResourceOptions(parent=self),
        )

        logs, logs_policy = private_bucket(
            self,
            f"{name}-logs",
            args.tags,
            encryption={"apply_server_side_encryption_by_default": {"sse_algorithm": "AES256"}},
            lifecycle=[
                {
                    "id": "expire-logs",
                    "status": "Enabled",
                    "filter": {},
                    "expiration": {"days": args.log_days},
                    "noncurrent_version_expiration": {"noncurrent_days": 1},
                    "abort_incomplete_multipart_upload": {"days_after_initiation": 1},
                }
            ],
            delivery=lambda arn: pulumi.Output.all(arn, account, elb_account).apply(lambda v: log_delivery(*v)),
        )
        models, _ = private_bucket(
            self,
            f"{name}-models",
            args.tags,
            encryption={
                "apply_server_side_encryption_by_default": {"sse_algorithm": "aws:kms", "kms_master_key_id": key.arn},
                "bucket_key_enabled": True,  # one data key per bucket and period, not per object: fewer KMS calls
            },
            lifecycle=[
                {
                    "id": "expire-noncurrent",
                    "status": "Enabled",
                    "filter": {},
                    "noncurrent_version_expiration": {"noncurrent_days": args.noncurrent_days},
                    "abort_incomplete_multipart_upload": {"days_after_initiation": 7},
                },
                *(
                    {
                        "id": f"churn-{prefix.rstrip('/')}",
                        "status": "Enabled",
                        "filter": {"prefix": prefix},
                        "noncurrent_version_expiration": {"noncurrent_days": CHURN_NONCURRENT_DAYS},
                        "expiration": {"expired_object_delete_marker": True},
                    }
                    for prefix in CHURN_PREFIXES
                ),
                *log_rules(args.log_retention_days),
            ],
        )
        aws.s3.BucketLogging(
            f"{name}-models",
            bucket=models.id,
            target_bucket=logs.id,
            target_prefix=S3_LOG_PREFIX,
            opts=pulumi.ResourceOptions(parent=self),
        )
        self.models_bucket, self.models_bucket_arn = models.bucket, models.arn
        self.logs_bucket, self.logs_bucket_arn = logs.bucket, logs.arn
        # what writes logs into the bucket (the load balancer) must wait for this: AWS checks
        # that it may write when the writer is configured ("Access Denied" otherwise)
        self.logs_policy = logs_policy
        self.key_arn = key.arn
        self.register_outputs({"models_bucket": models.bucket, "logs_bucket": logs.bucket, "key_arn": key.arn})
