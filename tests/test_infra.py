"""The Pulumi program under Pulumi's mocks: both example stacks build, and what matters holds —
node groups sized and tainted from the placement plan, private encrypted versioned buckets,
HTTPS only, least-privilege IRSA, cost tags, and Kubernetes objects valid against the schemas."""

from __future__ import annotations

import json
import re

import pulumi
import pytest
from infra_harness import (
    ADMIN_TOKEN,
    ADMIN_TOKEN_KEY,
    PROJECT,
    ROOT,
    SECRET_CONFIG,
    Build,
    build,
    example,
    stack_config,
    takes_tags,
)
from infra_harness import as_list as _list
from infra_harness import iam_allows as _allows
from k8s_schemas import json_ints, validate

from fleet.catalog.policies.loader import load_policies
from fleet.planning.placement import DEDICATED_KEY, GPU_RESOURCE, POOL_LABEL
from fleet.planning.planner import plan
from fleet.planning.stack import placement_inputs, read_stack_file

STACKS = ("dev", "prod")
COST_TAGS = ("team", "env", "model")


@pytest.fixture(scope="module", params=STACKS)
def stack(request: pytest.FixtureRequest) -> Build:
    return example(request.param)


def expected_plan(stack: str):  # noqa: ANN201
    """The placement plan computed straight from the stack file and the policies."""
    policies = load_policies(ROOT / "policies")
    return plan(policies, *placement_inputs(read_stack_file(ROOT / f"Pulumi.{stack}.yaml"), stack, policies))


def statements(document: str) -> list[dict]:
    return json.loads(document)["Statement"]


# --- the stacks build -----------------------------------------------------------------------


def test_both_example_stacks_build_with_their_outputs(stack: Build) -> None:
    from infra import config as cfg

    names = [getattr(cfg, n) for n in dir(cfg) if n.startswith("OUT_")]
    assert set(stack.outputs) == set(names)
    assert stack.outputs[cfg.OUT_CLUSTER_NAME] == f"serving-fleet-{stack.stack}"
    assert stack.outputs[cfg.OUT_STORE_URL] == f"s3://{stack.outputs[cfg.OUT_MODELS_BUCKET]}"
    assert stack.outputs[cfg.OUT_GATEWAY_URL].startswith("https://")
    assert json_ints(json.loads(json.dumps(stack.outputs[cfg.OUT_PLACEMENT]))) == json.loads(
        json.dumps(expected_plan(stack.stack).to_dict())
    )


def test_cost_per_hour_of_the_example_stacks() -> None:
    # dev: EKS 0.10 (1.35, standard support) + 1 NAT 0.05 + ALB 0.0225 + 2 ECR endpoints × 2 AZs 0.04
    # + 2-3 × t3.xlarge 0.1664 + Karpenter's m6i.large 1-3 × 0.096 and g5.xlarge 1-2 × 1.006 (the
    # limits hold one canary's surge) + 1 × cache.t4g.small (Valkey) 0.0256 + db.t4g.small 0.032
    # (Prefect) + the S3 requests of 2-3 gateway processes (and, at the maximum, of the log tables:
    # the processes' staged files and the committer's for 2 busy models, fleet.planning.costs.log_requests)
    assert example("dev").outputs["usdPerHour"] == {"min": 1.73, "max": 3.1}
    # prod: 3 NATs, 6 endpoint-AZs, 3-5 × m6i.2xlarge, 2 × cache.t4g.small, db.t4g.small Multi-AZ,
    # the NodePools of `fleet plan --stack prod` (24.36-52.74), 6-24 gateway processes' S3 requests
    # (and the log tables' of 5 models)
    assert example("prod").outputs["usdPerHour"] == {"min": 26.02, "max": 55.36}
    # what the NodePools' nvidia.com/gpu limits let Karpenter launch
    assert (example("dev").outputs["maxGpus"], example("prod").outputs["maxGpus"]) == (2, 24)


def test_a_retired_key_is_refused_saying_what_replaced_it() -> None:
    config = {**stack_config("dev"), "serving-fleet:rootVolumeGib": "300"}
    with pytest.raises(
        pulumi.RunError, match=r"serving-fleet:rootVolumeGib: no longer used — expected nothing: remove"
    ):
        build("dev", config)


def test_a_config_mistake_stops_the_program_with_one_clear_message() -> None:
    config = stack_config("dev")
    pools = json.loads(config["serving-fleet:nodePools"])
    pools[1]["gpus"] = "one"
    config["serving-fleet:nodePools"] = json.dumps(pools)
    config["serving-fleet:nodePool"] = "[]"
    with pytest.raises(pulumi.RunError) as err:
        build("dev", config)
    message = str(err.value)
    assert "Pulumi.dev.yaml: serving-fleet:nodePool: unknown key — expected one of" in message
    assert "did you mean 'nodePools'?" in message
    config.pop("serving-fleet:nodePool")
    with pytest.raises(
        pulumi.RunError, match=r"Pulumi.dev.yaml: serving-fleet: nodePools\[1\].gpus: got 'one' — expected an integer"
    ):
        build("dev", config)


# --- node groups from the placement plan ----------------------------------------------------


def _custom(stack: Build, kind: str) -> dict[str, dict]:
    """The stack's Karpenter objects of ``kind`` (NodePool, EC2NodeClass) by name, as sent."""
    return {r.inputs["metadata"]["name"]: r.inputs for r in stack.resources if r.type.endswith(f":{kind}")}


def test_model_node_pools_have_the_instance_type_labels_and_taints_of_the_plan(stack: Build) -> None:
    planned = {g.name: g for g in expected_plan(stack.stack).node_groups}
    pools = _custom(stack, "NodePool")
    assert set(pools) == set(planned)  # one Karpenter NodePool per node group of the plan
    groups = {r.inputs["nodeGroupName"] for r in stack.of_type("aws:eks/nodeGroup:NodeGroup")}
    assert groups == {"system"}  # the only managed node group
    for name, group in planned.items():
        template = pools[name]["spec"]["template"]
        requirements = {r["key"]: r["values"] for r in template["spec"]["requirements"]}
        assert requirements["node.kubernetes.io/instance-type"] == [group.instance_type]
        assert template["metadata"]["labels"] == group.labels
        taints = {(t["key"], t["value"], t["effect"]) for t in template["spec"]["taints"]}
        assert ("fleet.io/model-node", "true", "NoSchedule") in taints  # platform pods stay off
        assert ((GPU_RESOURCE, "present", "NoSchedule") in taints) == bool(group.gpus_per_node)
        if group.dedicated_to:
            assert (DEDICATED_KEY, group.dedicated_to, "NoSchedule") in taints
    system = stack.one("aws:eks/nodeGroup:NodeGroup").inputs
    assert system["labels"] == {POOL_LABEL: "system"} and not system.get("taints")


def test_prod_runs_the_70b_model_tensor_parallel_on_a100s_and_isolates_llm_7b() -> None:
    pools = _custom(example("prod"), "NodePool")
    a100 = pools["a100-8"]["spec"]
    (types,) = [r["values"] for r in a100["template"]["spec"]["requirements"] if r["key"].endswith("instance-type")]
    assert types == ["p4d.24xlarge"] and int(a100["limits"]["nodes"]) >= 2  # 2 at peak, + a canary's surge
    assert pools["a10g-1-llm-7b"]["spec"]["template"]["metadata"]["labels"][DEDICATED_KEY] == "llm-7b"
    assert pools["a10g-1"]["spec"]["template"]["metadata"]["labels"]["nvidia.com/device-plugin.config"] == "slices-4"
    assert "a10g-4" not in pools  # a pool no model needed makes no NodePool


def test_the_system_group_has_a_launch_template_with_an_encrypted_root_volume_and_imdsv2(stack: Build) -> None:
    system = json.loads(stack_config(stack.stack)["serving-fleet:systemNodes"])
    templates = {r.name: r.inputs for r in stack.of_type("aws:ec2/launchTemplate:LaunchTemplate")}
    for group in stack.of_type("aws:eks/nodeGroup:NodeGroup"):
        assert "diskSize" not in group.inputs  # the template's volume is the one used
        template = templates[group.name]
        (volume,) = template["blockDeviceMappings"]
        assert volume["deviceName"] == "/dev/xvda"
        assert volume["ebs"]["encrypted"] == "true" and volume["ebs"]["volumeType"] == "gp3"
        assert volume["ebs"]["volumeSize"] == system.get("root_volume_gib", 50)
        assert template["metadataOptions"]["httpTokens"] == "required"
        assert template["metadataOptions"]["httpPutResponseHopLimit"] == 1  # pods cannot take the node's role
        assert {s["resourceType"] for s in template["tagSpecifications"]} == {"instance", "volume"}
        assert group.property_dependencies["launchTemplate"]  # wired to the template, not copied


# --- buckets ----------------------------------------------------------------------------------


def _for_bucket(stack: Build, type_: str, bucket: dict) -> dict:
    (found,) = [r.inputs for r in stack.of_type(type_) if r.inputs["bucket"] == bucket["bucket"]]
    return found


def test_buckets_are_private_versioned_encrypted_and_tls_only(stack: Build) -> None:
    buckets = [r.state for r in stack.of_type("aws:s3/bucket:Bucket")]
    assert len(buckets) == 3  # models, access logs, Athena's query results
    for bucket in buckets:
        block = _for_bucket(stack, "aws:s3/bucketPublicAccessBlock:BucketPublicAccessBlock", bucket)
        assert all(
            block[k] is True
            for k in ("blockPublicAcls", "blockPublicPolicy", "ignorePublicAcls", "restrictPublicBuckets")
        )
        assert _for_bucket(stack, "aws:s3/bucketVersioning:BucketVersioning", bucket)["versioningConfiguration"] == {
            "status": "Enabled"
        }
        owner = _for_bucket(stack, "aws:s3/bucketOwnershipControls:BucketOwnershipControls", bucket)
        assert owner["rule"]["objectOwnership"] == "BucketOwnerEnforced"  # no ACLs at all
        (rule,) = _for_bucket(
            stack, "aws:s3/bucketServerSideEncryptionConfiguration:BucketServerSideEncryptionConfiguration", bucket
        )["rules"]
        deny = statements(_for_bucket(stack, "aws:s3/bucketPolicy:BucketPolicy", bucket)["policy"])[0]
        assert deny["Effect"] == "Deny" and deny["Condition"] == {"Bool": {"aws:SecureTransport": "false"}}
        assert deny["Resource"] == [bucket["arn"], bucket["arn"] + "/*"]
        lifecycle = _for_bucket(stack, "aws:s3/bucketLifecycleConfiguration:BucketLifecycleConfiguration", bucket)[
            "rules"
        ]
        assert all(
            r["status"] == "Enabled" and r["noncurrentVersionExpiration"]["noncurrentDays"] >= 1 for r in lifecycle
        )
        if "models" in bucket["bucket"]:
            sse = rule["applyServerSideEncryptionByDefault"]
            assert sse["sseAlgorithm"] == "aws:kms" and sse["kmsMasterKeyId"].startswith("arn:aws:kms:")
            days = json.loads(stack_config(stack.stack)["serving-fleet:noncurrentVersionDays"])
            assert lifecycle[0]["noncurrentVersionExpiration"]["noncurrentDays"] == days
            # every prefix rewritten every few seconds keeps its old copies a day, not `days`
            churn = {r["filter"]["prefix"]: r for r in lifecycle if r["id"].startswith("churn-")}
            assert set(churn) == {"changes/", "gateways/", "activity/", "usage/"}
            assert all(r["noncurrentVersionExpiration"]["noncurrentDays"] == 1 < days for r in churn.values())
            assert all(r["expiration"] == {"expiredObjectDeleteMarker": True} for r in churn.values())
            # the rest are the log tables' (tests/test_infra_logs.py)
            assert all(r["filter"]["prefix"].startswith("logs/") for r in lifecycle[1 + len(churn) :])
        elif "athena-results" in bucket["bucket"]:  # rows of the tables: the store's key, kept a week
            sse = rule["applyServerSideEncryptionByDefault"]
            assert sse["sseAlgorithm"] == "aws:kms"
            assert sse["kmsMasterKeyId"] == stack.one("aws:kms/key:Key", "models").state["arn"]
            (expire,) = lifecycle
            assert expire["filter"] == {} and expire["expiration"] == {"days": 7}
        else:  # the load balancer can only write its logs to SSE-S3 buckets
            assert rule["applyServerSideEncryptionByDefault"]["sseAlgorithm"] == "AES256"
            days = json.loads(stack_config(stack.stack)["serving-fleet:logRetentionDays"])
            assert lifecycle[0]["expiration"]["days"] == days


# --- edge -------------------------------------------------------------------------------------


def test_the_load_balancer_waits_for_the_policy_that_lets_it_write_its_logs(stack: Build) -> None:
    (lb,) = stack.of_type("aws:lb/loadBalancer:LoadBalancer")
    (logs,) = [r for r in stack.of_type("aws:s3/bucket:Bucket") if r.name.endswith("-logs")]
    (policy,) = [r for r in stack.of_type("aws:s3/bucketPolicy:BucketPolicy") if r.name == logs.name]
    assert policy.urn in lb.dependencies  # else the first `up` can fail: Access Denied for access logs


def test_the_load_balancer_listens_on_https_only(stack: Build) -> None:
    (listener,) = [r.inputs for r in stack.of_type("aws:lb/listener:Listener")]
    assert (listener["protocol"], listener["port"]) == ("HTTPS", 443)
    assert listener["certificateArn"] == stack_config(stack.stack)["serving-fleet:certificateArn"]
    assert listener["sslPolicy"].startswith("ELBSecurityPolicy-TLS13")
    (alb_sg,) = [r.urn for r in stack.of_type("aws:ec2/securityGroup:SecurityGroup") if r.name.endswith("-alb")]
    ingress = [
        r.inputs
        for r in stack.of_type("aws:vpc/securityGroupIngressRule:SecurityGroupIngressRule")
        if alb_sg in r.property_dependencies.get("securityGroupId", [])
    ]
    assert ingress and all((r["fromPort"], r["toPort"]) == (443, 443) for r in ingress)
    (lb,) = stack.of_type("aws:lb/loadBalancer:LoadBalancer")
    assert lb.inputs["dropInvalidHeaderFields"] is True and lb.inputs["accessLogs"]["enabled"] is True


# --- IRSA -------------------------------------------------------------------------------------


def _role(stack: Build, role: str) -> tuple[dict, list[dict]]:
    trust = stack.one("aws:iam/role:Role", f"-{role}").inputs["assumeRolePolicy"]
    policy = stack.one("aws:iam/rolePolicy:RolePolicy", f"-{role}").inputs["policy"]
    return statements(trust)[0], statements(policy)


def test_each_irsa_role_trusts_exactly_one_service_account(stack: Build) -> None:
    for role, subject in (
        ("gateway", "fleet:fleet-gateway"),
        ("flows", "flows:fleet-flows"),  # the flow-run Jobs' account, not the worker's
        ("models", "models:fleet-model"),  # the model pods': they fetch their weights
        ("cluster-autoscaler", "kube-system:cluster-autoscaler"),
    ):
        trust, _ = _role(stack, role)
        (oidc,) = stack.of_type("aws:iam/openIdConnectProvider:OpenIdConnectProvider")
        assert (
            trust["Principal"] == {"Federated": oidc.state["arn"]}
            and trust["Action"] == "sts:AssumeRoleWithWebIdentity"
        )
        issuer = oidc.inputs["url"].removeprefix("https://")
        assert trust["Condition"]["StringEquals"] == {
            f"{issuer}:sub": f"system:serviceaccount:{subject}",
            f"{issuer}:aud": "sts.amazonaws.com",
        }


# key → may the gateway write it; the keys are what fleet.catalog.routes.store, fleet.catalog.tenants, fleet.audit,
# Registry.transition, fleet.catalog.gateway_directory, the inference log, fleet.usage.meter and fleet.logs.activity write
GATEWAY_KEYS = {
    "routes/demo-classifier.json": True,
    "tenants/acme.json": True,
    "events/demo-classifier/routes/0000000007.json": True,
    "events/demo-classifier/versions/20250101T000000Z-0a1b2c3d.json": True,
    "models/demo-classifier/1.2.0/manifest.json": True,
    "gateways/3f2a9c.json": True,
    "logs/staging/inference/2025/01/01/00/1735689600000-1735689659000-3f2a9c-1.parquet": True,  # staged log
    "logs/staging/feedback/2025/01/01/00/1735689600000-1735689659000-3f2a9c-2.parquet": True,
    "usage/2026-12-01T10/3f2a9c.json": True,  # fleet.usage.meter's hourly file (refused before: metering failed on AWS)
    "usage/2026-12-01T10/3f2a9c/000004.json": True,  # ... and its parts while the hour is open
    "changes/journal.json": True,  # fleet.changes: the entry after an admin API write (refused: the write half done)
    "activity/3f2a9c.json": True,  # fleet.logs.activity: lazy loading's idle clock
    "models/demo-classifier/1.2.0/artifact/model.pt": False,
    "models/demo-classifier/1.2.0/artifact/nested/manifest.json": False,  # * would match it, the Deny does not let it
    "models/demo-classifier/1.2.0/registering.json": False,  # registration is the flows' work
    "rollouts/demo-classifier.json": False,
    "manifest.json": False,
    # the log tables and the committer's own keys: only the committer (a flow) writes them
    "logs/tables/inference/data/model=demo-classifier/ts_hour=2025-01-01-00/00000-0-a1b2.parquet": False,
    "logs/tables/inference/metadata/00007-c3d4.metadata.json": False,
    "logs/commits/inference/intents/3f2a9c.json": False,
    "logs/rejected/inference/2025/01/01/00/1735689600000-1735689659000-3f2a9c-1.parquet": False,
    "logs/committer/lease": False,
    "logs/inference/demo-classifier/2025/01/01/00/1735689600000-3f2a9c-1.parquet": False,  # the old layout
}


def test_the_gateway_writes_exactly_what_its_data_plane_and_admin_api_write_and_never_artifacts(stack: Build) -> None:
    bucket = stack.one("aws:s3/bucket:Bucket", "models").state["arn"]
    _, policy = _role(stack, "gateway")
    for key, writable in GATEWAY_KEYS.items():
        assert _allows(policy, "s3:GetObject", f"{bucket}/{key}"), key
        assert _allows(policy, "s3:PutObject", f"{bucket}/{key}") is writable, key
        # it deletes heartbeat records (its own at shutdown, dead gateways' ones) and usage parts only
        deletes = key.startswith("gateways/") or (key.startswith("usage/") and key.count("/") == 3)
        assert _allows(policy, "s3:DeleteObject", f"{bucket}/{key}") is deletes, key
    assert _allows(policy, "s3:ListBucket", bucket)
    other = "arn:aws:s3:::another-bucket"
    assert not any(_allows(policy, a, f"{other}/routes/x.json") for a in ("s3:GetObject", "s3:PutObject"))
    assert {a for s in policy for a in _list(s["Action"])} == {
        "s3:ListBucket",
        "s3:GetObject",
        "s3:PutObject",
        "s3:DeleteObject",
        "kms:Decrypt",
        "kms:GenerateDataKey",
        "glue:GetDatabase",  # the log tables' catalog, read only
        "glue:GetTable",
        "glue:GetTables",
    }
    key_arn = stack.one("aws:kms/key:Key", "models").state["arn"]
    (kms,) = [s for s in policy if s["Resource"] == key_arn]
    assert kms["Condition"] == {
        "StringEquals": {"kms:ViaService": "s3.us-east-1.amazonaws.com"}
    }  # SSE-KMS, through S3 only


def test_the_flows_read_and_write_the_whole_store_and_no_role_has_a_wildcard_action(stack: Build) -> None:
    bucket = stack.one("aws:s3/bucket:Bucket", "models").state["arn"]
    _, flows = _role(stack, "flows")
    for key in GATEWAY_KEYS:
        assert all(_allows(flows, a, f"{bucket}/{key}") for a in ("s3:GetObject", "s3:PutObject", "s3:DeleteObject")), (
            key
        )
    for role in ("gateway", "flows", "cluster-autoscaler"):
        for s in _role(stack, role)[1]:
            assert not any(a.endswith(":*") or a == "*" for a in _list(s["Action"])), (role, s)
    _, scaler = _role(stack, "cluster-autoscaler")
    (resize,) = [s for s in scaler if "autoscaling:SetDesiredCapacity" in s["Action"]]
    assert resize["Condition"] == {
        "StringEquals": {f"aws:ResourceTag/k8s.io/cluster-autoscaler/serving-fleet-{stack.stack}": "owned"}
    }


def test_model_pods_read_only_manifests_and_artifacts_with_their_own_role(stack: Build) -> None:
    """Weights are fetched at start (bentos/weights.py) with the models' IRSA role: it reads a
    version's manifest and artifact files, and nothing else of the store (no routes, tenants, logs)."""
    bucket = stack.one("aws:s3/bucket:Bucket", "models").state["arn"]
    _, policy = _role(stack, "models")
    for key in ("models/llm-7b/1.0.0/manifest.json", "models/llm-7b/1.0.0/artifact/weights/model-00001.safetensors"):
        assert _allows(policy, "s3:GetObject", f"{bucket}/{key}"), key
        assert not _allows(policy, "s3:PutObject", f"{bucket}/{key}"), key
    for key in GATEWAY_KEYS:
        if not key.startswith("models/"):
            assert not _allows(policy, "s3:GetObject", f"{bucket}/{key}"), key
    assert {a for s in policy for a in _list(s["Action"])} == {"s3:GetObject", "kms:Decrypt", "kms:GenerateDataKey"}
    # the model pods' ServiceAccount carries it, and every model Deployment runs as that account
    (account,) = [
        r.inputs["metadata"]
        for r in stack.of_type("kubernetes:core/v1:ServiceAccount")
        if r.inputs["metadata"]["name"] == "fleet-model"
    ]
    assert account["namespace"] == "models"
    role = stack.one("aws:iam/role:Role", "-models")
    assert role.urn in stack.one("kubernetes:core/v1:ServiceAccount", "-model-pods").property_dependencies["metadata"]


# --- tags -------------------------------------------------------------------------------------


def test_every_taggable_aws_resource_carries_the_cost_tags(stack: Build) -> None:
    aws = [r for r in stack.resources if r.type.startswith("aws:")]
    taggable = [r for r in aws if takes_tags(r.type)]
    assert len(taggable) > 40 if stack.stack == "prod" else len(taggable) > 30
    for r in taggable:
        tags = r.inputs.get("tags") or {}
        assert all(tags.get(k) for k in COST_TAGS), f"{r.type} {r.name} lacks cost tags: {tags}"
        assert tags["env"] == stack.stack and tags["team"] == "ml-platform"
    assert stack.one("aws:eks/nodeGroup:NodeGroup").inputs["tags"]["model"] == "shared"  # the system nodes
    # Karpenter tags the model nodes it launches with its EC2NodeClass's tags
    for name, nodeclass in _custom(stack, "EC2NodeClass").items():
        tags = nodeclass["spec"]["tags"]
        assert all(tags.get(k) for k in COST_TAGS), f"EC2NodeClass {name} lacks cost tags: {tags}"
    if stack.stack == "prod":
        assert _custom(stack, "EC2NodeClass")["a100-8"]["spec"]["tags"]["model"] == "llm-70b"


# --- Kubernetes objects -----------------------------------------------------------------------


def _manifests(stack: Build) -> list[dict]:
    """The Kubernetes objects as the provider sends them: inputs, with the names it auto-generated."""
    skip = ("pulumi:providers:kubernetes", "kubernetes:helm.sh/v3:Release")
    return [
        {**r.inputs, "metadata": r.state["metadata"]}
        for r in stack.resources
        if r.type.startswith("kubernetes:") and r.type not in skip
    ]


def _gateway(stack: Build) -> tuple[dict, dict]:
    """(pod spec, container) of the gateway Deployment."""
    (deployment,) = [o for o in _manifests(stack) if o["kind"] == "Deployment"]
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    return pod, container


def _env(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container["env"]}


def test_every_kubernetes_object_is_valid_against_its_schema(stack: Build) -> None:
    objects = _manifests(stack)
    kinds = {o["kind"] for o in objects}
    assert kinds >= {
        "Namespace",
        "ResourceQuota",
        "Deployment",
        "Service",
        "PodDisruptionBudget",
        "HorizontalPodAutoscaler",
        "ConfigMap",
        "Secret",
        "Role",
        "RoleBinding",
        "ServiceAccount",
        "PrometheusRule",
        "ServiceMonitor",
    }
    for obj in objects:
        if obj["kind"] in ("NodePool", "EC2NodeClass"):
            continue  # against Karpenter's CRD schemas: tests/test_karpenter.py
        validate(obj)


def test_the_gateway_deployment_probes_drains_and_runs_on_system_nodes(stack: Build) -> None:
    pod, container = _gateway(stack)
    assert container["readinessProbe"]["httpGet"] == {"path": "/v2/health/ready", "port": "http"}
    assert container["livenessProbe"]["httpGet"] == {"path": "/v2/health/live", "port": "http"}
    # SIGTERM comes after the preStop sleep; the gateway then flushes its inference log
    drain = container["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert pod["terminationGracePeriodSeconds"] >= drain + 15
    env = _env(container)
    assert env["FLEET_RUNTIME"]["value"] == "kubernetes" and env["FLEET_STORE"]["value"] == stack.outputs["storeUrl"]
    assert pod["nodeSelector"] == {POOL_LABEL: "system"} and GPU_RESOURCE not in container["resources"]["requests"]
    (service,) = [o for o in _manifests(stack) if o["kind"] == "Service" and o["spec"]["type"] == "NodePort"]
    node_port = json.loads(stack_config(stack.stack)["serving-fleet:gateway"]).get("node_port", 30080)
    assert service["spec"]["type"] == "NodePort" and service["spec"]["ports"][0]["nodePort"] == node_port
    (targets,) = stack.of_type("aws:lb/targetGroup:TargetGroup")
    assert targets.inputs["port"] == node_port and targets.inputs["healthCheck"]["path"] == "/v2/health/ready"


def test_each_gateway_pod_announces_its_own_address(stack: Build) -> None:
    _, container = _gateway(stack)
    args = container["args"]
    assert args[:4] == ["--host", "0.0.0.0", "--port", "8000"]  # after the image's entry point, `fleet gateway`
    # Kubernetes expands $(POD_IP); the control plane pushes to the admin port (tests/test_network_access.py)
    assert args[args.index("--public-url") + 1] == "http://$(POD_IP):8002"
    assert _env(container)["POD_IP"]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert container["ports"] == [
        {"name": "http", "containerPort": 8000},
        {"name": "grpc", "containerPort": 8001},
        {"name": "admin", "containerPort": 8002},
    ]
    assert args[args.index("--grpc-port") + 1] == "8001"  # OIP over gRPC, on the port the Service names
    services = {s.inputs["metadata"]["name"]: s.inputs["spec"] for s in stack.of_type("kubernetes:core/v1:Service")}
    assert [p["name"] for p in services["fleet-gateway"]["ports"]] == ["http"]  # the NodePort one: HTTP only
    grpc_service = services["fleet-gateway-grpc"]  # gRPC in-cluster only: no port on every node
    assert grpc_service["type"] == "ClusterIP" and grpc_service["ports"][0]["targetPort"] == "grpc"
    # pod IPs are pushed to only inside the stack's VPC (fleet.catalog.gateway_directory' trust model)
    (vpc,) = stack.of_type("aws:ec2/vpc:Vpc")
    assert _env(container)["FLEET_GATEWAY_NETWORKS"]["value"] == vpc.inputs["cidrBlock"]


def test_the_gateway_admin_token_comes_from_a_secret_and_no_stack_secret_is_ever_plain_text(stack: Build) -> None:
    (secret,) = [r for r in stack.of_type("kubernetes:core/v1:Secret") if "token" in r.inputs["stringData"]]
    assert secret.inputs["type"] == "Opaque" and secret.inputs["stringData"] == {"token": ADMIN_TOKEN}
    assert "stringData" in secret.secret_inputs  # encrypted in the state like every secret
    _, container = _gateway(stack)
    ref = _env(container)["FLEET_ADMIN_TOKEN"]["valueFrom"]["secretKeyRef"]
    assert ref == {"name": secret.state["metadata"]["name"], "key": "token"}
    for value in SECRET_CONFIG.values():
        assert value not in json.dumps(stack.outputs, default=str)
        assert any(value in json.dumps(r.inputs, default=str) for r in stack.resources)  # used somewhere
        for r in stack.resources:
            plain = {k: v for k, v in r.inputs.items() if k not in r.secret_inputs}
            assert value not in json.dumps(plain, default=str), f"{r.type} {r.name} holds a stack secret in plain text"


def test_prometheus_scrapes_the_gateway_with_a_scrape_token_the_gateway_takes_and_never_the_admin_token(
    stack: Build,
) -> None:
    """/metrics names every tenant: the gateway needs a token for it (FLEET_METRICS_TOKEN), and
    Prometheus's ServiceMonitor sends one from a Secret in its namespace: the same value, derived
    from the admin token, never the admin token itself (which opens the admin API)."""
    from infra.gateway import scrape_token
    from infra.namespaces import GATEWAY_NS, MONITORING_NS

    token = scrape_token(ADMIN_TOKEN)
    assert token != ADMIN_TOKEN and ADMIN_TOKEN not in token and len(token) == 64
    scrapes = [r for r in stack.of_type("kubernetes:core/v1:Secret") if "scrape-token" in r.inputs["stringData"]]
    by_ns = {r.inputs["metadata"]["namespace"]: r for r in scrapes}
    assert sorted(by_ns) == sorted([GATEWAY_NS, MONITORING_NS]) and len(scrapes) == 2
    assert all(r.inputs["stringData"] == {"scrape-token": token} and "stringData" in r.secret_inputs for r in scrapes)
    _, container = _gateway(stack)
    gateway_secret = by_ns[GATEWAY_NS]
    ref = _env(container)["FLEET_METRICS_TOKEN"]["valueFrom"]["secretKeyRef"]
    assert ref == {"name": gateway_secret.state["metadata"]["name"], "key": "scrape-token"}
    (monitor,) = [r for r in stack.of_type("kubernetes:monitoring.coreos.com/v1:ServiceMonitor")]
    (endpoint,) = monitor.inputs["spec"]["endpoints"]
    assert endpoint["path"] == "/metrics" and endpoint["authorization"] == {
        "type": "Bearer",
        "credentials": {"name": "fleet-gateway-scrape", "key": "scrape-token"},
    }
    assert by_ns[MONITORING_NS].inputs["metadata"]["name"] == "fleet-gateway-scrape"


def test_grafana_and_prefects_database_use_the_stacks_passwords_and_keep_their_data(stack: Build) -> None:
    releases = {r.inputs["chart"]: r for r in stack.of_type("kubernetes:helm.sh/v3:Release")}
    grafana = releases["kube-prometheus-stack"].inputs["values"]["grafana"]["admin"]
    (secret,) = [
        r
        for r in stack.of_type("kubernetes:core/v1:Secret")
        if r.inputs["metadata"].get("name") == grafana["existingSecret"]
    ]
    assert secret.inputs["stringData"][grafana["passwordKey"]] == SECRET_CONFIG[f"{PROJECT}:grafanaAdminPassword"]
    assert secret.inputs["metadata"]["namespace"] == releases["kube-prometheus-stack"].inputs["namespace"]
    # Prefect's database is RDS (or the stack's), its password in a Secret: tests/test_flows_cluster.py
    server = releases["prefect-server"].inputs["values"]
    assert server["postgresql"] == {"enabled": False} and server["externalDatabase"]["existingSecret"]
    storage = {
        r.inputs["metadata"]["name"]: r.inputs for r in stack.of_type("kubernetes:storage.k8s.io/v1:StorageClass")
    }
    prometheus = releases["kube-prometheus-stack"].inputs["values"]["prometheus"]["prometheusSpec"]["storageSpec"]
    claim = prometheus["volumeClaimTemplate"]["spec"]
    assert claim["storageClassName"] in storage and claim["resources"]["requests"]["storage"]
    (default,) = [
        n
        for n, sc in storage.items()
        if sc["metadata"].get("annotations", {}).get("storageclass.kubernetes.io/is-default-class") == "true"
    ]
    assert storage[default]["parameters"] == {"type": "gp3", "encrypted": "true"}


def test_every_namespace_with_a_quota_gives_pods_default_requests(stack: Build) -> None:
    quotas = {r.inputs["metadata"]["namespace"] for r in stack.of_type("kubernetes:core/v1:ResourceQuota")}
    ranges = {
        r.inputs["metadata"]["namespace"]: r.inputs["spec"] for r in stack.of_type("kubernetes:core/v1:LimitRange")
    }
    assert quotas and quotas <= set(ranges)
    for ns in quotas:
        (limits,) = ranges[ns]["limits"]
        assert limits["type"] == "Container" and {"cpu", "memory"} <= set(limits["defaultRequest"])


def test_the_gateway_reads_the_stacks_policies_from_a_config_map(stack: Build, tmp_path) -> None:  # noqa: ANN001
    pod, container = _gateway(stack)
    folder = _env(container)["FLEET_POLICIES"]["value"]
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == folder]
    assert mount["readOnly"] is True
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    (cm,) = [
        o
        for o in _manifests(stack)
        if o["kind"] == "ConfigMap" and o["metadata"]["name"] == volume["configMap"]["name"]
    ]
    assert cm["data"] == {f.name: f.read_text() for f in sorted((ROOT / "policies").glob("*.yaml"))}
    for name, text in cm["data"].items():  # the folder the gateway sees
        (tmp_path / name).write_text(text)
    assert load_policies(tmp_path) == load_policies(ROOT / "policies")


def test_the_gateway_reads_the_plans_prices_from_a_config_map(stack: Build, tmp_path) -> None:  # noqa: ANN001
    from fleet.usage.prices import prices_from_plan, read_prices

    pod, container = _gateway(stack)
    path = _env(container)["FLEET_PRICES_FILE"]["value"]
    assert path == "/etc/fleet/prices/prices.json"
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == "/etc/fleet/prices"]
    assert mount["readOnly"] is True
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    (cm,) = [
        o
        for o in _manifests(stack)
        if o["kind"] == "ConfigMap" and o["metadata"]["name"] == volume["configMap"]["name"]
    ]
    cm_input = stack.one("kubernetes:core/v1:ConfigMap", "gateway-prices").inputs
    assert (
        "name" not in cm_input["metadata"] and cm_input["metadata"]["namespace"] == "fleet"
    )  # auto-named: a new price rolls the pods
    assert set(cm["data"]) == {"prices.json"}
    (tmp_path / "prices.json").write_text(cm["data"]["prices.json"])  # the file the gateway sees
    placed = expected_plan(stack.stack)
    policies = load_policies(ROOT / "policies")
    pools, _ = placement_inputs(read_stack_file(ROOT / f"Pulumi.{stack.stack}.yaml"), stack.stack, policies)
    expected = prices_from_plan(placed, pools, f"Pulumi.{stack.stack}.yaml")
    prices = read_prices(tmp_path / "prices.json")
    assert prices == expected and set(prices) == {m.model for m in placed.models}
    assert all(p.usd_per_replica_hour > 0 and f"Pulumi.{stack.stack}.yaml" in p.source for p in prices.values())
    deployment = stack.one("kubernetes:apps/v1:Deployment", "gateway")
    assert stack.one("kubernetes:core/v1:ConfigMap", "gateway-prices").urn in deployment.dependencies


def test_the_gateway_sizes_its_decode_pools_from_the_pods_cpu_not_the_nodes(stack: Build) -> None:
    from infra.gateway import decode_workers

    _, container = _gateway(stack)
    env = _env(container)
    workers = int(env["FLEET_GATEWAY_WORKERS"]["value"])
    assert env["FLEET_DECODE_WORKERS"]["value"] == "1"  # one CPU per worker in both stacks: one decoder each
    assert (stack.stack, workers > 1) in {("dev", False), ("prod", True)}
    # spare whole CPUs after one per worker, shared among the workers; at least 1, at most 4
    assert [decode_workers(cpu, w) for cpu, w in [(1, 1), (2, 2), (2.5, 2), (4, 1), (6, 2), (16, 1), (3, 2)]] == [
        1,
        1,
        1,
        3,
        2,
        4,
        1,
    ]


def test_the_admin_token_must_be_set_and_long_and_is_never_shown() -> None:
    config = stack_config("dev")
    del config[ADMIN_TOKEN_KEY]
    with pytest.raises(pulumi.RunError) as err:
        build("dev", config)
    assert (
        "Pulumi.dev.yaml: serving-fleet:gatewayAdminToken: not set — expected the gateway's admin token, as a "
        'secret: `pulumi config set --secret gatewayAdminToken "$(openssl rand -hex 32)"`'
    ) in str(err.value)
    config[ADMIN_TOKEN_KEY] = "short-but-secret"
    with pytest.raises(pulumi.RunError) as err:
        build("dev", config)
    assert "serving-fleet:gatewayAdminToken: got 16 characters (value not shown) — expected at least 32" in str(
        err.value
    )
    assert "short-but-secret" not in str(err.value)
    for key in ("grafanaAdminPassword", "prefectDbPassword"):
        config = stack_config("dev")
        del config[f"{PROJECT}:{key}"]
        with pytest.raises(
            pulumi.RunError, match=f"serving-fleet:{key}: not set .* `pulumi config set --secret {key} "
        ):
            build("dev", config)
    config = stack_config("dev")
    config[f"{PROJECT}:prefectDbPassword"] = "p@ss/word:" * 4  # would break the chart's connection URL
    with pytest.raises(pulumi.RunError, match="prefectDbPassword: has characters a URL would need escaped") as err:
        build("dev", config)
    assert "p@ss" not in str(err.value)


def test_a_prod_kubernetes_api_open_to_the_internet_is_refused() -> None:
    config = stack_config("prod")
    config["serving-fleet:apiAccessCidrs"] = json.dumps(["0.0.0.0/0"])
    with pytest.raises(
        pulumi.RunError, match=r"serving-fleet:apiAccessCidrs: got \['0.0.0.0/0'\] — expected the CIDRs"
    ):
        build("prod", config)
    del config["serving-fleet:apiAccessCidrs"]  # the default is open: prod must name its CIDRs
    with pytest.raises(pulumi.RunError, match="required for env prod"):
        build("prod", config)
    dev = stack_config("dev")
    dev["serving-fleet:apiAccessCidrs"] = json.dumps(["0.0.0.0/0"])
    assert build("dev", dev).one("aws:eks/cluster:Cluster").inputs["vpcConfig"]["publicAccessCidrs"] == ["0.0.0.0/0"]


def test_the_runtime_config_map_carries_the_plan_and_quotas_follow_it(stack: Build) -> None:
    from fleet.runtime.kubernetes.manifests import CONFIG_MAP
    from infra.platform import model_quota

    (cm,) = [o for o in _manifests(stack) if o["kind"] == "ConfigMap" and o["metadata"]["name"] == CONFIG_MAP]
    expected = expected_plan(stack.stack)
    assert json.loads(cm["data"]["placement.json"]) == json.loads(json.dumps(expected.to_dict()))
    assert set(json.loads(cm["data"]["images.json"])) == {m.family for m in expected.models}
    quotas = {o["metadata"]["namespace"]: o["spec"]["hard"] for o in _manifests(stack) if o["kind"] == "ResourceQuota"}
    from test_karpenter import expected_pools

    pools = expected_pools(stack.stack)
    assert quotas["models"] == model_quota(expected, pools)
    # what Karpenter may launch, a canary's surge included: a canary at peak is not refused by the
    # quota the pools were sized for (each GPU counted once per time-slice)
    slices = {g.name: g.gpu_slices for g in expected.node_groups}
    gpu_units = sum((p.max_nodes + p.surge_nodes) * p.gpus_per_node * slices[p.name] for p in pools)
    assert gpu_units > sum(g.max_size * g.gpus_per_node * g.gpu_slices for g in expected.node_groups)
    assert (
        quotas["models"][f"requests.{GPU_RESOURCE}"] == str(gpu_units)
        and quotas["fleet"][f"requests.{GPU_RESOURCE}"] == "0"
    )
    # memory: every model at max_replicas twice, a tensor-parallel replica's /dev/shm included
    from fleet.runtime.kubernetes.node_cache import shm_bytes

    memory = 2 * sum(m.max_replicas * (m.memory_gib + shm_bytes(m) / 2**30) for m in expected.models)
    assert quotas["models"]["requests.memory"] == f"{memory:g}Gi"


def test_the_engine_learns_its_gpu_type_and_tensor_parallel_degree_through_the_config_map() -> None:
    """Placement → the fleet-runtime ConfigMap infra writes → the runtime's Deployment env."""
    from fleet.runtime.kubernetes.manifests import CONFIG_MAP, manifests, placement_from_dict

    (cm,) = [o for o in _manifests(example("prod")) if o["kind"] == "ConfigMap" and o["metadata"]["name"] == CONFIG_MAP]
    placed = {m["model"]: placement_from_dict(m) for m in json.loads(cm["data"]["placement.json"])["models"]}
    deployment = manifests(
        "llm-70b",
        "1.0.0",
        "repo@sha256:" + "0" * 64,
        placed["llm-70b"],
        floor=1,
        prometheus_url="http://prometheus:9090",
    )[0]
    validate(deployment)
    env = {e["name"]: e["value"] for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert (env["FLEET_TENSOR_PARALLEL"], env["FLEET_GPU_TYPE"], env["FLEET_KV_CACHE_GIB"]) == ("8", "A100-40GB", "40")
    assert deployment["spec"]["template"]["spec"]["nodeSelector"] == {POOL_LABEL: "a100-8"}  # the p4d group


def test_the_platform_charts_are_pinned_and_the_device_plugin_slices_shared_gpus(stack: Build) -> None:
    releases = {r.inputs["chart"]: r.inputs for r in stack.of_type("kubernetes:helm.sh/v3:Release")}
    assert all(r.get("version") for r in releases.values())  # tests/test_charts.py checks each against its chart
    plugin = releases["nvidia-device-plugin"]["values"]
    assert "replicas: 4" in plugin["config"]["map"]["slices-4"]
    assert plugin["config"]["default"] in plugin["config"]["map"]  # the chart does not check it
    assert {"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"} in plugin["tolerations"]
    rules = [o for o in _manifests(stack) if o["kind"] == "PrometheusRule"][0]["spec"]["groups"]
    assert {g["name"] for g in rules} >= {f"slo-{m.model}" for m in expected_plan(stack.stack).models}


def _snake_keys(value: object, path: str = "") -> list[str]:
    """Keys with an underscore below ``value``, skipping user maps (tags, labels)."""
    if isinstance(value, dict):
        found = []
        for k, v in value.items():
            if "_" in k:
                found.append(f"{path}.{k}")
            if k not in ("tags", "labels"):
                found += _snake_keys(v, f"{path}.{k}")
        return found
    if isinstance(value, list):
        return [p for i, v in enumerate(value) for p in _snake_keys(v, f"{path}[{i}]")]
    return []


def test_no_misspelt_aws_argument_survives(stack: Build) -> None:
    """The SDK turns every argument it knows into its camelCase wire name; a misspelt key in a
    dict argument would reach the provider as snake_case (and fail only at `pulumi up`)."""
    problems = [
        f"{r.type} {r.name}{p}" for r in stack.resources if r.type.startswith("aws:") for p in _snake_keys(r.inputs)
    ]
    assert problems == []


def test_the_readmes_first_targeted_up_names_the_gateway_repository_and_every_parent_it_needs() -> None:
    """A targeted `up` creates only what it names: a child whose parent component does not
    exist yet is refused, so the bootstrap step must name the component too."""
    readme = (ROOT / "README.md").read_text()
    (line,) = [ln for ln in readme.splitlines() if ln.startswith("pulumi up --target")]
    targets = re.findall(r"--target '([^']+)'", line)
    build_ = example("dev")
    (repo,) = [r for r in build_.of_type("aws:ecr/repository:Repository") if r.name.endswith("-gateway")]
    needed, parent = [repo.urn], repo.parent
    while parent and not parent.endswith("pulumi:pulumi:Stack::serving-fleet-dev"):
        needed.append(build_.by_urn(parent).urn)
        parent = build_.by_urn(parent).parent
    urn = {r.urn for r in build_.resources}
    # the engine leaves the root stack's type out of its children's URNs; the mock monitor
    # writes it in (…::pulumi:pulumi:Stack$serving-fleet:infra:ImageRegistry::…)
    prefix = "urn:pulumi:dev::serving-fleet::"
    normalized = [prefix + "pulumi:pulumi:Stack$" + t.removeprefix(prefix) if "$" not in t else t for t in targets]
    assert all(t in urn for t in normalized), normalized
    assert set(needed) <= set(normalized)


# --- cluster add-ons and the order things are created in --------------------------------------


def _kubernetes_version(stack: Build) -> str:
    return stack_config(stack.stack).get("serving-fleet:kubernetesVersion", "1.35")


def test_cluster_addons_are_managed_by_eks_at_its_default_version_for_the_clusters_kubernetes(stack: Build) -> None:
    from infra.addons import AFTER_NODES, BEFORE_NODES

    addons = {r.inputs["addonName"]: r for r in stack.of_type("aws:eks/addon:Addon")}
    assert (
        set(addons)
        == set(BEFORE_NODES + AFTER_NODES)
        >= {"vpc-cni", "coredns", "kube-proxy", "aws-ebs-csi-driver", "metrics-server"}
    )
    (cluster,) = stack.of_type("aws:eks/cluster:Cluster")
    for name, addon in addons.items():
        # the mocks answer the lookup with the add-on and Kubernetes version they were asked for
        assert addon.inputs["addonVersion"] == f"v{_kubernetes_version(stack)}.0-{name}-eksbuild.1"
        assert addon.inputs["resolveConflictsOnCreate"] == "OVERWRITE"  # takes over what EKS installed itself
        assert cluster.urn in addon.property_dependencies["clusterName"]
    role_arn = addons["aws-ebs-csi-driver"].inputs["serviceAccountRoleArn"]
    (role,) = [r for r in stack.of_type("aws:iam/role:Role") if r.state["arn"] == role_arn]
    (condition,) = [s["Condition"]["StringEquals"] for s in statements(role.inputs["assumeRolePolicy"])]
    assert "system:serviceaccount:kube-system:ebs-csi-controller-sa" in condition.values()
    attached = [
        a.inputs["policyArn"]
        for a in stack.of_type("aws:iam/rolePolicyAttachment:RolePolicyAttachment")
        if a.inputs["role"] == role.state["name"]
    ]
    assert attached == ["arn:aws:iam::aws:policy/service-role/AmazonEBSCSIDriverPolicy"]


def test_an_addon_version_can_be_pinned_and_an_unknown_addon_is_refused() -> None:
    import typing

    from infra.addons import AFTER_NODES, BEFORE_NODES
    from infra.config import ADDONS

    assert set(typing.get_args(ADDONS)) == set(BEFORE_NODES + AFTER_NODES)  # the config knows every add-on
    config = stack_config("dev")
    config["serving-fleet:addonVersions"] = json.dumps({"vpc-cni": "v1.19.5-eksbuild.1"})
    addons = {r.inputs["addonName"]: r.inputs for r in build("dev", config).of_type("aws:eks/addon:Addon")}
    assert addons["vpc-cni"]["addonVersion"] == "v1.19.5-eksbuild.1"
    assert addons["coredns"]["addonVersion"] == f"v{_kubernetes_version(example('dev'))}.0-coredns-eksbuild.1"
    config["serving-fleet:addonVersions"] = json.dumps({"vpc-cin": "v1.19.5-eksbuild.1"})
    with pytest.raises(pulumi.RunError, match="addonVersions"):
        build("dev", config)
    for bad in ("", "latest", "v1.19.5"):  # an empty pin would silently fall back to the lookup
        config["serving-fleet:addonVersions"] = json.dumps({"vpc-cni": bad})
        with pytest.raises(pulumi.RunError, match="expected an EKS add-on version like 'v1.19.5-eksbuild.1'"):
            build("dev", config)


def test_node_groups_follow_the_cluster_version(stack: Build) -> None:
    (cluster,) = stack.of_type("aws:eks/cluster:Cluster")
    for group in stack.of_type("aws:eks/nodeGroup:NodeGroup"):
        assert group.inputs["version"] == _kubernetes_version(stack)
        assert cluster.urn in group.property_dependencies["version"]  # the cluster's output, not a copy


def test_the_dependency_edges_that_matter(stack: Build) -> None:
    """Nodes after the add-ons they need to turn Ready; add-ons that run pods after the nodes;
    every Helm release and the gateway after nodes and add-ons; the gateway after its image
    repository."""
    from infra.addons import AFTER_NODES, BEFORE_NODES

    addons = {r.inputs["addonName"]: r.urn for r in stack.of_type("aws:eks/addon:Addon")}
    groups = [g.urn for g in stack.of_type("aws:eks/nodeGroup:NodeGroup")]
    for group in stack.of_type("aws:eks/nodeGroup:NodeGroup"):
        assert {addons[a] for a in BEFORE_NODES} <= set(group.dependencies), group.name
    for name in AFTER_NODES:
        (addon,) = [r for r in stack.of_type("aws:eks/addon:Addon") if r.urn == addons[name]]
        assert set(groups) <= set(addon.dependencies), name
    after = set(groups) | {addons[a] for a in AFTER_NODES}
    releases = stack.of_type("kubernetes:helm.sh/v3:Release")
    deployment = stack.one("kubernetes:apps/v1:Deployment", "gateway")
    for r in [*releases, deployment]:
        assert after <= set(r.dependencies), f"{r.name} may start before the nodes and add-ons"
    (repo,) = [r for r in stack.of_type("aws:ecr/repository:Repository") if r.name.endswith("-gateway")]
    assert repo.urn in deployment.property_dependencies["spec"]  # its image is that repository's URL
    # the gateway starts once its quota store exists (its URL names the primary endpoint)
    assert stack.one("aws:elasticache/replicationGroup:ReplicationGroup").urn in deployment.dependencies


def test_gpu_nodes_launch_only_in_zones_that_offer_their_type() -> None:
    from infra_harness import OFFERINGS

    prod = example("prod")
    classes = _custom(prod, "EC2NodeClass")
    subnets = {
        r.state.get("id") or r.id: r.inputs["availabilityZone"]
        for r in prod.of_type("aws:ec2/subnet:Subnet")
        if "private" in r.name
    }
    planned = {g.name: g for g in expected_plan("prod").node_groups}
    p4d = [n for n, g in planned.items() if g.instance_type == "p4d.24xlarge"]
    assert p4d
    for name in p4d:
        zones = {subnets[t["id"]] for t in classes[name]["spec"]["subnetSelectorTerms"]}
        assert zones and all("p4d.24xlarge" in OFFERINGS[z] or "*" in OFFERINGS[z] for z in zones)
        assert len(zones) < len(set(subnets.values()))  # the zone without it is left out
    # Karpenter has no minimum: nothing is launched (or paid) until a model's pods ask, and a
    # type the account has no quota for fails at launch, not at `pulumi up`
    assert all("minSize" not in str(p["spec"]) for p in _custom(prod, "NodePool").values())


def test_a_gpu_type_no_zone_of_the_stack_offers_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    import infra_harness

    monkeypatch.setattr(infra_harness, "OFFERINGS", {z: {"m6i.2xlarge"} for z in infra_harness.OFFERINGS})
    with pytest.raises(Exception, match=r"g5.xlarge is offered in none of the stack's availability zones"):
        build("dev")


def test_weights_and_images_reach_the_nodes_without_the_nat(stack: Build) -> None:
    endpoints = {r.inputs["serviceName"]: r.inputs for r in stack.of_type("aws:ec2/vpcEndpoint:VpcEndpoint")}
    s3 = endpoints["com.amazonaws.us-east-1.s3"]
    private_tables = {r.id for r in stack.of_type("aws:ec2/routeTable:RouteTable") if "private" in r.name}
    assert s3["vpcEndpointType"] == "Gateway" and set(s3["routeTableIds"]) == private_tables
    private_subnets = {r.id for r in stack.of_type("aws:ec2/subnet:Subnet") if "private" in r.name}
    for service in ("ecr.api", "ecr.dkr"):
        ecr = endpoints[f"com.amazonaws.us-east-1.{service}"]
        assert ecr["vpcEndpointType"] == "Interface" and ecr["privateDnsEnabled"] is True
        assert set(ecr["subnetIds"]) == private_subnets


# --- the gateways' quota store (ElastiCache) ------------------------------------------------

REDIS_TOKEN = SECRET_CONFIG[f"{PROJECT}:redisAuthToken"]


def _redis_config(stack: str) -> dict:
    return json.loads(stack_config(stack)["serving-fleet:redis"])


def _quota_sg(stack: Build):  # noqa: ANN202
    return stack.one("aws:ec2/securityGroup:SecurityGroup", "-quotas")


def test_the_quota_store_is_an_encrypted_valkey_replication_group_sized_for_its_env(stack: Build) -> None:
    group = stack.one("aws:elasticache/replicationGroup:ReplicationGroup")
    rg, config = group.inputs, _redis_config(stack.stack)
    assert (rg["engine"], rg["port"], rg["nodeType"]) == ("valkey", 6379, config["node_type"])
    assert rg["atRestEncryptionEnabled"] is True and rg["transitEncryptionEnabled"] is True
    assert rg["transitEncryptionMode"] == "required" and "kmsKeyId" not in rg  # the service's key
    replicated = stack.stack == "prod"  # dev: one node; prod: a primary and a replica in another AZ
    assert rg["numCacheClusters"] == (2 if replicated else 1) == config["nodes"]
    assert rg["automaticFailoverEnabled"] is replicated and rg["multiAzEnabled"] is replicated
    assert rg["authToken"] == REDIS_TOKEN and "authToken" in group.secret_inputs
    assert rg["authTokenUpdateStrategy"] == "ROTATE"
    assert rg["replicationGroupId"] == f"serving-fleet-{stack.stack}-quotas"
    subnets = stack.one("aws:elasticache/subnetGroup:SubnetGroup")
    assert (
        rg["subnetGroupName"] == subnets.state["name"] and subnets.urn in group.property_dependencies["subnetGroupName"]
    )
    assert rg["securityGroupIds"] == [_quota_sg(stack).id]


def test_the_quota_store_lives_in_the_private_subnets_only(stack: Build) -> None:
    subnets = stack.one("aws:elasticache/subnetGroup:SubnetGroup").inputs["subnetIds"]
    private = {r.id for r in stack.of_type("aws:ec2/subnet:Subnet") if "private" in r.name}
    public = {r.id for r in stack.of_type("aws:ec2/subnet:Subnet") if "public" in r.name}
    assert set(subnets) == private and not set(subnets) & public
    assert len(subnets) == json.loads(
        stack_config(stack.stack)["serving-fleet:azCount"]
    )  # one per AZ: Multi-AZ can place a replica


def test_only_the_nodes_security_group_reaches_the_quota_store_on_6379(stack: Build) -> None:
    sg = _quota_sg(stack)
    assert not sg.inputs.get("ingress") and not sg.inputs.get("egress")  # no inline rules; stateful replies need none
    rules = [
        r
        for r in stack.resources
        if r.type.startswith("aws:vpc/securityGroup") and sg.urn in r.property_dependencies.get("securityGroupId", [])
    ]
    (rule,) = rules
    assert rule.type == "aws:vpc/securityGroupIngressRule:SecurityGroupIngressRule"
    assert (rule.inputs["ipProtocol"], rule.inputs["fromPort"], rule.inputs["toPort"]) == ("tcp", 6379, 6379)
    assert not {"cidrIpv4", "cidrIpv6", "prefixListId"} & set(rule.inputs)  # a security group, never an address range
    # the cluster security group: EKS puts it on every managed node, and the system nodes the
    # gateway runs on name no other in their launch template (pods use their node's groups)
    cluster = stack.one("aws:eks/cluster:Cluster")
    assert rule.inputs["referencedSecurityGroupId"] == cluster.state["vpcConfig"]["clusterSecurityGroupId"]
    assert cluster.urn in rule.property_dependencies["referencedSecurityGroupId"]
    system = stack.one("aws:ec2/launchTemplate:LaunchTemplate", "-system").inputs
    assert "vpcSecurityGroupIds" not in system and "networkInterfaces" not in system
    pod, _ = _gateway(stack)
    assert pod["nodeSelector"] == {POOL_LABEL: "system"}


def test_the_gateway_reads_its_redis_url_from_a_secret_and_runs_its_workers(stack: Build) -> None:
    from infra.quota_store import redis_url

    group = stack.one("aws:elasticache/replicationGroup:ReplicationGroup")
    (secret,) = [r for r in stack.of_type("kubernetes:core/v1:Secret") if "url" in r.inputs["stringData"]]
    url = secret.inputs["stringData"]["url"]
    assert (
        url
        == f"rediss://:{REDIS_TOKEN}@{group.state['primaryEndpointAddress']}:6379/0"
        == redis_url(REDIS_TOKEN, group.state["primaryEndpointAddress"])
    )
    assert "stringData" in secret.secret_inputs and secret.inputs["type"] == "Opaque"
    assert (
        secret.inputs["metadata"]["namespace"] == "fleet" and "name" not in secret.inputs["metadata"]
    )  # auto-named: a new URL rolls the pods
    _, container = _gateway(stack)
    env = _env(container)
    assert env["FLEET_REDIS_URL"] == {
        "name": "FLEET_REDIS_URL",
        "valueFrom": {"secretKeyRef": {"name": secret.state["metadata"]["name"], "key": "url"}},
    }
    assert "value" not in env["FLEET_REDIS_URL"]
    gateway = json.loads(stack_config(stack.stack)["serving-fleet:gateway"])
    assert env["FLEET_GATEWAY_WORKERS"]["value"] == str(gateway["workers"])
    cpu = float(container["resources"]["requests"]["cpu"])
    assert cpu >= gateway["workers"]  # one CPU per worker process at least
    assert stack.outputs["redisEndpoint"] == group.state["primaryEndpointAddress"]  # a host name, no token
    deployment = stack.one("kubernetes:apps/v1:Deployment", "gateway")
    assert group.urn in deployment.dependencies and secret.urn in deployment.dependencies


def test_the_quota_store_config_is_checked() -> None:
    config = stack_config("dev")
    del config[f"{PROJECT}:redisAuthToken"]
    with pytest.raises(
        pulumi.RunError, match="serving-fleet:redisAuthToken: not set .* `pulumi config set --secret redisAuthToken "
    ):
        build("dev", config)
    for bad, says in (
        (REDIS_TOKEN + "#$" * 10, "characters ElastiCache refuses or a URL would need escaped"),
        ("a" * 129, "got 129 characters (value not shown) — expected at most 128"),
    ):
        config[f"{PROJECT}:redisAuthToken"] = bad
        with pytest.raises(pulumi.RunError, match=re.escape(says)) as err:
            build("dev", config)
        assert bad not in str(err.value)
    prod = stack_config("prod")
    prod["serving-fleet:redis"] = json.dumps({"nodes": 1})
    with pytest.raises(
        pulumi.RunError, match=r"serving-fleet:redis.nodes: got 1 — expected an integer >= 2 \(required for env prod"
    ):
        build("prod", prod)
    dev = stack_config("dev")
    dev["serving-fleet:redis"] = json.dumps({"node_type": "cache.r7g.large", "nodes": 1})
    with pytest.raises(
        pulumi.RunError, match=r"redis.hourly_usd: .*expected the on-demand USD price of one cache.r7g.large"
    ):
        build("dev", dev)
    dev["serving-fleet:redis"] = json.dumps({"node_type": "cache.r7g.large", "nodes": 3, "hourly_usd": 0.2})
    built = build("dev", dev)
    rg = built.one("aws:elasticache/replicationGroup:ReplicationGroup").inputs
    assert (rg["nodeType"], rg["numCacheClusters"], rg["multiAzEnabled"]) == ("cache.r7g.large", 3, True)
    # 1.6793-3.0437 without the store and S3, + 3 × 0.2, + the S3 requests of 2-3 gateway processes and the log
    assert built.outputs["usdPerHour"] == {"min": 2.3, "max": 3.68}
    dev["serving-fleet:gateway"] = json.dumps({"workers": 3, "cpu": 2})
    with pytest.raises(
        pulumi.RunError,
        match=r"serving-fleet:gateway.cpu: got 2.0 — expected a number >= workers \(3\): one CPU per worker",
    ):
        build("dev", dev)


def test_replication_group_ids_are_what_elasticache_accepts() -> None:
    from infra.quota_store import replication_group_id

    assert replication_group_id("serving-fleet-dev-quotas") == "serving-fleet-dev-quotas"
    assert replication_group_id("serving-fleet-My_Stack.2-quotas") == "serving-fleet-my-stack-2-quotas"
    assert replication_group_id("serving-fleet-9x-quotas").startswith("serving-fleet-9x")
    long_a, long_b = (replication_group_id(f"serving-fleet-{s}-quotas") for s in ("a" * 40 + "-eu", "a" * 40 + "-us"))
    for rid in (long_a, long_b, replication_group_id("9" * 50)):
        assert re.fullmatch(r"[a-z](?:[a-z0-9]|-(?!-))*[a-z0-9]", rid) and len(rid) <= 40, rid
    assert long_a != long_b
