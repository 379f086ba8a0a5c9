"""The cluster's own rules: ValidatingAdmissionPolicies (CEL, in the API server).

``gpu_pod_policy``: GPU pods must tolerate the GPU taint. ``gateway_scaling_policy``: the
gateway may change nothing of a ScaledObject but a lazy model's floor, from 0 to 1 (or send
that same 1 again: every gateway process that sees the cold start sends the wake). The first,
in detail:

Model pods are created by the Kubernetes runtime and by whoever runs ``kubectl``, not by
Pulumi, so a policy-as-code check of the program's objects cannot see them; the API server
can. A pod (containers and init containers) that asks for ``nvidia.com/gpu`` must tolerate
the GPU nodes' ``nvidia.com/gpu=present:NoSchedule`` taint (its GPUs in limits, equal to any
request, the API server checks itself). The same rules in Python are
``policies/guardrails/fleet_guardrails/compute.py``'s ``pod_gpu_problems``.
"""

from __future__ import annotations

from fleet.planning.placement import GPU_RESOURCE

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
        "matchConstraints": {
            "resourceRules": [
                {"apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE", "UPDATE"], "resources": ["pods"]}
            ]
        },
        "matchConditions": [{"name": "asks-for-gpus", "expression": ASKS_FOR_GPUS_ALONE}],
        "variables": [
            {"name": "containers", "expression": CONTAINERS},
            {"name": "asksForGpus", "expression": ASKS_FOR_GPUS},
        ],
        "validations": [
            {
                "expression": TOLERATES_GPU_TAINT,
                "reason": "Forbidden",
                "message": f"a pod that asks for {GPU_RESOURCE} must tolerate the {GPU_RESOURCE}=present:NoSchedule "
                "taint of the GPU nodes",
            },
        ],
    }
    binding = {"policyName": NAME, "validationActions": ["Deny"]}
    return policy, binding


GATEWAY_SCALING = "fleet-gateway-scaling"
# What the gateway may change in a ScaledObject: a lazy model's floor, from 0 to 1
# (fleet.runtime.kubernetes.runtime KubernetesRuntime.activate wakes a version scaled to zero). Nothing
# else in spec; metadata only as the API server itself moves it. A floor already at 1 may be
# "raised" to 1 again: every gateway process that sees a cold start sends the wake, and the API
# server runs admission on that no-op patch too; refusing it turned a race the fleet wins into
# a 403, a 503 to the caller and the runtime's back-off of up to 120 s.
LAZY_ONLY = "has(oldObject.metadata.labels) && 'fleet.io/loading' in oldObject.metadata.labels && oldObject.metadata.labels['fleet.io/loading'] == 'lazy'"
TO_ONE = (
    "has(oldObject.spec.minReplicaCount) && oldObject.spec.minReplicaCount in [0, 1]"
    " && has(object.spec.minReplicaCount) && object.spec.minReplicaCount == 1"
)
ONLY_THE_FLOOR = (
    "object.spec.all(k, k == 'minReplicaCount' || (k in oldObject.spec && object.spec[k] == oldObject.spec[k]))"
    " && oldObject.spec.all(k, k == 'minReplicaCount' || k in object.spec)"
)
_SERVER_MOVES = "['managedFields', 'resourceVersion', 'generation']"  # what the API server changes on any update
SAME_METADATA = (
    f"object.metadata.all(k, k in {_SERVER_MOVES} || (k in oldObject.metadata && object.metadata[k] == oldObject.metadata[k]))"
    f" && oldObject.metadata.all(k, k in {_SERVER_MOVES} || k in object.metadata)"
)


def gateway_scaling_policy(gateway_account: str, models_namespace: str) -> tuple[dict, dict]:
    """(ValidatingAdmissionPolicy spec, its binding's spec): the gateway's service account may
    only raise a lazy model's ScaledObject's ``minReplicaCount`` from 0 to 1 (or to 1 again) in the models
    namespace (the idle-unload flow, another account, sets it back to 0).

    RBAC cannot say which fields a ``patch`` may touch; without this, the Role that lets the
    gateway wake a lazy version would also let it raise ``maxReplicaCount`` or point a trigger
    at another server. Only the gateway's own requests are evaluated (``matchConditions``)."""
    policy = {
        "failurePolicy": "Fail",
        "matchConstraints": {
            "resourceRules": [
                {
                    "apiGroups": ["keda.sh"],
                    "apiVersions": ["*"],
                    "operations": ["UPDATE"],
                    "resources": ["scaledobjects"],
                }
            ],
            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": models_namespace}},
        },
        "matchConditions": [{"name": "the-gateway", "expression": f"request.userInfo.username == '{gateway_account}'"}],
        "validations": [
            {
                "expression": LAZY_ONLY,
                "reason": "Forbidden",
                "message": "the gateway may wake only a lazy model's ScaledObject (label fleet.io/loading: lazy)",
            },
            {
                "expression": ONLY_THE_FLOOR,
                "reason": "Forbidden",
                "message": "the gateway may change only spec.minReplicaCount of a ScaledObject (scaling a lazy version from zero)",
            },
            {
                "expression": TO_ONE,
                "reason": "Forbidden",
                "message": "the gateway may only raise spec.minReplicaCount from 0 to 1 (or leave it at 1)",
            },
            {
                "expression": SAME_METADATA,
                "reason": "Forbidden",
                "message": "the gateway may not change a ScaledObject's metadata (labels, annotations, owners, finalizers)",
            },
        ],
    }
    binding = {"policyName": GATEWAY_SCALING, "validationActions": ["Deny"]}
    return policy, binding
