"""Running the CrossGuard pack (policies/guardrails/) in tests as the Pulumi engine runs it.

Policies get their props as the engine hands them over: wrapped in pulumi_policy's
unknown-checking proxies (Mappings and Sequences, not dicts and lists, raising
UnknownValueError on a value a preview does not know yet), so a policy that only works on
plain dicts fails here as it would in `pulumi preview`. Resource policies see a resource's
inputs; stack policies its outputs, with parents and property dependencies.
"""

from __future__ import annotations

import json
import sys

from infra_harness import ROOT, Registered
from pulumi_policy import (
    PolicyCustomTimeouts,
    PolicyResource,
    PolicyResourceOptions,
    ResourceValidationArgs,
    ResourceValidationPolicy,
    StackValidationArgs,
)
from pulumi_policy.proxy import unknown_checking_proxy

PACK = ROOT / "policies" / "guardrails"
sys.path.insert(0, str(PACK))  # the pack imports its policies as a sibling package, as here

import fleet_guardrails as guard  # noqa: E402

Violation = tuple[str, str]  # (policy name, message)
NODE_POOL = "kubernetes:karpenter.sh/v1:NodePool"
NODE_CLASS = "kubernetes:karpenter.k8s.aws/v1:EC2NodeClass"


def pack_config(stack: str) -> dict:
    return json.loads((PACK / f"{stack}.json").read_text())


def options(parent: str | None = None) -> PolicyResourceOptions:
    return PolicyResourceOptions(False, [], None, [], PolicyCustomTimeouts(0, 0, 0), [], parent)


def stack_resources(resources: list[Registered]) -> list[PolicyResource]:
    """PolicyResources as the engine builds them for stack policies: outputs, parents, dependencies."""
    made = {
        r.urn: PolicyResource(
            r.type,
            unknown_checking_proxy({**r.inputs, **r.state}),
            r.urn,
            r.name,
            options(r.parent or None),
            None,
            None,
            [],
            {},
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
    as_stack = stack_resources(resources)
    for policy in guard.POLICIES:

        def report(message: str, urn: str | None = None, name: str = policy.name) -> None:
            found.append((name, message))

        settings = config.get(policy.name, {})
        if isinstance(policy, ResourceValidationPolicy):
            for r in resources:
                if r.custom:
                    policy.validate(
                        ResourceValidationArgs(
                            r.type, unknown_checking_proxy(r.inputs), r.urn, r.name, options(), None, settings
                        ),
                        report,
                    )
        else:
            policy.validate(StackValidationArgs(as_stack, settings), report)
    return found


def policies_of(violations: list[Violation]) -> set[str]:
    return {name for name, _ in violations}


# --- one policy over hand-made resources ------------------------------------------------------


def check_resource(policy: ResourceValidationPolicy, type_: str, props: dict, config: dict | None = None) -> list[str]:
    """The messages ``policy`` reports for one resource of ``type_`` (its Pulumi name: r)."""
    found: list[str] = []
    policy.validate(
        ResourceValidationArgs(
            type_, unknown_checking_proxy(props), f"urn:{type_}::r", "r", options(), None, config or {}
        ),
        lambda message, urn=None: found.append(message),
    )
    return found


def check_stack(policy, resources: list[PolicyResource], config: dict | None = None) -> list[str]:  # noqa: ANN001
    found: list[str] = []
    policy.validate(StackValidationArgs(resources, config or {}), lambda message, urn=None: found.append(message))
    return found


def policy_resource(type_: str, name: str, props: dict, deps: dict | None = None) -> PolicyResource:
    """A stack policy's view of one resource: ``props`` as the engine wraps them."""
    return PolicyResource(
        type_,
        unknown_checking_proxy(props),
        f"urn:pulumi:s::p::{type_}::{name}",
        name,
        options(),
        None,
        None,
        [],
        deps or {},
    )
