"""Platform: what runs inside the cluster besides the models.

Namespaces with ResourceQuotas sized from the placement plan; Helm releases of the NVIDIA
device plugin (with time-slicing for pools that share GPUs) and DCGM exporter, KEDA, kube-prometheus-stack,
the cluster autoscaler, and a Prefect server with a worker polling a Kubernetes work pool;
the fleet's Grafana dashboard and alert rules; RBAC for the Kubernetes runtime; the
``fleet-runtime`` ConfigMap it reads; and the gateway. Platform pods stay on the system
nodes: model nodes are for models.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pulumi
import pulumi_kubernetes as k8s

from fleet.catalog.policies.loader import Policies
from fleet.planning.placement import DEDICATED_KEY, GPU_RESOURCE, POOL_LABEL, SLICES_LABEL, PlacementPlan
from fleet.runtime.kubernetes.manifests import CONFIG_MAP, MANAGED, config_map_data
from infra import waited_for
from infra.admission import GATEWAY_SCALING, gateway_scaling_policy, gpu_pod_policy
from infra.admission import NAME as GPU_ADMISSION
from infra.config import GatewaySettings
from infra.gateway import NAME as GATEWAY
from infra.gateway import Gateway, GatewayArgs
from infra.images import GATEWAY_REPOSITORY
from infra.monitoring import alert_rules, dashboard
from infra.nodegroups import SYSTEM_GROUP

GATEWAY_NS, MODELS_NS, FLOWS_NS, MONITORING_NS, KEDA_NS = "fleet", "models", "flows", "monitoring", "keda"
FLOWS_SA = "prefect-worker"  # the worker and the flow-run jobs it starts use this account
WORK_POOL = "fleet-kubernetes"
PROMETHEUS_URL = f"http://kps-prometheus.{MONITORING_NS}.svc:9090"  # kube-prometheus-stack, fullnameOverride kps
ON_SYSTEM = {POOL_LABEL: SYSTEM_GROUP}
PREFECT_IMAGE_TAG = "3.9.1-python3.11"  # the Prefect release the flows are written against (requirements.lock)
# Every chart at an exact version. The default values and values.schema.json of each, as the
# chart's source has them at that version (tag, commit and date in
# tests/fixtures/charts/SOURCES.json, checked 2026-12-01), are test fixtures: the values below
# are validated against them. Bump a version together with its fixtures.
CHARTS = {
    "nvidia-device-plugin": ("https://nvidia.github.io/k8s-device-plugin", "0.17.1"),
    "keda": ("https://kedacore.github.io/charts", "2.17.2"),
    "kube-prometheus-stack": ("https://prometheus-community.github.io/helm-charts", "79.7.1"),
    "cluster-autoscaler": ("https://kubernetes.github.io/autoscaler", "9.43.1"),
    # Prefect's charts are released together with date versions; PREFECT_IMAGE_TAG pins what runs
    "prefect-server": ("https://prefecthq.github.io/prefect-helm", "2026.8.18172642"),
    "prefect-worker": ("https://prefecthq.github.io/prefect-helm", "2026.8.18172642"),
    # GPU metrics per pod (DCGM_FI_DEV_GPU_UTIL...) for the gpu_utilization scaling trigger
    "dcgm-exporter": ("https://nvidia.github.io/dcgm-exporter/helm-charts", "4.8.2"),
}
STORAGE_CLASS = "gp3"  # the cluster's default: encrypted gp3 volumes through the EBS CSI driver
PROMETHEUS_STORAGE = "50Gi"
PREFECT_DB_STORAGE = "20Gi"
GRAFANA_SECRET = "grafana-admin"
# The Kubernetes work pool's base job template: prefect-kubernetes 0.8.0's default
# (KubernetesWorker.get_default_base_job_template(), taken 2026-12-01), with this fleet's
# namespace, service account and default requests (flow_run_job_template sets them).
JOB_TEMPLATE = Path(__file__).with_name("prefect-kubernetes-job-template.json")
FLOW_JOB_DEFAULTS = {
    "namespace": FLOWS_NS,
    "service_account_name": FLOWS_SA,
    "cpu_request": "500m",
    "memory_request": "1Gi",
    "memory_limit": "2Gi",
    "finished_job_ttl": 86400,
}
# Pods that ask for nothing in a namespace with a ResourceQuota are refused; these defaults
# let them in with a bounded size (a LimitRange per namespace with a quota).
LIMIT_DEFAULTS = {"defaultRequest": {"cpu": "250m", "memory": "256Mi"}, "default": {"memory": "1Gi"}}


def flow_run_job_template() -> dict:
    """The work pool's base job template: flow runs as Jobs in the flows namespace, under the
    flows' service account (their IAM role), with requests the namespace quota accepts."""
    template = json.loads(JOB_TEMPLATE.read_text())
    variables = template["variables"]["properties"]
    for name, value in FLOW_JOB_DEFAULTS.items():
        variables[name]["default"] = value
    return template


@dataclass
class PlatformArgs:
    kubeconfig: pulumi.Input[str]
    cluster_name: pulumi.Input[str]
    region: str
    kubernetes_version: str
    plan: PlacementPlan
    policies: Policies
    images: dict[str, pulumi.Output[str]]  # family (and "gateway") → ECR repository URL
    store_url: pulumi.Input[str]
    gateway_role_arn: pulumi.Input[str]
    flows_role_arn: pulumi.Input[str]
    autoscaler_role_arn: pulumi.Input[str]
    gateway: GatewaySettings
    gateway_image_tag: str
    gateway_admin_token: pulumi.Input[str]  # a secret Output
    policy_files: dict[str, str]  # file name → YAML text, mounted into the gateway
    grafana_admin_password: pulumi.Input[str]  # a secret Output
    prefect_db_password: pulumi.Input[str]  # a secret Output
    redis_url: pulumi.Input[str]  # a secret Output: the gateways' FLEET_REDIS_URL
    redis_group: pulumi.Resource  # the quota store's replication group: the gateway waits for it
    vpc_cidr: str = "10.0.0.0/16"  # where gateway pods live: the network pushes between them may use
    gateway_prices: str = "{}"  # the gateway's FLEET_PRICES_FILE (fleet.usage.prices.write_prices of the plan's prices)


def model_quota(plan: PlacementPlan) -> dict[str, str]:
    """ResourceQuota of the models namespace: GPUs are what the node groups can hold; CPU,
    memory and pods allow every model at max_replicas twice over (stable and canary)."""
    units = sum(g.max_size * g.gpus_per_node * g.gpu_slices for g in plan.node_groups)
    cpu = 2 * sum(m.max_replicas * m.cpu for m in plan.models)
    memory = 2 * sum(m.max_replicas * m.memory_gib for m in plan.models)
    pods = 2 * sum(m.max_replicas for m in plan.models)
    return {
        f"requests.{GPU_RESOURCE}": str(units),
        "requests.cpu": f"{cpu:g}",
        "requests.memory": f"{memory:g}Gi",
        "pods": str(pods),
    }


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


class Platform(pulumi.ComponentResource):
    def __init__(self, name: str, args: PlatformArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__("serving-fleet:infra:Platform", name, None, opts)
        provider = k8s.Provider(f"{name}-k8s", kubeconfig=args.kubeconfig, opts=pulumi.ResourceOptions(parent=self))
        # every object waits for what the component does (the nodes and add-ons): without
        # this a chart could start installing before any node exists
        after = waited_for(opts)
        self._opts = pulumi.ResourceOptions(parent=self, provider=provider, depends_on=after)
        self._name = name
        namespaces = {
            ns: k8s.core.v1.Namespace(
                f"{name}-{ns}",
                metadata={"name": ns, "labels": {"app.kubernetes.io/part-of": "serving-fleet"}},
                opts=self._opts,
            )
            for ns in (GATEWAY_NS, MODELS_NS, FLOWS_NS, MONITORING_NS, KEDA_NS)
        }
        gw = args.gateway
        quotas = {
            MODELS_NS: model_quota(args.plan),
            GATEWAY_NS: {
                f"requests.{GPU_RESOURCE}": "0",
                "requests.cpu": f"{2 * gw.max_replicas * gw.cpu:g}",
                "requests.memory": f"{2 * gw.max_replicas * gw.memory_gib:g}Gi",
                "pods": str(2 * gw.max_replicas),
            },
            FLOWS_NS: {f"requests.{GPU_RESOURCE}": "0", "requests.cpu": "16", "requests.memory": "64Gi", "pods": "50"},
        }
        for ns, hard in quotas.items():
            k8s.core.v1.ResourceQuota(
                f"{name}-{ns}-quota",
                metadata={"name": "fleet-quota", "namespace": ns},
                spec={"hard": hard},
                opts=self._child(namespaces[ns]),
            )
            k8s.core.v1.LimitRange(
                f"{name}-{ns}-limits",
                metadata={"name": "fleet-defaults", "namespace": ns},
                spec={"limits": [{"type": "Container", **LIMIT_DEFAULTS}]},
                opts=self._child(namespaces[ns]),
            )
        k8s.storage.v1.StorageClass(
            f"{name}-{STORAGE_CLASS}",
            metadata={"name": STORAGE_CLASS, "annotations": {"storageclass.kubernetes.io/is-default-class": "true"}},
            provisioner="ebs.csi.aws.com",
            volume_binding_mode="WaitForFirstConsumer",
            allow_volume_expansion=True,
            parameters={"type": "gp3", "encrypted": "true"},
            reclaim_policy="Delete",
            opts=self._opts,
        )
        policy, binding = gpu_pod_policy()
        gpu_policy = k8s.admissionregistration.v1.ValidatingAdmissionPolicy(
            f"{name}-gpu-pods", metadata={"name": GPU_ADMISSION}, spec=policy, opts=self._opts
        )
        k8s.admissionregistration.v1.ValidatingAdmissionPolicyBinding(
            f"{name}-gpu-pods", metadata={"name": GPU_ADMISSION}, spec=binding, opts=self._child(gpu_policy)
        )
        policy, binding = gateway_scaling_policy(f"system:serviceaccount:{GATEWAY_NS}:{GATEWAY}", MODELS_NS)
        scaling_policy = k8s.admissionregistration.v1.ValidatingAdmissionPolicy(
            f"{name}-gateway-scaling", metadata={"name": GATEWAY_SCALING}, spec=policy, opts=self._opts
        )
        k8s.admissionregistration.v1.ValidatingAdmissionPolicyBinding(
            f"{name}-gateway-scaling",
            metadata={"name": GATEWAY_SCALING},
            spec=binding,
            opts=self._child(scaling_policy),
        )
        grafana_admin = k8s.core.v1.Secret(
            f"{name}-grafana-admin",
            metadata={"name": GRAFANA_SECRET, "namespace": MONITORING_NS},
            type="Opaque",
            string_data={"admin-user": "admin", "admin-password": pulumi.Output.secret(args.grafana_admin_password)},
            opts=self._child(namespaces[MONITORING_NS]),
        )

        on_gpu_nodes = {
            # every GPU node, dedicated ones included, and nowhere else (as the device plugin)
            "tolerations": [
                {"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"},
                {"key": DEDICATED_KEY, "operator": "Exists", "effect": "NoSchedule"},
            ],
            "affinity": {
                "nodeAffinity": {
                    "requiredDuringSchedulingIgnoredDuringExecution": {
                        "nodeSelectorTerms": [{"matchExpressions": [{"key": SLICES_LABEL, "operator": "Exists"}]}]
                    }
                }
            },
        }
        self._chart(
            "nvidia-device-plugin",
            "kube-system",
            {"config": {"map": device_plugin_config(args.plan), "default": "whole"}, **on_gpu_nodes},
        )
        keda = self._chart("keda", KEDA_NS, {"nodeSelector": ON_SYSTEM}, namespaces[KEDA_NS])
        prometheus = self._chart(
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
                "alertmanager": {"alertmanagerSpec": {"nodeSelector": ON_SYSTEM}},
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
        )
        self._chart(
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
        self._chart(
            "cluster-autoscaler",
            "kube-system",
            {
                "autoDiscovery": {"clusterName": args.cluster_name},
                "awsRegion": args.region,
                "image": {"tag": f"v{args.kubernetes_version}.0"},  # the autoscaler's minor follows the cluster's
                "rbac": {
                    "serviceAccount": {
                        "name": "cluster-autoscaler",
                        "annotations": {"eks.amazonaws.com/role-arn": args.autoscaler_role_arn},
                    }
                },
                "extraArgs": {"balance-similar-node-groups": True, "skip-nodes-with-local-storage": False},
                "nodeSelector": ON_SYSTEM,
            },
        )
        server = self._chart(
            "prefect-server",
            FLOWS_NS,
            {
                "global": {"prefect": {"image": {"prefectTag": PREFECT_IMAGE_TAG}}},
                "server": {"nodeSelector": ON_SYSTEM},
                # the bundled PostgreSQL with the stack's secret password (the chart and its
                # subchart keep it in Secrets) on a volume: not the chart's default password, and
                # flow-run history that outlives the pod
                "postgresql": {
                    "auth": {"password": pulumi.Output.secret(args.prefect_db_password)},
                    "primary": {
                        "persistence": {"enabled": True, "storageClass": STORAGE_CLASS, "size": PREFECT_DB_STORAGE},
                        "nodeSelector": ON_SYSTEM,
                    },
                },
            },
            namespaces[FLOWS_NS],
        )
        self._chart(
            "prefect-worker",
            FLOWS_NS,
            {
                "worker": {
                    "image": {"prefectTag": f"{PREFECT_IMAGE_TAG}-kubernetes"},
                    "apiConfig": "selfHostedServer",
                    "selfHostedServerApiConfig": {
                        "apiUrl": f"http://prefect-server.{FLOWS_NS}.svc.cluster.local:4200/api"
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
                "serviceAccount": {
                    "create": True,
                    "name": FLOWS_SA,
                    "annotations": {"eks.amazonaws.com/role-arn": args.flows_role_arn},
                },
            },
            namespaces[FLOWS_NS],
            server,
        )

        monitoring = self._child(namespaces[MONITORING_NS], prometheus)
        k8s.core.v1.ConfigMap(
            f"{name}-dashboard",
            metadata={
                "name": "serving-fleet-dashboard",
                "namespace": MONITORING_NS,
                "labels": {"grafana_dashboard": "1"},
            },
            data={"serving-fleet.json": json.dumps(dashboard())},
            opts=monitoring,
        )
        models = tuple(m.model for m in args.plan.models)
        k8s.apiextensions.CustomResource(
            f"{name}-alerts",
            api_version="monitoring.coreos.com/v1",
            kind="PrometheusRule",
            metadata={"name": "serving-fleet", "namespace": MONITORING_NS},
            spec={"groups": alert_rules(args.policies, models)},
            opts=monitoring,
        )
        k8s.apiextensions.CustomResource(
            f"{name}-gateway-monitor",
            api_version="monitoring.coreos.com/v1",
            kind="ServiceMonitor",
            metadata={"name": GATEWAY, "namespace": MONITORING_NS},
            spec={
                "selector": {"matchLabels": {"app.kubernetes.io/name": GATEWAY}},
                "jobLabel": "app.kubernetes.io/name",
                "namespaceSelector": {"matchNames": [GATEWAY_NS]},
                "endpoints": [{"port": "http", "path": "/metrics", "interval": "15s"}],
            },
            opts=monitoring,
        )

        self._runtime_access(namespaces, keda)
        families = sorted({m.family for m in args.plan.models})
        images = pulumi.Output.all(**{f: args.images[f] for f in families}).apply(lambda urls: dict(urls))
        timeouts = {m: args.policies.models[m].timeout_ms for m in models}
        k8s.core.v1.ConfigMap(
            f"{name}-runtime",
            metadata={"name": CONFIG_MAP, "namespace": MODELS_NS},
            data=images.apply(lambda urls: config_map_data(args.plan, urls, PROMETHEUS_URL, timeouts)),
            opts=self._child(namespaces[MODELS_NS]),
        )
        Gateway(
            f"{name}-gateway",
            GatewayArgs(
                namespace=GATEWAY_NS,
                models_namespace=MODELS_NS,
                image=pulumi.Output.concat(args.images[GATEWAY_REPOSITORY], ":", args.gateway_image_tag),
                store_url=args.store_url,
                role_arn=args.gateway_role_arn,
                region=args.region,
                settings=gw,
                admin_token=args.gateway_admin_token,
                policy_files=args.policy_files,
                redis_url=args.redis_url,
                trusted_networks=args.vpc_cidr,
                prices=args.gateway_prices,
            ),
            opts=pulumi.ResourceOptions(
                parent=self,
                providers={"kubernetes": provider},
                depends_on=[*after, namespaces[GATEWAY_NS], args.redis_group],
            ),
        )
        self.register_outputs({})

    def _child(self, *depends: pulumi.Resource) -> pulumi.ResourceOptions:
        return pulumi.ResourceOptions.merge(self._opts, pulumi.ResourceOptions(depends_on=list(depends)))

    def _chart(self, chart: str, namespace: str, values: dict, *depends: pulumi.Resource) -> k8s.helm.v3.Release:
        repo, version = CHARTS[chart]
        return k8s.helm.v3.Release(
            f"{self._name}-{chart}",
            name=chart,
            chart=chart,
            version=version,
            namespace=namespace,
            repository_opts={"repo": repo},
            values=values,
            atomic=True,
            timeout=900,
            opts=self._child(*depends),
        )

    def _runtime_access(self, namespaces: dict, keda: k8s.helm.v3.Release) -> None:
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
            opts = self._child(namespaces[MODELS_NS], keda)
            k8s.rbac.v1.Role(
                f"{self._name}-{role}",
                metadata={"name": role, "namespace": MODELS_NS, "labels": MANAGED},
                rules=role_rules,
                opts=opts,
            )
            account, ns = subjects[role]
            k8s.rbac.v1.RoleBinding(
                f"{self._name}-{role}",
                metadata={"name": role, "namespace": MODELS_NS, "labels": MANAGED},
                role_ref={"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": role},
                subjects=[{"kind": "ServiceAccount", "name": account, "namespace": ns}],
                opts=opts,
            )
