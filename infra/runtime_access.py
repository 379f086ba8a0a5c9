"""The Kubernetes runtime's access to the models namespace: a Role and RoleBinding for the
flows, which deploy model versions, and for the gateway, which reads them and wakes a lazy one
(``fleet.runtime.kubernetes.runtime``); and the model pods' own ServiceAccount, whose IAM role
(``infra.identity.model_policy``) reads the artifacts their replicas fetch. Children of the
Platform component."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import pulumi
import pulumi_kubernetes as k8s

from fleet.runtime.kubernetes.manifests import CONFIG_MAP, MANAGED, MODEL_SERVICE_ACCOUNT
from infra.gateway import NAME as GATEWAY
from infra.namespaces import FLOWS_NS, FLOWS_SA, GATEWAY_NS, MODELS_NS


def runtime_roles(
    name: str,
    child: Callable[..., pulumi.ResourceOptions],
    namespaces: Mapping[str, k8s.core.v1.Namespace],
    keda: k8s.helm.v3.Release,
    model_role_arn: pulumi.Input[str],
) -> None:
    """Roles in the models namespace: the flows deploy model versions; the gateway reads them
    and wakes a lazy one scaled to zero (a patch of its ScaledObject's floor, which the
    admission policy ``fleet-gateway-scaling`` keeps to exactly that)."""
    rules = {
        "model-deployer": [
            {
                "apiGroups": ["apps"],
                "resources": ["deployments"],
                "verbs": ["get", "list", "watch", "create", "patch", "delete"],
            },
            {"apiGroups": [""], "resources": ["services"], "verbs": ["get", "list", "create", "patch", "delete"]},
            {
                "apiGroups": ["policy"],
                "resources": ["poddisruptionbudgets"],
                "verbs": ["get", "create", "patch", "delete"],
            },
            {
                "apiGroups": ["keda.sh"],
                "resources": ["scaledobjects"],
                "verbs": ["get", "create", "patch", "delete"],
            },
            {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]},
            {"apiGroups": [""], "resources": ["configmaps"], "resourceNames": [CONFIG_MAP], "verbs": ["get"]},
        ],
        "model-reader": [
            {"apiGroups": ["apps"], "resources": ["deployments"], "verbs": ["get", "list", "watch"]},
            {"apiGroups": ["keda.sh"], "resources": ["scaledobjects"], "verbs": ["patch"]},
            {"apiGroups": [""], "resources": ["pods", "services"], "verbs": ["get", "list", "watch"]},
            {"apiGroups": [""], "resources": ["configmaps"], "resourceNames": [CONFIG_MAP], "verbs": ["get"]},
        ],
    }
    subjects = {"model-deployer": (FLOWS_SA, FLOWS_NS), "model-reader": (GATEWAY, GATEWAY_NS)}
    for role, role_rules in rules.items():
        opts = child(namespaces[MODELS_NS], keda)
        k8s.rbac.v1.Role(
            f"{name}-{role}",
            metadata={"name": role, "namespace": MODELS_NS, "labels": MANAGED},
            rules=role_rules,
            opts=opts,
        )
        account, ns = subjects[role]
        k8s.rbac.v1.RoleBinding(
            f"{name}-{role}",
            metadata={"name": role, "namespace": MODELS_NS, "labels": MANAGED},
            role_ref={"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": role},
            subjects=[{"kind": "ServiceAccount", "name": account, "namespace": ns}],
            opts=opts,
        )
    # every model Deployment runs as this account (fleet.runtime.kubernetes.manifests): its
    # replicas fetch their weights from the store with its role (IRSA), and nothing else. Its
    # token stays mounted: IRSA is reported to fail without it, and the account has no RBAC binding
    k8s.core.v1.ServiceAccount(
        f"{name}-model-pods",
        metadata={
            "name": MODEL_SERVICE_ACCOUNT,
            "namespace": MODELS_NS,
            "labels": MANAGED,
            "annotations": {"eks.amazonaws.com/role-arn": model_role_arn},
        },
        opts=child(namespaces[MODELS_NS]),
    )
