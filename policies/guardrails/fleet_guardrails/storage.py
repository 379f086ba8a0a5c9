"""Buckets: encrypted at rest, versioned, never public.

Stack policies, because with pulumi-aws v7 these are separate resources
(BucketServerSideEncryptionConfiguration, BucketVersioning, BucketPublicAccessBlock) that
point at the bucket; each bucket must have its own. The deprecated inline bucket arguments
and the *V2 resource names count too, so an older program is judged by the same rules.
"""

from __future__ import annotations

import json

from pulumi_policy import EnforcementLevel, ReportViolation, StackValidationArgs, StackValidationPolicy

from fleet_guardrails._common import as_list, get, linked

BUCKETS = {"aws:s3/bucket:Bucket", "aws:s3/bucketV2:BucketV2"}
ENCRYPTION = {
    "aws:s3/bucketServerSideEncryptionConfiguration:BucketServerSideEncryptionConfiguration",
    "aws:s3/bucketServerSideEncryptionConfigurationV2:BucketServerSideEncryptionConfigurationV2",
}
VERSIONING = {"aws:s3/bucketVersioning:BucketVersioning", "aws:s3/bucketVersioningV2:BucketVersioningV2"}
PUBLIC_ACCESS_BLOCK = "aws:s3/bucketPublicAccessBlock:BucketPublicAccessBlock"
ACLS = {"aws:s3/bucketAcl:BucketAcl", "aws:s3/bucketAclV2:BucketAclV2"}
POLICY = "aws:s3/bucketPolicy:BucketPolicy"
ALGORITHMS = {"AES256", "aws:kms", "aws:kms:dsse"}
PUBLIC_ACLS = {"public-read", "public-read-write", "authenticated-read"}
BLOCKS = ("blockPublicAcls", "blockPublicPolicy", "ignorePublicAcls", "restrictPublicBuckets")


def _name(bucket) -> str:  # noqa: ANN001 - a PolicyResource
    return bucket.props.get("bucket") or bucket.name


def _attached(args: StackValidationArgs, types: set[str] | str, bucket) -> list:  # noqa: ANN001
    types = {types} if isinstance(types, str) else types
    return [r for r in args.resources if r.resource_type in types and linked(r, "bucket", bucket)]


def _encrypted(args: StackValidationArgs, report: ReportViolation) -> None:
    for bucket in (r for r in args.resources if r.resource_type in BUCKETS):
        rules = [rule for c in _attached(args, ENCRYPTION, bucket) for rule in as_list(c.props.get("rules"))]
        rules += as_list(get(bucket.props, "serverSideEncryptionConfiguration", "rule"))  # deprecated inline form
        algorithms = {get(r, "applyServerSideEncryptionByDefault", "sseAlgorithm") for r in rules}
        if not algorithms & ALGORITHMS:
            report(
                f"bucket {_name(bucket)} has no default encryption; expected a "
                f"BucketServerSideEncryptionConfiguration with sse_algorithm aws:kms or AES256",
                bucket.urn,
            )


def _versioned(args: StackValidationArgs, report: ReportViolation) -> None:
    for bucket in (r for r in args.resources if r.resource_type in BUCKETS):
        states = [get(v.props, "versioningConfiguration", "status") for v in _attached(args, VERSIONING, bucket)]
        if get(bucket.props, "versioning", "enabled") is True:  # deprecated inline form
            states.append("Enabled")
        if "Enabled" not in states:
            got = ", ".join(str(s) for s in states) or "no BucketVersioning"
            report(
                f"bucket {_name(bucket)} is not versioned (got {got}); expected a BucketVersioning with status Enabled",
                bucket.urn,
            )


def _public_statements(document: str) -> list[dict]:
    try:
        statements = as_list(json.loads(document).get("Statement"))
    except (TypeError, ValueError, AttributeError):
        return []
    public = []
    for s in statements:
        principal = s.get("Principal")
        everyone = principal == "*" or "*" in as_list(get(principal, "AWS"))
        if s.get("Effect") == "Allow" and everyone and not s.get("Condition"):
            public.append(s)
    return public


def _never_public(args: StackValidationArgs, report: ReportViolation) -> None:
    for bucket in (r for r in args.resources if r.resource_type in BUCKETS):
        name = _name(bucket)
        blocks = _attached(args, PUBLIC_ACCESS_BLOCK, bucket)
        if not any(all(b.props.get(k) is True for k in BLOCKS) for b in blocks):
            report(f"bucket {name} lacks a BucketPublicAccessBlock with {', '.join(BLOCKS)} all true", bucket.urn)
        acls = [bucket.props.get("acl")] + [get(a.props, "acl") for a in _attached(args, ACLS, bucket)]
        for acl in {a for a in acls if a in PUBLIC_ACLS}:
            report(f"bucket {name} has the public ACL {acl!r}; expected private", bucket.urn)
        for policy in _attached(args, POLICY, bucket):
            for s in _public_statements(policy.props.get("policy") or "{}"):
                report(
                    f"bucket {name}'s policy allows {s.get('Action')} to everyone (statement "
                    f"{s.get('Sid', '?')}) without a condition; expected no public grants",
                    policy.urn,
                )


def _stack(name: str, description: str, validate) -> StackValidationPolicy:  # noqa: ANN001
    return StackValidationPolicy(
        name=name, description=description, validate=validate, enforcement_level=EnforcementLevel.MANDATORY
    )


bucket_encrypted = _stack("bucket-encrypted", "Every S3 bucket has default encryption (SSE-KMS or SSE-S3).", _encrypted)
bucket_versioned = _stack("bucket-versioned", "Every S3 bucket is versioned.", _versioned)
bucket_never_public = _stack(
    "bucket-never-public", "Every S3 bucket blocks public access and grants nothing to everyone.", _never_public
)
