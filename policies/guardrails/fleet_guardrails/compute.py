"""GPUs: GPU nodes are tainted, the cluster refuses pods that want GPUs without tolerating
the taint and setting limits (an admission policy the stack must carry), and a stack never
scales past its GPU ceiling (``maxGpus`` from the pack's config).

GPU nodes come from Karpenter NodePools (the model nodes, infra/karpenter.py) and, should a
stack add one, from EKS managed node groups or plain instances: each is checked the same way.
"""

from __future__ import annotations

import math
from typing import Any

from pulumi_policy import (
    EnforcementLevel,
    PolicyConfigSchema,
    ReportViolation,
    ResourceValidationArgs,
    ResourceValidationPolicy,
    StackValidationArgs,
    StackValidationPolicy,
)

from fleet_guardrails._common import (
    GPU_RESOURCE,
    GPU_TAINT_VALUE,
    as_list,
    get,
    gpus_of,
    is_gpu_node_group,
    plain,
)
from fleet_guardrails.karpenter import (
    NODE_POOL,
    gpu_limit,
    gpus_per_node,
    instance_types,
    launches_gpus,
    node_limit,
    pool_name,
    taints,
)

NODE_GROUP = "aws:eks/nodeGroup:NodeGroup"
EC2_INSTANCE = "aws:ec2/instance:Instance"
# where each workload kind keeps its pod spec
POD_SPEC = {
    "kubernetes:core/v1:Pod": ("spec",),
    "kubernetes:apps/v1:Deployment": ("spec", "template", "spec"),
    "kubernetes:apps/v1:StatefulSet": ("spec", "template", "spec"),
    "kubernetes:apps/v1:DaemonSet": ("spec", "template", "spec"),
    "kubernetes:apps/v1:ReplicaSet": ("spec", "template", "spec"),
    "kubernetes:batch/v1:Job": ("spec", "template", "spec"),
    "kubernetes:batch/v1:CronJob": ("spec", "jobTemplate", "spec", "template", "spec"),
}


def _gpu_nodes_tainted(args: ResourceValidationArgs, report: ReportViolation) -> None:
    if args.resource_type == NODE_POOL:
        _node_pool_tainted(args, report)
    elif args.resource_type == NODE_GROUP:
        _node_group_tainted(args, report)


def _node_pool_tainted(args: ResourceValidationArgs, report: ReportViolation) -> None:
    if not launches_gpus(args.props):
        return
    found = taints(args.props)
    if not any(t.get("key") == GPU_RESOURCE and t.get("effect") == "NoSchedule" for t in found):
        got = ", ".join(f"{t.get('key')}={t.get('value')}:{t.get('effect')}" for t in found) or "none"
        report(
            f"GPU NodePool {pool_name(args.props, args.name)} must carry the taint "
            f"{GPU_RESOURCE}={GPU_TAINT_VALUE}:NoSchedule in spec.template.spec.taints (got {got}), "
            "so only pods that asked for GPUs land on its nodes"
        )


def _node_group_tainted(args: ResourceValidationArgs, report: ReportViolation) -> None:
    if not is_gpu_node_group(args.props):
        return
    taints = as_list(args.props.get("taints"))
    if not any(t.get("key") == GPU_RESOURCE and t.get("effect") == "NO_SCHEDULE" for t in taints):
        got = ", ".join(f"{t.get('key')}={t.get('value')}:{t.get('effect')}" for t in taints) or "none"
        report(
            f"GPU node group {args.props.get('nodeGroupName') or args.name} must carry the taint "
            f"{GPU_RESOURCE}={GPU_TAINT_VALUE}:NO_SCHEDULE (got {got}), so only pods that asked for GPUs land there"
        )


def tolerates_gpu_taint(tolerations: Any) -> bool:
    """Does a pod with these tolerations schedule onto a node tainted nvidia.com/gpu=present:NoSchedule?"""
    for t in as_list(tolerations):
        key_ok = t.get("key") == GPU_RESOURCE or (not t.get("key") and t.get("operator") == "Exists")
        effect_ok = t.get("effect") in (None, "", "NoSchedule")
        value_ok = t.get("operator") == "Exists" or t.get("value") == GPU_TAINT_VALUE
        if key_ok and effect_ok and value_ok:
            return True
    return False


def pod_gpu_problems(pod: Any) -> list[str]:
    """What is wrong with how a pod spec asks for GPUs (empty when nothing, or it asks for none)."""
    problems, wants = [], False
    for c in as_list(get(pod, "containers")) + as_list(get(pod, "initContainers")):
        requests, limits = get(c, "resources", "requests", default={}), get(c, "resources", "limits", default={})
        if GPU_RESOURCE not in requests and GPU_RESOURCE not in limits:
            continue
        wants = True
        if GPU_RESOURCE not in limits:
            problems.append(
                f"container {c.get('name')} requests {GPU_RESOURCE} without a limit; expected limits.{GPU_RESOURCE}"
            )
        elif GPU_RESOURCE in requests and str(requests[GPU_RESOURCE]) != str(limits[GPU_RESOURCE]):
            problems.append(
                f"container {c.get('name')} requests {requests[GPU_RESOURCE]} GPUs but limits "
                f"{limits[GPU_RESOURCE]}; expected them equal"
            )
    if wants and not tolerates_gpu_taint(get(pod, "tolerations")):
        problems.append(f"the pod asks for GPUs but does not tolerate the {GPU_RESOURCE}:NoSchedule taint of GPU nodes")
    return problems


def _gpus(resource: Any) -> tuple[int, int | None, list[str]]:
    """(nodes at most, GPUs per node or None if unknown, instance types) of a GPU-bearing resource."""
    if resource.resource_type == NODE_GROUP:
        types = as_list(resource.props.get("instanceTypes"))
        counts = [gpus_of(t) for t in types]
        per_node = None if not types or None in counts else max(counts)
        return int(get(resource.props, "scalingConfig", "maxSize", default=0)), per_node, types
    kind = resource.props.get("instanceType") or ""
    return 1, gpus_of(kind), [kind]


def _node_pool_gpus(r: Any, ceiling: int, report: ReportViolation) -> tuple[int, str] | None:
    """(GPUs at most, how counted) of a NodePool that can launch GPU nodes: its nvidia.com/gpu
    limit, or its node limit × GPUs per node where that is less. Without a GPU limit it is
    refused: Karpenter counts GPUs only against that limit, and the instance types its
    requirements allow need not be ones the pack can count."""
    props = r.props
    if not launches_gpus(props):
        return None
    name = pool_name(props, r.name)
    named, limit = gpu_limit(props)
    if not named:
        unknown = [t for t in instance_types(props) or [] if gpus_of(t) is None]
        also = (
            f"; and it cannot count the GPUs of instance type(s) {', '.join(unknown)} "
            "(not among the GPU types fleet_guardrails/_common.py knows)"
            if unknown
            else ""
        )
        report(
            f"NodePool {name} can launch GPU nodes but has no spec.limits[{GPU_RESOURCE!r}]: no limit of Karpenter's "
            f"bounds the GPUs it adds{also}; expected a GPU limit that keeps the stack within maxGpus {ceiling}",
            r.urn,
        )
        return None
    if limit is None:
        report(
            f"NodePool {name}: spec.limits[{GPU_RESOURCE!r}] is {get(props, 'spec', 'limits', GPU_RESOURCE)!r}; "
            "expected a whole number of GPUs",
            r.urn,
        )
        return None
    gpus, line = math.floor(limit), f"NodePool {name} {math.floor(limit)} by its {GPU_RESOURCE} limit"
    nodes, per_node = node_limit(props), gpus_per_node(props)
    if nodes is not None and per_node is not None and nodes * per_node < gpus:
        gpus, line = nodes * per_node, f"NodePool {name} {nodes} × {per_node} by its node limit"
    return gpus, line


def _gpu_ceiling(args: StackValidationArgs, report: ReportViolation) -> None:
    ceiling = args.get_config()["maxGpus"]
    total, lines = 0, []
    for r in args.resources:
        if r.resource_type == NODE_POOL:
            counted = _node_pool_gpus(r, ceiling, report)
            if counted:
                total += counted[0]
                lines.append(counted[1])
            continue
        if r.resource_type not in (NODE_GROUP, EC2_INSTANCE):
            continue
        if r.resource_type == NODE_GROUP and not is_gpu_node_group(r.props):
            continue
        nodes, per_node, types = _gpus(r)
        if per_node is None:
            report(
                f"{r.name}: cannot count the GPUs of instance type(s) {', '.join(types) or 'none given'}; "
                "expected a GPU instance type the guardrails know (fleet_guardrails/_common.py)",
                r.urn,
            )
            continue
        if per_node:
            total += nodes * per_node
            lines.append(f"{r.name} {nodes} × {per_node}")
    if total > ceiling:
        report(f"this stack can scale to {total} GPUs ({'; '.join(sorted(lines))}); its ceiling maxGpus is {ceiling}")


gpu_node_groups_tainted = ResourceValidationPolicy(
    name="gpu-node-groups-tainted",
    description=f"Karpenter NodePools that can launch GPU nodes, and EKS node groups with GPUs, carry the "
    f"{GPU_RESOURCE} NoSchedule taint.",
    validate=_gpu_nodes_tainted,
    enforcement_level=EnforcementLevel.MANDATORY,
)
VAP = "kubernetes:admissionregistration.k8s.io/v1:ValidatingAdmissionPolicy"
VAP_BINDING = "kubernetes:admissionregistration.k8s.io/v1:ValidatingAdmissionPolicyBinding"


def _gpu_admission(args: StackValidationArgs, report: ReportViolation) -> None:
    """The cluster refuses GPU pods that do not tolerate the taint or set limits: a
    ValidatingAdmissionPolicy on pods whose rules name both, bound with Deny. (The program's
    own workloads are also checked here; model pods are made later, by the runtime, and only
    the API server sees them.)"""
    policies = {}
    for r in args.resources:
        if r.resource_type == VAP:
            spec = r.props.get("spec") or {}
            on_pods = any(
                "pods" in as_list(rule.get("resources")) and "CREATE" in as_list(rule.get("operations"))
                for rule in as_list(get(spec, "matchConstraints", "resourceRules"))
            )
            text = " ".join(str(v.get("expression", "")) for v in as_list(spec.get("validations")))
            if on_pods and GPU_RESOURCE in str(plain(spec)) and "tolerations" in text:
                policies[get(r.props, "metadata", "name")] = r
        path = POD_SPEC.get(r.resource_type)
        if path is not None:
            for problem in pod_gpu_problems(get(r.props, *path)):
                report(
                    f"{r.resource_type.rsplit(':', 1)[1]} {get(r.props, 'metadata', 'name') or r.name}: {problem}",
                    r.urn,
                )
    bound = {
        get(r.props, "spec", "policyName")
        for r in args.resources
        if r.resource_type == VAP_BINDING and "Deny" in as_list(get(r.props, "spec", "validationActions"))
    }
    if not set(policies) & bound:
        report(
            f"no ValidatingAdmissionPolicy bound with Deny refuses pods that ask for {GPU_RESOURCE} without tolerating "
            "its taint; expected infra/admission.py's (model pods are made outside Pulumi)"
        )


gpu_pods_admission = StackValidationPolicy(
    name="gpu-pods-admission",
    description="The cluster itself refuses GPU pods without the GPU toleration (a ValidatingAdmissionPolicy); "
    "the program's own GPU workloads tolerate and set limits.",
    validate=_gpu_admission,
    enforcement_level=EnforcementLevel.MANDATORY,
)
gpu_ceiling = StackValidationPolicy(
    name="gpu-ceiling",
    description="All GPU NodePools at their GPU limits, GPU node groups at their maximum size and GPU instances "
    "stay within the stack's maxGpus.",
    validate=_gpu_ceiling,
    enforcement_level=EnforcementLevel.MANDATORY,
    config_schema=PolicyConfigSchema(properties={"maxGpus": {"type": "integer", "minimum": 0}}, required=["maxGpus"]),
)
