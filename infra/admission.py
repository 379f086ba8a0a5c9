"""The cluster's own rule for GPU pods: a ValidatingAdmissionPolicy (CEL, in the API server).

Model pods are created by the Kubernetes runtime and by whoever runs ``kubectl``, not by
Pulumi, so a policy-as-code check of the program's objects cannot see them; the API server
can. A pod (containers and init containers) that asks for ``nvidia.com/gpu`` must tolerate
the GPU nodes' ``nvidia.com/gpu=present:NoSchedule`` taint and state its GPUs in limits (equal
to the request, if it makes one): GPUs are never overcommitted and never land on a pod that
could not be scheduled where they are. The same rule in Python is
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
GPUS_IN_LIMITS = (
    "variables.containers.all(c, !has(c.resources) || !has(c.resources.requests) || "
    f"!({_GPU} in c.resources.requests) || (has(c.resources.limits) && {_GPU} in c.resources.limits && "
    f"string(c.resources.limits[{_GPU}]) == string(c.resources.requests[{_GPU}])))"
)


def gpu_pod_policy() -> tuple[dict, dict]:
    """(ValidatingAdmissionPolicy spec, its binding's spec): refuse, in every namespace."""
    policy = {
        "failurePolicy": "Fail",
        "matchConstraints": {"resourceRules": [{"apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE", "UPDATE"],
                                                "resources": ["pods"]}]},
        "variables": [{"name": "containers", "expression": CONTAINERS},
                      {"name": "asksForGpus", "expression": ASKS_FOR_GPUS}],
        "validations": [
            {"expression": TOLERATES_GPU_TAINT, "reason": "Forbidden",
             "message": f"a pod that asks for {GPU_RESOURCE} must tolerate the {GPU_RESOURCE}=present:NoSchedule "
                        "taint of the GPU nodes"},
            {"expression": GPUS_IN_LIMITS, "reason": "Invalid",
             "message": f"a container that requests {GPU_RESOURCE} must set the same count in limits"},
        ],
    }  # fmt: skip
    binding = {"policyName": NAME, "validationActions": ["Deny"]}
    return policy, binding
