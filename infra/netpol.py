"""NetworkPolicies: who may open a connection to whom inside the cluster.

Every namespace the fleet owns that serves something (``fleet``, ``models``, ``flows``)
denies ingress by default; what is allowed is listed here, and nothing else:

- **gateways** (``fleet``): their public port (``http``, inference, health, ``/metrics``) and
  gRPC from anywhere — the load balancer's traffic arrives through the NodePort from node
  addresses (``externalTrafficPolicy: Cluster``), Prometheus scrapes ``/metrics`` with its
  token, in-cluster clients use gRPC. Their admin port (and the workers' private ports, which
  the kernel picks from the ephemeral range and the gateways announce) only from the flows
  and from the other gateways, which push admin changes to each other.
- **models** (``models``): the serving port only from the gateways and from Prometheus. The
  kubelet's probes are not subject to NetworkPolicies. Their egress is limited too — DNS, and
  HTTPS to addresses outside the VPC (S3 through its gateway endpoint, STS for IRSA): a model
  server runs third-party code and weights, so it reaches nothing in the VPC, not the quota
  store, the gateways' admin port or the Prefect API.
- **flows** (``flows``): Prefect's server, database, worker and flow-run Jobs talk among
  themselves; nothing from outside the namespace (operators reach the UI with
  ``kubectl port-forward``, which NetworkPolicies do not see).

The quota store is ElastiCache, outside the cluster: NetworkPolicies cannot select it. What
guards it is its security group (the nodes' only, infra/quota_store.py), TLS and the AUTH
token, which only the gateway's Secret holds; the models' egress policy keeps model pods off
it as well. Other egress is open: the flows and gateways need S3, STS, the Kubernetes API and
each other, and an allow-list of AWS's addresses would be out of date before it was applied.
``monitoring`` and ``keda`` are left open: the API server calls their webhooks and metrics API.
"""

from __future__ import annotations

from typing import Any

from fleet.runtime.kubernetes.manifests import BENTO_PORT
from infra.gateway import LABELS as GATEWAY_LABELS

EPHEMERAL_PORTS = (32768, 60999)  # Linux's ip_local_port_range: where a worker's private port is bound
NS_LABEL = "kubernetes.io/metadata.name"  # set on every namespace by the API server
PROMETHEUS_LABELS = {"app.kubernetes.io/name": "prometheus"}  # what prometheus-operator labels its pods
DNS_LABELS = {"k8s-app": "kube-dns"}  # CoreDNS on EKS
# The vpc-cni add-on's configuration that makes its node agent enforce NetworkPolicies (off by
# default on EKS: without it every policy below is accepted and ignored). infra/addons.py passes
# it as the add-on's configuration_values.
VPC_CNI_CONFIGURATION = {"enableNetworkPolicy": "true"}


def _in(namespace: str, pods: dict[str, str] | None = None) -> dict[str, Any]:
    peer: dict[str, Any] = {"namespaceSelector": {"matchLabels": {NS_LABEL: namespace}}}
    if pods is not None:
        peer["podSelector"] = {"matchLabels": pods}
    return peer


def _policy(name: str, namespace: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": name, "namespace": namespace, "labels": {"app.kubernetes.io/part-of": "serving-fleet"}},
        "spec": spec,
    }


def _deny_ingress(namespace: str) -> dict[str, Any]:
    return _policy("default-deny-ingress", namespace, {"podSelector": {}, "policyTypes": ["Ingress"]})


def network_policies(
    gateway_ns: str, models_ns: str, flows_ns: str, monitoring_ns: str, vpc_cidr: str
) -> list[dict[str, Any]]:
    """The NetworkPolicy objects of the fleet's namespaces (pure)."""
    gateways = {"matchLabels": GATEWAY_LABELS}
    low, high = EPHEMERAL_PORTS
    return [
        _deny_ingress(gateway_ns),
        _policy(
            "gateway-public",
            gateway_ns,
            {
                "podSelector": gateways,
                "policyTypes": ["Ingress"],
                "ingress": [{"ports": [{"protocol": "TCP", "port": "http"}, {"protocol": "TCP", "port": "grpc"}]}],
            },
        ),
        _policy(
            "gateway-admin",
            gateway_ns,
            {
                "podSelector": gateways,
                "policyTypes": ["Ingress"],
                "ingress": [
                    {
                        "from": [_in(flows_ns), {"podSelector": gateways}],
                        "ports": [
                            {"protocol": "TCP", "port": "admin"},
                            {"protocol": "TCP", "port": low, "endPort": high},
                        ],
                    }
                ],
            },
        ),
        _deny_ingress(models_ns),
        _policy(
            "models-from-gateways-and-prometheus",
            models_ns,
            {
                "podSelector": {},
                "policyTypes": ["Ingress"],
                "ingress": [
                    {
                        "from": [_in(gateway_ns, GATEWAY_LABELS), _in(monitoring_ns, PROMETHEUS_LABELS)],
                        "ports": [{"protocol": "TCP", "port": BENTO_PORT}],
                    }
                ],
            },
        ),
        _policy(
            "models-egress",
            models_ns,
            {
                "podSelector": {},
                "policyTypes": ["Egress"],
                "egress": [
                    {
                        "to": [_in("kube-system", DNS_LABELS)],
                        "ports": [{"protocol": "UDP", "port": 53}, {"protocol": "TCP", "port": 53}],
                    },
                    {
                        "to": [{"ipBlock": {"cidr": "0.0.0.0/0", "except": [vpc_cidr]}}],
                        "ports": [{"protocol": "TCP", "port": 443}],
                    },
                ],
            },
        ),
        _deny_ingress(flows_ns),
        _policy(
            "flows-within-namespace",
            flows_ns,
            {"podSelector": {}, "policyTypes": ["Ingress"], "ingress": [{"from": [{"podSelector": {}}]}]},
        ),
    ]
