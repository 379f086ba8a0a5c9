"""The flows namespace's side of a flow run: what each Job the Prefect worker starts reads.

The worker (infra/charts.py) starts every run of a deployment ``fleet flows deploy`` made
as a Job of the flows image, with the work pool's base job template (``flow_run_job_template``
there). That Job:

- runs as the ``fleet-flows`` service account, which carries the flows' IAM role (IRSA,
  infra/identity.py) and may deploy models (infra/runtime_access.py); the worker's own
  account only starts Jobs in this namespace;
- reads its environment from the ``fleet-flows`` ConfigMap (``flows_environment``: the store,
  the Kubernetes runtime, the metrics source, the log catalog and retention, the gateways'
  network, the region) and the ``fleet-flows`` Secret (the gateways' admin token), both with
  envFrom, so no value is in a Job manifest or a deployment;
- mounts the stack's policy files (``fleet-flows-policies``) at FLEET_POLICIES.

Beside them, the Prefect server's two Secrets: its database's connection string
(infra/prefect_db.py) and the basic-auth string of its API (``prefect_api_auth``), which the
worker hands on to each Job as a secretKeyRef, never as a value.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import pulumi
import pulumi_kubernetes as k8s

from fleet.runtime.kubernetes.manifests import NAMESPACE as MODELS_NAMESPACE
from infra.charts import PROMETHEUS_URL
from infra.gateway import POLICY_DIR
from infra.namespaces import (
    FLOWS_ENV_CONFIG,
    FLOWS_ENV_SECRET,
    FLOWS_NS,
    FLOWS_POLICIES,
    FLOWS_SA,
    PREFECT_AUTH_SECRET,
    PREFECT_DB_SECRET,
)

ADMIN_TOKEN_ITEM = "FLEET_ADMIN_TOKEN"  # envFrom: the Secret's key is the variable's name
AUTH_ITEM = "auth-string"  # the key both Prefect charts read from basicAuth.existingSecret
DATABASE_ITEM = "connection-string"  # externalDatabase.connectionStringSecretKey of the server chart
PREFECT_API_USER = "admin"
TMP = "/tmp"  # the Jobs' only writable path (an emptyDir; the root file system is read-only)
LABELS = {"app.kubernetes.io/part-of": "serving-fleet", "app.kubernetes.io/component": "flows"}


def prefect_api_auth(secret: str) -> str:
    """``admin:<password>``, the Prefect API's basic auth, derived from a stack secret (the
    database password): no new secret to set, and one that reveals nothing of the password.
    The same secret always gives the same string, so an ``up`` changes nothing."""
    password = hmac.new(secret.encode(), b"prefect-api-auth", hashlib.sha256).hexdigest()
    return f"{PREFECT_API_USER}:{password}"


def flows_environment(
    store_url: str, region: str, log_catalog: str, log_retention_days: int, gateway_networks: str
) -> dict[str, str]:
    """The ``fleet-flows`` ConfigMap: every variable the flows read that is not a secret."""
    return {
        "FLEET_STORE": store_url,
        "FLEET_POLICIES": POLICY_DIR,
        # deploy and stop model versions as Deployments in the models namespace, in-cluster
        "FLEET_RUNTIME": "kubernetes",
        "FLEET_KUBE_NAMESPACE": MODELS_NAMESPACE,
        # canary analysis and monitoring read what Prometheus scraped from every gateway:
        # windows in the past too, and no gateway left out while it restarts
        "FLEET_METRICS": "prometheus",
        "FLEET_PROMETHEUS_URL": PROMETHEUS_URL,
        "FLEET_LOG_CATALOG": log_catalog,
        "FLEET_LOG_RETENTION_DAYS": str(log_retention_days),
        # a route change is pushed to the gateways' pod IPs: only inside the VPC
        "FLEET_GATEWAY_NETWORKS": gateway_networks,
        "FLEET_ACTOR": "prefect-flows",  # who the audit log says acted
        "FLEET_CACHE_DIR": f"{TMP}/fleet-cache",
        "BENTOML_HOME": f"{TMP}/bentoml",
        "HOME": TMP,
        "AWS_REGION": region,
        "AWS_DEFAULT_REGION": region,  # what boto3 reads
    }


@dataclass
class FlowsClusterArgs:
    store_url: pulumi.Input[str]
    region: str
    log_catalog: pulumi.Input[str]  # glue:<database> (infra/analytics.py)
    log_retention_days: int
    gateway_networks: str  # the VPC's CIDR
    policy_files: dict[str, str]
    flows_role_arn: pulumi.Input[str]
    admin_token: pulumi.Input[str]  # a secret Output
    prefect_database_url: pulumi.Input[str]  # a secret Output: postgresql+asyncpg://... (infra/prefect_db.py)
    prefect_auth_from: pulumi.Input[str]  # a secret Output the API's basic auth is derived from


def flows_cluster(
    name: str,
    child: Callable[..., pulumi.ResourceOptions],
    namespaces: Mapping[str, k8s.core.v1.Namespace],
    args: FlowsClusterArgs,
) -> list[pulumi.Resource]:
    """The flows namespace's objects, children of the Platform; returns the Secrets the Prefect
    releases read (they wait for them)."""
    opts = child(namespaces[FLOWS_NS])

    def meta(object_name: str) -> dict:
        return {"name": object_name, "namespace": FLOWS_NS, "labels": LABELS}

    k8s.core.v1.ServiceAccount(
        f"{name}-flows-jobs",
        metadata={**meta(FLOWS_SA), "annotations": {"eks.amazonaws.com/role-arn": args.flows_role_arn}},
        opts=opts,
    )
    environment = pulumi.Output.all(args.store_url, args.log_catalog).apply(
        lambda v: flows_environment(v[0], args.region, v[1], args.log_retention_days, args.gateway_networks)
    )
    k8s.core.v1.ConfigMap(f"{name}-flows-env", metadata=meta(FLOWS_ENV_CONFIG), data=environment, opts=opts)
    k8s.core.v1.ConfigMap(f"{name}-flows-policies", metadata=meta(FLOWS_POLICIES), data=args.policy_files, opts=opts)
    k8s.core.v1.Secret(
        f"{name}-flows-secrets",
        metadata=meta(FLOWS_ENV_SECRET),
        type="Opaque",
        string_data={ADMIN_TOKEN_ITEM: pulumi.Output.secret(args.admin_token)},
        opts=opts,
    )
    auth = k8s.core.v1.Secret(
        f"{name}-prefect-api-auth",
        metadata=meta(PREFECT_AUTH_SECRET),
        type="Opaque",
        string_data={
            AUTH_ITEM: pulumi.Output.secret(pulumi.Output.from_input(args.prefect_auth_from).apply(prefect_api_auth))
        },
        opts=opts,
    )
    database = k8s.core.v1.Secret(
        f"{name}-prefect-database",
        metadata=meta(PREFECT_DB_SECRET),
        type="Opaque",
        string_data={DATABASE_ITEM: pulumi.Output.secret(args.prefect_database_url)},
        opts=opts,
    )
    return [auth, database]
