"""Karpenter for the model nodes: the NodePools and EC2NodeClasses the plan makes, checked
against the vendored CRD schemas of the pinned release; the canary surge, capacity-type rule,
taints and budgets; the controller's IAM, interruption queue and Helm values as the program
builds them under Pulumi's mocks; and the system group's minimum raised by a later `up`."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import jsonschema
import pytest
import yaml
from infra_harness import ACCOUNT, REGION, ROOT, Build, build, example, iam_allows, role_policy, stack_config
from k8s_schemas import _closed, json_ints
from test_charts import merged, unknown_keys

from fleet.planning.karpenter import (
    KARPENTER_VERSION,
    MODEL_NODE_TAINT,
    ON_DEMAND,
    SPOT,
    node_class,
    node_pool,
    node_pools,
)
from fleet.planning.placement import GPU_RESOURCE, ModelPlacement, NodeGroupPlan, PlacementPlan
from fleet.planning.stack import NodePool
from infra.karpenter_iam import INTERRUPTION_EVENTS

FIXTURES = Path(__file__).parent / "fixtures" / "karpenter"
SOURCES = json.loads((FIXTURES / "SOURCES.json").read_text())
SCHEMAS = {
    ("karpenter.sh/v1", "NodePool"): json.loads((FIXTURES / "nodepool.schema.json").read_text()),
    ("karpenter.k8s.aws/v1", "EC2NodeClass"): json.loads((FIXTURES / "ec2nodeclass.schema.json").read_text()),
}


def validate(obj: dict) -> None:
    """The object against its CRD's schema, unknown fields closed (as tests/k8s_schemas.py does)."""
    obj = json_ints(obj)
    jsonschema.validate(obj, _closed(SCHEMAS[(obj["apiVersion"], obj["kind"])]))


@pytest.fixture(scope="module", params=("dev", "prod"))
def stack(request: pytest.FixtureRequest) -> Build:
    return example(request.param)


def expected_pools(stack: str):  # noqa: ANN201
    from fleet.catalog.policies.loader import load_policies
    from fleet.planning.planner import plan
    from fleet.planning.stack import placement_inputs, read_stack_file

    policies = load_policies(ROOT / "policies")
    pools, models = placement_inputs(read_stack_file(ROOT / f"Pulumi.{stack}.yaml"), stack, policies)
    return node_pools(plan(policies, pools, models), pools)


def controller_role(stack: Build):  # noqa: ANN201
    (role,) = [r for r in stack.of_type("aws:iam/role:Role") if r.name == f"serving-fleet-{stack.stack}-karpenter"]
    return role


def custom(stack: Build, kind: str) -> dict[str, dict]:
    """The NodePools or EC2NodeClasses as the provider sends them, by metadata.name."""
    out = {}
    for r in stack.resources:
        if r.type.endswith(f":{kind}"):
            # a copy: the stack is built once per session and other tests read the same objects
            obj = copy.deepcopy({k: v for k, v in r.inputs.items() if k in ("apiVersion", "kind", "metadata", "spec")})
            out[obj["metadata"]["name"]] = obj
    return out


# --- the objects against the CRDs ------------------------------------------------------------


def test_the_vendored_files_are_the_pinned_release() -> None:
    assert SOURCES["karpenter"]["version"] == KARPENTER_VERSION
    chart = yaml.safe_load((FIXTURES / f"karpenter-{KARPENTER_VERSION}" / "Chart.yaml").read_text())
    assert chart["version"] == chart["appVersion"] == KARPENTER_VERSION


def test_every_nodepool_and_nodeclass_of_the_program_validates_against_the_crds(stack: Build) -> None:
    pools, classes = custom(stack, "NodePool"), custom(stack, "EC2NodeClass")
    assert set(pools) == set(classes) == {p.name for p in expected_pools(stack.stack)}
    for obj in classes.values():  # the mocks name a subnet "<resource>-id"; AWS answers subnet-<hex>
        for term in obj["spec"]["subnetSelectorTerms"]:
            assert term["id"].endswith("-id")
            term["id"] = "subnet-0" + term["id"].encode().hex()[:16]
    for obj in [*pools.values(), *classes.values()]:
        validate(obj)


def test_the_schema_check_has_teeth() -> None:
    (p, *_) = expected_pools("prod")
    good = node_pool(p)
    validate(good)
    typo = json.loads(json.dumps(good))
    typo["spec"]["disruption"]["consolidateafter"] = "5m"
    with pytest.raises(jsonschema.ValidationError, match="consolidateafter"):
        validate(typo)
    bad = node_class(p, cluster="c", role="r", subnet_ids=["subnet-1"], tags={})
    bad["spec"]["metadataOptions"]["httpTokens"] = "sometimes"
    with pytest.raises(jsonschema.ValidationError):
        validate(bad)


# --- limits, surge, capacity type, taints, budgets -------------------------------------------


def _placed(model: str, gpus: int, max_replicas: int, *, tp: int = 1, weights: float = 1.0) -> ModelPlacement:
    return ModelPlacement(
        model=model,
        family="f",
        node_group="g",
        pool="g",
        instance_type="g5.12xlarge",
        gpus=gpus,
        tensor_parallel=tp,
        shared_gpu=False,
        gpu_memory_gib=10.0,
        cpu=4.0,
        memory_gib=16.0,
        min_replicas=1,
        max_replicas=max_replicas,
        target_qps_per_replica=1.0,
        target_p99_ms=100.0,
        weights_gib=weights,
    )


def test_limits_include_the_canary_surge_as_computed_by_hand() -> None:
    """g5.12xlarge: 4 GPUs, 48 vCPU, 192 GiB. Model a: 1 GPU × 3 replicas, model b: 2 GPUs × 2.
    Stables at peak: 3 + 4 = 7 GPUs → 2 nodes. b's canary (2 × 2 GPUs) needs 11 GPUs → 3 nodes,
    a's (3 × 1) 10 → 3 nodes: one surge node. Limits: 3 nodes = 12 GPUs, 144 vCPU, 576 GiB."""
    pool = NodePool(
        name="g",
        instance_type="g5.12xlarge",
        gpus=4,
        gpu_memory_gib=24,
        vcpu=48,
        memory_gib=192,
        hourly_usd=5.672,
        max_nodes=10,
    )
    group = NodeGroupPlan("g", "g", "g5.12xlarge", 4, 1, 1, 2, 5.672, ("a", "b"))
    plan = PlacementPlan((_placed("a", 1, 3), _placed("b", 2, 2, tp=2)), (group,))
    (p,) = node_pools(plan, [pool])
    assert (p.max_nodes, p.surge_nodes, p.surge_short, p.limit_nodes) == (2, 1, 0, 3)
    assert p.limits == {"cpu": "144", "memory": "576Gi", "nodes": "3", GPU_RESOURCE: "12"}
    assert p.usd_per_hour == pytest.approx((5.672, 3 * 5.672))
    # the stack owner's max_nodes caps the surge, and the plan says by how much
    (capped,) = node_pools(plan, [pool.model_copy(update={"max_nodes": 2})])
    assert (capped.surge_nodes, capped.surge_short, capped.limits["nodes"]) == (0, 1, "2")


def test_capacity_type_on_demand_for_large_models_spot_allowed_for_small() -> None:
    pools = {p.name: p for p in expected_pools("prod")}
    assert pools["a100-8"].capacity_types == (ON_DEMAND,)  # llm-70b: tensor-parallel over 8 GPUs
    assert pools["a10g-1-llm-7b"].capacity_types == (ON_DEMAND,)  # 13 GiB of weights
    assert pools["a10g-1"].capacity_types == (SPOT, ON_DEMAND) == pools["cpu"].capacity_types
    for name, p in pools.items():
        (req,) = [
            r for r in node_pool(p)["spec"]["template"]["spec"]["requirements"] if r["key"].endswith("capacity-type")
        ]
        assert tuple(req["values"]) == p.capacity_types, name


@pytest.mark.parametrize(
    ("given", "small", "large"), [("ON_DEMAND", (ON_DEMAND,), (ON_DEMAND,)), ("SPOT", (SPOT, ON_DEMAND), (ON_DEMAND,))]
)
def test_a_pools_capacity_type_forbids_spot_or_allows_it_but_never_for_a_large_model(
    given: str, small: tuple[str, ...], large: tuple[str, ...]
) -> None:
    from fleet.catalog.policies.loader import load_policies
    from fleet.planning.planner import plan
    from fleet.planning.stack import placement_inputs, read_stack_file

    policies = load_policies(ROOT / "policies")
    raw = read_stack_file(ROOT / "Pulumi.prod.yaml")
    pools, models = placement_inputs(raw, "prod", policies)
    pools = tuple(p.model_copy(update={"capacity_type": given}) for p in pools)
    found = {p.name: p.capacity_types for p in node_pools(plan(policies, pools, models), pools)}
    assert (found["cpu"], found["a10g-1"]) == (small, small)
    assert found["a100-8"] == found["a10g-1-llm-7b"] == large


def test_prod_surge_fits_the_gpu_ceiling_and_says_what_max_nodes_cut() -> None:
    pools = {p.name: p for p in expected_pools("prod")}
    assert {n: (p.max_nodes, p.surge_nodes, p.surge_short) for n, p in pools.items()} == {
        "a100-8": (2, 0, 2),  # max_nodes 2: a 70b canary at peak waits for its stable to scale down
        "a10g-1": (1, 1, 0),
        "a10g-1-llm-7b": (4, 2, 2),  # the a10g-1 pool's max_nodes 8 leaves 3 surge nodes
        "cpu": (1, 1, 0),
    }
    ceiling = json.loads((ROOT / "policies" / "guardrails" / "prod.json").read_text())["gpu-ceiling"]["maxGpus"]
    assert sum(p.limit_gpus for p in pools.values()) <= ceiling


def test_every_model_pool_is_tainted_and_gpu_and_dedicated_taints_stay(stack: Build) -> None:
    for p in expected_pools(stack.stack):
        taints = {(t["key"], t.get("value"), t["effect"]) for t in node_pool(p)["spec"]["template"]["spec"]["taints"]}
        assert MODEL_NODE_TAINT in taints, p.name  # platform pods never land on model nodes
        if p.gpus_per_node:
            assert (GPU_RESOURCE, "present", "NoSchedule") in taints
        if "fleet.io/dedicated" in p.labels:
            assert ("fleet.io/dedicated", p.labels["fleet.io/dedicated"], "NoSchedule") in taints
        # the placement's node selector finds the nodes
        assert node_pool(p)["spec"]["template"]["metadata"]["labels"]["fleet.io/node-group"] == p.name


def test_consolidation_and_budgets_move_one_node_at_a_time_and_never_a_large_replica_for_utilisation() -> None:
    for p in expected_pools("prod"):
        disruption = node_pool(p)["spec"]["disruption"]
        assert disruption["consolidationPolicy"] == "WhenEmptyOrUnderutilized" and disruption["consolidateAfter"]
        assert {"nodes": "1"} in disruption["budgets"]
        assert ({"nodes": "0", "reasons": ["Underutilized"]} in disruption["budgets"]) == p.large
        assert node_pool(p)["spec"]["template"]["spec"]["expireAfter"] == "Never"


def test_node_classes_imdsv2_raid0_on_nvme_else_a_sized_gp3_root(stack: Build) -> None:
    pools = {p.name: p for p in expected_pools(stack.stack)}
    for name, obj in custom(stack, "EC2NodeClass").items():
        spec, p = obj["spec"], pools[name]
        assert spec["metadataOptions"]["httpTokens"] == "required"
        assert spec["metadataOptions"]["httpPutResponseHopLimit"] == 1
        assert spec["amiSelectorTerms"][0]["alias"].startswith("al2023@")
        assert spec["securityGroupSelectorTerms"] == [
            {"tags": {"karpenter.sh/discovery": f"serving-fleet-{stack.stack}"}}
        ]
        assert spec["role"].endswith(f"serving-fleet-{stack.stack}-karpenter-nodes-{spec['role'][-7:]}")
        (root,) = spec["blockDeviceMappings"]
        assert root["rootVolume"] and root["ebs"]["encrypted"] and root["ebs"]["volumeType"] == "gp3"
        assert spec["tags"]["env"] == stack.stack and spec["tags"]["fleet-node-group"] == name
        if p.nvme:
            assert spec["instanceStorePolicy"] == "RAID0"
        else:
            assert "instanceStorePolicy" not in spec
            assert root["ebs"]["throughput"] == 1000 and root["ebs"]["iops"] == 4000
            assert int(root["ebs"]["volumeSize"].removesuffix("Gi")) >= p.weights_cache_gib + 20


# --- the controller: IAM, queue, rules, chart --------------------------------------------------


def test_the_interruption_queue_has_its_rules_and_a_policy_for_events_and_the_controller_only(stack: Build) -> None:
    queue = stack.one("aws:sqs/queue:Queue", "karpenter-interruptions")
    assert queue.inputs["name"] == f"serving-fleet-{stack.stack}" and queue.inputs["sqsManagedSseEnabled"]
    rules = {r.urn: json.loads(r.inputs["eventPattern"]) for r in stack.of_type("aws:cloudwatch/eventRule:EventRule")}
    detail = {p["detail-type"][0] for p in rules.values() if "karpenter" in json.dumps(p) or True}
    for needed in (
        "EC2 Spot Instance Interruption Warning",
        "EC2 Instance Rebalance Recommendation",
        "EC2 Instance State-change Notification",
        "AWS Health Event",
    ):
        assert needed in detail
    targets = [t for t in stack.of_type("aws:cloudwatch/eventTarget:EventTarget")]
    assert len(targets) == len(INTERRUPTION_EVENTS)
    for t in targets:
        assert t.inputs["arn"] == queue.state["arn"] and queue.urn in t.property_dependencies["arn"]
    policy = json.loads(stack.one("aws:sqs/queuePolicy:QueuePolicy").inputs["policy"])["Statement"]
    role = controller_role(stack)
    by_sid = {s["Sid"]: s for s in policy}
    assert by_sid["EventsSend"]["Principal"] == {"Service": "events.amazonaws.com"}
    rule_arns = [r.state["arn"] for r in stack.of_type("aws:cloudwatch/eventRule:EventRule")]
    assert sorted(by_sid["EventsSend"]["Condition"]["ArnEquals"]["aws:SourceArn"]) == sorted(rule_arns)
    consume = by_sid["OnlyTheControllerConsumes"]
    assert consume["Effect"] == "Deny" and "sqs:ReceiveMessage" in consume["Action"]
    assert consume["Condition"]["ArnNotEquals"]["aws:PrincipalArn"] == role.state["arn"]
    assert by_sid["DenyHTTP"]["Condition"] == {"Bool": {"aws:SecureTransport": "false"}}


def test_the_controller_policy_is_scoped_to_this_cluster(stack: Build) -> None:
    cluster = f"serving-fleet-{stack.stack}"
    policy = role_policy(stack, "karpenter")
    writes = [
        s
        for s in policy
        if any(
            a.split(":")[1].startswith(("Run", "Create", "Terminate", "Delete", "Tag", "Add", "Remove"))
            for a in (s["Action"] if isinstance(s["Action"], list) else [s["Action"]])
        )
        and s["Resource"] != "*"
    ]
    for s in writes:
        if s["Sid"] == "AllowScopedEC2InstanceAccessActions":  # images, subnets...: what a launch reads
            continue
        if s["Sid"] == "AllowInterruptionQueueActions":  # this stack's queue only
            assert s["Resource"] == stack.one("aws:sqs/queue:Queue").state["arn"]
            continue
        conditions = json.dumps(s.get("Condition", {}))
        assert f"kubernetes.io/cluster/{cluster}" in conditions, s["Sid"]
    node_role = stack.one("aws:iam/role:Role", "karpenter-nodes").state["arn"]
    (passing,) = [s for s in policy if s["Action"] == "iam:PassRole"]
    assert passing["Resource"] == node_role  # the Karpenter node role only
    assert not iam_allows(policy, "iam:PassRole", f"arn:aws:iam::{ACCOUNT}:role/admin")
    (describe,) = [s for s in policy if s["Action"] == "eks:DescribeCluster"]
    assert describe["Resource"] == f"arn:aws:eks:{REGION}:{ACCOUNT}:cluster/{cluster}"
    # the same statements as Karpenter's published reference, no action more
    reference = yaml.safe_load(
        (FIXTURES / "cloudformation.yaml").read_text().replace("!Sub", "").replace("!GetAtt", "").replace("!Ref", "")
    )
    text = json.dumps(reference)
    for s in policy:
        assert s["Sid"] in text, s["Sid"]
        for action in s["Action"] if isinstance(s["Action"], list) else [s["Action"]]:
            assert action in text, action
    assert len(json.dumps(policy, separators=(",", ":"))) < 10240  # an inline policy's limit


def test_the_chart_is_pinned_and_its_values_exist_in_the_chart(stack: Build) -> None:
    release = stack.one("kubernetes:helm.sh/v3:Release", "karpenter").inputs
    assert release["chart"] == "oci://public.ecr.aws/karpenter/karpenter" and release["version"] == KARPENTER_VERSION
    assert release["namespace"] == "kube-system" and release["atomic"] is True
    files = FIXTURES / f"karpenter-{KARPENTER_VERSION}"
    assert not (files / "values.schema.json").exists() and SOURCES["karpenter"]["schema"] is False
    defaults = yaml.safe_load((files / "values.yaml").read_text())
    ours = release["values"]
    # nodeSelector is a label map the chart passes on as it is
    assert unknown_keys(defaults, {k: v for k, v in ours.items() if k != "nodeSelector"}) == []
    effective = merged(defaults, ours)
    assert effective["settings"]["clusterName"] == f"serving-fleet-{stack.stack}"
    assert effective["settings"]["interruptionQueue"] == f"serving-fleet-{stack.stack}"
    assert effective["nodeSelector"]["fleet.io/node-group"] == "system"
    role = controller_role(stack)
    assert effective["serviceAccount"]["annotations"]["eks.amazonaws.com/role-arn"] == role.state["arn"]
    for cr in [
        *stack.of_type("kubernetes:karpenter.sh/v1:NodePool"),
        *stack.of_type("kubernetes:karpenter.k8s.aws/v1:EC2NodeClass"),
    ]:
        assert stack.one("kubernetes:helm.sh/v3:Release", "karpenter").urn in cr.dependencies  # its CRDs first


def test_no_managed_node_group_but_the_system_one(stack: Build) -> None:
    groups = [r.inputs["nodeGroupName"] for r in stack.of_type("aws:eks/nodeGroup:NodeGroup")]
    assert groups == ["system"]


# --- the system group's minimum, raised by a later `up` ----------------------------------------


def test_a_later_up_that_raises_the_system_minimum_sends_a_desired_size_eks_accepts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """EKS refuses min > desired. The engine replaces an ignored property with its old value,
    so with desiredSize ignored (today's code) the update sends min 3 with desired 2."""
    from pulumi.runtime import mocks

    import infra.nodegroups

    ignored: dict[str, list[str]] = {}
    register = mocks.MockMonitor.RegisterResource

    def spy(self, request):  # noqa: ANN001, ANN202
        ignored[request.name] = list(request.ignoreChanges)
        return register(self, request)

    monkeypatch.setattr(mocks.MockMonitor, "RegisterResource", spy)
    monkeypatch.setattr(infra.nodegroups, "live_desired_size", lambda cluster, group: 2)  # first `up`: min 2
    config = stack_config("dev")
    system = json.loads(config["serving-fleet:systemNodes"])
    config["serving-fleet:systemNodes"] = json.dumps({**system, "min_size": 3, "max_size": 4})
    group = build("dev", config).one("aws:eks/nodeGroup:NodeGroup", "system")
    sent = dict(group.inputs["scalingConfig"])
    if "scalingConfig.desiredSize" in ignored[group.name] or "scalingConfig" in ignored[group.name]:
        sent["desiredSize"] = 2  # what the engine sends: the old input
    assert sent["minSize"] == 3 <= sent["desiredSize"] <= sent["maxSize"] == 4
    # the autoscaler's choice stands where it is within the bounds
    monkeypatch.setattr(infra.nodegroups, "live_desired_size", lambda cluster, group: 4)
    assert build("dev", config).one("aws:eks/nodeGroup:NodeGroup", "system").inputs["scalingConfig"]["desiredSize"] == 4


def _tolerates(tolerations: list[dict], taint: tuple[str, str, str]) -> bool:
    """Kubernetes' rule: a toleration matches a taint's key (or is an Exists without a key),
    its value (Equal) and its effect (or has none)."""
    key, value, effect = taint
    for t in tolerations:
        key_ok = t.get("key") == key or (not t.get("key") and t.get("operator") == "Exists")
        value_ok = t.get("operator") == "Exists" or t.get("value") == value
        if key_ok and value_ok and t.get("effect") in (None, "", effect):
            return True
    return False


def test_model_pods_tolerate_every_taint_of_their_pool_and_platform_pods_none(stack: Build) -> None:
    """A model pod that missed one taint of its NodePool would stay Pending for ever (Karpenter
    launches nothing for it); a platform pod tolerating the model-node taint could take a GPU node's room."""
    from fleet.runtime.kubernetes.manifests import manifests, placement_from_dict

    pools = {p.name: p for p in expected_pools(stack.stack)}
    for raw in stack.outputs["placement"]["models"]:
        placed = placement_from_dict(json.loads(json.dumps(raw)))
        deployment = manifests(placed.model, "1.0.0", "image:x", placed, floor=1, prometheus_url="http://p")[0]
        pod = deployment["spec"]["template"]["spec"]
        for taint in pools[placed.node_group].taints:
            assert _tolerates(pod["tolerations"], taint), f"{placed.model} does not tolerate {taint}"
        assert pod["nodeSelector"]["fleet.io/node-group"] == placed.node_group
    platform = [
        r.inputs["spec"]["template"]["spec"]
        for r in stack.resources
        if r.type in ("kubernetes:apps/v1:Deployment", "kubernetes:apps/v1:StatefulSet")
    ]
    assert platform  # the gateway at least
    for pod in platform:
        assert not _tolerates(pod.get("tolerations") or [], MODEL_NODE_TAINT)


@pytest.mark.parametrize("chart", ["nvidia-device-plugin", "dcgm-exporter"])
def test_the_gpu_daemonsets_tolerate_every_taint_of_every_gpu_pool(stack: Build, chart: str) -> None:
    """Without the device plugin a GPU node never advertises nvidia.com/gpu and every GPU model
    pod stays Pending; without the DCGM exporter the gpu_utilization trigger reads nothing."""
    (release,) = [r for r in stack.of_type("kubernetes:helm.sh/v3:Release") if r.inputs["chart"] == chart]
    tolerations = release.inputs["values"]["tolerations"]
    gpu_pools = [p for p in expected_pools(stack.stack) if p.gpus_per_node]
    assert gpu_pools
    for p in gpu_pools:
        for taint in p.taints:
            assert _tolerates(tolerations, taint), f"{chart} does not tolerate {taint} of NodePool {p.name}"


@pytest.mark.parametrize(
    ("floor", "expected"), [(2, {"minAvailable": 2}), (1, {"minAvailable": 1}), (0, {"maxUnavailable": 1})]
)
def test_an_eviction_never_takes_a_version_below_its_floor(floor: int, expected: dict) -> None:
    """Karpenter drains through the eviction API: the version's PodDisruptionBudget is what
    keeps consolidation and drift from taking its last replicas (a lazy one, floor 0, may go)."""
    from fleet.runtime.kubernetes.manifests import manifests, placement_from_dict

    raw = next(m for m in example("prod").outputs["placement"]["models"] if m["model"] == "llm-7b")
    placed = placement_from_dict(json.loads(json.dumps(raw)))
    objs = manifests("llm-7b", "1.0.0", "image:x", placed, floor=floor, prometheus_url="http://p")
    (budget,) = [o for o in objs if o["kind"] == "PodDisruptionBudget"]
    spec = {k: v for k, v in budget["spec"].items() if k != "selector"}
    assert spec == expected


def test_the_system_groups_size_is_read_live_and_only_a_missing_group_counts_as_new(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A lookup that failed for another reason (credentials, throttling) must stop the program:
    taking it for a new group would send the minimum and shrink a scaled-out system pool."""
    from types import SimpleNamespace

    import pulumi
    import pulumi_aws as aws
    from pulumi.runtime import settings

    import infra.nodegroups as ng

    monkeypatch.setattr(settings, "get_monitor", lambda: None)  # as under `pulumi up`, not the mocks
    answer: dict = {}

    def get_node_group(**kwargs):  # noqa: ANN003, ANN202
        if "error" in answer:
            raise Exception(answer["error"])  # noqa: TRY002 - what the provider's invoke raises
        return SimpleNamespace(scaling_configs=[SimpleNamespace(desired_size=5)])

    monkeypatch.setattr(aws.eks, "get_node_group", get_node_group)
    assert ng.live_desired_size("serving-fleet-dev", "system") == 5
    answer["error"] = "reading EKS Node Group: ResourceNotFoundException: No node group found for name: system."
    assert ng.live_desired_size("serving-fleet-dev", "system") is None
    answer["error"] = (
        "operation error EKS: DescribeNodegroup, https response error StatusCode: 429, ThrottlingException"
    )
    with pytest.raises(pulumi.RunError, match="could not read node group system of cluster serving-fleet-dev"):
        ng.live_desired_size("serving-fleet-dev", "system")
