"""The CrossGuard pack (policies/guardrails/): it passes what the Pulumi program registers for
both example stacks, catches each deliberately broken variant, and every policy has a passing
and a failing case of its own."""

from __future__ import annotations

import copy
import json
import runpy
import sys
from collections.abc import Callable

import pulumi_policy
import pytest
from infra_harness import ROOT, Registered, example, takes_tags
from pulumi_policy import (
    PolicyCustomTimeouts,
    PolicyResource,
    PolicyResourceOptions,
    ResourceValidationArgs,
    ResourceValidationPolicy,
    StackValidationArgs,
)

PACK = ROOT / "policies" / "guardrails"
sys.path.insert(0, str(PACK))  # the pack imports its policies as a sibling package, as here

import fleet_guardrails as guard  # noqa: E402
from fleet_guardrails.compute import pod_gpu_problems  # noqa: E402

Violation = tuple[str, str]  # (policy name, message)


def pack_config(stack: str) -> dict:
    return json.loads((PACK / f"{stack}.json").read_text())


def _options(parent: str | None = None) -> PolicyResourceOptions:
    return PolicyResourceOptions(False, [], None, [], PolicyCustomTimeouts(0, 0, 0), [], parent)


def _stack_resources(resources: list[Registered]) -> list[PolicyResource]:
    """PolicyResources as the engine builds them for stack policies: outputs, parents, dependencies."""
    made = {
        r.urn: PolicyResource(
            r.type, {**r.inputs, **r.state}, r.urn, r.name, _options(r.parent or None), None, None, [], {}
        )
        for r in resources
    }
    for r in resources:
        p = made[r.urn]
        p.parent = made.get(r.parent)
        p.dependencies = [made[d] for d in r.dependencies if d in made]
        p.property_dependencies = {
            k: [made[u] for u in urns if u in made] for k, urns in r.property_dependencies.items()
        }
    return list(made.values())


def run_pack(resources: list[Registered], config: dict) -> list[Violation]:
    """Every policy of the pack over ``resources``: resource policies see inputs, stack policies outputs."""
    found: list[Violation] = []
    stack_resources = _stack_resources(resources)
    for policy in guard.POLICIES:

        def report(message: str, urn: str | None = None, name: str = policy.name) -> None:
            found.append((name, message))

        settings = config.get(policy.name, {})
        if isinstance(policy, ResourceValidationPolicy):
            for r in resources:
                if r.custom:
                    policy.validate(
                        ResourceValidationArgs(r.type, r.inputs, r.urn, r.name, _options(), None, settings), report
                    )
        else:
            policy.validate(StackValidationArgs(stack_resources, settings), report)
    return found


def policies_of(violations: list[Violation]) -> set[str]:
    return {name for name, _ in violations}


# --- the program's own resources ------------------------------------------------------------


@pytest.mark.parametrize("stack", ["dev", "prod"])
def test_the_pack_finds_nothing_wrong_with_what_the_program_registers(stack: str) -> None:
    assert run_pack(example(stack).resources, pack_config(stack)) == []


def _find(resources: list[Registered], type_: str, name_contains: str = "") -> Registered:
    return next(r for r in resources if r.type == type_ and name_contains in r.name)


def _untaint(rs: list[Registered]) -> None:
    group = _find(rs, "aws:eks/nodeGroup:NodeGroup", "a100-8")
    group.inputs["taints"] = []


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
    _find(rs, "aws:ec2/launchTemplate:LaunchTemplate", "a100-8").inputs["metadataOptions"][
        "httpPutResponseHopLimit"
    ] = 2


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


def _unknown_gpu_type(rs: list[Registered]) -> None:
    _find(rs, "aws:eks/nodeGroup:NodeGroup", "a100-8").inputs["instanceTypes"] = ["p9.96xlarge"]
    _find(rs, "aws:eks/nodeGroup:NodeGroup", "a100-8").state["instanceTypes"] = ["p9.96xlarge"]


BROKEN: dict[str, tuple[Callable[[list[Registered]], None], str]] = {
    "gpu node group without taint": (_untaint, "gpu-node-groups-tainted"),
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
    "IMDS hop limit 2": (_hop_limit_2, "imds-hop-limit"),
    "SSH open to the internet": (_ssh_from_anywhere, "no-open-ingress"),
    "GPU instance type the ceiling cannot count": (_unknown_gpu_type, "gpu-ceiling"),
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
    assert policies_of(violations) == {policy}, violations


def test_a_stack_over_its_gpu_ceiling_is_refused() -> None:
    violations = run_pack(example("prod").resources, {"gpu-ceiling": {"maxGpus": 20}})
    (message,) = [m for p, m in violations if p == "gpu-ceiling"]
    assert "can scale to 21 GPUs" in message and "ceiling maxGpus is 20" in message
    assert "a100-8 2 × 8" in message


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


# --- each policy alone ----------------------------------------------------------------------


def _resource(policy: ResourceValidationPolicy, type_: str, props: dict, config: dict | None = None) -> list[str]:
    found: list[str] = []
    policy.validate(
        ResourceValidationArgs(type_, props, f"urn:{type_}::r", "r", _options(), None, config or {}),
        lambda message, urn=None: found.append(message),
    )
    return found


def _stack(policy, resources: list[PolicyResource], config: dict | None = None) -> list[str]:  # noqa: ANN001
    found: list[str] = []
    policy.validate(StackValidationArgs(resources, config or {}), lambda message, urn=None: found.append(message))
    return found


def _pr(type_: str, name: str, props: dict, deps: dict | None = None) -> PolicyResource:
    return PolicyResource(
        type_, props, f"urn:pulumi:s::p::{type_}::{name}", name, _options(), None, None, [], deps or {}
    )


NG = "aws:eks/nodeGroup:NodeGroup"
TAINT = {"key": "nvidia.com/gpu", "value": "present", "effect": "NO_SCHEDULE"}


def test_gpu_node_groups_tainted() -> None:
    policy = guard.gpu_node_groups_tainted
    assert _resource(policy, NG, {"instanceTypes": ["m6i.large"], "amiType": "AL2023_x86_64_STANDARD"}) == []
    assert _resource(policy, NG, {"instanceTypes": ["g5.xlarge"], "taints": [TAINT]}) == []
    (message,) = _resource(
        policy,
        NG,
        {
            "nodeGroupName": "gpu",
            "amiType": "AL2023_x86_64_NVIDIA",
            "taints": [{**TAINT, "effect": "PREFER_NO_SCHEDULE"}],
        },
    )
    assert "GPU node group gpu must carry the taint nvidia.com/gpu=present:NO_SCHEDULE" in message
    assert "got nvidia.com/gpu=present:PREFER_NO_SCHEDULE" in message


def test_gpu_pods_admission() -> None:
    from infra.admission import NAME, gpu_pod_policy

    policy, deploy = guard.gpu_pods_admission, "kubernetes:apps/v1:Deployment"
    spec, binding = gpu_pod_policy()
    vap = _pr(
        "kubernetes:admissionregistration.k8s.io/v1:ValidatingAdmissionPolicy",
        "p",
        {"metadata": {"name": NAME}, "spec": spec},
    )
    bound = _pr(
        "kubernetes:admissionregistration.k8s.io/v1:ValidatingAdmissionPolicyBinding",
        "b",
        {"metadata": {"name": NAME}, "spec": binding},
    )
    assert _stack(policy, [vap, bound]) == []
    (missing,) = _stack(policy, [vap])
    assert "no ValidatingAdmissionPolicy bound with Deny" in missing
    warn_only = _pr(bound.resource_type, "b", {"spec": {**binding, "validationActions": ["Warn", "Audit"]}})
    assert _stack(policy, [vap, warn_only])
    toothless = _pr(
        vap.resource_type, "p", {"metadata": {"name": NAME}, "spec": {**spec, "validations": []}}
    )  # no rule
    assert _stack(policy, [toothless, bound])

    def workload(resources: dict, tolerations: list) -> PolicyResource:
        return _pr(
            deploy,
            "w",
            {
                "metadata": {"name": "w"},
                "spec": {
                    "template": {
                        "spec": {"containers": [{"name": "c", "resources": resources}], "tolerations": tolerations}
                    }
                },
            },
        )

    exists = [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    assert _stack(policy, [vap, bound, workload({"limits": {"cpu": "1"}}, [])]) == []  # no GPUs, no demands
    assert _stack(policy, [vap, bound, workload({"limits": {"nvidia.com/gpu": "2"}}, exists)]) == []
    assert _stack(policy, [vap, bound, workload({"limits": {"nvidia.com/gpu": 1}}, [{"operator": "Exists"}])]) == []
    (no_limit,) = _stack(policy, [vap, bound, workload({"requests": {"nvidia.com/gpu": "1"}}, exists)])
    assert "Deployment w: container c requests nvidia.com/gpu without a limit" in no_limit
    (unequal,) = _stack(
        policy, [vap, bound, workload({"requests": {"nvidia.com/gpu": "1"}, "limits": {"nvidia.com/gpu": "2"}}, exists)]
    )
    assert "requests 1 GPUs but limits 2" in unequal
    wrong_value = [{"key": "nvidia.com/gpu", "operator": "Equal", "value": "yes", "effect": "NoSchedule"}]
    (untolerated,) = _stack(policy, [vap, bound, workload({"limits": {"nvidia.com/gpu": "1"}}, wrong_value)])
    assert "does not tolerate the nvidia.com/gpu:NoSchedule taint" in untolerated


def test_the_admission_policys_cel_states_the_python_rule() -> None:
    """The CEL runs in the API server, not here; what can be checked is that each rule the
    Python check knows has its expression, over every container kind, with a message."""
    from infra import admission

    spec, binding = admission.gpu_pod_policy()
    assert spec["failurePolicy"] == "Fail" and binding["validationActions"] == ["Deny"]
    assert "initContainers" in admission.CONTAINERS
    (condition,) = spec["matchConditions"]  # only pods that ask for GPUs are evaluated
    assert "variables." not in condition["expression"] and "nvidia.com/gpu" in condition["expression"]
    assert "limits" in condition["expression"] and "requests" in condition["expression"]
    (rule,) = spec["validations"]
    assert (
        "tolerations" in rule["expression"] and "'present'" in rule["expression"] and "NoSchedule" in rule["expression"]
    )
    assert rule["message"]


def test_eks_api_cidrs() -> None:
    policy, cluster = guard.eks_api_cidrs, "aws:eks/cluster:Cluster"
    assert _resource(policy, cluster, {"vpcConfig": {"publicAccessCidrs": ["203.0.113.0/24"]}}) == []
    assert _resource(policy, cluster, {"vpcConfig": {"endpointPublicAccess": False}}) == []
    (open_,) = _resource(policy, cluster, {"vpcConfig": {"publicAccessCidrs": ["10.0.0.0/8", "::/0"]}})
    assert "open to ['10.0.0.0/8', '::/0']" in open_
    assert _resource(policy, cluster, {"vpcConfig": {}})  # AWS's default is 0.0.0.0/0
    assert _resource(policy, cluster, {"vpcConfig": {}}, {"allowOpen": True}) == []  # a dev stack may say so


def test_imds_hop_limit() -> None:
    policy, template = guard.imds_hop_limit, "aws:ec2/launchTemplate:LaunchTemplate"
    assert (
        _resource(policy, template, {"metadataOptions": {"httpTokens": "required", "httpPutResponseHopLimit": 1}}) == []
    )
    (hops,) = _resource(policy, template, {"metadataOptions": {"httpTokens": "required", "httpPutResponseHopLimit": 2}})
    assert "hop limit 2; expected 1" in hops
    assert len(_resource(policy, template, {})) == 2  # IMDSv1 allowed and AWS's default hop limit


def test_no_open_ingress() -> None:
    policy = guard.no_open_ingress
    rule = "aws:vpc/securityGroupIngressRule:SecurityGroupIngressRule"
    assert _resource(policy, rule, {"ipProtocol": "tcp", "fromPort": 443, "toPort": 443, "cidrIpv4": "0.0.0.0/0"}) == []
    assert _resource(policy, rule, {"ipProtocol": "tcp", "fromPort": 22, "toPort": 22, "cidrIpv4": "10.0.0.0/16"}) == []
    (ssh,) = _resource(policy, rule, {"ipProtocol": "tcp", "fromPort": 22, "toPort": 22, "cidrIpv6": "::/0"})
    assert "inbound tcp 22-22 from the whole internet" in ssh
    assert _resource(policy, rule, {"ipProtocol": "-1", "cidrIpv4": "0.0.0.0/0"})  # everything
    legacy = {"type": "ingress", "protocol": "tcp", "fromPort": 80, "toPort": 80, "cidrBlocks": ["0.0.0.0/0"]}
    assert _resource(policy, "aws:ec2/securityGroupRule:SecurityGroupRule", legacy)
    assert _resource(policy, "aws:ec2/securityGroupRule:SecurityGroupRule", {**legacy, "type": "egress"}) == []
    inline = {"ingress": [{"protocol": "tcp", "fromPort": 30080, "toPort": 30080, "cidrBlocks": ["0.0.0.0/0"]}]}
    assert _resource(policy, "aws:ec2/securityGroup:SecurityGroup", inline)


def test_cache_encrypted() -> None:
    policy, group = guard.cache_encrypted, "aws:elasticache/replicationGroup:ReplicationGroup"
    good = {"engine": "valkey", "atRestEncryptionEnabled": True, "transitEncryptionEnabled": True}
    assert _resource(policy, group, good) == []
    assert _resource(policy, group, {**good, "transitEncryptionMode": "required"}) == []
    (at_rest,) = _resource(policy, group, {**good, "atRestEncryptionEnabled": False})
    assert "at_rest_encryption_enabled is False; expected true" in at_rest
    (tls,) = _resource(policy, group, {**good, "transitEncryptionEnabled": None})
    assert "transit_encryption_enabled is None; expected true" in tls
    (preferred,) = _resource(policy, group, {**good, "transitEncryptionMode": "preferred"})
    assert "'preferred', which still accepts plain-text clients" in preferred
    assert len(_resource(policy, group, {"engine": "redis"})) == 2  # Redis OSS's defaults: neither
    cluster = "aws:elasticache/cluster:Cluster"
    (standalone,) = _resource(policy, cluster, {"engine": "valkey", "numCacheNodes": 1})
    assert "a standalone valkey cluster cannot encrypt at rest" in standalone
    assert _resource(policy, cluster, {"engine": "redis", "replicationGroupId": "rg"}) == []  # a member of a group
    assert _resource(policy, cluster, {"engine": "memcached"}) == []
    assert _resource(policy, "aws:ec2/vpc:Vpc", {}) == []


def test_no_open_ingress_covers_the_redis_port() -> None:
    rule = "aws:vpc/securityGroupIngressRule:SecurityGroupIngressRule"
    (redis,) = _resource(
        guard.no_open_ingress, rule, {"ipProtocol": "tcp", "fromPort": 6379, "toPort": 6379, "cidrIpv4": "0.0.0.0/0"}
    )
    assert "inbound tcp 6379-6379 from the whole internet" in redis
    assert (
        _resource(
            guard.no_open_ingress,
            rule,
            {"ipProtocol": "tcp", "fromPort": 6379, "toPort": 6379, "referencedSecurityGroupId": "sg-nodes"},
        )
        == []
    )


def test_https_only_listeners() -> None:
    policy, listener = guard.https_only_listeners, "aws:lb/listener:Listener"
    assert _resource(policy, listener, {"protocol": "HTTPS", "port": 443, "certificateArn": "arn:cert"}) == []
    redirect = [{"type": "redirect", "redirect": {"protocol": "HTTPS", "port": "443", "statusCode": "HTTP_301"}}]
    assert _resource(policy, listener, {"protocol": "HTTP", "port": 80, "defaultActions": redirect}) == []
    (plain,) = _resource(policy, listener, {"protocol": "HTTP", "port": 80, "defaultActions": [{"type": "forward"}]})
    assert "uses HTTP; expected HTTPS" in plain
    assert _resource(policy, listener, {"port": 80})  # no protocol: AWS's default is HTTP
    assert "without a certificate_arn" in _resource(policy, listener, {"protocol": "HTTPS", "port": 443})[0]
    classic = {"listeners": [{"lbProtocol": "http", "lbPort": 80, "instancePort": 80, "instanceProtocol": "http"}]}
    assert _resource(policy, "aws:elb/loadBalancer:LoadBalancer", classic)


def test_cost_tags() -> None:
    policy = guard.cost_tags
    tags = {"team": "ml", "model": "shared", "env": "dev"}
    assert _resource(policy, "aws:ec2/vpc:Vpc", {"tags": tags}) == []
    assert _resource(policy, "aws:ec2/vpc:Vpc", {"tags": {"model": "m"}, "tagsAll": {"team": "ml", "env": "dev"}}) == []
    assert _resource(policy, "aws:iam/rolePolicy:RolePolicy", {"policy": "{}"}) == []  # takes no tags
    assert _resource(policy, "kubernetes:core/v1:Namespace", {"metadata": {}}) == []  # not AWS
    (message,) = _resource(policy, "aws:ec2/vpc:Vpc", {"tags": {"team": "ml", "model": ""}})
    assert message.startswith("Vpc r lacks the cost tag(s) model, env")
    assert _resource(policy, "aws:s3/bucket:Bucket", {})  # taggable but untagged
    assert _resource(policy, "aws:newservice/thing:Thing", {"tags": {}})  # any AWS resource with tags


S3 = "aws:s3/"


def _bucket_set(**overrides: dict | None) -> list[PolicyResource]:
    """A bucket and its companions, linked by property dependencies with no values (a preview)."""
    bucket = _pr(f"{S3}bucket:Bucket", "b", {"bucket": "b-123"})
    parts = {
        "sse": (
            f"{S3}bucketServerSideEncryptionConfiguration:BucketServerSideEncryptionConfiguration",
            {"rules": [{"applyServerSideEncryptionByDefault": {"sseAlgorithm": "aws:kms"}}]},
        ),
        "versioning": (f"{S3}bucketVersioning:BucketVersioning", {"versioningConfiguration": {"status": "Enabled"}}),
        "block": (
            f"{S3}bucketPublicAccessBlock:BucketPublicAccessBlock",
            {k: True for k in ("blockPublicAcls", "blockPublicPolicy", "ignorePublicAcls", "restrictPublicBuckets")},
        ),
        "policy": (
            f"{S3}bucketPolicy:BucketPolicy",
            {
                "policy": json.dumps(
                    {
                        "Statement": [
                            {
                                "Effect": "Deny",
                                "Principal": "*",
                                "Action": "s3:*",
                                "Condition": {"Bool": {"aws:SecureTransport": "false"}},
                            }
                        ]
                    }
                )
            },
        ),
    }
    out = [bucket]
    for key, (type_, props) in parts.items():
        props = overrides.get(key, props)
        if props is not None:
            out.append(_pr(type_, f"b-{key}", props, {"bucket": [bucket]}))
    return out


def test_bucket_encrypted() -> None:
    assert _stack(guard.bucket_encrypted, _bucket_set()) == []
    sse_s3 = {"rules": [{"applyServerSideEncryptionByDefault": {"sseAlgorithm": "AES256"}}]}
    assert _stack(guard.bucket_encrypted, _bucket_set(sse=sse_s3)) == []
    (message,) = _stack(guard.bucket_encrypted, _bucket_set(sse=None))
    assert message.startswith("bucket b-123 has no default encryption")
    # linked by value when the engine recorded no property dependencies
    bucket = _pr(f"{S3}bucket:Bucket", "c", {"bucket": "c-1"})
    sse = _pr(
        f"{S3}bucketServerSideEncryptionConfiguration:BucketServerSideEncryptionConfiguration",
        "c-sse",
        {"bucket": "c-1", **sse_s3},
    )
    assert _stack(guard.bucket_encrypted, [bucket, sse]) == []
    other = _pr(f"{S3}bucket:Bucket", "d", {"bucket": "d-1"})
    assert len(_stack(guard.bucket_encrypted, [bucket, sse, other])) == 1  # one config does not cover two buckets


def test_bucket_versioned() -> None:
    assert _stack(guard.bucket_versioned, _bucket_set()) == []
    (suspended,) = _stack(
        guard.bucket_versioned, _bucket_set(versioning={"versioningConfiguration": {"status": "Suspended"}})
    )
    assert "bucket b-123 is not versioned (got Suspended)" in suspended
    (none,) = _stack(guard.bucket_versioned, _bucket_set(versioning=None))
    assert "got no BucketVersioning" in none
    inline = _pr(f"{S3}bucketV2:BucketV2", "old", {"bucket": "old", "versioning": {"enabled": True}})
    assert _stack(guard.bucket_versioned, [inline]) == []  # the deprecated inline form counts


def test_bucket_never_public() -> None:
    assert _stack(guard.bucket_never_public, _bucket_set()) == []
    loose = {k: True for k in ("blockPublicAcls", "blockPublicPolicy", "ignorePublicAcls")}
    assert "lacks a BucketPublicAccessBlock" in _stack(guard.bucket_never_public, _bucket_set(block=loose))[0]
    open_policy = {
        "policy": json.dumps(
            {"Statement": [{"Sid": "All", "Effect": "Allow", "Principal": {"AWS": "*"}, "Action": "s3:GetObject"}]}
        )
    }
    (message,) = _stack(guard.bucket_never_public, _bucket_set(policy=open_policy))
    assert "allows s3:GetObject to everyone (statement All)" in message
    resources = _bucket_set()
    resources[0].props["acl"] = "public-read"
    assert "public ACL 'public-read'" in _stack(guard.bucket_never_public, resources)[0]


def test_gpu_ceiling() -> None:
    groups = [
        _pr(NG, "a", {"instanceTypes": ["g5.12xlarge"], "scalingConfig": {"maxSize": 2.0}, "taints": [TAINT]}),
        _pr(NG, "cpu", {"instanceTypes": ["m6i.large"], "scalingConfig": {"maxSize": 50}}),
        _pr("aws:ec2/instance:Instance", "box", {"instanceType": "p4d.24xlarge"}),
    ]
    assert _stack(guard.gpu_ceiling, groups, {"maxGpus": 16}) == []  # 2 × 4 + 8; CPU nodes do not count
    (over,) = _stack(guard.gpu_ceiling, groups, {"maxGpus": 15})
    assert "can scale to 16 GPUs (a 2 × 4; box 1 × 8); its ceiling maxGpus is 15" in over


# --- the pack itself ------------------------------------------------------------------------


def test_the_pack_entry_point_builds_a_mandatory_pack_of_every_policy(monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[dict] = []
    monkeypatch.setattr(pulumi_policy, "PolicyPack", lambda **kwargs: made.append(kwargs))
    runpy.run_path(str(PACK), run_name="__main__")
    (pack,) = made
    assert pack["name"] == guard.PACK_NAME and pack["policies"] == guard.POLICIES
    assert pack["enforcement_level"] == pulumi_policy.EnforcementLevel.MANDATORY
    assert len({p.name for p in guard.POLICIES}) == len(guard.POLICIES) == 12


@pytest.mark.parametrize("stack", ["dev", "prod"])
def test_each_stack_has_a_pack_config_with_a_ceiling_above_its_plan(stack: str) -> None:
    config = pack_config(stack)
    assert set(config) <= {p.name for p in guard.POLICIES}
    assert example(stack).outputs["maxGpus"] <= config["gpu-ceiling"]["maxGpus"]


def test_the_gateway_may_only_raise_a_lazy_scaledobjects_floor_from_0_to_1() -> None:
    """The gateway's Role may patch ScaledObjects (to wake a lazy version); the admission
    policy keeps that to a lazy model's floor, 0 → 1. Its CEL is evaluated here with
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
    woken = changed(lazy, minReplicaCount=1)
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
