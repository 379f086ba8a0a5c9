"""The pack's other guardrails, each alone on hand-made resources: the Kubernetes API's
CIDRs, IMDS on launch templates and EC2NodeClasses, open ingress, encrypted caches, HTTPS-only
listeners, cost tags (EC2NodeClasses' included) and private, encrypted, versioned buckets."""

from __future__ import annotations

import json

import pytest
from guardrails_harness import NODE_CLASS, check_resource, check_stack, guard, policy_resource
from infra_harness import ROOT
from pulumi_policy import PolicyResource
from pulumi_policy.proxy import UNKNOWN_STRING_VALUE, UnknownValueError


def test_eks_api_cidrs() -> None:
    policy, cluster = guard.eks_api_cidrs, "aws:eks/cluster:Cluster"
    assert check_resource(policy, cluster, {"vpcConfig": {"publicAccessCidrs": ["203.0.113.0/24"]}}) == []
    assert check_resource(policy, cluster, {"vpcConfig": {"endpointPublicAccess": False}}) == []
    (open_,) = check_resource(policy, cluster, {"vpcConfig": {"publicAccessCidrs": ["10.0.0.0/8", "::/0"]}})
    assert "open to ['10.0.0.0/8', '::/0']" in open_
    assert check_resource(policy, cluster, {"vpcConfig": {}})  # AWS's default is 0.0.0.0/0
    assert check_resource(policy, cluster, {"vpcConfig": {}}, {"allowOpen": True}) == []  # a dev stack may say so


def test_imds_hop_limit_on_node_classes() -> None:
    policy = guard.imds_hop_limit
    assert check_resource(policy, NODE_CLASS, {"metadata": {"name": "gpu"}, "spec": {}}) == []  # the CRD's defaults
    ok = {"httpTokens": "required", "httpPutResponseHopLimit": 1.0}  # Pulumi's numbers are floats
    assert check_resource(policy, NODE_CLASS, {"spec": {"metadataOptions": ok}}) == []
    (hops,) = check_resource(
        policy,
        NODE_CLASS,
        {"metadata": {"name": "gpu"}, "spec": {"metadataOptions": {**ok, "httpPutResponseHopLimit": 2}}},
    )
    assert hops.startswith("EC2NodeClass gpu: IMDS hop limit 2; expected 1")
    (v1,) = check_resource(policy, NODE_CLASS, {"spec": {"metadataOptions": {"httpTokens": "optional"}}})
    assert v1.startswith("EC2NodeClass r: httpTokens is 'optional'; expected 'required'")  # r: its Pulumi name
    off = {"httpEndpoint": "disabled", "httpTokens": "optional", "httpPutResponseHopLimit": 2}
    assert check_resource(policy, NODE_CLASS, {"spec": {"metadataOptions": off}}) == []  # no metadata to reach


def test_the_node_class_defaults_the_pack_assumes_are_the_crds() -> None:
    from fleet_guardrails.karpenter import NODE_CLASS_METADATA_DEFAULTS

    schema = json.loads((ROOT / "tests" / "fixtures" / "karpenter" / "ec2nodeclass.schema.json").read_text())
    options = schema["properties"]["spec"]["properties"]["metadataOptions"]
    assert options["default"] == NODE_CLASS_METADATA_DEFAULTS
    assert {k: v["default"] for k, v in options["properties"].items()} == NODE_CLASS_METADATA_DEFAULTS


def test_a_preview_with_unknown_node_class_spec_skips_rather_than_reports() -> None:
    """In a first `pulumi preview` an EC2NodeClass's spec waits on the node role's name, so the
    engine sends it unknown; reading it raises UnknownValueError, which the engine turns into an
    advisory "can't run policy during preview" rather than a violation."""
    unknown = {"metadata": {"name": "gpu"}, "spec": UNKNOWN_STRING_VALUE}
    for policy in (guard.imds_hop_limit, guard.cost_tags):
        with pytest.raises(UnknownValueError):
            check_resource(policy, NODE_CLASS, unknown)


def test_imds_hop_limit() -> None:
    policy, template = guard.imds_hop_limit, "aws:ec2/launchTemplate:LaunchTemplate"
    assert (
        check_resource(policy, template, {"metadataOptions": {"httpTokens": "required", "httpPutResponseHopLimit": 1}})
        == []
    )
    (hops,) = check_resource(
        policy, template, {"metadataOptions": {"httpTokens": "required", "httpPutResponseHopLimit": 2}}
    )
    assert "hop limit 2; expected 1" in hops
    assert len(check_resource(policy, template, {})) == 2  # IMDSv1 allowed and AWS's default hop limit


def test_no_open_ingress() -> None:
    policy = guard.no_open_ingress
    rule = "aws:vpc/securityGroupIngressRule:SecurityGroupIngressRule"
    assert (
        check_resource(policy, rule, {"ipProtocol": "tcp", "fromPort": 443, "toPort": 443, "cidrIpv4": "0.0.0.0/0"})
        == []
    )
    assert (
        check_resource(policy, rule, {"ipProtocol": "tcp", "fromPort": 22, "toPort": 22, "cidrIpv4": "10.0.0.0/16"})
        == []
    )
    (ssh,) = check_resource(policy, rule, {"ipProtocol": "tcp", "fromPort": 22, "toPort": 22, "cidrIpv6": "::/0"})
    assert "inbound tcp 22-22 from the whole internet" in ssh
    assert check_resource(policy, rule, {"ipProtocol": "-1", "cidrIpv4": "0.0.0.0/0"})  # everything
    legacy = {"type": "ingress", "protocol": "tcp", "fromPort": 80, "toPort": 80, "cidrBlocks": ["0.0.0.0/0"]}
    assert check_resource(policy, "aws:ec2/securityGroupRule:SecurityGroupRule", legacy)
    assert check_resource(policy, "aws:ec2/securityGroupRule:SecurityGroupRule", {**legacy, "type": "egress"}) == []
    inline = {"ingress": [{"protocol": "tcp", "fromPort": 30080, "toPort": 30080, "cidrBlocks": ["0.0.0.0/0"]}]}
    assert check_resource(policy, "aws:ec2/securityGroup:SecurityGroup", inline)


def test_cache_encrypted() -> None:
    policy, group = guard.cache_encrypted, "aws:elasticache/replicationGroup:ReplicationGroup"
    good = {"engine": "valkey", "atRestEncryptionEnabled": True, "transitEncryptionEnabled": True}
    assert check_resource(policy, group, good) == []
    assert check_resource(policy, group, {**good, "transitEncryptionMode": "required"}) == []
    (at_rest,) = check_resource(policy, group, {**good, "atRestEncryptionEnabled": False})
    assert "at_rest_encryption_enabled is False; expected true" in at_rest
    (tls,) = check_resource(policy, group, {**good, "transitEncryptionEnabled": None})
    assert "transit_encryption_enabled is None; expected true" in tls
    (preferred,) = check_resource(policy, group, {**good, "transitEncryptionMode": "preferred"})
    assert "'preferred', which still accepts plain-text clients" in preferred
    assert len(check_resource(policy, group, {"engine": "redis"})) == 2  # Redis OSS's defaults: neither
    cluster = "aws:elasticache/cluster:Cluster"
    (standalone,) = check_resource(policy, cluster, {"engine": "valkey", "numCacheNodes": 1})
    assert "a standalone valkey cluster cannot encrypt at rest" in standalone
    assert check_resource(policy, cluster, {"engine": "redis", "replicationGroupId": "rg"}) == []  # a member of a group
    assert check_resource(policy, cluster, {"engine": "memcached"}) == []
    assert check_resource(policy, "aws:ec2/vpc:Vpc", {}) == []


def test_no_open_ingress_covers_the_redis_port() -> None:
    rule = "aws:vpc/securityGroupIngressRule:SecurityGroupIngressRule"
    (redis,) = check_resource(
        guard.no_open_ingress, rule, {"ipProtocol": "tcp", "fromPort": 6379, "toPort": 6379, "cidrIpv4": "0.0.0.0/0"}
    )
    assert "inbound tcp 6379-6379 from the whole internet" in redis
    assert (
        check_resource(
            guard.no_open_ingress,
            rule,
            {"ipProtocol": "tcp", "fromPort": 6379, "toPort": 6379, "referencedSecurityGroupId": "sg-nodes"},
        )
        == []
    )


def test_https_only_listeners() -> None:
    policy, listener = guard.https_only_listeners, "aws:lb/listener:Listener"
    assert check_resource(policy, listener, {"protocol": "HTTPS", "port": 443, "certificateArn": "arn:cert"}) == []
    redirect = [{"type": "redirect", "redirect": {"protocol": "HTTPS", "port": "443", "statusCode": "HTTP_301"}}]
    assert check_resource(policy, listener, {"protocol": "HTTP", "port": 80, "defaultActions": redirect}) == []
    (plain,) = check_resource(
        policy, listener, {"protocol": "HTTP", "port": 80, "defaultActions": [{"type": "forward"}]}
    )
    assert "uses HTTP; expected HTTPS" in plain
    assert check_resource(policy, listener, {"port": 80})  # no protocol: AWS's default is HTTP
    assert "without a certificate_arn" in check_resource(policy, listener, {"protocol": "HTTPS", "port": 443})[0]
    classic = {"listeners": [{"lbProtocol": "http", "lbPort": 80, "instancePort": 80, "instanceProtocol": "http"}]}
    assert check_resource(policy, "aws:elb/loadBalancer:LoadBalancer", classic)


def test_cost_tags() -> None:
    policy = guard.cost_tags
    tags = {"team": "ml", "model": "shared", "env": "dev"}
    assert check_resource(policy, "aws:ec2/vpc:Vpc", {"tags": tags}) == []
    assert (
        check_resource(policy, "aws:ec2/vpc:Vpc", {"tags": {"model": "m"}, "tagsAll": {"team": "ml", "env": "dev"}})
        == []
    )
    assert check_resource(policy, "aws:iam/rolePolicy:RolePolicy", {"policy": "{}"}) == []  # takes no tags
    assert check_resource(policy, "kubernetes:core/v1:Namespace", {"metadata": {}}) == []  # not AWS
    (message,) = check_resource(policy, "aws:ec2/vpc:Vpc", {"tags": {"team": "ml", "model": ""}})
    assert message.startswith("Vpc r lacks the cost tag(s) model, env")
    assert check_resource(policy, "aws:s3/bucket:Bucket", {})  # taggable but untagged
    assert check_resource(policy, "aws:newservice/thing:Thing", {"tags": {}})  # any AWS resource with tags
    # Karpenter's nodes carry their EC2NodeClass's spec.tags
    assert check_resource(policy, NODE_CLASS, {"spec": {"tags": tags}}) == []
    (nodes,) = check_resource(policy, NODE_CLASS, {"metadata": {"name": "gpu"}, "spec": {"tags": {"team": "ml"}}})
    assert nodes.startswith("EC2NodeClass gpu lacks the cost tag(s) model, env in spec.tags")
    assert check_resource(policy, NODE_CLASS, {"spec": {}})


S3 = "aws:s3/"


def _bucket_set(**overrides: dict | None) -> list[PolicyResource]:
    """A bucket and its companions, linked by property dependencies with no values (a preview)."""
    bucket = policy_resource(f"{S3}bucket:Bucket", "b", {"bucket": "b-123"})
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
            out.append(policy_resource(type_, f"b-{key}", props, {"bucket": [bucket]}))
    return out


def test_bucket_encrypted() -> None:
    assert check_stack(guard.bucket_encrypted, _bucket_set()) == []
    sse_s3 = {"rules": [{"applyServerSideEncryptionByDefault": {"sseAlgorithm": "AES256"}}]}
    assert check_stack(guard.bucket_encrypted, _bucket_set(sse=sse_s3)) == []
    (message,) = check_stack(guard.bucket_encrypted, _bucket_set(sse=None))
    assert message.startswith("bucket b-123 has no default encryption")
    # linked by value when the engine recorded no property dependencies
    bucket = policy_resource(f"{S3}bucket:Bucket", "c", {"bucket": "c-1"})
    sse = policy_resource(
        f"{S3}bucketServerSideEncryptionConfiguration:BucketServerSideEncryptionConfiguration",
        "c-sse",
        {"bucket": "c-1", **sse_s3},
    )
    assert check_stack(guard.bucket_encrypted, [bucket, sse]) == []
    other = policy_resource(f"{S3}bucket:Bucket", "d", {"bucket": "d-1"})
    assert len(check_stack(guard.bucket_encrypted, [bucket, sse, other])) == 1  # one config does not cover two buckets


def test_bucket_versioned() -> None:
    assert check_stack(guard.bucket_versioned, _bucket_set()) == []
    (suspended,) = check_stack(
        guard.bucket_versioned, _bucket_set(versioning={"versioningConfiguration": {"status": "Suspended"}})
    )
    assert "bucket b-123 is not versioned (got Suspended)" in suspended
    (none,) = check_stack(guard.bucket_versioned, _bucket_set(versioning=None))
    assert "got no BucketVersioning" in none
    inline = policy_resource(f"{S3}bucketV2:BucketV2", "old", {"bucket": "old", "versioning": {"enabled": True}})
    assert check_stack(guard.bucket_versioned, [inline]) == []  # the deprecated inline form counts


def test_bucket_never_public() -> None:
    assert check_stack(guard.bucket_never_public, _bucket_set()) == []
    loose = {k: True for k in ("blockPublicAcls", "blockPublicPolicy", "ignorePublicAcls")}
    assert "lacks a BucketPublicAccessBlock" in check_stack(guard.bucket_never_public, _bucket_set(block=loose))[0]
    open_policy = {
        "policy": json.dumps(
            {"Statement": [{"Sid": "All", "Effect": "Allow", "Principal": {"AWS": "*"}, "Action": "s3:GetObject"}]}
        )
    }
    (message,) = check_stack(guard.bucket_never_public, _bucket_set(policy=open_policy))
    assert "allows s3:GetObject to everyone (statement All)" in message
    resources = _bucket_set()
    resources[0].props["acl"] = "public-read"
    assert "public ACL 'public-read'" in check_stack(guard.bucket_never_public, resources)[0]
