"""The Prefect server's database and API: PostgreSQL on RDS (or a database the stack names),
its connection string and the API's basic-auth string in Secrets of the flows namespace, read
by the charts through ``existingSecret`` (the keys checked against the vendored chart values
by tests/test_charts.py). Built under Pulumi's mocks (tests/infra_harness.py)."""

from __future__ import annotations

import json

import pytest
from infra_harness import PROJECT, SECRET_CONFIG, Build, build, example, stack_config

from fleet.errors import ConfigError
from infra.flows_cluster import AUTH_ITEM, DATABASE_ITEM, prefect_api_auth
from infra.namespaces import FLOWS_NS, PREFECT_AUTH_SECRET, PREFECT_DB_SECRET

DB_PASSWORD = SECRET_CONFIG[f"{PROJECT}:prefectDbPassword"]
AUTH = prefect_api_auth(DB_PASSWORD)


@pytest.fixture(scope="module")
def dev() -> Build:
    return example("dev")


def _flows_secret(stack: Build, name: str):  # noqa: ANN202 - a Registered
    (found,) = [
        r
        for r in stack.of_type("kubernetes:core/v1:Secret")
        if r.inputs["metadata"].get("name") == name and r.inputs["metadata"].get("namespace") == FLOWS_NS
    ]
    return found


def _server_values(stack: Build) -> dict:
    return next(
        r for r in stack.of_type("kubernetes:helm.sh/v3:Release") if r.inputs["chart"] == "prefect-server"
    ).inputs["values"]


@pytest.mark.parametrize("stack_name", ["dev", "prod"])
def test_prefects_database_is_a_private_encrypted_rds_instance_reached_from_the_nodes_only(stack_name: str) -> None:
    from infra.prefect_db import ENGINE_VERSION, PORT

    stack = example(stack_name)
    prod = stack_name == "prod"
    (db,) = stack.of_type("aws:rds/instance:Instance")
    i = db.inputs
    assert i["engine"] == "postgres" and i["engineVersion"] == ENGINE_VERSION and int(ENGINE_VERSION) >= 16
    assert i["storageEncrypted"] is True and i["publiclyAccessible"] is False and i["storageType"] == "gp3"
    assert i["multiAz"] is prod and i["deletionProtection"] is prod and i["skipFinalSnapshot"] is not prod
    assert i["backupRetentionPeriod"] >= (14 if prod else 1) and "password" in db.secret_inputs
    assert i["password"] == DB_PASSWORD and len(i["identifier"]) <= 63
    (subnets,) = stack.of_type("aws:rds/subnetGroup:SubnetGroup")
    private = {r.urn for r in stack.of_type("aws:ec2/subnet:Subnet") if "private" in r.name}
    assert len(subnets.inputs["subnetIds"]) == len(private) >= 2
    assert all("private" in s for s in subnets.inputs["subnetIds"]), subnets.inputs["subnetIds"]
    (sg,) = [r for r in stack.of_type("aws:ec2/securityGroup:SecurityGroup") if r.name.endswith("-prefect-db")]
    assert not sg.inputs.get("ingress")
    rules = [
        r for r in stack.of_type("aws:vpc/securityGroupIngressRule:SecurityGroupIngressRule") if "prefect-db" in r.name
    ]
    assert [(r.inputs["fromPort"], r.inputs["toPort"], r.inputs["referencedSecurityGroupId"]) for r in rules] == [
        (PORT, PORT, "sg-cluster")
    ]  # the EKS cluster security group, on every node; no CIDR
    assert "cidrIpv4" not in rules[0].inputs
    values = _server_values(stack)
    assert values["postgresql"] == {"enabled": False} and values["secret"] == {"create": False}
    assert values["externalDatabase"] == {
        "existingSecret": PREFECT_DB_SECRET,
        "connectionStringSecretKey": DATABASE_ITEM,
    }
    secret = _flows_secret(stack, PREFECT_DB_SECRET)
    url = secret.inputs["stringData"][DATABASE_ITEM]
    assert "stringData" in secret.secret_inputs
    assert url.startswith(f"postgresql+asyncpg://prefect:{DB_PASSWORD}@") and url.endswith(f":{PORT}/prefect")


def test_an_external_database_from_the_stack_config_replaces_the_rds_instance() -> None:
    config = {**stack_config("dev"), f"{PROJECT}:prefectDatabase": json.dumps({"external_host": "pg.internal.example"})}
    stack = build("dev", config)
    assert stack.of_type("aws:rds/instance:Instance") == []
    url = _flows_secret(stack, PREFECT_DB_SECRET).inputs["stringData"][DATABASE_ITEM]
    assert url == f"postgresql+asyncpg://prefect:{DB_PASSWORD}@pg.internal.example:5432/prefect"


def test_the_prefect_api_has_basic_auth_from_a_secret_derived_from_the_database_password(dev: Build) -> None:
    values = _server_values(dev)
    assert values["server"]["basicAuth"] == {"enabled": True, "existingSecret": PREFECT_AUTH_SECRET}
    secret = _flows_secret(dev, PREFECT_AUTH_SECRET)
    assert "stringData" in secret.secret_inputs and secret.inputs["stringData"][AUTH_ITEM] == AUTH
    user, _, password = AUTH.partition(":")
    assert user == "admin" and len(password) == 64 and DB_PASSWORD not in AUTH
    assert prefect_api_auth(DB_PASSWORD) == AUTH != prefect_api_auth(DB_PASSWORD + "x")  # stable, and its own


def test_a_database_setting_out_of_range_is_one_clear_message_naming_the_key() -> None:
    from infra.config import parse

    raw = {k.partition(":")[2]: v for k, v in stack_config("dev").items() if k.startswith(f"{PROJECT}:")}
    for bad, match in (
        (
            {"storage_gib": 50, "max_storage_gib": 30},
            r"prefectDatabase.max_storage_gib: got 30 — expected an integer >= storage_gib \(50\)",
        ),
        (
            {"external_host": "postgres://pg:5432"},
            r"prefectDatabase.external_host: got 'postgres://pg:5432' — expected a host name",
        ),
    ):
        with pytest.raises(ConfigError, match=match):
            parse({**raw, "prefectDatabase": json.dumps(bad)}, "dev", "us-east-1")
