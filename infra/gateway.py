"""Gateway: the fleet's router as a Kubernetes Deployment behind the load balancer.

It runs on the system nodes, reads its state from the models bucket with its IRSA role, and
finds model replicas through the Kubernetes runtime (``FLEET_RUNTIME=kubernetes``), which
its Role in the models namespace lets it read but not change. The Service is a NodePort the
load balancer's target group points at; a PodDisruptionBudget keeps all but one replica up
during node drains, and an HPA scales it on CPU.

Its admin API is on: ``FLEET_ADMIN_TOKEN`` comes from a Secret made from the stack's secret
``gatewayAdminToken``; ``/metrics`` needs a scrape token (``FLEET_METRICS_TOKEN``, derived from
it: ``scrape_token``), which Prometheus's ServiceMonitor holds (infra/platform.py). Tenants' quotas are shared through the quota store
(infra/quota_store.py): ``FLEET_REDIS_URL`` comes from a Secret of its own holding
``rediss://:<redisAuthToken>@<primary endpoint>:6379/0``, and the Deployment waits for the
replication group. ``FLEET_GATEWAY_WORKERS`` processes serve each pod (the stack's
``gateway.workers``; the CPU request is at least one per worker, infra/config.py). The
policies are a ConfigMap of ``policies/*.yaml`` mounted at ``POLICY_DIR``
(``FLEET_POLICIES``). The Secrets and the ConfigMap are auto-named: pulumi-kubernetes
replaces a ConfigMap or Secret whose data changed, under a new name, so the pod template
changes with it and a token rotation, a policy change or a price change rolls the gateway.

Cost metering (fleet/usage/prices.py) reads each model's price per replica-hour from
``FLEET_PRICES_FILE``: a ConfigMap of the JSON ``fleet.usage.prices.write_prices`` writes (the
program's ``prices_from_plan`` of the placement plan, what ``fleet plan`` prints), mounted at
``PRICES_DIR``. Each worker process would otherwise start a pool of decode processes sized
from the node's CPUs (``os.cpu_count`` sees the node, not the pod's request);
``FLEET_DECODE_WORKERS`` is set from the pod's CPU instead (``decode_workers``). Each pod announces its own
address (``--public-url http://$(POD_IP):8002``, its admin port), so an admin change is pushed
to every gateway, not to whichever one the Service picks.

The admin API listens on ``ADMIN_PORT`` only (``fleet gateway --admin-port``; on the public
port the gateway answers ``/admin/...`` with 404, fleet/gateway/listeners.py). The NodePort
Service behind the load balancer exposes the public port alone; a ClusterIP Service of its own
(``fleet-gateway-admin``) exposes the admin port inside the cluster, for an operator's
``kubectl port-forward`` (the flows reach each pod at its announced address). An idle
connection stays open ``keep_alive_s`` (``FLEET_GATEWAY_KEEPALIVE_S``), longer than the load
balancer's idle timeout (infra/edge.py), so the load balancer never reuses a connection the
gateway has just closed.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass

import pulumi
import pulumi_kubernetes as k8s

from fleet.planning.placement import POOL_LABEL
from infra import waited_for
from infra.config_sections import GatewaySettings
from infra.nodegroups import SYSTEM_GROUP

NAME = "fleet-gateway"
PORT = 8000
GRPC_PORT = 8001  # OIP over gRPC (Triton's port); in-cluster clients reach it through the Service
ADMIN_PORT = 8002  # the admin API, inside the cluster only (a ClusterIP Service; never the NodePort)
ADMIN_SERVICE = "fleet-gateway-admin"
POLICY_DIR = "/etc/fleet/policies"
PRICES_DIR = "/etc/fleet/prices"
PRICES_ITEM = "prices.json"  # the key in the prices ConfigMap's data: FLEET_PRICES_FILE = PRICES_DIR/PRICES_ITEM
MAX_DECODE_WORKERS = 4  # the gateway's own ceiling when it sizes the pool itself (fleet/gateway/body.py)
USER_ID = 10001  # the numeric user and group of the gateway image (the repository's Dockerfile)
ADMIN_TOKEN_ITEM = "token"  # the key in the Secret's data
SCRAPE_TOKEN_ITEM = "scrape-token"  # the key of the scrape token, in the gateway's Secret and Prometheus's


def scrape_token(admin_token: str) -> str:
    """The token Prometheus scrapes ``/metrics`` with (the gateway's ``FLEET_METRICS_TOKEN``):
    derived from the admin token, so it rotates with it and needs no config of its own, and
    reveals nothing of it (an HMAC); it opens ``/metrics`` only, never the admin API."""
    return hmac.new(admin_token.encode(), b"serving-fleet metrics scrape", hashlib.sha256).hexdigest()


REDIS_URL_ITEM = "url"  # the key in the quota store Secret's data
DRAIN_S = 10  # preStop: stay in the endpoints until kube-proxy on every node has dropped this pod
# after SIGTERM: uvicorn's graceful shutdown (10 s), the inference log's last flush, the
# heartbeat record withdrawn; the kubelet kills what is left after the grace period
GRACE_S = DRAIN_S + 30
LABELS = {"app.kubernetes.io/name": NAME, "app.kubernetes.io/part-of": "serving-fleet"}


def decode_workers(cpu: float, workers: int) -> int:
    """``FLEET_DECODE_WORKERS``: decode processes per gateway worker process. The whole CPUs of
    the pod's request left after one per worker, shared among the workers, at least 1 (a
    large body never decodes on the event loop) and at most ``MAX_DECODE_WORKERS``; so 1 at
    the default of one CPU per worker (both example stacks), where the memory is tight too."""
    spare = max(0, int(cpu) - workers)
    return max(1, min(MAX_DECODE_WORKERS, spare // workers))


@dataclass
class GatewayArgs:
    namespace: str
    models_namespace: str
    image: pulumi.Input[str]
    store_url: pulumi.Input[str]
    role_arn: pulumi.Input[str]
    region: str
    settings: GatewaySettings
    admin_token: pulumi.Input[str]  # a secret Output
    policy_files: dict[str, str]  # file name → YAML text
    redis_url: pulumi.Input[str]  # a secret Output: FLEET_REDIS_URL, the quota store (infra/quota_store.py)
    prices: str = (
        "{}"  # FLEET_PRICES_FILE's JSON: fleet.usage.prices.write_prices(prices_from_plan(...)); {}: cost unknown
    )
    trusted_networks: str = ""  # FLEET_GATEWAY_NETWORKS: where the other gateways' pod IPs are
    log_catalog: pulumi.Input[str] = ""  # FLEET_LOG_CATALOG: glue:<database> of the log tables (infra/analytics.py)
    keep_alive_s: int = (
        75  # FLEET_GATEWAY_KEEPALIVE_S: infra.edge.gateway_keep_alive_s of the load balancer's idle timeout
    )


class Gateway(pulumi.ComponentResource):
    def __init__(self, name: str, args: GatewayArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__("serving-fleet:infra:Gateway", name, None, opts)
        after = waited_for(opts)
        child = pulumi.ResourceOptions(parent=self, depends_on=after)
        s = args.settings
        meta = {"name": NAME, "namespace": args.namespace, "labels": LABELS}
        account = k8s.core.v1.ServiceAccount(
            f"{name}-sa", metadata={**meta, "annotations": {"eks.amazonaws.com/role-arn": args.role_arn}}, opts=child
        )
        owned = {"namespace": args.namespace, "labels": LABELS}  # no name: auto-named, see the module docstring
        token = k8s.core.v1.Secret(
            f"{name}-admin-token",
            metadata=owned,
            type="Opaque",
            string_data={ADMIN_TOKEN_ITEM: pulumi.Output.secret(args.admin_token)},
            opts=child,
        )
        scrape = k8s.core.v1.Secret(
            f"{name}-scrape-token",
            metadata=owned,
            type="Opaque",
            string_data={
                SCRAPE_TOKEN_ITEM: pulumi.Output.secret(pulumi.Output.from_input(args.admin_token).apply(scrape_token))
            },
            opts=child,
        )
        redis = k8s.core.v1.Secret(
            f"{name}-redis",
            metadata=owned,
            type="Opaque",
            string_data={REDIS_URL_ITEM: pulumi.Output.secret(args.redis_url)},
            opts=child,
        )
        policies = k8s.core.v1.ConfigMap(f"{name}-policies", metadata=owned, data=args.policy_files, opts=child)
        prices = k8s.core.v1.ConfigMap(f"{name}-prices", metadata=owned, data={PRICES_ITEM: args.prices}, opts=child)
        probe = {"periodSeconds": 5, "timeoutSeconds": 2, "failureThreshold": 3}
        memory = f"{int(s.memory_gib * 1024)}Mi"
        container = {
            "name": "gateway",
            "image": args.image,
            # the image's entry point is `fleet gateway` (Dockerfile); Kubernetes expands
            # $(POD_IP) from the env below: each pod announces its own address
            "args": [
                "--host",
                "0.0.0.0",
                "--port",
                str(PORT),
                "--public-url",
                f"http://$(POD_IP):{ADMIN_PORT}",
                "--grpc-port",
                str(GRPC_PORT),
                "--admin-port",
                str(ADMIN_PORT),
            ],
            "ports": [
                {"name": "http", "containerPort": PORT},
                {"name": "grpc", "containerPort": GRPC_PORT},
                {"name": "admin", "containerPort": ADMIN_PORT},
            ],
            "env": [
                {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
                {
                    "name": "FLEET_ADMIN_TOKEN",
                    "valueFrom": {"secretKeyRef": {"name": token.metadata.name, "key": ADMIN_TOKEN_ITEM}},
                },
                {
                    "name": "FLEET_METRICS_TOKEN",
                    "valueFrom": {"secretKeyRef": {"name": scrape.metadata.name, "key": SCRAPE_TOKEN_ITEM}},
                },
                {
                    "name": "FLEET_REDIS_URL",
                    "valueFrom": {"secretKeyRef": {"name": redis.metadata.name, "key": REDIS_URL_ITEM}},
                },
                {"name": "FLEET_GATEWAY_WORKERS", "value": str(s.workers)},
                {"name": "FLEET_GATEWAY_KEEPALIVE_S", "value": str(args.keep_alive_s)},
                {"name": "FLEET_DECODE_WORKERS", "value": str(decode_workers(s.cpu, s.workers))},
                {"name": "FLEET_PRICES_FILE", "value": f"{PRICES_DIR}/{PRICES_ITEM}"},
                {"name": "FLEET_POLICIES", "value": POLICY_DIR},
                {"name": "FLEET_STORE", "value": args.store_url},
                {"name": "FLEET_LOG_CATALOG", "value": args.log_catalog},  # it reads committed rows
                {"name": "FLEET_RUNTIME", "value": "kubernetes"},
                {"name": "FLEET_KUBE_NAMESPACE", "value": args.models_namespace},
                # an admin change is pushed to every pod's announced IP: only inside the VPC
                {"name": "FLEET_GATEWAY_NETWORKS", "value": args.trusted_networks},
                {"name": "AWS_REGION", "value": args.region},
                {"name": "HOME", "value": "/tmp"},  # the root filesystem is read-only
            ],
            "resources": {"requests": {"cpu": f"{s.cpu:g}", "memory": memory}, "limits": {"memory": memory}},
            "readinessProbe": {"httpGet": {"path": "/v2/health/ready", "port": "http"}, **probe},
            "livenessProbe": {"httpGet": {"path": "/v2/health/live", "port": "http"}, **probe, "periodSeconds": 10},
            "lifecycle": {"preStop": {"sleep": {"seconds": DRAIN_S}}},
            "securityContext": {
                "runAsNonRoot": True,
                "runAsUser": USER_ID,
                "runAsGroup": USER_ID,
                "allowPrivilegeEscalation": False,
                "readOnlyRootFilesystem": True,
                "capabilities": {"drop": ["ALL"]},
                "seccompProfile": {"type": "RuntimeDefault"},
            },
            "volumeMounts": [
                {"name": "tmp", "mountPath": "/tmp"},
                {"name": "policies", "mountPath": POLICY_DIR, "readOnly": True},
                {"name": "prices", "mountPath": PRICES_DIR, "readOnly": True},
            ],
        }
        k8s.apps.v1.Deployment(
            f"{name}-deployment",
            metadata=meta,
            spec={
                "replicas": s.min_replicas,
                "selector": {"matchLabels": LABELS},
                "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
                "template": {
                    "metadata": {"labels": LABELS},
                    "spec": {
                        "serviceAccountName": NAME,
                        "containers": [container],
                        "volumes": [
                            {"name": "tmp", "emptyDir": {}},
                            {"name": "policies", "configMap": {"name": policies.metadata.name}},
                            {"name": "prices", "configMap": {"name": prices.metadata.name}},
                        ],
                        "nodeSelector": {POOL_LABEL: SYSTEM_GROUP},
                        "terminationGracePeriodSeconds": GRACE_S,
                        "topologySpreadConstraints": [
                            {
                                "maxSkew": 1,
                                "topologyKey": "topology.kubernetes.io/zone",
                                "whenUnsatisfiable": "ScheduleAnyway",
                                "labelSelector": {"matchLabels": LABELS},
                            }
                        ],
                    },
                },
            },
            # the HPA owns the replica count once the Deployment exists
            opts=pulumi.ResourceOptions(
                parent=self,
                depends_on=[*after, account, token, redis, policies, prices],
                ignore_changes=["spec.replicas"],
            ),
        )
        service = k8s.core.v1.Service(
            f"{name}-service",
            metadata=meta,
            spec={
                "type": "NodePort",
                "selector": LABELS,
                "externalTrafficPolicy": "Cluster",
                "ports": [{"name": "http", "port": 80, "targetPort": "http", "nodePort": s.node_port}],
            },
            opts=child,
        )
        # gRPC for in-cluster clients only: a ClusterIP Service of its own (on the NodePort one it
        # would get a port on every node; the public load balancer listens for HTTPS only)
        k8s.core.v1.Service(
            f"{name}-grpc-service",
            metadata={**meta, "name": f"{NAME}-grpc"},
            spec={
                "type": "ClusterIP",
                "selector": LABELS,
                "ports": [
                    {"name": "grpc", "port": GRPC_PORT, "targetPort": "grpc", "appProtocol": "kubernetes.io/h2c"}
                ],
            },
            opts=child,
        )
        # the admin API for whoever is inside the cluster (kubectl port-forward service/fleet-gateway-admin)
        k8s.core.v1.Service(
            f"{name}-admin-service",
            metadata={**meta, "name": ADMIN_SERVICE},
            spec={
                "type": "ClusterIP",
                "selector": LABELS,
                "ports": [{"name": "admin", "port": ADMIN_PORT, "targetPort": "admin"}],
            },
            opts=child,
        )
        k8s.policy.v1.PodDisruptionBudget(
            f"{name}-pdb", metadata=meta, spec={"maxUnavailable": 1, "selector": {"matchLabels": LABELS}}, opts=child
        )
        k8s.autoscaling.v2.HorizontalPodAutoscaler(
            f"{name}-hpa",
            metadata=meta,
            spec={
                "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": NAME},
                "minReplicas": s.min_replicas,
                "maxReplicas": s.max_replicas,
                "metrics": [
                    {
                        "type": "Resource",
                        "resource": {"name": "cpu", "target": {"type": "Utilization", "averageUtilization": 70}},
                    }
                ],
            },
            opts=child,
        )
        self.service_name = service.metadata.name
        self.register_outputs({"service": self.service_name})
