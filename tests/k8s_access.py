"""Two of Kubernetes' admission and network rules, evaluated in the tests: whether a set of
NetworkPolicies lets a connection through, and the strictest Pod Security Standard a pod
spec meets. Written from the API reference (networking.k8s.io/v1 NetworkPolicy; the Pod
Security Standards page, kubernetes.io/docs/concepts/security/pod-security-standards), for
the fields this project uses; anything else raises rather than guessing."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from typing import Any

NS_LABEL = "kubernetes.io/metadata.name"


@dataclass(frozen=True)
class Endpoint:
    """A pod (namespace, labels, named container ports, IP) or an address outside the cluster."""

    name: str
    ip: str
    namespace: str | None = None  # None: not a pod
    labels: dict[str, str] = field(default_factory=dict)
    ports: dict[str, int] = field(default_factory=dict)  # container port name → number


def _selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    unknown = set(selector) - {"matchLabels", "matchExpressions"}
    if unknown:
        raise ValueError(f"selector fields {unknown} not understood")
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for e in selector.get("matchExpressions", []):
        present, value = e["key"] in labels, labels.get(e["key"])
        ok = {
            "In": present and value in e.get("values", []),
            "NotIn": not present or value not in e.get("values", []),
            "Exists": present,
            "DoesNotExist": not present,
        }[e["operator"]]
        if not ok:
            return False
    return True


def _peer_matches(peer: dict[str, Any], policy_ns: str, other: Endpoint) -> bool:
    if "ipBlock" in peer:
        block = peer["ipBlock"]
        ip = ipaddress.ip_address(other.ip)
        inside = ip in ipaddress.ip_network(block["cidr"])
        return inside and not any(ip in ipaddress.ip_network(c) for c in block.get("except", []))
    if other.namespace is None:
        return False  # pod and namespace selectors select pods only
    if "namespaceSelector" in peer:
        ns_ok = _selects(peer["namespaceSelector"], {NS_LABEL: other.namespace})
    else:
        ns_ok = other.namespace == policy_ns
    return ns_ok and _selects(peer.get("podSelector", {}), other.labels)


def _port_matches(rule_ports: list[dict] | None, port: int, protocol: str, target: Endpoint) -> bool:
    if not rule_ports:
        return True
    for p in rule_ports:
        if p.get("protocol", "TCP") != protocol:
            continue
        if "port" not in p:
            return True
        want = p["port"]
        number = target.ports.get(want) if isinstance(want, str) else int(want)
        if number is None:
            continue  # a named port the target does not have
        if number <= port <= int(p.get("endPort", number)):
            return True
    return False


def _direction_allows(
    policies: list[dict], kind: str, subject: Endpoint, other: Endpoint, port: int, protocol: str, target: Endpoint
) -> bool:
    """Whether the policies selecting ``subject`` for ``kind`` let the connection pass (True
    when none selects it: a pod no policy isolates accepts everything)."""
    key, peers_key = ("ingress", "from") if kind == "Ingress" else ("egress", "to")
    selecting = [
        p
        for p in policies
        if p["metadata"]["namespace"] == subject.namespace
        and kind in p["spec"].get("policyTypes", ["Ingress"])
        and _selects(p["spec"]["podSelector"], subject.labels)
    ]
    if not selecting:
        return True
    for p in selecting:
        for rule in p["spec"].get(key, []):
            peers = rule.get(peers_key)
            peer_ok = not peers or any(_peer_matches(peer, p["metadata"]["namespace"], other) for peer in peers)
            if peer_ok and _port_matches(rule.get("ports"), port, protocol, target):
                return True
    return False


def allowed(policies: list[dict], source: Endpoint, dest: Endpoint, port: int, protocol: str = "TCP") -> bool:
    """Whether ``source`` may open a connection to ``dest``:``port``: its own egress policies
    and ``dest``'s ingress policies must both let it through."""
    egress = source.namespace is None or _direction_allows(policies, "Egress", source, dest, port, protocol, dest)
    ingress = dest.namespace is None or _direction_allows(policies, "Ingress", dest, source, port, protocol, dest)
    return egress and ingress


# --- Pod Security Standards -------------------------------------------------------------------

LEVELS = ("privileged", "baseline", "restricted")  # from least to most strict
BASELINE_CAPABILITIES = {
    "AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD", "NET_BIND_SERVICE",
    "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT",
}  # fmt: skip
RESTRICTED_VOLUMES = {
    "configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim", "projected", "secret",
}  # fmt: skip


def violations(pod: dict[str, Any], level: str) -> list[str]:
    """What in ``pod`` (a pod spec) breaks ``level``; empty when it meets it."""
    if level == "privileged":
        return []
    found: list[str] = []
    containers = [*pod.get("initContainers", []), *pod["containers"]]
    for host in ("hostNetwork", "hostPID", "hostIPC"):
        if pod.get(host):
            found.append(host)
    for v in pod.get("volumes", []):
        if "hostPath" in v:
            found.append(f"hostPath volume {v['name']}")
    for c in containers:
        sc = c.get("securityContext") or {}
        if sc.get("privileged"):
            found.append(f"{c['name']}: privileged")
        added = set((sc.get("capabilities") or {}).get("add", []))
        if added - BASELINE_CAPABILITIES:
            found.append(f"{c['name']}: adds {sorted(added - BASELINE_CAPABILITIES)}")
        if any(p.get("hostPort") for p in c.get("ports", [])):
            found.append(f"{c['name']}: hostPort")
    if level == "baseline":
        return found
    pod_sc = pod.get("securityContext") or {}
    for v in pod.get("volumes", []):
        kinds = set(v) - {"name"}
        if not kinds <= RESTRICTED_VOLUMES:
            found.append(f"volume {v['name']} of type {sorted(kinds)}")
    for c in containers:
        sc = c.get("securityContext") or {}
        if sc.get("allowPrivilegeEscalation") is not False:
            found.append(f"{c['name']}: allowPrivilegeEscalation not false")
        if "ALL" not in (sc.get("capabilities") or {}).get("drop", []):
            found.append(f"{c['name']}: capabilities not dropped (ALL)")
        if set((sc.get("capabilities") or {}).get("add", [])) - {"NET_BIND_SERVICE"}:
            found.append(f"{c['name']}: adds capabilities")
        if not sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot")):
            found.append(f"{c['name']}: runAsNonRoot not set")
        if sc.get("runAsUser", pod_sc.get("runAsUser")) == 0:
            found.append(f"{c['name']}: runs as user 0")
        seccomp = (sc.get("seccompProfile") or pod_sc.get("seccompProfile") or {}).get("type")
        if seccomp not in ("RuntimeDefault", "Localhost"):
            found.append(f"{c['name']}: no RuntimeDefault seccomp profile")
    return found


def strictest(pod: dict[str, Any]) -> str:
    """The strictest Pod Security Standard ``pod`` meets."""
    return next(level for level in reversed(LEVELS) if not violations(pod, level))
