"""Where the platform's parts run: the cluster's namespaces, the flows' service account, and
the node selector that keeps platform pods on the system nodes (model nodes are for models)."""

from __future__ import annotations

from fleet.planning.placement import POOL_LABEL
from infra.nodegroups import SYSTEM_GROUP

GATEWAY_NS, MODELS_NS, FLOWS_NS, MONITORING_NS, KEDA_NS = "fleet", "models", "flows", "monitoring", "keda"
FLOWS_SA = "prefect-worker"  # the worker and the flow-run jobs it starts use this account
ON_SYSTEM = {POOL_LABEL: SYSTEM_GROUP}
