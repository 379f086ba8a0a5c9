"""Network and access, under Pulumi's mocks (tests/infra_harness.py): the load balancer's and
target group's names fit AWS's limit; the load balancer's idle timeout is below the gateway's
keep-alive; the admin API stays off the public listener and the NodePort; NetworkPolicies are
valid and let through exactly the connections of an explicit table; each namespace's Pod
Security level is one its pods meet; cluster admins from config get EKS access entries."""

from __future__ import annotations

import json
import re

import pulumi
import pytest
import yaml
from infra_harness import PROJECT, ROOT, Build, build, example, stack_config
from k8s_access import LEVELS, Endpoint, allowed, strictest, violations
from k8s_schemas import validate

from fleet.runtime.kubernetes.manifests import CONFIG_MAP, labels, manifests, placement_from_dict
from infra.config import parse
from infra.edge import ELB_NAME_MAX, elb_name
from infra.gateway import ADMIN_PORT, ADMIN_SERVICE, GRPC_PORT, PORT
from infra.gateway import LABELS as GATEWAY_LABELS
from infra.namespaces import FLOWS_NS, GATEWAY_NS, KEDA_NS, MODELS_NS, MONITORING_NS
from infra.netpol import VPC_CNI_CONFIGURATION
from infra.pod_security import LEVELS as NAMESPACE_LEVELS

STACKS = ("dev", "prod")
AUTO_SUFFIX = 7  # pulumi-aws auto-names a resource "<name>-" + 7 random characters
ELB_NAME = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?")


@pytest.fixture(scope="module", params=STACKS)
def stack(request: pytest.FixtureRequest) -> Build:
    return example(request.param)


def _objects(stack: Build, kind: str) -> list[dict]:
    """The Kubernetes objects of ``kind`` as the provider sends them (auto-generated names in)."""
    return [
        {**r.inputs, "metadata": r.state["metadata"]}
        for r in stack.resources
        if r.type.startswith("kubernetes:") and r.inputs.get("kind") == kind
    ]


def _gateway_pod(stack: Build) -> dict:
    (deployment,) = [d for d in _objects(stack, "Deployment") if d["metadata"]["namespace"] == GATEWAY_NS]
    return deployment["spec"]["template"]["spec"]


# --- names --------------------------------------------------------------------------------------


def test_load_balancer_and_target_group_names_fit_aws_limit(stack: Build) -> None:
    for type_ in ("aws:lb/loadBalancer:LoadBalancer", "aws:lb/targetGroup:TargetGroup"):
        for r in stack.of_type(type_):
            # what AWS gets: the name the program sets, else pulumi-aws's auto-name
            physical = r.inputs.get("name") or f"{r.name}-{'x' * AUTO_SUFFIX}"
            assert len(physical) <= ELB_NAME_MAX, (
                f"{type_} {r.name}: {physical!r} is {len(physical)} characters; AWS allows {ELB_NAME_MAX}"
            )
            assert ELB_NAME.fullmatch(physical), f"{physical!r}: expected letters, digits and inner hyphens only"
            assert not physical.startswith("internal-"), f"{physical!r}: AWS refuses names starting 'internal-'"
            assert stack.stack in physical, f"{physical!r} does not say which stack it belongs to"


@pytest.mark.parametrize("prefix", ["serving-fleet-dev", "serving-fleet-a-very-long-stack-name-indeed", "x", "_a.b_"])
def test_elb_names_fit_for_any_stack_and_change_with_what_forces_a_replacement(prefix: str) -> None:
    name = elb_name(prefix, "gw", "vpc-1", 30080, "HTTP", "instance")
    assert len(name) <= ELB_NAME_MAX and ELB_NAME.fullmatch(name), name
    assert name == elb_name(prefix, "gw", "vpc-1", 30080, "HTTP", "instance")  # deterministic: preview shows it
    # a new port or VPC replaces the target group: a new name lets the new one exist beside the old
    assert name != elb_name(prefix, "gw", "vpc-1", 30081, "HTTP", "instance")
    assert name != elb_name(prefix, "gw", "vpc-2", 30080, "HTTP", "instance")


# --- idle connections ------------------------------------------------------------------------------


def test_the_load_balancer_gives_up_on_an_idle_connection_before_the_gateway_does(stack: Build) -> None:
    (lb,) = stack.of_type("aws:lb/loadBalancer:LoadBalancer")
    idle = lb.inputs["idleTimeout"]
    (container,) = _gateway_pod(stack)["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    keep_alive = float(env["FLEET_GATEWAY_KEEPALIVE_S"])
    assert idle < keep_alive, f"ALB idle timeout {idle} s >= gateway keep-alive {keep_alive} s: sporadic 502s"
    # and it outwaits the slowest answer a served model may take (nothing is sent until it is done)
    raw = {k.removeprefix(f"{PROJECT}:"): v for k, v in stack_config(stack.stack).items() if k.startswith(PROJECT)}
    config = parse(raw, stack.stack, "us-east-1")
    longest_s = max(config.policies.models[m.model].timeout_ms for m in config.plan.models) / 1000
    assert idle > longest_s, f"ALB idle timeout {idle} s would cut a {longest_s:g} s answer short"


# --- the admin API: internal only -----------------------------------------------------------------


def test_the_public_listener_answers_admin_paths_itself(stack: Build) -> None:
    (listener,) = stack.of_type("aws:lb/listener:Listener")
    (rule,) = stack.of_type("aws:lb/listenerRule:ListenerRule")
    assert listener.urn in rule.property_dependencies["listenerArn"]
    (action,) = rule.inputs["actions"]
    assert action["type"] == "fixed-response" and action["fixedResponse"]["statusCode"] == "404"
    (condition,) = rule.inputs["conditions"]
    assert set(condition["pathPattern"]["values"]) == {"/admin", "/admin/*"}


def test_the_admin_port_is_exposed_by_a_clusterip_service_only(stack: Build) -> None:
    services = {s["metadata"]["name"]: s["spec"] for s in _objects(stack, "Service")}
    public = [s for s in services.values() if s["type"] == "NodePort"]
    assert len(public) == 1, "one NodePort: the load balancer's target"
    assert [p["targetPort"] for p in public[0]["ports"]] == ["http"], "the NodePort must expose the public port only"
    admin = services[ADMIN_SERVICE]
    assert admin["type"] == "ClusterIP" and [p["port"] for p in admin["ports"]] == [ADMIN_PORT]
    (container,) = _gateway_pod(stack)["containers"]
    args = container["args"]
    assert args[args.index("--admin-port") + 1] == str(ADMIN_PORT)
    # the control plane pushes admin changes to the announced URL: the admin port
    assert args[args.index("--public-url") + 1] == f"http://$(POD_IP):{ADMIN_PORT}"
    assert {p["name"]: p["containerPort"] for p in container["ports"]} == {
        "http": PORT,
        "grpc": GRPC_PORT,
        "admin": ADMIN_PORT,
    }


# --- NetworkPolicies: valid, and who may reach whom ---------------------------------------------

GW_PORTS = {"http": PORT, "grpc": GRPC_PORT, "admin": ADMIN_PORT}
GATEWAY = Endpoint("gateway", "10.0.64.5", GATEWAY_NS, GATEWAY_LABELS, GW_PORTS)
OTHER_GATEWAY = Endpoint("another gateway", "10.0.96.6", GATEWAY_NS, GATEWAY_LABELS, GW_PORTS)
MODEL = Endpoint("model replica", "10.0.64.7", MODELS_NS, labels("demo-classifier", "1.0.0"), {"http": 3000})
OTHER_MODEL = Endpoint("another model", "10.0.96.8", MODELS_NS, labels("embed-small", "2.0.0"), {"http": 3000})
PROMETHEUS = Endpoint("prometheus", "10.0.64.9", MONITORING_NS, {"app.kubernetes.io/name": "prometheus"})
GRAFANA = Endpoint("grafana", "10.0.64.10", MONITORING_NS, {"app.kubernetes.io/name": "grafana"})
FLOW_RUN = Endpoint("flow-run job", "10.0.64.11", FLOWS_NS, {"job-name": "fleet-retrain-abc"})
PREFECT = Endpoint("prefect server", "10.0.64.12", FLOWS_NS, {"app.kubernetes.io/name": "prefect-server"})
TENANT_APP = Endpoint("a pod elsewhere", "10.0.64.13", "default", {"app": "client"})
KEDA = Endpoint("keda operator", "10.0.64.14", KEDA_NS, {"app": "keda-operator"})
DNS = Endpoint("coredns", "10.0.64.2", "kube-system", {"k8s-app": "kube-dns"})
NODE = Endpoint("a node (the ALB through the NodePort)", "10.0.32.20")
S3 = Endpoint("S3 (gateway endpoint)", "52.216.8.1")
QUOTA_STORE = Endpoint("ElastiCache quota store", "10.0.80.5")
IMDS = Endpoint("instance metadata", "169.254.169.254")
WORKER_PRIVATE = 41234  # a gateway worker's private port: ephemeral, announced in the store

EXPECTED = [  # (from, to, port, protocol, allowed)
    # the gateways' public side: the load balancer (via the NodePort), in-cluster clients, Prometheus
    (NODE, GATEWAY, PORT, "TCP", True),
    (TENANT_APP, GATEWAY, GRPC_PORT, "TCP", True),
    (PROMETHEUS, GATEWAY, PORT, "TCP", True),
    # the gateways' admin side: flows and the other gateways only
    (FLOW_RUN, GATEWAY, ADMIN_PORT, "TCP", True),
    (FLOW_RUN, GATEWAY, WORKER_PRIVATE, "TCP", True),
    (OTHER_GATEWAY, GATEWAY, ADMIN_PORT, "TCP", True),
    (OTHER_GATEWAY, GATEWAY, WORKER_PRIVATE, "TCP", True),
    (NODE, GATEWAY, ADMIN_PORT, "TCP", False),
    (TENANT_APP, GATEWAY, ADMIN_PORT, "TCP", False),
    (PROMETHEUS, GATEWAY, ADMIN_PORT, "TCP", False),
    (MODEL, GATEWAY, ADMIN_PORT, "TCP", False),
    (TENANT_APP, GATEWAY, WORKER_PRIVATE, "TCP", False),
    # models: gateways and Prometheus, on the serving port only
    (GATEWAY, MODEL, 3000, "TCP", True),
    (PROMETHEUS, MODEL, 3000, "TCP", True),
    (GATEWAY, MODEL, 9999, "TCP", False),
    (GRAFANA, MODEL, 3000, "TCP", False),
    (FLOW_RUN, MODEL, 3000, "TCP", False),
    (TENANT_APP, MODEL, 3000, "TCP", False),
    (OTHER_MODEL, MODEL, 3000, "TCP", False),
    (KEDA, MODEL, 3000, "TCP", False),
    (NODE, MODEL, 3000, "TCP", False),
    # models reach DNS and HTTPS outside the VPC, nothing inside it
    (MODEL, DNS, 53, "UDP", True),
    (MODEL, DNS, 53, "TCP", True),
    (MODEL, S3, 443, "TCP", True),
    (MODEL, QUOTA_STORE, 6379, "TCP", False),
    (MODEL, PREFECT, 4200, "TCP", False),
    (MODEL, IMDS, 80, "TCP", False),
    (MODEL, PROMETHEUS, 9090, "TCP", False),
    # flows: among themselves; they reach S3, Prometheus and the gateways' admin (above)
    (FLOW_RUN, PREFECT, 4200, "TCP", True),
    (GATEWAY, PREFECT, 4200, "TCP", False),
    (TENANT_APP, PREFECT, 4200, "TCP", False),
    (FLOW_RUN, S3, 443, "TCP", True),
    (FLOW_RUN, PROMETHEUS, 9090, "TCP", True),
    # the quota store is outside the cluster: its security group and AUTH token guard it
    (GATEWAY, QUOTA_STORE, 6379, "TCP", True),
]


def _policies(stack: Build) -> list[dict]:
    return _objects(stack, "NetworkPolicy")


def test_network_policies_are_valid_against_the_kubernetes_schema(stack: Build) -> None:
    policies = _policies(stack)
    assert policies
    for policy in policies:
        validate(policy)
    for ns in (GATEWAY_NS, MODELS_NS, FLOWS_NS):
        deny = [
            p
            for p in policies
            if p["metadata"]["namespace"] == ns and p["spec"]["podSelector"] == {} and "ingress" not in p["spec"]
        ]
        assert deny, f"namespace {ns} has no default-deny ingress policy"


def test_the_vpc_cni_enforces_network_policies(stack: Build) -> None:
    """EKS's vpc-cni ignores NetworkPolicies unless its add-on turns the node agent's enforcement on."""
    (cni,) = [a for a in stack.of_type("aws:eks/addon:Addon") if a.inputs["addonName"] == "vpc-cni"]
    config = json.loads(cni.inputs.get("configurationValues") or "{}")
    assert config.get("enableNetworkPolicy") == VPC_CNI_CONFIGURATION["enableNetworkPolicy"], (
        f"vpc-cni configuration {config}: expected enableNetworkPolicy 'true', else no policy is enforced"
    )


@pytest.mark.parametrize(
    ("source", "dest", "port", "protocol", "expected"),
    EXPECTED,
    ids=[f"{s.name}->{d.name}:{port}/{proto}" for s, d, port, proto, _ in EXPECTED],
)
def test_who_may_reach_whom(source: Endpoint, dest: Endpoint, port: int, protocol: str, expected: bool) -> None:
    got = allowed(_policies(example("prod")), source, dest, port, protocol)
    assert got is expected, f"{source.name} -> {dest.name}:{port}/{protocol}: {'allowed' if got else 'denied'}"


# --- Pod Security Admission ------------------------------------------------------------------------


def test_every_namespace_enforces_its_pod_security_level_and_audits_restricted(stack: Build) -> None:
    version = json.loads(json.dumps(stack_config(stack.stack)["serving-fleet:kubernetesVersion"]))
    namespaces = {n["metadata"]["name"]: n["metadata"].get("labels", {}) for n in _objects(stack, "Namespace")}
    for ns, (level, why) in NAMESPACE_LEVELS.items():
        got = namespaces[ns]
        assert got["pod-security.kubernetes.io/enforce"] == level, f"{ns}: expected {level} ({why})"
        assert got["pod-security.kubernetes.io/enforce-version"] == f"v{version}"
        assert got["pod-security.kubernetes.io/audit"] == "restricted"
    assert NAMESPACE_LEVELS[GATEWAY_NS][0] == "restricted"


def test_the_gateway_pod_meets_restricted(stack: Build) -> None:
    assert violations(_gateway_pod(stack), "restricted") == []


def _model_pod(stack: Build) -> dict:
    (cm,) = [o for o in _objects(stack, "ConfigMap") if o["metadata"]["name"] == CONFIG_MAP]
    first = json.loads(cm["data"]["placement.json"])["models"][0]
    deployment = manifests(
        first["model"],
        "1.0.0",
        "repo@sha256:" + "0" * 64,
        placement_from_dict(first),
        floor=1,
        prometheus_url="http://p",
    )[0]
    return deployment["spec"]["template"]["spec"]


def test_no_namespace_enforces_a_level_its_pods_do_not_meet(stack: Build) -> None:
    """Levels are as strict as the pods allow: a stricter one would refuse them."""
    pods = {GATEWAY_NS: _gateway_pod(stack), MODELS_NS: _model_pod(stack)}
    for ns, pod in pods.items():
        level = NAMESPACE_LEVELS[ns][0]
        assert LEVELS.index(level) <= LEVELS.index(strictest(pod)), (
            f"{ns} enforces {level}, its pods meet {strictest(pod)}: {violations(pod, level)}"
        )


def _chart_values(prefix: str) -> dict:
    (chart,) = (ROOT / "tests" / "fixtures" / "charts").glob(f"{prefix}-[0-9]*")
    return yaml.safe_load((chart / "values.yaml").read_text())


def _pod(name: str, pod_context: dict | None, container_context: dict | None) -> dict:
    return {"securityContext": pod_context or {}, "containers": [{"name": name, "securityContext": container_context}]}


def _chart_pods() -> dict[str, list[dict]]:
    """Namespace → the pods its pinned charts run, with their default security contexts (the
    vendored values.yaml; infra/charts.py sets none of these)."""
    keda = _chart_values("keda")
    server, worker = _chart_values("prefect-server"), _chart_values("prefect-worker")["worker"]
    return {
        KEDA_NS: [
            _pod(part, keda["podSecurityContext"][part], keda["securityContext"][part])
            for part in ("operator", "metricServer", "webhooks")
        ],
        FLOWS_NS: [
            _pod("server", server["server"]["podSecurityContext"], server["server"]["containerSecurityContext"]),
            _pod("migrations", server["migrations"]["podSecurityContext"], server["migrations"]["securityContext"]),
            _pod("worker", worker["podSecurityContext"], worker["containerSecurityContext"]),
        ],
    }


@pytest.mark.parametrize("namespace", [KEDA_NS, FLOWS_NS])
def test_chart_namespaces_enforce_the_strictest_level_their_charts_pods_meet(namespace: str) -> None:
    """KEDA's chart is restricted by default; the Prefect charts' pods keep their capabilities
    (and the migration Job has no seccomp profile), so flows is baseline: stricter would refuse them."""
    pods = _chart_pods()[namespace]
    meets = min((strictest(p) for p in pods), key=LEVELS.index)
    enforced = NAMESPACE_LEVELS[namespace][0]
    assert enforced == meets, (
        f"{namespace} enforces {enforced}; its charts' pods meet {meets}: {[violations(p, 'restricted') for p in pods]}"
    )


# --- EKS access entries ----------------------------------------------------------------------------

ADMIN_POLICY = "arn:aws:eks::aws:cluster-access-policy/AmazonEKSClusterAdminPolicy"


def test_cluster_admins_from_config_get_access_entries(stack: Build) -> None:
    raw = stack_config(stack.stack).get("serving-fleet:adminRoleArns", "[]")
    wanted = set(json.loads(raw))
    # people's entries (STANDARD); nodes have entries of their own type (EC2_LINUX, infra/karpenter.py)
    entries = [e for e in stack.of_type("aws:eks/accessEntry:AccessEntry") if e.inputs["type"] == "STANDARD"]
    associations = stack.of_type("aws:eks/accessPolicyAssociation:AccessPolicyAssociation")
    assert {e.inputs["principalArn"] for e in entries} == wanted
    assert {a.inputs["principalArn"] for a in associations} == wanted
    for a in associations:
        assert a.inputs["policyArn"] == ADMIN_POLICY and a.inputs["accessScope"] == {"type": "cluster"}
    assert stack.stack != "prod" or wanted, "the prod example names its admin role"


def test_an_admin_role_that_is_not_an_iam_arn_is_refused_with_the_key() -> None:
    config = stack_config("dev")
    config["serving-fleet:adminRoleArns"] = json.dumps(["platform-admins"])
    with pytest.raises(pulumi.RunError, match=r"adminRoleArns\[0\]: got 'platform-admins' — expected an IAM role"):
        build("dev", config)
