"""Analytics: the catalog of the logs' Iceberg tables and the Athena workgroup that queries them.

- A Glue database (``glue_database_name``) located at ``s3://<models bucket>/logs/tables``.
  The committer (a flow, told ``FLEET_LOG_CATALOG=glue:<database>``) creates the tables
  (``fleet.logs.tables.TABLES``) in it on its first run through pyiceberg's Glue catalog:
  their partition spec, identity(model) and hour(ts), cannot be said through Glue's
  CreateTable, so Pulumi makes the database and not the tables. Each table lives at
  ``logs/tables/<table>`` (where the committer puts it, and where a table made without a
  location would go: the database's and its name), its ``data/`` and ``metadata/`` where
  infra/storage.py's lifecycle rules expect them.
- An Athena workgroup (engine version 3) that overrides what clients ask for: results go to
  a bucket of its own (private, TLS-only, encrypted with the store's KMS key like the tables
  it copies rows from, expired after ``RESULTS_DAYS``), a query that would scan more than
  ``logs.athena_bytes_scanned_limit_gb`` is cancelled, and it publishes CloudWatch metrics.
- Saved queries (``NAMED_QUERIES``) for questions asked most, in that workgroup and database.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

import pulumi
import pulumi_aws as aws

from infra.config_sections import LogSettings
from infra.storage import LOG_TABLE_ROOT, private_bucket

ENGINE = "Athena engine version 3"
RESULTS_DAYS = 7
GLUE_NAME_MAX = 255  # Glue's limit for a database name; Athena's is the same

# The questions users ask, against the tables' columns (fleet.logs.tables): inference (ts,
# tenant, "row", latency_ms; a classifier's request logs a row per input row, and its first,
# "row" = 0, stands for the request) and feedback (a generative model's labels: version,
# match). Each looks back a bounded time: Iceberg prunes the hour(ts) partitions by it.
# A failed request is sampled like an answer, with its HTTP status and no prediction.
NAMED_QUERIES = {
    "p99-latency": (
        "p99 latency per tenant (last 24 hours), slowest first",
        """SELECT tenant, count(*) AS requests, approx_percentile(latency_ms, 0.99) AS p99_latency_ms
FROM inference
WHERE ts >= current_timestamp - INTERVAL '1' DAY AND "row" = 0
GROUP BY tenant
ORDER BY p99_latency_ms DESC""",
    ),
    "error-rate": (
        "Error rate per version per hour (last 24 hours) of the sampled requests: answered 5xx, timed out or unreachable",
        """SELECT model, version, date_trunc('hour', ts) AS hour, count(DISTINCT request_id) AS requests,
  CAST(count(DISTINCT CASE WHEN status >= 500 THEN request_id END) AS double) / count(DISTINCT request_id) AS error_rate
FROM inference
WHERE ts >= current_timestamp - INTERVAL '1' DAY
GROUP BY model, version, date_trunc('hour', ts)
ORDER BY model, version, hour""",
    ),
    "match-rate": (
        "Label match rate per version of each generative model (last 7 days): answers equal to their label",
        """SELECT model, version, count(*) AS labels, avg(CAST(match AS double)) AS match_rate
FROM feedback
WHERE ts >= current_timestamp - INTERVAL '7' DAY AND match IS NOT NULL
GROUP BY model, version
ORDER BY model, version""",
    ),
}


def glue_database_name(prefix: str) -> str:
    """``serving-fleet-dev`` → ``serving_fleet_dev_logs``: a name both Glue and Athena take as
    it is (lowercase letters, digits and underscores, a letter first, at most 255 characters;
    a longer one keeps a digest of the whole so two stacks never share it)."""
    name = re.sub(r"[^a-z0-9_]", "_", f"{prefix}_logs".lower())
    if not name[0].isalpha():
        name = f"logs_{name}"
    if len(name) > GLUE_NAME_MAX:
        digest = hashlib.sha256(name.encode()).hexdigest()[:8]
        name = f"{name[: GLUE_NAME_MAX - len(digest) - 1]}_{digest}"
    return name


def catalog_arns(region: str, account: str, database: str) -> list[str]:
    """What Glue checks a table call against: the catalog, the database and its tables."""
    prefix = f"arn:aws:glue:{region}:{account}"
    return [f"{prefix}:catalog", f"{prefix}:database/{database}", f"{prefix}:table/{database}/*"]


@dataclass
class AnalyticsArgs:
    prefix: str  # the stack's physical-name prefix, serving-fleet-<stack>
    region: str
    store_bucket: pulumi.Input[str]  # the models bucket (FLEET_STORE), where logs/tables/ is
    key_arn: pulumi.Input[str]  # the store's KMS key: the results are rows of the tables
    logs: LogSettings
    tags: dict[str, str]


class Analytics(pulumi.ComponentResource):
    database_name: pulumi.Output[str]
    workgroup_name: pulumi.Output[str]
    results_bucket: pulumi.Output[str]
    catalog_arns: pulumi.Output[list[str]]  # for IAM: catalog, database, its tables
    log_catalog: pulumi.Output[str]  # FLEET_LOG_CATALOG

    def __init__(self, name: str, args: AnalyticsArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__("serving-fleet:infra:Analytics", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        account = aws.get_caller_identity_output(opts=pulumi.InvokeOutputOptions(parent=self)).account_id
        database = aws.glue.CatalogDatabase(
            f"{name}-logs",
            name=glue_database_name(args.prefix),
            description="The fleet's log tables (Iceberg), made by their committer (fleet.logs.committer)",
            location_uri=pulumi.Output.concat("s3://", args.store_bucket, "/", LOG_TABLE_ROOT.rstrip("/")),
            tags=args.tags,
            opts=child,
        )
        results, _ = private_bucket(
            self,
            f"{name}-athena-results",
            args.tags,
            encryption={
                "apply_server_side_encryption_by_default": {
                    "sse_algorithm": "aws:kms",
                    "kms_master_key_id": args.key_arn,
                },
                "bucket_key_enabled": True,
            },
            lifecycle=[
                {
                    "id": "expire-results",
                    "status": "Enabled",
                    "filter": {},
                    "expiration": {"days": RESULTS_DAYS},
                    "noncurrent_version_expiration": {"noncurrent_days": 1},
                    "abort_incomplete_multipart_upload": {"days_after_initiation": 1},
                }
            ],
        )
        workgroup = aws.athena.Workgroup(
            f"{name}-logs",
            name=f"{args.prefix}-logs",
            description="Queries of the fleet's log tables: settings enforced, results kept a week",
            configuration={
                "enforce_workgroup_configuration": True,  # clients cannot pick another result place or drop the cutoff
                "publish_cloudwatch_metrics_enabled": True,
                "bytes_scanned_cutoff_per_query": args.logs.athena_bytes_scanned_limit,
                "engine_version": {"selected_engine_version": ENGINE},
                "result_configuration": {
                    "output_location": pulumi.Output.concat("s3://", results.bucket, "/"),
                    "expected_bucket_owner": account,
                    "encryption_configuration": {"encryption_option": "SSE_KMS", "kms_key_arn": args.key_arn},
                },
            },
            tags=args.tags,
            opts=child,
        )
        for key, (description, query) in NAMED_QUERIES.items():
            aws.athena.NamedQuery(
                f"{name}-{key}",
                name=key,
                description=description,
                database=database.name,
                workgroup=workgroup.name,
                query=query,
                opts=child,
            )
        self.database_name = database.name
        self.workgroup_name = workgroup.name
        self.results_bucket = results.bucket
        self.catalog_arns = pulumi.Output.all(account, database.name).apply(lambda v: catalog_arns(args.region, *v))
        self.log_catalog = pulumi.Output.concat("glue:", database.name)
        self.register_outputs(
            {"database": database.name, "workgroup": workgroup.name, "results_bucket": results.bucket}
        )
