"""Platform: what runs inside the cluster besides the models.

Namespaces (``infra.namespaces``) with ResourceQuotas sized from the placement plan; the
default storage class and the admission policies; Helm releases of the NVIDIA device plugin
(with time-slicing for pools that share GPUs) and DCGM exporter, KEDA, kube-prometheus-stack,
the cluster autoscaler, and a Prefect server with a worker polling a Kubernetes work pool
(``infra.charts``); the fleet's Grafana dashboard and alert rules; RBAC for the Kubernetes
runtime (``infra.runtime_access``); the ``fleet-runtime`` ConfigMap it reads; and the gateway.
Every one of them is a child of this component. Platform pods stay on the system nodes:
model nodes are for models.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field

import pulumi
import pulumi_kubernetes as k8s

from fleet.catalog.policies.loader import Policies
from fleet.planning.karpenter import NodePoolPlan
from fleet.planning.placement import GPU_RESOURCE, PlacementPlan
from fleet.runtime.kubernetes.manifests import CONFIG_MAP, config_map_data
from fleet.runtime.kubernetes.node_cache import shm_bytes
from infra import waited_for
from infra.admission import GATEWAY_SCALING, gateway_scaling_policy, gpu_pod_policy
from infra.admission import NAME as GPU_ADMISSION
from infra.alerting import AlertingSettings
from infra.alerting import warnings as alerting_warnings
from infra.charts import PROMETHEUS_URL, STORAGE_CLASS, install_charts
from infra.config_sections import GatewaySettings
from infra.flows_cluster import FlowsClusterArgs, flows_cluster
from infra.gateway import NAME as GATEWAY
from infra.gateway import SCRAPE_TOKEN_ITEM, Gateway, GatewayArgs, scrape_token
from infra.images import GATEWAY_REPOSITORY
from infra.monitoring import alert_rules, dashboard
from infra.namespaces import FLOWS_NS, GATEWAY_NS, KEDA_NS, MODELS_NS, MONITORING_NS
from infra.netpol import network_policies
from infra.pod_security import pod_security_labels
from infra.runtime_access import runtime_roles

# Pods that ask for nothing in a namespace with a ResourceQuota are refused; these defaults
# let them in with a bounded size (a LimitRange per namespace with a quota).
LIMIT_DEFAULTS = {"defaultRequest": {"cpu": "250m", "memory": "256Mi"}, "default": {"memory": "1Gi"}}


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
    model_role_arn: pulumi.Input[str]  # the model pods' (fleet-model): reads the artifacts they fetch
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
    log_catalog: pulumi.Input[str] = ""  # the gateway's FLEET_LOG_CATALOG: glue:<database> (infra/analytics.py)
    gateway_keep_alive_s: int = 75  # the gateway's FLEET_GATEWAY_KEEPALIVE_S: above the load balancer's idle timeout
    alerting: AlertingSettings = field(default_factory=AlertingSettings)  # Alertmanager's receivers
    alert_secrets: dict[str, pulumi.Input[str]] = field(default_factory=dict)  # key → secret Output, those set
    prefect_database_url: pulumi.Input[str] = ""  # a secret Output: the Prefect server's database (infra/prefect_db.py)
    log_retention_days: int = 30  # the flows' FLEET_LOG_RETENTION_DAYS: the stack's logs.retention_days
    model_pools: tuple[NodePoolPlan, ...] = ()  # Karpenter's NodePools: the models' GPU quota is their limits


def model_quota(plan: PlacementPlan, pools: Sequence[NodePoolPlan] = ()) -> dict[str, str]:
    """ResourceQuota of the models namespace: GPUs are what the NodePools' limits can hold
    (one canary's surge included; the plan's node groups where no pool is given); CPU, memory
    (a tensor-parallel replica's /dev/shm included) and pods allow every model at max_replicas
    twice over (stable and canary)."""
    slices = {g.name: g.gpu_slices for g in plan.node_groups}
    if pools:
        units = sum(p.limit_nodes * p.gpus_per_node * slices[p.name] for p in pools)
    else:
        units = sum(g.max_size * g.gpus_per_node * g.gpu_slices for g in plan.node_groups)
    cpu = 2 * sum(m.max_replicas * m.cpu for m in plan.models)
    memory = 2 * sum(m.max_replicas * (m.memory_gib + shm_bytes(m) / 2**30) for m in plan.models)
    pods = 2 * sum(m.max_replicas for m in plan.models)
    return {
        f"requests.{GPU_RESOURCE}": str(units),
        "requests.cpu": f"{cpu:g}",
        "requests.memory": f"{memory:g}Gi",
        "pods": str(pods),
    }


class Platform(pulumi.ComponentResource):
    def __init__(self, name: str, args: PlatformArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__("serving-fleet:infra:Platform", name, None, opts)
        provider = k8s.Provider(f"{name}-k8s", kubeconfig=args.kubeconfig, opts=pulumi.ResourceOptions(parent=self))
        # every object waits for what the component does (the nodes and add-ons): without
        # this a chart could start installing before any node exists
        after = waited_for(opts)
        self._opts = pulumi.ResourceOptions(parent=self, provider=provider, depends_on=after)
        namespaces = {
            ns: k8s.core.v1.Namespace(
                f"{name}-{ns}",
                metadata={
                    "name": ns,
                    "labels": {
                        "app.kubernetes.io/part-of": "serving-fleet",
                        **pod_security_labels(ns, args.kubernetes_version),  # infra/pod_security.py says why
                    },
                },
                opts=self._opts,
            )
            for ns in (GATEWAY_NS, MODELS_NS, FLOWS_NS, MONITORING_NS, KEDA_NS)
        }
        # who may reach whom (infra/netpol.py)
        for policy in network_policies(GATEWAY_NS, MODELS_NS, FLOWS_NS, MONITORING_NS, args.vpc_cidr):
            meta = policy["metadata"]
            k8s.networking.v1.NetworkPolicy(
                f"{name}-netpol-{meta['namespace']}-{meta['name']}",
                metadata=meta,
                spec=policy["spec"],
                opts=self._child(namespaces[meta["namespace"]]),
            )
        gw = args.gateway
        quotas = {
            MODELS_NS: model_quota(args.plan, args.model_pools),
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
        # what each flow-run Job reads, and the Prefect server's database and API auth Secrets
        prefect_secrets = flows_cluster(
            name,
            self._child,
            namespaces,
            FlowsClusterArgs(
                store_url=args.store_url,
                region=args.region,
                log_catalog=args.log_catalog,
                log_retention_days=args.log_retention_days,
                gateway_networks=args.vpc_cidr,
                policy_files=args.policy_files,
                flows_role_arn=args.flows_role_arn,
                admin_token=args.gateway_admin_token,
                prefect_database_url=args.prefect_database_url,
                prefect_auth_from=args.prefect_db_password,
            ),
        )
        keda, prometheus = install_charts(
            name,
            self._child,
            namespaces,
            plan=args.plan,
            cluster_name=args.cluster_name,
            region=args.region,
            kubernetes_version=args.kubernetes_version,
            autoscaler_role_arn=args.autoscaler_role_arn,
            grafana_admin_password=args.grafana_admin_password,
            prefect_secrets=prefect_secrets,
            alerting=args.alerting,
            alert_secrets=args.alert_secrets,
        )

        # a stack without receivers is valid (nowhere to page yet) but says so on every preview
        for line in alerting_warnings(args.alerting):
            pulumi.log.warn(line, resource=self)
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
            spec={"groups": alert_rules(args.policies, models, args.alerting.runbook_url)},
            opts=monitoring,
        )
        # /metrics names every tenant and version: Prometheus scrapes it with the scrape token
        # (infra/gateway.py), from a Secret in its own namespace (a ServiceMonitor reads only those)
        scrape = k8s.core.v1.Secret(
            f"{name}-gateway-scrape-token",
            metadata={"name": "fleet-gateway-scrape", "namespace": MONITORING_NS},
            type="Opaque",
            string_data={
                SCRAPE_TOKEN_ITEM: pulumi.Output.secret(
                    pulumi.Output.from_input(args.gateway_admin_token).apply(scrape_token)
                )
            },
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
                "endpoints": [
                    {
                        "port": "http",
                        "path": "/metrics",
                        "interval": "15s",
                        "authorization": {
                            "type": "Bearer",
                            "credentials": {"name": scrape.metadata["name"], "key": SCRAPE_TOKEN_ITEM},
                        },
                    }
                ],
            },
            opts=monitoring,
        )

        runtime_roles(name, self._child, namespaces, keda, args.model_role_arn)
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
                log_catalog=args.log_catalog,
                keep_alive_s=args.gateway_keep_alive_s,
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
