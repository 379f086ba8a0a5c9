"""Who can reach what: the Kubernetes API only from the CIDRs a stack names, no inbound rule
open to the internet except HTTPS (the edge's 443), and nodes whose instance metadata a pod
cannot reach (IMDSv2, hop limit 1: every workload has its own IAM role through IRSA) — the
system nodes' launch template and every Karpenter EC2NodeClass (the model nodes)."""

from __future__ import annotations

import ipaddress

from pulumi_policy import (
    EnforcementLevel,
    PolicyConfigSchema,
    ReportViolation,
    ResourceValidationArgs,
    ResourceValidationPolicy,
)

from fleet_guardrails._common import as_list, get
from fleet_guardrails.karpenter import NODE_CLASS, NODE_CLASS_METADATA_DEFAULTS, pool_name

CLUSTER = "aws:eks/cluster:Cluster"
LAUNCH_TEMPLATE = "aws:ec2/launchTemplate:LaunchTemplate"
INGRESS_RULE = "aws:vpc/securityGroupIngressRule:SecurityGroupIngressRule"
LEGACY_RULE = "aws:ec2/securityGroupRule:SecurityGroupRule"
SECURITY_GROUP = "aws:ec2/securityGroup:SecurityGroup"


def _open(cidr: object) -> bool:
    try:
        return ipaddress.ip_network(str(cidr), strict=False).prefixlen == 0
    except ValueError:
        return False


def _api_cidrs(args: ResourceValidationArgs, report: ReportViolation) -> None:
    if args.resource_type != CLUSTER or args.get_config().get("allowOpen"):
        return
    vpc = args.props.get("vpcConfig") or {}
    if vpc.get("endpointPublicAccess") is False:
        return
    cidrs = as_list(vpc.get("publicAccessCidrs"))
    if not cidrs or any(_open(c) for c in cidrs):
        report(
            f"EKS cluster {args.name}: its public API endpoint is open to {cidrs or ['0.0.0.0/0 (the default)']}; "
            "expected publicAccessCidrs naming your offices, VPN or CI (or endpointPublicAccess false)"
        )


def _hop_limit(args: ResourceValidationArgs, report: ReportViolation) -> None:
    if args.resource_type == LAUNCH_TEMPLATE:
        # EC2's own defaults allow IMDSv1: a launch template says both
        what, options = f"launch template {args.name}", args.props.get("metadataOptions") or {}
    elif args.resource_type == NODE_CLASS:
        # an absent field takes the CRD's default (IMDSv2, hop limit 1)
        what = f"EC2NodeClass {pool_name(args.props, args.name)}"
        options = {**NODE_CLASS_METADATA_DEFAULTS, **(get(args.props, "spec", "metadataOptions", default={}))}
        if options.get("httpEndpoint") == "disabled":
            return  # no instance metadata at all: nothing for a pod to reach
    else:
        return
    if options.get("httpTokens") != "required":
        report(f"{what}: httpTokens is {options.get('httpTokens')!r}; expected 'required' (IMDSv2 only)")
    if options.get("httpPutResponseHopLimit") != 1:
        report(
            f"{what}: IMDS hop limit {options.get('httpPutResponseHopLimit')!r}; expected 1, "
            "so that pods cannot take the node's role (they have their own through IRSA)"
        )


def _https_only(protocol: object, low: object, high: object) -> bool:
    return str(protocol).lower() in ("tcp", "6") and low == 443 and high == 443


def _open_ingress(args: ResourceValidationArgs, report: ReportViolation) -> None:
    props, rules = args.props, []
    if args.resource_type == INGRESS_RULE:
        rules = [
            (
                props.get("ipProtocol"),
                props.get("fromPort"),
                props.get("toPort"),
                [props.get("cidrIpv4"), props.get("cidrIpv6")],
            )
        ]
    elif args.resource_type == LEGACY_RULE and props.get("type") == "ingress":
        rules = [
            (
                props.get("protocol"),
                props.get("fromPort"),
                props.get("toPort"),
                as_list(props.get("cidrBlocks")) + as_list(props.get("ipv6CidrBlocks")),
            )
        ]
    elif args.resource_type == SECURITY_GROUP:
        rules = [
            (
                r.get("protocol"),
                r.get("fromPort"),
                r.get("toPort"),
                as_list(r.get("cidrBlocks")) + as_list(r.get("ipv6CidrBlocks")),
            )
            for r in as_list(props.get("ingress"))
        ]
    for protocol, low, high, cidrs in rules:
        if any(_open(c) for c in cidrs if c) and not _https_only(protocol, low, high):
            report(
                f"{args.name}: inbound {protocol} {low}-{high} from the whole internet; only HTTPS (tcp 443) may be "
                "open to 0.0.0.0/0 or ::/0, anything else names its sources"
            )


eks_api_cidrs = ResourceValidationPolicy(
    name="eks-api-cidrs",
    description="The EKS API's public endpoint is reachable only from named CIDRs (allowOpen: true for a dev stack).",
    validate=_api_cidrs,
    enforcement_level=EnforcementLevel.MANDATORY,
    config_schema=PolicyConfigSchema(properties={"allowOpen": {"type": "boolean", "default": False}}),
)
imds_hop_limit = ResourceValidationPolicy(
    name="imds-hop-limit",
    description="Launch templates and Karpenter EC2NodeClasses require IMDSv2 with a hop limit of 1.",
    validate=_hop_limit,
    enforcement_level=EnforcementLevel.MANDATORY,
)
no_open_ingress = ResourceValidationPolicy(
    name="no-open-ingress",
    description="No inbound rule is open to 0.0.0.0/0 or ::/0 except HTTPS on 443.",
    validate=_open_ingress,
    enforcement_level=EnforcementLevel.MANDATORY,
)
