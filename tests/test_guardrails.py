"""The CrossGuard pack (policies/guardrails/) over what the Pulumi program registers: it passes
both example stacks, catches each deliberately broken variant (naming what broke), and the
pack builds. Each policy alone, on hand-made resources: tests/test_guardrails_gpu.py and
tests/test_guardrails_policies.py; how the pack is run as the engine runs it:
tests/guardrails_harness.py."""

from __future__ import annotations

import copy
import json
import runpy
from collections.abc import Callable

import pulumi_policy
import pytest
from guardrails_harness import NODE_CLASS, NODE_POOL, PACK, guard, pack_config, policies_of, run_pack
from infra_harness import ROOT, Registered, example, takes_tags

pod_gpu_problems = guard.compute.pod_gpu_problems  # the pack is importable once guardrails_harness put it on the path

# --- the program's own resources ------------------------------------------------------------


@pytest.mark.parametrize("stack", ["dev", "prod"])
def test_the_pack_finds_nothing_wrong_with_what_the_program_registers(stack: str) -> None:
    assert run_pack(example(stack).resources, pack_config(stack)) == []


def _find(resources: list[Registered], type_: str, name_contains: str = "") -> Registered:
    return next(r for r in resources if r.type == type_ and name_contains in r.name)


def _both(r: Registered) -> tuple[dict, ...]:
    """A resource's inputs (what resource policies see) and its state (stack policies')."""
    return (r.inputs, r.state) if r.state else (r.inputs,)


def _pool_spec(rs: list[Registered], name: str) -> tuple[dict, ...]:
    return tuple(props["spec"] for props in _both(_find(rs, NODE_POOL, f"-karpenter-{name}")) if "spec" in props)


def _untaint_pool(rs: list[Registered]) -> None:
    for spec in _pool_spec(rs, "a100-8"):
        template = spec["template"]["spec"]
        template["taints"] = [t for t in template["taints"] if t["key"] != "nvidia.com/gpu"]


def _untainted_gpu_node_group(rs: list[Registered]) -> None:
    """A managed GPU node group beside the system one, as someone might add: the system group's
    registered resource, made a GPU group (NVIDIA AMI, g5.xlarge, up to 3 nodes) without the taint."""
    system = _find(rs, "aws:eks/nodeGroup:NodeGroup", "-system")
    group = copy.deepcopy(system)
    group.name, group.urn = system.name.replace("-system", "-gpu"), system.urn.replace("-system", "-gpu")
    for props in _both(group):
        props.update(nodeGroupName="gpu", instanceTypes=["g5.xlarge"], amiType="AL2023_x86_64_NVIDIA", taints=[])
        props["scalingConfig"] = {"minSize": 0, "desiredSize": 0, "maxSize": 3}
    rs.append(group)


def _suspend_versioning(rs: list[Registered]) -> None:
    _find(rs, "aws:s3/bucketVersioning:BucketVersioning", "models").inputs["versioningConfiguration"]["status"] = (
        "Suspended"
    )
    _find(rs, "aws:s3/bucketVersioning:BucketVersioning", "models").state["versioningConfiguration"]["status"] = (
        "Suspended"
    )


def _drop_encryption(rs: list[Registered]) -> None:
    rs.remove(
        _find(rs, "aws:s3/bucketServerSideEncryptionConfiguration:BucketServerSideEncryptionConfiguration", "logs")
    )


def _unblock(rs: list[Registered]) -> None:
    block = _find(rs, "aws:s3/bucketPublicAccessBlock:BucketPublicAccessBlock", "models")
    block.inputs["restrictPublicBuckets"] = block.state["restrictPublicBuckets"] = False


def _public_policy(rs: list[Registered]) -> None:
    policy = _find(rs, "aws:s3/bucketPolicy:BucketPolicy", "models")
    document = json.loads(policy.state["policy"])
    document["Statement"].append(
        {"Sid": "Oops", "Effect": "Allow", "Principal": "*", "Action": "s3:GetObject", "Resource": "arn:aws:s3:::x/*"}
    )
    policy.inputs["policy"] = policy.state["policy"] = json.dumps(document)


def _plain_http(rs: list[Registered]) -> None:
    listener = _find(rs, "aws:lb/listener:Listener")
    listener.inputs.update(protocol="HTTP", port=80)


def _untag(rs: list[Registered]) -> None:
    del _find(rs, "aws:lb/loadBalancer:LoadBalancer").inputs["tags"]["model"]


def _gpu_pod_without_toleration(rs: list[Registered]) -> None:
    gateway = _find(rs, "kubernetes:apps/v1:Deployment")
    for props in (gateway.inputs, gateway.state):
        props["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] = "1"


def _no_gpu_admission_policy(rs: list[Registered]) -> None:
    rs.remove(_find(rs, "kubernetes:admissionregistration.k8s.io/v1:ValidatingAdmissionPolicyBinding", "gpu-pods"))


def _admission_policy_that_only_warns(rs: list[Registered]) -> None:
    binding = _find(rs, "kubernetes:admissionregistration.k8s.io/v1:ValidatingAdmissionPolicyBinding", "gpu-pods")
    for props in (binding.inputs, binding.state):
        props["spec"]["validationActions"] = ["Warn"]


def _open_api(rs: list[Registered]) -> None:
    _find(rs, "aws:eks/cluster:Cluster").inputs["vpcConfig"]["publicAccessCidrs"] = ["0.0.0.0/0"]


def _hop_limit_2(rs: list[Registered]) -> None:
    _find(rs, "aws:ec2/launchTemplate:LaunchTemplate", "-system").inputs["metadataOptions"][
        "httpPutResponseHopLimit"
    ] = 2


def _node_class_hop_limit_2(rs: list[Registered]) -> None:
    for props in _both(_find(rs, NODE_CLASS, "-karpenter-a100-8-class")):
        props["spec"]["metadataOptions"]["httpPutResponseHopLimit"] = 2


def _node_class_imdsv1(rs: list[Registered]) -> None:
    for props in _both(_find(rs, NODE_CLASS, "-karpenter-a100-8-class")):
        props["spec"]["metadataOptions"]["httpTokens"] = "optional"


def _node_class_untagged(rs: list[Registered]) -> None:
    for props in _both(_find(rs, NODE_CLASS, "-karpenter-a100-8-class")):
        del props["spec"]["tags"]["team"]


def _ssh_from_anywhere(rs: list[Registered]) -> None:
    rule = _find(
        rs, "aws:vpc/securityGroupIngressRule:SecurityGroupIngressRule", "prod-https-0"
    )  # the edge's, from 0.0.0.0/0
    rule.inputs.update(fromPort=22, toPort=22)


def _quota_store(rs: list[Registered]) -> Registered:
    return _find(rs, "aws:elasticache/replicationGroup:ReplicationGroup", "-quotas")


def _cache_not_encrypted_at_rest(rs: list[Registered]) -> None:
    del _quota_store(rs).inputs["atRestEncryptionEnabled"]  # Redis OSS's default: off


def _cache_without_tls(rs: list[Registered]) -> None:
    _quota_store(rs).inputs.update(transitEncryptionEnabled=False)


def _cache_tls_only_preferred(rs: list[Registered]) -> None:
    _quota_store(rs).inputs.update(transitEncryptionMode="preferred")


def _standalone_redis(rs: list[Registered]) -> None:
    cluster = copy.deepcopy(_quota_store(rs))
    cluster.type, cluster.urn = "aws:elasticache/cluster:Cluster", cluster.urn.replace("replicationGroup", "cluster")
    cluster.inputs = {
        "engine": "redis",
        "nodeType": "cache.t4g.small",
        "numCacheNodes": 1,
        "tags": cluster.inputs["tags"],
    }
    rs.append(cluster)


def _redis_from_anywhere(rs: list[Registered]) -> None:
    rule = _find(rs, "aws:vpc/securityGroupIngressRule:SecurityGroupIngressRule", "-quotas-from-nodes")
    del rule.inputs["referencedSecurityGroupId"]
    rule.inputs["cidrIpv4"] = "0.0.0.0/0"


def _no_gpu_limit(rs: list[Registered]) -> None:
    for spec in _pool_spec(rs, "a100-8"):
        del spec["limits"]["nvidia.com/gpu"]


def _unknown_gpu_type(rs: list[Registered]) -> None:
    """A GPU type the pack cannot count, in a NodePool without a GPU limit to count instead."""
    _no_gpu_limit(rs)
    for spec in _pool_spec(rs, "a100-8"):
        (types,) = [
            r for r in spec["template"]["spec"]["requirements"] if r["key"] == "node.kubernetes.io/instance-type"
        ]
        types["values"] = ["p9.96xlarge"]


def _cpu_pool_opened_to_every_type(rs: list[Registered]) -> None:
    """The CPU NodePool with its instance-type requirement dropped: it can now launch GPU nodes,
    untainted and with no GPU limit."""
    for spec in _pool_spec(rs, "cpu"):
        template = spec["template"]["spec"]
        template["requirements"] = [
            r for r in template["requirements"] if r["key"] != "node.kubernetes.io/instance-type"
        ]


BROKEN: dict[str, tuple[Callable[[list[Registered]], None], str | frozenset[str]]] = {
    "GPU NodePool without the GPU taint": (_untaint_pool, "gpu-node-groups-tainted"),
    # 3 more GPUs also take prod past its ceiling (24, all its NodePools' GPU limits)
    "managed GPU node group without taint": (
        _untainted_gpu_node_group,
        frozenset({"gpu-node-groups-tainted", "gpu-ceiling"}),
    ),
    "models bucket versioning suspended": (_suspend_versioning, "bucket-versioned"),
    "logs bucket without encryption": (_drop_encryption, "bucket-encrypted"),
    "public access block loosened": (_unblock, "bucket-never-public"),
    "bucket policy open to everyone": (_public_policy, "bucket-never-public"),
    "plain HTTP listener": (_plain_http, "https-only-listeners"),
    "load balancer without a model tag": (_untag, "cost-tags"),
    "GPU pod that does not tolerate the taint": (_gpu_pod_without_toleration, "gpu-pods-admission"),
    "no admission policy for GPU pods": (_no_gpu_admission_policy, "gpu-pods-admission"),
    "GPU admission policy that only warns": (_admission_policy_that_only_warns, "gpu-pods-admission"),
    "Kubernetes API open to the internet": (_open_api, "eks-api-cidrs"),
    "system nodes' launch template with IMDS hop limit 2": (_hop_limit_2, "imds-hop-limit"),
    "EC2NodeClass with IMDS hop limit 2": (_node_class_hop_limit_2, "imds-hop-limit"),
    "EC2NodeClass that allows IMDSv1": (_node_class_imdsv1, "imds-hop-limit"),
    "EC2NodeClass whose nodes lack the team tag": (_node_class_untagged, "cost-tags"),
    "SSH open to the internet": (_ssh_from_anywhere, "no-open-ingress"),
    "GPU NodePool without a GPU limit": (_no_gpu_limit, "gpu-ceiling"),
    "GPU instance type the ceiling cannot count": (_unknown_gpu_type, "gpu-ceiling"),
    "CPU NodePool opened to every instance type": (
        _cpu_pool_opened_to_every_type,
        frozenset({"gpu-node-groups-tainted", "gpu-ceiling"}),
    ),
    "quota store not encrypted at rest": (_cache_not_encrypted_at_rest, "cache-encrypted"),
    "quota store without TLS": (_cache_without_tls, "cache-encrypted"),
    "quota store that still takes plain-text clients": (_cache_tls_only_preferred, "cache-encrypted"),
    "standalone Redis cluster": (_standalone_redis, "cache-encrypted"),
    "Redis port open to the internet": (_redis_from_anywhere, "no-open-ingress"),
}


@pytest.mark.parametrize("variant", list(BROKEN))
def test_each_deliberately_broken_variant_is_caught_by_its_policy(variant: str) -> None:
    breaks, policy = BROKEN[variant]
    resources = copy.deepcopy(example("prod").resources)
    breaks(resources)
    violations = run_pack(resources, pack_config("prod"))
    assert policies_of(violations) == ({policy} if isinstance(policy, str) else policy), violations


def test_a_stack_over_its_gpu_ceiling_is_refused() -> None:
    # prod's GPU NodePools (Pulumi.prod.yaml's plan) and their spec.limits:
    #   a100-8         p4d.24xlarge (8 GPUs), nodes "2" → nvidia.com/gpu "16"  (2 × 8)
    #   a10g-1         g5.xlarge (1 GPU),     nodes "2" → nvidia.com/gpu "2"   (2 × 1)
    #   a10g-1-llm-7b  g5.xlarge (1 GPU),     nodes "6" → nvidia.com/gpu "6"   (6 × 1)
    #   cpu            m6i.2xlarge: no GPUs, no GPU limit
    # 16 + 2 + 6 = 24 GPUs, prod.json's maxGpus exactly; one fewer is refused.
    assert example("prod").outputs["maxGpus"] == 24  # the plan's own count agrees
    violations = run_pack(example("prod").resources, {"gpu-ceiling": {"maxGpus": 23}})
    (message,) = [m for p, m in violations if p == "gpu-ceiling"]
    assert "can scale to 24 GPUs" in message and "ceiling maxGpus is 23" in message
    for line in (
        "NodePool a100-8 16 by its nvidia.com/gpu limit",
        "NodePool a10g-1 2 by its nvidia.com/gpu limit",
        "NodePool a10g-1-llm-7b 6 by its nvidia.com/gpu limit",
    ):
        assert line in message, message
    assert "NodePool cpu" not in message
    assert run_pack(example("prod").resources, {"gpu-ceiling": {"maxGpus": 24}}) == []


def test_the_broken_node_pools_are_named_in_their_messages() -> None:
    """What the Karpenter variants report, on the program's own a100-8 NodePool and EC2NodeClass."""

    def messages(breaks: Callable[[list[Registered]], None], policy: str) -> list[str]:
        resources = copy.deepcopy(example("prod").resources)
        breaks(resources)
        return [m for p, m in run_pack(resources, pack_config("prod")) if p == policy]

    (taint,) = messages(_untaint_pool, "gpu-node-groups-tainted")
    assert taint.startswith("GPU NodePool a100-8 must carry the taint nvidia.com/gpu=present:NoSchedule")
    assert "(got fleet.io/model-node=true:NoSchedule)" in taint
    (group,) = messages(_untainted_gpu_node_group, "gpu-node-groups-tainted")
    assert "GPU node group gpu must carry the taint nvidia.com/gpu=present:NO_SCHEDULE (got none)" in group
    (over,) = messages(_untainted_gpu_node_group, "gpu-ceiling")
    assert "can scale to 27 GPUs" in over and "serving-fleet-prod-gpu 3 × 1" in over  # 24 + 3 × g5.xlarge
    (hops,) = messages(_node_class_hop_limit_2, "imds-hop-limit")
    assert hops.startswith("EC2NodeClass a100-8: IMDS hop limit 2; expected 1")
    (v1,) = messages(_node_class_imdsv1, "imds-hop-limit")
    assert v1.startswith("EC2NodeClass a100-8: httpTokens is 'optional'; expected 'required'")
    (tags,) = messages(_node_class_untagged, "cost-tags")
    assert tags.startswith("EC2NodeClass a100-8 lacks the cost tag(s) team in spec.tags")
    (unbounded,) = messages(_no_gpu_limit, "gpu-ceiling")
    assert unbounded.startswith("NodePool a100-8 can launch GPU nodes but has no spec.limits['nvidia.com/gpu']")
    assert "cannot count" not in unbounded  # p4d.24xlarge is known: only the limit is missing
    (unknown,) = messages(_unknown_gpu_type, "gpu-ceiling")
    assert "NodePool a100-8" in unknown and "cannot count the GPUs of instance type(s) p9.96xlarge" in unknown
    opened = messages(_cpu_pool_opened_to_every_type, "gpu-node-groups-tainted")
    assert [m.split(" must")[0] for m in opened] == ["GPU NodePool cpu"]


def test_taggable_covers_every_taggable_type_the_program_uses() -> None:
    used = {r.type for s in ("dev", "prod") for r in example(s).resources if r.type.startswith("aws:")}
    assert {t for t in used if takes_tags(t)} <= guard.tags.TAGGABLE


def test_the_kubernetes_runtimes_deployments_pass_the_pod_policy() -> None:
    from fleet.runtime.kubernetes.manifests import manifests, placement_from_dict

    images = example("prod").outputs["imageRepositories"]
    for raw in example("prod").outputs["placement"]["models"]:
        p = placement_from_dict(json.loads(json.dumps(raw)))
        deployment = manifests(p.model, "1.0.0", f"{images[p.family]}:x", p, floor=1, prometheus_url="http://p")[0]
        pod = deployment["spec"]["template"]["spec"]
        assert pod_gpu_problems(pod) == [], p.model
        if p.gpus:
            assert pod_gpu_problems({**pod, "tolerations": []}), p.model


# --- the pack itself ------------------------------------------------------------------------


def test_the_pack_entry_point_builds_a_mandatory_pack_of_every_policy(monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[dict] = []
    monkeypatch.setattr(pulumi_policy, "PolicyPack", lambda **kwargs: made.append(kwargs))
    runpy.run_path(str(PACK), run_name="__main__")
    (pack,) = made
    assert pack["name"] == guard.PACK_NAME and pack["policies"] == guard.POLICIES
    assert pack["enforcement_level"] == pulumi_policy.EnforcementLevel.MANDATORY
    assert len({p.name for p in guard.POLICIES}) == len(guard.POLICIES) == 12


def test_the_pack_reads_props_as_the_engine_wraps_them() -> None:
    """The engine wraps props in pulumi_policy's proxies: a list arrives as a Sequence that is no
    ``list``, a dict as a Mapping. ``as_list`` once took such a list for one item, and the taint
    policy crashed on every node group in a real `pulumi preview`."""
    from fleet_guardrails._common import as_list, plain
    from pulumi_policy.proxy import unknown_checking_proxy

    props = unknown_checking_proxy({"instanceTypes": ["g5.xlarge", "g5.2xlarge"], "spec": {"a": [{"b": 1}]}})
    assert not isinstance(props["instanceTypes"], list)
    assert as_list(props["instanceTypes"]) == ["g5.xlarge", "g5.2xlarge"]
    assert as_list("g5.xlarge") == ["g5.xlarge"] and as_list(None) == []
    assert plain(props["spec"]) == {"a": [{"b": 1}]}


@pytest.mark.parametrize("stack", ["dev", "prod"])
def test_each_stack_has_a_pack_config_with_a_ceiling_above_its_plan(stack: str) -> None:
    config = pack_config(stack)
    assert set(config) <= {p.name for p in guard.POLICIES}
    assert example(stack).outputs["maxGpus"] <= config["gpu-ceiling"]["maxGpus"]


def test_the_gateway_may_only_raise_a_lazy_scaledobjects_floor_from_0_to_1() -> None:
    """The gateway's Role may patch ScaledObjects (to wake a lazy version); the admission
    policy keeps that to a lazy model's floor, 0 → 1 (and the same wake again, 1 → 1). Its CEL is evaluated here with
    cel-python, against ScaledObjects the runtime writes, as the API server would."""
    import copy

    import celpy

    from fleet.catalog.policies.loader import load_policies
    from fleet.planning.planner import plan
    from fleet.planning.stack import placement_inputs, read_stack_file
    from fleet.runtime.kubernetes.manifests import manifests
    from infra import admission

    policies = load_policies(ROOT / "policies")
    lazy_spec = policies.models["embed-small"].model_copy(update={"loading": "lazy", "idle_unload_s": 600.0})
    policies = policies.model_copy(update={"models": {**policies.models, "embed-small": lazy_spec}})
    placed = {
        p.model: p
        for p in plan(policies, *placement_inputs(read_stack_file(ROOT / "Pulumi.prod.yaml"), "prod", policies)).models
    }

    def scaler_of(model: str, floor: int) -> dict:
        obj = manifests(
            model, "1.0.0", "x@sha256:" + "0" * 64, placed[model], floor=floor, prometheus_url="http://prometheus:9090"
        )[-1]
        obj["metadata"] |= {"resourceVersion": "41", "generation": 3, "managedFields": [{"manager": "serving-fleet"}]}
        return obj

    lazy, eager = scaler_of("embed-small", 0), scaler_of("demo-classifier", 3)
    spec, binding = admission.gateway_scaling_policy("system:serviceaccount:fleet:fleet-gateway", "models")
    assert spec["failurePolicy"] == "Fail" and binding["validationActions"] == ["Deny"]
    assert spec["matchConstraints"]["resourceRules"][0]["resources"] == ["scaledobjects"]
    env = celpy.Environment()
    rules = [(env.program(env.compile(v["expression"])), v["message"]) for v in spec["validations"]]
    (condition,) = spec["matchConditions"]
    applies = env.program(env.compile(condition["expression"]))

    def refused(old: dict, new: dict, user: str = "system:serviceaccount:fleet:fleet-gateway") -> list[str]:
        request = celpy.json_to_cel({"userInfo": {"username": user}})
        if not applies.evaluate({"request": request}):
            return []
        ctx = {"object": celpy.json_to_cel(new), "oldObject": celpy.json_to_cel(old), "request": request}
        return [message for program, message in rules if not program.evaluate(ctx)]

    def changed(old: dict, **spec_changes: object) -> dict:
        new = copy.deepcopy(old)
        new["spec"].update(spec_changes)
        new["metadata"] |= {
            "resourceVersion": "42",
            "generation": 4,
            "managedFields": [{"manager": "serving-fleet"}, {"manager": "fleet-gateway"}],
        }
        return new

    assert refused(lazy, changed(lazy, minReplicaCount=1)) == []  # the wake: 0 → 1, the server's fields moving
    assert any("from 0 to 1" in m for m in refused(lazy, changed(lazy, minReplicaCount=5)))
    assert any("from 0 to 1" in m for m in refused(lazy, changed(lazy, minReplicaCount=2)))  # 0 → 2
    woken = changed(lazy, minReplicaCount=1)
    # another gateway process's wake of the same cold start: 1 → 1, a no-op the API server still admits
    same = copy.deepcopy(woken)
    assert refused(woken, same) == []
    assert any("from 0 to 1" in m for m in refused(woken, changed(woken, minReplicaCount=2)))  # 1 → 2
    assert any("from 0 to 1" in m for m in refused(woken, changed(woken, minReplicaCount=0)))  # unloading is the flow's
    assert any("lazy model" in m for m in refused(eager, changed(eager, minReplicaCount=0)))  # an eager floor: never
    assert any(
        "only spec.minReplicaCount" in m for m in refused(lazy, changed(lazy, minReplicaCount=1, maxReplicaCount=500))
    )
    triggers = copy.deepcopy(lazy["spec"]["triggers"])
    triggers[0]["metadata"]["serverAddress"] = "http://attacker:9090"
    assert refused(lazy, changed(lazy, minReplicaCount=1, triggers=triggers))
    dropped = changed(lazy, minReplicaCount=1)
    del dropped["spec"]["cooldownPeriod"]
    assert refused(lazy, dropped)  # removing a field is a change too
    for key, value in (
        ("ownerReferences", [{"apiVersion": "v1", "kind": "ConfigMap", "name": "x", "uid": "u"}]),
        ("finalizers", ["example.com/hold"]),
    ):
        owned = changed(lazy, minReplicaCount=1)
        owned["metadata"][key] = value
        assert any("metadata" in m for m in refused(lazy, owned)), key
    relabelled = changed(lazy, minReplicaCount=1)
    relabelled["metadata"]["labels"]["fleet.io/loading"] = "eager"
    assert any("metadata" in m for m in refused(lazy, relabelled))
    flows = "system:serviceaccount:flows:prefect-worker"
    assert refused(woken, changed(woken, minReplicaCount=0), user=flows) == []  # not the gateway: not this policy's
