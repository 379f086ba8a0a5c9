"""Where the platform's parts run: the cluster's namespaces, the flows' service accounts and
the objects their Jobs read, and the node selector that keeps platform pods on the system
nodes (model nodes are for models)."""

from __future__ import annotations

from fleet.planning.placement import POOL_LABEL
from flows.serve import FLOWS_CONFIG, FLOWS_NAMESPACE, FLOWS_SECRET, JOB_SERVICE_ACCOUNT
from infra.nodegroups import SYSTEM_GROUP

GATEWAY_NS, MODELS_NS, FLOWS_NS, MONITORING_NS, KEDA_NS = "fleet", "models", FLOWS_NAMESPACE, "monitoring", "keda"
# Two accounts in the flows namespace: the Prefect worker's may only start Jobs there (the
# chart's Role); the Jobs' carries the flows' IAM role and may deploy models (infra/runtime_access.py)
WORKER_SA = "prefect-worker"
FLOWS_SA = JOB_SERVICE_ACCOUNT
FLOWS_ENV_CONFIG, FLOWS_ENV_SECRET = FLOWS_CONFIG, FLOWS_SECRET  # what each flow-run Job reads with envFrom
FLOWS_POLICIES = "fleet-flows-policies"  # the stack's policy files, mounted into each flow-run Job
PREFECT_AUTH_SECRET = "prefect-api-auth"  # key auth-string: basic auth of the Prefect API (server, worker, Jobs)
PREFECT_DB_SECRET = "prefect-database"  # key connection-string: the Prefect server's PostgreSQL
ON_SYSTEM = {POOL_LABEL: SYSTEM_GROUP}
