"""The cluster's own rule for GPU pods: a ValidatingAdmissionPolicy (CEL, in the API server).

Model pods are created by the Kubernetes runtime and by whoever runs ``kubectl``, not by
Pulumi, so a policy-as-code check of the program's objects cannot see them; the API server
can. A pod (containers and init containers) that asks for ``nvidia.com/gpu`` must tolerate
the GPU nodes' ``nvidia.com/gpu=present:NoSchedule`` taint (its GPUs in limits, equal to any
request, the API server checks itself). The same rules in Python are
``policies/guardrails/fleet_guardrails/compute.py``'s ``pod_gpu_problems``.
"""

from __future__ import annotations

from fleet.placement import GPU_RESOURCE

NAME = "fleet-gpu-pods"
_GPU = f"'{GPU_RESOURCE}'"
CONTAINERS = "object.spec.containers + (has(object.spec.initContainers) ? object.spec.initContainers : [])"
ASKS_FOR_GPUS = (
    f"variables.containers.exists(c, has(c.resources) && ((has(c.resources.limits) && {_GPU} in c.resources.limits)"
    f" || (has(c.resources.requests) && {_GPU} in c.resources.requests)))"
)
TOLERATES_GPU_TAINT = (
    "!variables.asksForGpus || (has(object.spec.tolerations) && object.spec.tolerations.exists(t, "
    f"(has(t.key) ? t.key == {_GPU} : (has(t.operator) && t.operator == 'Exists')) && "
    "(!has(t.effect) || t.effect == '' || t.effect == 'NoSchedule') && "
    "((has(t.operator) && t.operator == 'Exists') || (has(t.value) && t.value == 'present'))))"
)
# The API server's own pod validation already refuses a container that requests
# nvidia.com/gpu without the same count in limits (extended resources are never
# overcommitted), so this policy only adds the toleration rule; pod_gpu_problems checks both.
# Only pods that ask for GPUs are evaluated at all (matchConditions), so an expression error
# can never stop other pods.
ASKS_FOR_GPUS_ALONE = ASKS_FOR_GPUS.replace("variables.containers", f"({CONTAINERS})")


def gpu_pod_policy() -> tuple[dict, dict]:
    """(ValidatingAdmissionPolicy spec, its binding's spec): refuse, in every namespace."""
    policy = {
        "failurePolicy": "Fail",
        "matchConstraints": {"resourceRules": [{"apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE", "UPDATE"],
                                                "resources": ["pods"]}]},
        "matchConditions": [{"name": "asks-for-gpus", "expression": ASKS_FOR_GPUS_ALONE}],
        "variables": [{"name": "containers", "expression": CONTAINERS},
                      {"name": "asksForGpus", "expression": ASKS_FOR_GPUS}],
        "validations": [
            {"expression": TOLERATES_GPU_TAINT, "reason": "Forbidden",
             "message": f"a pod that asks for {GPU_RESOURCE} must tolerate the {GPU_RESOURCE}=present:NoSchedule "
                        "taint of the GPU nodes"},
        ],
    }  # fmt: skip
    binding = {"policyName": NAME, "validationActions": ["Deny"]}
    return policy, binding
