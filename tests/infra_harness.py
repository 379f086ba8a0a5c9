"""Run the Pulumi program (infra/) under Pulumi's mocks and record what it registers.

``build(stack)`` loads ``Pulumi.<stack>.yaml`` as the stack's config, runs
``infra/__main__.py`` exactly as ``pulumi up`` would (``runpy`` on the folder), and returns
every registered resource — type, name, URN, parent, inputs (the wire names, camelCase;
secrets unwrapped, their top-level names in ``secret_inputs``), the state the mocks
answered with, and its dependencies per property — plus the stack outputs. The mocks answer
like AWS would where the program reads outputs back (bucket names, OIDC issuer, repository
URLs, autoscaling group names), and like pulumi-kubernetes where it auto-names an object.
The stack's secrets are ``SECRET_CONFIG`` (``gatewayAdminToken`` is ``ADMIN_TOKEN``), as if
``pulumi config set --secret`` had put them there.
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib
import inspect
import json
import re
import runpy
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
PROJECT = "serving-fleet"
ACCOUNT = "123456789012"
REGION = "us-east-1"
ADMIN_TOKEN_KEY = f"{PROJECT}:gatewayAdminToken"
ADMIN_TOKEN = "test-admin-token-must-stay-secret-0123456789abcdef"
SECRET_CONFIG = {  # as if `pulumi config set --secret` had put them there
    ADMIN_TOKEN_KEY: ADMIN_TOKEN,
    f"{PROJECT}:grafanaAdminPassword": "test-grafana-password-must-stay-secret-0123456789",
    f"{PROJECT}:prefectDbPassword": "test-prefect-db-password-must-stay-secret-012345",
    f"{PROJECT}:redisAuthToken": "test-redis-auth-token-must-stay-secret-0123456789",
}

if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # `infra` imports as a package, as infra/__main__.py arranges too


@dataclass
class Registered:
    type: str
    name: str
    urn: str
    parent: str
    custom: bool
    inputs: dict[str, Any]
    state: dict[str, Any]
    id: str
    dependencies: list[str] = field(default_factory=list)
    property_dependencies: dict[str, list[str]] = field(default_factory=dict)
    secret_inputs: set[str] = field(default_factory=set)  # inputs that were registered as secrets


@dataclass
class Build:
    stack: str
    resources: list[Registered]
    outputs: dict[str, Any]

    def of_type(self, type_: str) -> list[Registered]:
        return [r for r in self.resources if r.type == type_]

    def one(self, type_: str, name_contains: str = "") -> Registered:
        found = [r for r in self.of_type(type_) if name_contains in r.name]
        assert len(found) == 1, f"{len(found)} {type_} named *{name_contains}*: {[r.name for r in found]}"
        return found[0]

    def by_urn(self, urn: str) -> Registered:
        return next(r for r in self.resources if r.urn == urn)


def _physical(name: str) -> str:
    return f"{name}-{hashlib.sha256(name.encode()).hexdigest()[:7]}"


def _state(typ: str, name: str, inputs: dict) -> tuple[str, dict]:
    """(id, outputs) as AWS would answer for what the program reads back."""
    if typ.startswith("kubernetes:"):
        # pulumi-kubernetes names an object without metadata.name "<resource name>-<8 random characters>"
        metadata = inputs.get("metadata") or {}
        named = {**metadata, "name": metadata.get("name") or f"{name}-{hashlib.sha256(name.encode()).hexdigest()[:8]}"}
        return f"{named.get('namespace', 'default')}/{named['name']}", {**inputs, "metadata": named}
    arn = f"arn:aws:{typ.split(':')[1].split('/')[0]}:{REGION}:{ACCOUNT}:{name}"
    out: dict[str, Any] = {**inputs, "arn": arn}
    rid = f"{name}-id"
    if typ == "aws:s3/bucket:Bucket":
        bucket = inputs.get("bucket") or _physical(name)
        out.update(bucket=bucket, arn=f"arn:aws:s3:::{bucket}")
        rid = bucket
    elif typ == "aws:eks/cluster:Cluster":
        out.update(
            endpoint=f"https://{name}.gr7.{REGION}.eks.amazonaws.com",
            certificateAuthority={"data": "Y2VydA=="},
            identities=[{"oidcs": [{"issuer": f"https://oidc.eks.{REGION}.amazonaws.com/id/EXAMPLE{len(name)}"}]}],
            vpcConfig={**inputs.get("vpcConfig", {}), "clusterSecurityGroupId": "sg-cluster"},
        )
        rid = inputs["name"]
    elif typ == "aws:eks/nodeGroup:NodeGroup":
        out["resources"] = [{"autoscalingGroups": [{"name": f"eks-{inputs['nodeGroupName']}-asg"}]}]
    elif typ == "aws:ec2/launchTemplate:LaunchTemplate":
        out["latestVersion"] = 1
    elif typ == "aws:iam/role:Role":
        out.update(arn=f"arn:aws:iam::{ACCOUNT}:role/{_physical(name)}", name=_physical(name))
        rid = out["name"]
    elif typ == "aws:iam/openIdConnectProvider:OpenIdConnectProvider":
        out["arn"] = f"arn:aws:iam::{ACCOUNT}:oidc-provider/{inputs['url'].removeprefix('https://')}"
    elif typ == "aws:kms/key:Key":
        out.update(arn=f"arn:aws:kms:{REGION}:{ACCOUNT}:key/{name}", keyId=name)
    elif typ == "aws:ecr/repository:Repository":
        out["repositoryUrl"] = f"{ACCOUNT}.dkr.ecr.{REGION}.amazonaws.com/{inputs['name']}"
    elif typ == "aws:lb/loadBalancer:LoadBalancer":
        out["dnsName"] = f"{name}-1234567890.{REGION}.elb.amazonaws.com"
    elif typ == "aws:elasticache/subnetGroup:SubnetGroup":
        out["name"] = inputs.get("name") or _physical(name)
        rid = out["name"]
    elif typ == "aws:elasticache/replicationGroup:ReplicationGroup":
        rid = inputs["replicationGroupId"]
        # the primary endpoint of a group with cluster mode disabled and TLS on
        out["primaryEndpointAddress"] = f"master.{rid}.abc123.use1.cache.amazonaws.com"
    return rid, out


# What each AZ of the mocked region offers: p4d.24xlarge not in us-east-1a, as in some real
# regions; every other type everywhere. Tests may change it.
OFFERINGS: dict[str, set[str]] = {f"{REGION}{z}": {"*"} for z in "bcdef"} | {
    f"{REGION}a": {"m6i.2xlarge", "g5.xlarge", "g5.12xlarge"}
}


def _call(token: str, args: dict) -> dict:
    if token == "aws:index/getAvailabilityZones:getAvailabilityZones":
        return {
            "names": [f"{REGION}{z}" for z in "abcdef"],
            "zoneIds": [f"use1-az{i}" for i in range(1, 7)],
            "id": REGION,
        }
    if token == "aws:index/getCallerIdentity:getCallerIdentity":
        return {"accountId": ACCOUNT, "arn": f"arn:aws:iam::{ACCOUNT}:user/ci", "userId": "AIDA", "id": ACCOUNT}
    if token == "aws:ec2/getInstanceTypeOfferings:getInstanceTypeOfferings":
        (wanted,) = [f["values"][0] for f in args["filters"] if f["name"] == "instance-type"]
        zones = [z for z, types in OFFERINGS.items() if wanted in types or "*" in types]
        return {
            **args,
            "locations": zones,
            "locationTypes": ["availability-zone"] * len(zones),
            "instanceTypes": [wanted] * len(zones),
            "id": REGION,
        }
    if token == "aws:eks/getAddonVersion:getAddonVersion":  # EKS's default version for that Kubernetes version
        version = f"v{args['kubernetesVersion']}.0-{args['addonName']}-eksbuild.1"
        return {**args, "version": version, "id": args["addonName"]}
    if token == "aws:index/getRegion:getRegion":
        return {"region": REGION, "name": REGION, "id": REGION, "description": "US East (N. Virginia)", "endpoint": ""}
    if token == "aws:elb/getServiceAccount:getServiceAccount":
        return {"arn": "arn:aws:iam::127311923021:root", "id": "127311923021"}
    raise AssertionError(f"the program invoked {token}, which the mocks do not answer")


def stack_config(stack: str) -> dict[str, str]:
    """Pulumi.<stack>.yaml's config as the engine hands it to a program: strings, JSON for the
    rest, the secret admin token decrypted."""
    raw = yaml.safe_load((ROOT / f"Pulumi.{stack}.yaml").read_text())["config"]
    return {**{k: v if isinstance(v, str) else json.dumps(v) for k, v in raw.items()}, **SECRET_CONFIG}


def build(stack: str, config: dict[str, str] | None = None) -> Build:
    """Run the program for ``stack`` (its Pulumi.<stack>.yaml, or ``config``) under mocks.

    It runs in a thread of its own with a fresh event loop: Pulumi's runtime needs one, and
    other tests in the session may have closed or unset the main thread's."""

    def work() -> Build:
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        try:
            return _build(stack, config)
        finally:
            asyncio.set_event_loop(None)
            loop.close()

    with ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(work).result()


def _build(stack: str, config: dict[str, str] | None) -> Build:
    import pulumi
    from pulumi.runtime import mocks

    resources: list[Registered] = []

    class Mocks(pulumi.runtime.Mocks):
        def new_resource(self, args: pulumi.runtime.MockResourceArgs) -> tuple[str, dict]:
            return _state(args.typ, args.name, args.inputs) if args.custom else (None, {})

        def call(self, args: pulumi.runtime.MockCallArgs) -> dict:
            return _call(args.token, args.args)

    class Monitor(mocks.MockMonitor):
        def RegisterResource(self, request):  # noqa: ANN001, ANN201, N802 - the gRPC method's name
            response = super().RegisterResource(request)
            if request.type != "pulumi:pulumi:Stack":
                registration = self.resources.get(response.urn)
                inputs = pulumi.runtime.rpc.deserialize_properties(request.object)
                secret = {k for k, v in inputs.items() if pulumi.runtime.rpc.is_rpc_secret(v)}
                resources.append(
                    Registered(
                        type=request.type,
                        name=request.name,
                        urn=response.urn,
                        parent=request.parent,
                        custom=request.custom,
                        inputs={k: pulumi.runtime.rpc.unwrap_rpc_secret(v) for k, v in inputs.items()},
                        state=registration.state if registration else {},
                        id=registration.id if registration else "",
                        dependencies=list(request.dependencies),
                        property_dependencies={k: list(v.urns) for k, v in request.propertyDependencies.items()},
                        secret_inputs=secret,
                    )
                )
            return response

    pulumi.runtime.set_all_config(config if config is not None else stack_config(stack), list(SECRET_CONFIG))
    monitor = Monitor(Mocks())
    pulumi.runtime.set_mocks(monitor.mocks, project=PROJECT, stack=stack, preview=False, monitor=monitor)
    exported: dict[str, Any] = {}
    outputs: dict[str, Any] = {}
    real_export = pulumi.export

    @pulumi.runtime.test
    def run():  # noqa: ANN202
        pulumi.export = lambda key, value: exported.__setitem__(key, value)
        try:
            runpy.run_path(str(ROOT / "infra"), run_name="__main__")
        finally:
            pulumi.export = real_export
        return pulumi.Output.all(**exported).apply(outputs.update)

    run()
    return Build(stack, resources, outputs)


def takes_tags(type_: str) -> bool:
    """Does the pulumi_aws class of ``type_`` (aws:<module>/<x>:<Class>) accept ``tags``?"""
    module, cls = type_.split(":")[1].split("/")[0], type_.split(":")[2]
    resource = getattr(importlib.import_module(f"pulumi_aws.{module}"), cls)
    return "tags" in inspect.signature(resource._internal_init).parameters


_BUILDS: dict[str, Build] = {}


def example(stack: str) -> Build:
    """The build of an example stack, made once per test session (each takes about a second)."""
    if stack not in _BUILDS:
        _BUILDS[stack] = build(stack)
    return _BUILDS[stack]


# --- IAM, as AWS evaluates one identity policy ------------------------------------------------


def as_list(value: str | list[str]) -> list[str]:
    return [value] if isinstance(value, str) else value


def iam_matches(pattern: str, value: str) -> bool:
    """IAM's wildcards in actions and resources: * is any run of characters ("/" included), ? one."""
    return re.fullmatch(re.escape(pattern).replace(r"\*", ".*").replace(r"\?", "."), value) is not None


def iam_allows(policy: list[dict], action: str, resource: str) -> bool:
    """IAM's evaluation within one policy: an explicit Deny wins, else any Allow, else denied."""
    hits = [
        s["Effect"]
        for s in policy
        if any(iam_matches(a, action) for a in as_list(s["Action"]))
        and any(iam_matches(r, resource) for r in as_list(s["Resource"]))
    ]
    return "Deny" not in hits and "Allow" in hits


def role_policy(build: Build, role: str) -> list[dict]:
    """The statements of the inline policy of the IRSA role ``<stack name>-<role>``."""
    return json.loads(build.one("aws:iam/rolePolicy:RolePolicy", f"-{role}").inputs["policy"])["Statement"]
