"""The ``fleet-kubernetes`` work pool's base job template: how every flow run becomes a Job.

The starting point is prefect-kubernetes 0.8.0's default
(``KubernetesWorker.get_default_base_job_template()``, kept verbatim in
prefect-kubernetes-job-template.json; tests/test_flows_cluster.py compares them). On it:

- defaults for the flows namespace, the Jobs' service account and requests the namespace's
  quota accepts (``FLOW_JOB_DEFAULTS``);
- an ``env_from`` variable, defaulting to the flows' ConfigMap and Secret (infra/flows_cluster.py):
  a deployment's variables carry it too (flows/serve.py ``job_variables``);
- the stack's policy files mounted at FLEET_POLICIES, /tmp as the one writable path, a
  non-root user (the flows image's, which is the gateway image's) and the restricted Pod
  Security profile's settings, on the system nodes;
- ``completions`` and ``parallelism`` moved to the Job's spec: the default puts them in the
  pod's, where the API server drops them with a warning and a strict schema refuses them.

The worker (the prefect-worker chart) syncs this template into the pool when it starts.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

from flows.serve import ENV_FROM, WORK_POOL
from infra.gateway import POLICY_DIR, USER_ID
from infra.namespaces import FLOWS_NS, FLOWS_POLICIES, FLOWS_SA, ON_SYSTEM

__all__ = ["FLOW_JOB_DEFAULTS", "JOB_TEMPLATE", "WORK_POOL", "flow_run_job_template"]

JOB_TEMPLATE = Path(__file__).with_name("prefect-kubernetes-job-template.json")
FLOW_JOB_DEFAULTS = {
    "namespace": FLOWS_NS,
    "service_account_name": FLOWS_SA,
    "cpu_request": "500m",
    "memory_request": "1Gi",
    "memory_limit": "2Gi",
    "finished_job_ttl": 86400,
}
TMP_SIZE = "10Gi"  # /tmp: retraining's data and checkpoints, packaging's Bento builds
ENV_FROM_VARIABLE = {
    "title": "Environment from",
    "description": "ConfigMaps and Secrets whose keys become the job container's environment (envFrom).",
    "type": "array",
    "items": {"type": "object"},
    "default": ENV_FROM,
}


def flow_run_job_template() -> dict:
    """The work pool's base job template: flow runs as Jobs in the flows namespace, under the
    flows' service account (their IAM role), their environment from the flows' ConfigMap and
    Secret, with requests the namespace quota accepts."""
    template = json.loads(JOB_TEMPLATE.read_text())
    variables = template["variables"]["properties"]
    for name, value in FLOW_JOB_DEFAULTS.items():
        variables[name]["default"] = value
    variables["env_from"] = copy.deepcopy(ENV_FROM_VARIABLE)
    job = template["job_configuration"]["job_manifest"]["spec"]
    pod = job["template"]["spec"]
    for field in ("completions", "parallelism"):
        job[field] = pod.pop(field)
    (container,) = pod["containers"]
    container["envFrom"] = "{{ env_from }}"
    container["volumeMounts"] = [
        {"name": "tmp", "mountPath": "/tmp"},
        {"name": "policies", "mountPath": POLICY_DIR, "readOnly": True},
    ]
    container["securityContext"] = {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }
    pod["securityContext"] = {
        "runAsNonRoot": True,
        "runAsUser": USER_ID,
        "runAsGroup": USER_ID,
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    pod["volumes"] = [
        {"name": "tmp", "emptyDir": {"sizeLimit": TMP_SIZE}},
        {"name": "policies", "configMap": {"name": FLOWS_POLICIES}},
    ]
    pod["nodeSelector"] = ON_SYSTEM
    return template
