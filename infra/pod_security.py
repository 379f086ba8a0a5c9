"""Pod Security Admission levels of the fleet's namespaces, each with the reason for it.

``enforce`` refuses a pod that breaks the level; ``audit`` records one that would break the
stricter level in the API server's audit log (the control plane logs ``audit``,
infra/cluster.py), so a namespace below ``restricted`` says what keeps it there. The levels
are pinned to the cluster's Kubernetes version (``<level>-version``), so an upgrade does not
change them silently. ``kube-system`` is EKS's, and left as it is.
"""

from __future__ import annotations

from infra.namespaces import FLOWS_NS, GATEWAY_NS, KEDA_NS, MODELS_NS, MONITORING_NS

PREFIX = "pod-security.kubernetes.io"

LEVELS: dict[str, tuple[str, str]] = {  # namespace → (enforce, why)
    GATEWAY_NS: (
        "restricted",
        "the gateway runs as a non-root user, read-only, no capabilities, RuntimeDefault seccomp",
    ),
    KEDA_NS: ("restricted", "KEDA's chart is restricted by default (non-root, capabilities dropped, RuntimeDefault)"),
    FLOWS_NS: (
        "baseline",
        "the Prefect charts' pods keep their default capabilities and the migration Job sets no seccomp "
        "profile: restricted would refuse them",
    ),
    MODELS_NS: (
        "privileged",
        "model pods mount the node's weights cache (a hostPath, shared by the replicas on a node), which "
        "baseline forbids; the GPU itself comes from the device plugin and needs no privilege",
    ),
    MONITORING_NS: (
        "privileged",
        "node-exporter uses the host's network, PID namespace and file system; DCGM exporter reads the "
        "kubelet's pod-resources socket (a hostPath)",
    ),
}


def pod_security_labels(namespace: str, kubernetes_version: str) -> dict[str, str]:
    """The PSA labels of ``namespace``: enforce its level, audit against ``restricted``.

    >>> pod_security_labels("fleet", "1.33")["pod-security.kubernetes.io/enforce"]
    'restricted'
    """
    level, _ = LEVELS[namespace]
    version = f"v{kubernetes_version}"
    return {
        f"{PREFIX}/enforce": level,
        f"{PREFIX}/enforce-version": version,
        f"{PREFIX}/audit": "restricted",
        f"{PREFIX}/audit-version": version,
    }
