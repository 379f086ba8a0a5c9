"""The serving fleet's production infrastructure: `pulumi up` runs this (Pulumi.yaml: main: infra/).

Only wiring: the stack config (read and checked in infra/config.py, placement plan included)
flows into the components, and their outputs into each other and the stack outputs.
"""

import sys
from pathlib import Path

# `pulumi up` runs this file with infra/ on sys.path; the components import as the `infra`
# package from the project root, as the tests import them.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import pulumi  # noqa: E402

from fleet.errors import FleetError  # noqa: E402
from fleet.planning.karpenter import node_pools  # noqa: E402
from fleet.runtime.kubernetes.manifests import MODEL_SERVICE_ACCOUNT  # noqa: E402
from fleet.usage.prices import prices_from_plan, write_prices  # noqa: E402
from infra import config as cfg  # noqa: E402
from infra.addons import AFTER_NODES, BEFORE_NODES, ClusterAddons, ClusterAddonsArgs  # noqa: E402
from infra.alerting import ALERT_SECRETS  # noqa: E402
from infra.analytics import Analytics, AnalyticsArgs  # noqa: E402
from infra.cluster import Cluster, ClusterArgs  # noqa: E402
from infra.cost import usd_per_hour  # noqa: E402
from infra.edge import Edge, EdgeArgs, gateway_keep_alive_s, idle_timeout_s  # noqa: E402
from infra.gateway import NAME as GATEWAY_SA  # noqa: E402
from infra.identity import (  # noqa: E402
    IrsaRole,
    IrsaRoleArgs,
    autoscaler_policy,
    flows_policy,
    gateway_policy,
    model_policy,
)
from infra.images import ImageRegistry, ImageRegistryArgs  # noqa: E402
from infra.karpenter import Karpenter, KarpenterArgs  # noqa: E402
from infra.namespaces import FLOWS_NS, FLOWS_SA, GATEWAY_NS, MODELS_NS  # noqa: E402
from infra.network import Network, NetworkArgs  # noqa: E402
from infra.nodegroups import NodeGroups, NodeGroupsArgs, SystemGroup  # noqa: E402
from infra.platform import Platform, PlatformArgs  # noqa: E402
from infra.prefect_db import PrefectDatabase, PrefectDatabaseArgs  # noqa: E402
from infra.quota_store import QuotaStore, QuotaStoreArgs  # noqa: E402
from infra.storage import ModelStore, ModelStoreArgs  # noqa: E402

try:
    stack = cfg.load()
except FleetError as exc:  # a config mistake is one clear message, not a traceback
    raise pulumi.RunError(str(exc)) from None
s, tags, name = stack.settings, stack.tags, stack.name

network = Network(name, NetworkArgs(s.vpcCidr, s.azCount, s.singleNatGateway, name, tags))
cluster = Cluster(
    name,
    ClusterArgs(
        name,
        s.kubernetesVersion,
        stack.region,
        network.private_subnet_ids + network.public_subnet_ids,
        s.apiAccessCidrs,
        tags,
        admin_role_arns=s.adminRoleArns,
    ),
)
system = s.systemNodes


def addons(part: str, names: tuple[str, ...], after: list[pulumi.Resource]) -> ClusterAddons:
    return ClusterAddons(
        f"{name}-{part}",
        ClusterAddonsArgs(
            cluster.name,
            cluster.version,
            cluster.oidc_provider_arn,
            cluster.oidc_issuer,
            names,
            tags,
            {a: v for a, v in s.addonVersions.items() if a in names},
        ),
        opts=pulumi.ResourceOptions(depends_on=after),
    )


node_addons = addons("node-addons", BEFORE_NODES, [])  # what a node needs to turn Ready
nodes = NodeGroups(
    name,
    NodeGroupsArgs(
        name,
        cluster.name,
        cluster.version,
        cluster.node_role_arn,
        network.private_subnet_ids,
        SystemGroup(system.instance_type, system.min_size, system.max_size, system.root_volume_gib),
        tags,
    ),
    opts=pulumi.ResourceOptions(depends_on=[*cluster.node_policy_attachments, *node_addons.addons.values()]),
)
cluster_addons = addons("addons", AFTER_NODES, [nodes])  # pods: they need nodes to run on
# the model nodes: a NodePool and EC2NodeClass per node group of the plan, canary surge included
model_pools = node_pools(stack.plan, stack.pools)
karpenter = Karpenter(
    name,
    KarpenterArgs(
        name,
        cluster.name,
        stack.region,
        cluster.kubeconfig,
        cluster.oidc_provider_arn,
        cluster.oidc_issuer,
        cluster.security_group_id,
        network.private_subnet_ids,
        network.private_subnet_zones,
        model_pools,
        tags,
    ),
    opts=pulumi.ResourceOptions(depends_on=[nodes, *cluster_addons.addons.values()]),
)
store = ModelStore(name, ModelStoreArgs(s.logRetentionDays, s.noncurrentVersionDays, tags, s.logs.retention_days))
# the log tables' Glue database and the Athena workgroup that queries them
analytics = Analytics(name, AnalyticsArgs(name, stack.region, store.models_bucket, store.key_arn, s.logs, tags))
images = ImageRegistry(name, ImageRegistryArgs(name, stack.families, tags))


def irsa(role: str, namespace: str, account: str, policy: pulumi.Input[str]) -> IrsaRole:
    return IrsaRole(
        f"{name}-{role}", IrsaRoleArgs(cluster.oidc_provider_arn, cluster.oidc_issuer, namespace, account, policy, tags)
    )


store_access = pulumi.Output.all(store.models_bucket_arn, store.key_arn, analytics.catalog_arns)
gateway_role = irsa(
    "gateway", GATEWAY_NS, GATEWAY_SA, store_access.apply(lambda v: gateway_policy(v[0], v[1], stack.region, v[2]))
)
flows_role = irsa(
    "flows", FLOWS_NS, FLOWS_SA, store_access.apply(lambda v: flows_policy(v[0], v[1], stack.region, v[2]))
)
model_role = irsa(
    "models", MODELS_NS, MODEL_SERVICE_ACCOUNT, store_access.apply(lambda v: model_policy(v[0], v[1], stack.region))
)
autoscaler_role = irsa("cluster-autoscaler", "kube-system", "cluster-autoscaler", cluster.name.apply(autoscaler_policy))

# the load balancer outwaits the slowest answer a served model's policy allows; the gateway outwaits it
alb_idle_s = idle_timeout_s(stack.policies.models[m.model].timeout_ms for m in stack.plan.models)
edge = Edge(
    name,
    EdgeArgs(
        network.vpc_id,
        network.public_subnet_ids,
        s.certificateArn,
        s.allowedCidrs,
        s.gateway.node_port,
        cluster.security_group_id,
        nodes.system.resources.apply(lambda r: r[0].autoscaling_groups[0].name),
        store.logs_bucket,
        store.logs_policy,
        tags,
        alb_idle_s,
    ),
)
# the gateways' shared quotas, reachable from the nodes' security group only
quota_store = QuotaStore(
    name,
    QuotaStoreArgs(
        network.vpc_id,
        network.private_subnet_ids,
        cluster.security_group_id,
        s.redis,
        stack.secrets[cfg.REDIS_AUTH_TOKEN_KEY],
        tags,
    ),
)
# the Prefect server's PostgreSQL (RDS, or the database the stack names), from the nodes only
prefect_db = PrefectDatabase(
    name,
    PrefectDatabaseArgs(
        network.vpc_id,
        network.private_subnet_ids,
        cluster.security_group_id,
        s.prefectDatabase,
        s.env == "prod",
        stack.secrets[cfg.PREFECT_DB_PASSWORD_KEY],
        tags,
    ),
)
store_url = pulumi.Output.concat("s3://", store.models_bucket)
# what the gateway meters cost with: each placed model's USD per replica-hour, as `fleet plan` prints it
gateway_prices = write_prices(prices_from_plan(stack.plan, stack.pools, f"Pulumi.{stack.stack}.yaml"))
Platform(
    name,
    PlatformArgs(
        cluster.kubeconfig,
        cluster.name,
        stack.region,
        s.kubernetesVersion,
        stack.plan,
        stack.policies,
        images.urls,
        store_url,
        gateway_role.arn,
        flows_role.arn,
        model_role.arn,
        autoscaler_role.arn,
        s.gateway,
        s.gateway.image_tag,
        stack.admin_token,
        stack.policy_files,
        stack.secrets[cfg.GRAFANA_PASSWORD_KEY],
        stack.secrets[cfg.PREFECT_DB_PASSWORD_KEY],
        quota_store.url,
        quota_store.group,
        s.vpcCidr,
        gateway_prices,
        analytics.log_catalog,
        gateway_keep_alive_s=gateway_keep_alive_s(alb_idle_s),
        alerting=s.alerting,
        alert_secrets={k: v for k, v in stack.secrets.items() if k in ALERT_SECRETS},
        prefect_database_url=prefect_db.connection_url,
        log_retention_days=s.logs.retention_days,
        model_pools=model_pools,
    ),
    opts=pulumi.ResourceOptions(depends_on=[nodes, *cluster_addons.addons.values()]),
)

pulumi.export(cfg.OUT_CLUSTER_NAME, cluster.name)
pulumi.export(cfg.OUT_KUBECONFIG, cluster.kubeconfig)
pulumi.export(cfg.OUT_VPC_ID, network.vpc_id)
pulumi.export(cfg.OUT_MODELS_BUCKET, store.models_bucket)
pulumi.export(cfg.OUT_LOGS_BUCKET, store.logs_bucket)
pulumi.export(cfg.OUT_STORE_URL, store_url)
pulumi.export(cfg.OUT_REPOSITORIES, images.urls)
pulumi.export(cfg.OUT_LOAD_BALANCER_DNS, edge.dns_name)
pulumi.export(cfg.OUT_GATEWAY_URL, pulumi.Output.concat("https://", edge.dns_name))
pulumi.export(cfg.OUT_GATEWAY_ROLE, gateway_role.arn)
pulumi.export(cfg.OUT_FLOWS_ROLE, flows_role.arn)
pulumi.export(cfg.OUT_PLACEMENT, stack.plan.to_dict())
pulumi.export(cfg.OUT_MAX_GPUS, sum(p.limit_gpus for p in model_pools))  # what the NodePools' limits allow
pulumi.export(cfg.OUT_USD_PER_HOUR, usd_per_hour(stack, network.nat_gateways))
pulumi.export(cfg.OUT_REDIS_ENDPOINT, quota_store.primary_endpoint)
pulumi.export(cfg.OUT_LOG_DATABASE, analytics.database_name)
pulumi.export(cfg.OUT_ATHENA_WORKGROUP, analytics.workgroup_name)
pulumi.export(cfg.OUT_ATHENA_RESULTS_BUCKET, analytics.results_bucket)
