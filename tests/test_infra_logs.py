"""The log tables' infrastructure under Pulumi's mocks: the Glue database and the Athena
workgroup (infra/analytics.py), the model store's lifecycle under ``logs/`` (infra/storage.py),
and who may write and commit what (infra/identity.py)."""

from __future__ import annotations

import json
import re

import pytest
from infra_harness import ACCOUNT, REGION, Build, build, example, iam_allows, role_policy, stack_config

STACKS = ("dev", "prod")
TABLES = ("inference", "feedback", "outcomes")  # at least these (fleet.logs.tables.TABLES may add more)
GLUE_NAME = re.compile(r"[a-z][a-z0-9_]{0,254}")  # Glue takes more; Athena wants only these, lowercase
GIB = 2**30


@pytest.fixture(scope="module", params=STACKS)
def stack(request: pytest.FixtureRequest) -> Build:
    return example(request.param)


def _logs_config(stack: str) -> dict:
    return json.loads(stack_config(stack).get("serving-fleet:logs", "{}"))


def _database(stack: Build) -> str:
    return stack.one("aws:glue/catalogDatabase:CatalogDatabase").inputs["name"]


def _store_lifecycle(build_: Build) -> list[dict]:
    bucket = build_.one("aws:s3/bucket:Bucket", "models").state["bucket"]
    (config,) = [
        r.inputs
        for r in build_.of_type("aws:s3/bucketLifecycleConfiguration:BucketLifecycleConfiguration")
        if r.inputs["bucket"] == bucket
    ]
    return config["rules"]


# --- the catalog and Athena -------------------------------------------------------------------


def test_the_log_database_has_a_name_glue_and_athena_take_and_lives_over_the_tables(stack: Build) -> None:
    database = stack.one("aws:glue/catalogDatabase:CatalogDatabase").inputs
    assert GLUE_NAME.fullmatch(database["name"]), database["name"]
    assert database["name"] == f"serving_fleet_{stack.stack}_logs" == stack.outputs["logDatabase"]
    bucket = stack.one("aws:s3/bucket:Bucket", "models").state["bucket"]
    assert database["locationUri"] == f"s3://{bucket}/logs/tables"  # a table made there is logs/tables/<table>


def test_database_names_stay_valid_and_distinct_for_any_stack_name() -> None:
    from infra.analytics import glue_database_name

    names = {
        stack: glue_database_name(f"serving-fleet-{stack}")
        for stack in ("dev", "Prod.EU-1", "a_b", "x" * 300, "x" * 299 + "y", "9lives")
    }
    assert names["Prod.EU-1"] == "serving_fleet_prod_eu_1_logs"
    assert glue_database_name("9-stack") == "logs_9_stack_logs"  # a letter first
    for name in names.values():
        assert GLUE_NAME.fullmatch(name) and len(name) <= 255, name
    assert len(set(names.values())) == len(names)  # the two long ones differ by their digest


def test_the_workgroup_enforces_its_configuration_with_the_byte_cutoff_and_results_in_its_bucket(stack: Build) -> None:
    workgroup = stack.one("aws:athena/workgroup:Workgroup")
    config = workgroup.inputs["configuration"]
    assert config["enforceWorkgroupConfiguration"] is True and config["publishCloudwatchMetricsEnabled"] is True
    limit_gb = _logs_config(stack.stack).get("athena_bytes_scanned_limit_gb", 10)
    assert config["bytesScannedCutoffPerQuery"] == limit_gb * GIB >= 10 * 2**20  # bytes; Athena's floor is 10 MB
    assert config["engineVersion"]["selectedEngineVersion"] == "Athena engine version 3"
    results = stack.one("aws:s3/bucket:Bucket", "athena-results").state["bucket"]
    out = config["resultConfiguration"]
    assert out["outputLocation"] == f"s3://{results}/" and out["expectedBucketOwner"] == ACCOUNT
    key = stack.one("aws:kms/key:Key", "models").state["arn"]
    assert out["encryptionConfiguration"] == {"encryptionOption": "SSE_KMS", "kmsKeyArn": key}
    assert stack.outputs["athenaWorkgroup"] == workgroup.inputs["name"] == f"serving-fleet-{stack.stack}-logs"
    assert stack.outputs["athenaResultsBucket"] == results


def test_the_saved_queries_answer_the_usual_questions_in_the_workgroup_and_database(stack: Build) -> None:
    queries = {q.inputs["name"]: q.inputs for q in stack.of_type("aws:athena/namedQuery:NamedQuery")}
    assert set(queries) == {"p99-latency", "match-rate", "error-rate"}
    assert "status >= 500" in queries["error-rate"]["query"]
    for query in queries.values():
        assert query["database"] == _database(stack) and query["workgroup"] == f"serving-fleet-{stack.stack}-logs"
        assert "ts >= current_timestamp - INTERVAL" in query["query"]  # bounded: hour(ts) partitions are pruned
    assert "approx_percentile(latency_ms, 0.99)" in queries["p99-latency"]["query"]
    assert "GROUP BY tenant" in queries["p99-latency"]["query"]
    assert "avg(CAST(match AS double))" in queries["match-rate"]["query"]
    assert re.search(r"GROUP BY model, version\b", queries["match-rate"]["query"])


SQL_WORDS = {
    "select", "from", "where", "and", "group", "by", "order", "desc", "as", "interval", "day", "cast",
    "double", "is", "not", "null", "current_timestamp", "count", "avg", "approx_percentile",
    "distinct", "case", "when", "then", "end", "date_trunc", "hour",
}  # fmt: skip


def test_the_saved_queries_name_only_their_tables_columns() -> None:
    """Every word of a query that is not SQL, an alias or a literal is a column of its table."""
    pytest.importorskip("pyiceberg")
    from fleet.logs import tables
    from infra.analytics import NAMED_QUERIES

    for key, (_, sql) in NAMED_QUERIES.items():
        (table,) = re.findall(r'FROM "?(\w+)"?', sql)
        assert table in tables.TABLES, key
        columns = set(tables.arrow_schema(table).names)
        bare = re.sub(r"'[^']*'|\b\d+(\.\d+)?\b", " ", sql)  # no string or number literals
        aliases = set(re.findall(r"\bAS (\w+)", bare)) - {"double"}
        words = {w.strip('"') for w in re.findall(r'"?[A-Za-z_]\w*"?', bare)} - {f'"{table}"', table}
        unknown = {w for w in words if w.lower() not in SQL_WORDS and w not in aliases and w != table}
        assert unknown <= columns, (key, unknown - columns)


# --- the store's lifecycle under logs/ --------------------------------------------------------


def _matching(rules: list[dict], key: str) -> list[dict]:
    return [r for r in rules if r["status"] == "Enabled" and key.startswith(r["filter"].get("prefix", ""))]


def _expires_after(rules: list[dict], key: str) -> int | None:
    """Days after which S3 expires the current version of ``key``: the shortest of its rules."""
    days = [r["expiration"]["days"] for r in _matching(rules, key) if "days" in r.get("expiration", {})]
    return min(days) if days else None


def _keys(table: str) -> dict[str, str]:
    return {
        "data": f"logs/tables/{table}/data/model=demo-classifier/ts_hour=2026-12-01-10/00000-0-a1b2.parquet",
        "metadata": f"logs/tables/{table}/metadata/00042-c3d4.metadata.json",
        "manifest": f"logs/tables/{table}/metadata/snap-1-1-e5f6.avro",
        "staged": f"logs/staging/{table}/2026/12/01/10/1796119200000-1796119259000-3f2a9c-000001.parquet",
        "rejected": f"logs/rejected/{table}/2026/12/01/10/1796119200000-1796119259000-3f2a9c-000001.parquet",
    }


def test_log_objects_expire_as_their_kind_needs_and_table_metadata_never(stack: Build) -> None:
    from fleet.logs.tables import TABLES as ALL_TABLES

    rules = _store_lifecycle(stack)
    retention = _logs_config(stack.stack).get("retention_days", 30)
    assert set(TABLES) <= set(ALL_TABLES)
    for table in ALL_TABLES:
        keys = _keys(table)
        assert _expires_after(rules, keys["data"]) == retention + 7  # a backstop after the committer's own expiry
        assert _expires_after(rules, keys["metadata"]) is None and _expires_after(rules, keys["manifest"]) is None
        assert _expires_after(rules, keys["staged"]) == 7
        assert _expires_after(rules, keys["rejected"]) == retention
        data = [r for r in _matching(rules, keys["data"]) if "days" in r.get("expiration", {})]
        assert [r["filter"]["prefix"] for r in data] == [f"logs/tables/{table}/data/"]
    for rule in rules:  # no rule that expires current objects reaches into any table's metadata
        if "days" in rule.get("expiration", {}):
            assert not "logs/tables/inference/metadata/".startswith(rule["filter"].get("prefix", "")), rule["id"]
            assert "/metadata" not in rule["filter"].get("prefix", ""), rule["id"]


def test_under_logs_old_versions_and_unfinished_uploads_go_after_a_day(stack: Build) -> None:
    rules = _store_lifecycle(stack)
    days = json.loads(stack_config(stack.stack)["serving-fleet:noncurrentVersionDays"])
    for key in [*_keys("outcomes").values(), "logs/commits/outcomes/intents/3f2a9c.json"]:
        matching = _matching(rules, key)
        noncurrent = [
            r["noncurrentVersionExpiration"]["noncurrentDays"] for r in matching if "noncurrentVersionExpiration" in r
        ]
        aborts = [
            r["abortIncompleteMultipartUpload"]["daysAfterInitiation"]
            for r in matching
            if "abortIncompleteMultipartUpload" in r
        ]
        assert min(noncurrent) == 1 < days and min(aborts) == 1, key  # S3 honours the shorter of overlapping rules
        assert any(r.get("expiration") == {"expiredObjectDeleteMarker": True} for r in matching), key
    assert _expires_after(rules, "models/demo-classifier/1.2.0/manifest.json") is None  # nothing else expires
    assert (
        min(  # the rest of the store keeps its old versions the configured days
            r["noncurrentVersionExpiration"]["noncurrentDays"] for r in _matching(rules, "routes/demo-classifier.json")
        )
        == days
    )


def test_the_lifecycle_is_one_s3_accepts(stack: Build) -> None:
    rules = _store_lifecycle(stack)
    assert len({r["id"] for r in rules}) == len(rules) <= 1000 and all(len(r["id"]) <= 255 for r in rules)
    for rule in rules:
        expiration = rule.get("expiration", {})
        # S3 refuses a delete-marker cleanup in the same expiration as days or a date
        assert not (expiration.get("expiredObjectDeleteMarker") and {"days", "date"} & set(expiration)), rule["id"]
        assert set(rule["filter"]) <= {"prefix"}, rule["id"]  # no tags: abort-multipart would be refused


def test_the_configured_retention_is_honoured_and_data_never_expires_before_the_committers() -> None:
    """A longer retention moves the backstop; a shorter one moves what the bucket alone keeps
    (rejected files), never a table's data before the committer's own retention (30 days, its
    default: the flows are not told the stack's value yet) plus the grace."""
    config = stack_config("dev")
    config["serving-fleet:logs"] = json.dumps({"retention_days": 14, "athena_bytes_scanned_limit_gb": 0.5})
    built = build("dev", config)
    rules = _store_lifecycle(built)
    for table in TABLES:
        keys = _keys(table)
        assert (_expires_after(rules, keys["data"]), _expires_after(rules, keys["rejected"])) == (37, 14), table
        assert _expires_after(rules, keys["staged"]) == 7 and _expires_after(rules, keys["metadata"]) is None
    cutoff = built.one("aws:athena/workgroup:Workgroup").inputs["configuration"]["bytesScannedCutoffPerQuery"]
    assert cutoff == GIB // 2
    config["serving-fleet:logs"] = json.dumps({"retention_days": 90})
    rules = _store_lifecycle(build("dev", config))
    assert _expires_after(rules, _keys(TABLES[0])["data"]) == 97


def test_the_logs_config_is_checked() -> None:
    from fleet.errors import ConfigError
    from infra.config import parse

    def problems(logs: dict) -> str:
        raw = {
            k.removeprefix("serving-fleet:"): v
            for k, v in stack_config("dev").items()
            if k.startswith("serving-fleet:")
        }
        with pytest.raises(ConfigError) as err:
            parse({**raw, "logs": json.dumps(logs)}, "dev", REGION)
        return str(err.value)

    assert "serving-fleet:logs.retention_days: got 0 — expected an integer >= 1" in problems({"retention_days": 0})
    small = problems({"athena_bytes_scanned_limit_gb": 0.001})  # 1 MB: under Athena's 10 MB
    assert (
        "serving-fleet:logs.athena_bytes_scanned_limit_gb: got 0.001 — expected a number of GB >= 0.009765625 "
        "(10 MB, Athena's smallest cutoff)"
    ) in small
    assert "serving-fleet:logs.athena_bytes_scanned_limit_gb: got inf" in problems(
        {"athena_bytes_scanned_limit_gb": 1e999}
    )
    assert "serving-fleet:logs: unknown key 'retention' — expected one of retention_days" in problems({"retention": 7})


# --- who writes and commits the logs -----------------------------------------------------------


def _catalog(stack: Build) -> tuple[str, str, str]:
    prefix, database = f"arn:aws:glue:{REGION}:{ACCOUNT}", _database(stack)
    return f"{prefix}:catalog", f"{prefix}:database/{database}", f"{prefix}:table/{database}/inference"


def test_the_gateway_stages_logs_and_reads_tables_but_never_writes_them(stack: Build) -> None:
    bucket = stack.one("aws:s3/bucket:Bucket", "models").state["arn"]
    gateway = role_policy(stack, "gateway")
    for table in TABLES:
        keys = _keys(table)
        assert iam_allows(gateway, "s3:PutObject", f"{bucket}/{keys['staged']}"), table
        for kind in ("data", "metadata", "rejected"):
            assert not iam_allows(gateway, "s3:PutObject", f"{bucket}/{keys[kind]}"), (table, kind)
            assert not iam_allows(gateway, "s3:DeleteObject", f"{bucket}/{keys[kind]}"), (table, kind)
        assert iam_allows(gateway, "s3:GetObject", f"{bucket}/{keys['data']}")  # feedback looks up committed rows
    assert not iam_allows(gateway, "s3:PutObject", f"{bucket}/logs/commits/inference/intents/3f2a9c.json")
    catalog, database, table = _catalog(stack)
    for action in ("glue:GetDatabase", "glue:GetTable", "glue:GetTables"):
        assert all(iam_allows(gateway, action, arn) for arn in (catalog, database, table)), action
    for action in ("glue:CreateTable", "glue:UpdateTable", "glue:DeleteTable", "glue:CreateDatabase"):
        assert not iam_allows(gateway, action, table), action
    assert not iam_allows(gateway, "glue:GetTable", table.replace(_database(stack), "another_db"))


def test_the_flows_commit_the_tables_of_their_database_only(stack: Build) -> None:
    bucket = stack.one("aws:s3/bucket:Bucket", "models").state["arn"]
    flows = role_policy(stack, "flows")
    for key in [*_keys("feedback").values(), "logs/commits/feedback/intents/1.json", "logs/committer/lease"]:
        for action in ("s3:GetObject", "s3:PutObject", "s3:DeleteObject"):
            assert iam_allows(flows, action, f"{bucket}/{key}"), (action, key)
    assert iam_allows(flows, "s3:ListBucket", bucket)
    catalog, database, table = _catalog(stack)
    for action in ("glue:CreateTable", "glue:UpdateTable", "glue:GetTable", "glue:GetTables", "glue:GetDatabase"):
        assert all(iam_allows(flows, action, arn) for arn in (catalog, database, table)), action
    other = table.replace(_database(stack), "another_db")
    assert not any(iam_allows(flows, a, other) for a in ("glue:CreateTable", "glue:UpdateTable", "glue:GetTable"))
    assert not iam_allows(flows, "glue:DeleteTable", table) and not iam_allows(flows, "glue:DeleteDatabase", database)


def test_the_gateway_is_told_the_log_catalog(stack: Build) -> None:
    (deployment,) = stack.of_type("kubernetes:apps/v1:Deployment")
    (container,) = deployment.inputs["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["FLEET_LOG_CATALOG"] == f"glue:{_database(stack)}"


def test_the_default_retention_is_the_committers() -> None:
    from fleet.logs.committer import RETENTION_DAYS
    from infra.config_sections import LogSettings

    assert LogSettings().retention_days == RETENTION_DAYS  # a shorter one here would expire files it still reads
