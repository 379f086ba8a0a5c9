"""The platform's Helm releases: the NVIDIA device plugin (with time-slicing for pools that
share GPUs) and DCGM exporter, KEDA, kube-prometheus-stack (with the Grafana admin Secret it
reads), the cluster autoscaler, and a Prefect server with a worker polling a Kubernetes work
pool. Each is a child of the Platform component, on the system nodes unless it serves GPUs.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence

import pulumi
import pulumi_kubernetes as k8s

from fleet.planning.placement import DEDICATED_KEY, GPU_RESOURCE, MODEL_NODE_TOLERATION, SLICES_LABEL, PlacementPlan
from infra.alerting import SECRET_NAME as ALERTING_SECRET
from infra.alerting import AlertingSettings, alertmanager_values, secret_items
from infra.flow_jobs import WORK_POOL, flow_run_job_template
from infra.monitoring import eks_values
from infra.namespaces import (
    FLOWS_NS,
    KEDA_NS,
    MONITORING_NS,
    ON_SYSTEM,
    PREFECT_AUTH_SECRET,
    PREFECT_DB_SECRET,
    WORKER_SA,
)

PROMETHEUS_URL = f"http://kps-prometheus.{MONITORING_NS}.svc:9090"  # kube-prometheus-stack, fullnameOverride kps
PREFECT_IMAGE_TAG = "3.9.1-python3.11"  # the Prefect release the flows are written against (requirements.lock)
# Every chart at an exact version. The default values and values.schema.json of each, as the
# chart's source has them at that version (tag, commit and date in
# tests/fixtures/charts/SOURCES.json, checked 2026-12-01), are test fixtures: the values below
# are validated against them. Bump a version together with its fixtures.
CHARTS = {
    "nvidia-device-plugin": ("https://nvidia.github.io/k8s-device-plugin", "0.17.1"),
    "keda": ("https://kedacore.github.io/charts", "2.17.2"),
    "kube-prometheus-stack": ("https://prometheus-community.github.io/helm-charts", "79.7.1"),
    "cluster-autoscaler": ("https://kubernetes.github.io/autoscaler", "9.59.0"),
    # Prefect's charts are released together with date versions; PREFECT_IMAGE_TAG pins what runs
    "prefect-server": ("https://prefecthq.github.io/prefect-helm", "2026.8.18172642"),
    "prefect-worker": ("https://prefecthq.github.io/prefect-helm", "2026.8.18172642"),
    # GPU metrics per pod (DCGM_FI_DEV_GPU_UTIL...) for the gpu_utilization scaling trigger
    "dcgm-exporter": ("https://nvidia.github.io/dcgm-exporter/helm-charts", "4.8.2"),
}
STORAGE_CLASS = "gp3"  # the cluster's default: encrypted gp3 volumes through the EBS CSI driver
PROMETHEUS_STORAGE = "50Gi"
GRAFANA_SECRET = "grafana-admin"


def device_plugin_config(plan: PlacementPlan) -> dict[str, str]:
    """Device-plugin configs by name: each node picks one with its ``nvidia.com/device-plugin.config``
    label ("whole", or "slices-N" for N replicas sharing a GPU)."""
    configs = {"whole": "version: v1\n"}
    for slices in sorted({g.gpu_slices for g in plan.node_groups if g.gpus_per_node and g.gpu_slices > 1}):
        configs[f"slices-{slices}"] = (
            "version: v1\nsharing:\n  timeSlicing:\n    resources:\n"
            f"    - name: {GPU_RESOURCE}\n      replicas: {slices}\n"
        )
    return configs


def install_charts(
    name: str,
    child: Callable[..., pulumi.ResourceOptions],
    namespaces: Mapping[str, k8s.core.v1.Namespace],
    *,
    plan: PlacementPlan,
    cluster_name: pulumi.Input[str],
    region: str,
    kubernetes_version: str,
    autoscaler_role_arn: pulumi.Input[str],
    grafana_admin_password: pulumi.Input[str],
    prefect_secrets: Sequence[pulumi.Resource] = (),
    alerting: AlertingSettings | None = None,
    alert_secrets: Mapping[str, pulumi.Input[str]] | None = None,
) -> tuple[k8s.helm.v3.Release, k8s.helm.v3.Release]:
    """Every release, named ``<name>-<chart>``; ``child(*depends)``: the Platform's options for a
    child that waits for ``depends``. Returns (KEDA, kube-prometheus-stack): what the
    runtime's roles and the monitoring objects wait for."""

    def release(chart: str, namespace: str, values: dict, *depends: pulumi.Resource) -> k8s.helm.v3.Release:
        repo, version = CHARTS[chart]
        return k8s.helm.v3.Release(
            f"{name}-{chart}",
            name=chart,
            chart=chart,
            version=version,
            namespace=namespace,
            repository_opts={"repo": repo},
            values=values,
            atomic=True,
            timeout=900,
            opts=child(*depends),
        )

    grafana_admin = k8s.core.v1.Secret(
        f"{name}-grafana-admin",
        metadata={"name": GRAFANA_SECRET, "namespace": MONITORING_NS},
        type="Opaque",
        string_data={"admin-user": "admin", "admin-password": pulumi.Output.secret(grafana_admin_password)},
        opts=child(namespaces[MONITORING_NS]),
    )
    # the receivers' secrets (infra/alerting.py): a Secret the Alertmanager pods mount, so the
    # chart's values (and the Helm release) only name files
    alert_secrets = dict(alert_secrets or {})
    alerting_depends = []
    if alert_secrets:
        alerting_depends.append(
            k8s.core.v1.Secret(
                f"{name}-alerting",
                metadata={"name": ALERTING_SECRET, "namespace": MONITORING_NS},
                type="Opaque",
                string_data={k: pulumi.Output.secret(v) for k, v in secret_items(alert_secrets).items()},
                opts=child(namespaces[MONITORING_NS]),
            )
        )

    on_gpu_nodes = {
        # every GPU node, dedicated ones included, and nowhere else (as the device plugin); every
        # model node also carries Karpenter's model-node taint (fleet.planning.karpenter)
        "tolerations": [
            {"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"},
            {"key": DEDICATED_KEY, "operator": "Exists", "effect": "NoSchedule"},
            dict(MODEL_NODE_TOLERATION),
        ],
        "affinity": {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [{"matchExpressions": [{"key": SLICES_LABEL, "operator": "Exists"}]}]
                }
            }
        },
    }
    release(
        "nvidia-device-plugin",
        "kube-system",
        {"config": {"map": device_plugin_config(plan), "default": "whole"}, **on_gpu_nodes},
    )
    keda = release("keda", KEDA_NS, {"nodeSelector": ON_SYSTEM}, namespaces[KEDA_NS])
    prometheus = release(
        "kube-prometheus-stack",
        MONITORING_NS,
        {
            "fullnameOverride": "kps",
            "prometheus": {
                "prometheusSpec": {
                    "nodeSelector": ON_SYSTEM,
                    "retention": "15d",
                    # pick up ServiceMonitors and rules of every namespace, not only the chart's own
                    "serviceMonitorSelectorNilUsesHelmValues": False,
                    "ruleSelectorNilUsesHelmValues": False,
                    # 15 days of samples outlive the pod: a volume, not an emptyDir
                    "storageSpec": {
                        "volumeClaimTemplate": {
                            "spec": {
                                "storageClassName": STORAGE_CLASS,
                                "accessModes": ["ReadWriteOnce"],
                                "resources": {"requests": {"storage": PROMETHEUS_STORAGE}},
                            }
                        }
                    },
                }
            },
            "alertmanager": alertmanager_values(alerting or AlertingSettings(), set(alert_secrets), ON_SYSTEM),
            **eks_values(),  # no scrape targets or alerts for what EKS hides (its control plane, kube-proxy)
            "grafana": {
                "nodeSelector": ON_SYSTEM,
                "sidecar": {"dashboards": {"enabled": True, "label": "grafana_dashboard"}},
                "admin": {
                    "existingSecret": GRAFANA_SECRET,
                    "userKey": "admin-user",
                    "passwordKey": "admin-password",
                },
            },
            "prometheusOperator": {"nodeSelector": ON_SYSTEM},
        },
        namespaces[MONITORING_NS],
        grafana_admin,
        *alerting_depends,
    )
    release(
        "dcgm-exporter",
        MONITORING_NS,
        {
            **on_gpu_nodes,
            # keep the pod, namespace and container labels DCGM puts on a GPU's samples (the pod
            # using it); without honorLabels they would be renamed exported_* under the exporter's own
            "serviceMonitor": {"enabled": True, "honorLabels": True, "interval": "15s"},
        },
        namespaces[MONITORING_NS],
        prometheus,
    )
    release(
        "cluster-autoscaler",
        "kube-system",
        {
            "autoDiscovery": {"clusterName": cluster_name},
            "awsRegion": region,
            "image": {"tag": f"v{kubernetes_version}.0"},  # the autoscaler's minor follows the cluster's
            "rbac": {
                "serviceAccount": {
                    "name": "cluster-autoscaler",
                    "annotations": {"eks.amazonaws.com/role-arn": autoscaler_role_arn},
                }
            },
            "extraArgs": {"balance-similar-node-groups": True, "skip-nodes-with-local-storage": False},
            "nodeSelector": ON_SYSTEM,
        },
    )
    server = release(
        "prefect-server",
        FLOWS_NS,
        {
            "global": {"prefect": {"image": {"prefectTag": PREFECT_IMAGE_TAG}}},
            # the API behind basic auth: the worker, its flow-run Jobs and `fleet flows deploy`
            # send the auth string (infra/flows_cluster.py); the UI asks for it
            "server": {
                "nodeSelector": ON_SYSTEM,
                "basicAuth": {"enabled": True, "existingSecret": PREFECT_AUTH_SECRET},
            },
            # PostgreSQL on RDS, or a database the stack names (infra/prefect_db.py), not the
            # chart's bundled one: its connection string from a Secret, never in the values
            "postgresql": {"enabled": False},
            "secret": {"create": False},
            "externalDatabase": {"existingSecret": PREFECT_DB_SECRET, "connectionStringSecretKey": "connection-string"},
        },
        namespaces[FLOWS_NS],
        *prefect_secrets,
    )
    release(
        "prefect-worker",
        FLOWS_NS,
        {
            "worker": {
                "image": {"prefectTag": f"{PREFECT_IMAGE_TAG}-kubernetes"},
                "apiConfig": "selfHostedServer",
                "selfHostedServerApiConfig": {
                    "apiUrl": f"http://prefect-server.{FLOWS_NS}.svc.cluster.local:4200/api",
                    # with existingSecret the chart also tells the worker to hand the auth string
                    # on to each Job as a secretKeyRef (PREFECT_INTEGRATIONS_KUBERNETES_WORKER_API_AUTH_STRING_*)
                    "basicAuth": {"enabled": True, "existingSecret": PREFECT_AUTH_SECRET},
                },
                # the worker creates the pool with this template; when the pool exists, the chart's
                # init container (sync-base-job-template) applies it each time a worker pod starts
                "config": {
                    "workPool": WORK_POOL,
                    "type": "kubernetes",
                    "baseJobTemplate": {"configuration": json.dumps(flow_run_job_template())},
                },
                "nodeSelector": ON_SYSTEM,
            },
            # the worker only starts Jobs in this namespace (the chart's Role); no IAM role: the
            # Jobs run as the flows' account (infra/flows_cluster.py), which has one
            "serviceAccount": {"create": True, "name": WORKER_SA},
        },
        namespaces[FLOWS_NS],
        server,
        *prefect_secrets,
    )
    return keda, prometheus
