"""Edge: an internet-facing Application Load Balancer in front of the gateway, HTTPS only.

There is one listener, on 443, with the stack's ACM certificate and a TLS 1.3 policy; no
plain-HTTP listener exists, so nothing can be served unencrypted. Targets are the system
nodes on the gateway Service's NodePort (the nodes' autoscaling group is attached to the
target group, so new nodes join by themselves); the health check is the gateway's readiness
endpoint. Access logs go to the logs bucket.

The admin API is not served here: the NodePort leads to the gateway's public port, where the
gateway itself answers ``/admin/...`` with 404 (it serves them on its admin port, which only a
ClusterIP Service exposes: infra/gateway.py); a listener rule answers them with 404 before
they reach a node at all, so a gateway started without ``--admin-port`` is not exposed either.

Names. AWS caps load balancer and target group names at 32 characters, and pulumi-aws's
auto-name (resource name + ``-`` + 7 random characters) of ``serving-fleet-<stack>-gateway``
is over it. Both get an explicit name from ``elb_name``: the stack's name cut to fit, a role,
and a hash of the stack's name and of the properties whose change replaces the resource.
Deterministic (a preview shows the real name) and still safe to replace: a change that
forces a replacement changes the name too, so Pulumi creates the new one beside the old
(create-before-delete) and the listener moves to it before the old one is deleted. A fixed
name would collide with itself there; ``name_prefix`` (6 characters for a target group)
would say nothing of the stack the resource belongs to.

Idle connections: the load balancer closes one after ``idle_timeout_s`` without a byte —
longer than the slowest answer a model's policy allows (a non-streamed LLM answer sends
nothing until it is done) — and the gateway keeps one open longer still
(``gateway_keep_alive_s``, its ``FLEET_GATEWAY_KEEPALIVE_S``): AWS's rule that the target's
keep-alive must exceed the load balancer's idle timeout, or the target closes a connection
the load balancer is about to reuse, and that request gets a 502.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass

import pulumi
import pulumi_aws as aws

from infra.storage import ALB_LOG_PREFIX

TLS_POLICY = "ELBSecurityPolicy-TLS13-1-2-2021-06"  # TLS 1.3, and 1.2 with forward secrecy only
READY_PATH = "/v2/health/ready"  # the gateway's readiness endpoint (Open Inference Protocol)
ELB_NAME_MAX = 32  # AWS's limit for load balancer and target group names
ADMIN_PATHS = ("/admin", "/admin/*")  # the gateway's admin API (fleet/gateway/admin.py): never through here
MIN_IDLE_TIMEOUT_S = 60  # the load balancer's default
IDLE_MARGIN_S = 15  # beyond the longest request, and again beyond the load balancer's idle timeout


def elb_name(prefix: str, role: str, *identity: object) -> str:
    """A load balancer's or target group's name: at most 32 characters, letters, digits and
    hyphens, no hyphen at either end; ``identity`` (what forces a replacement) is hashed in.

    >>> elb_name("serving-fleet-prod", "gw", "vpc-1", 30080, "HTTP", "instance")
    'serving-fleet-prod-gw-1a6ae0e4'
    """
    digest = hashlib.sha256(repr((prefix, role, *identity)).encode()).hexdigest()[:8]
    tail = f"-{role}-{digest}"
    head = re.sub(r"[^A-Za-z0-9-]+", "-", prefix).strip("-")[: ELB_NAME_MAX - len(tail)].rstrip("-")
    return f"{head}{tail}" if head else tail.lstrip("-")


def idle_timeout_s(timeouts_ms: Iterable[int]) -> int:
    """The load balancer's idle timeout: the longest request a model's policy allows (its
    ``timeout_ms``), plus a margin, and never under ALB's default of 60 s.

    >>> idle_timeout_s([2000, 60000])
    75
    """
    longest = max(timeouts_ms, default=0)
    return max(MIN_IDLE_TIMEOUT_S, math.ceil(longest / 1000) + IDLE_MARGIN_S)


def gateway_keep_alive_s(alb_idle_timeout_s: int) -> int:
    """How long the gateway keeps an idle connection open: past the load balancer's idle
    timeout, so it is always the load balancer that closes one first."""
    return alb_idle_timeout_s + IDLE_MARGIN_S


@dataclass
class EdgeArgs:
    vpc_id: pulumi.Input[str]
    public_subnet_ids: list[pulumi.Input[str]]
    certificate_arn: str
    allowed_cidrs: list[str]
    node_port: int
    node_security_group_id: pulumi.Input[str]  # the EKS cluster security group the nodes use
    node_autoscaling_group: pulumi.Input[str]  # of the system node group, where the gateway runs
    logs_bucket: pulumi.Input[str]
    logs_policy: pulumi.Resource  # the logs bucket's policy: ELB checks that it may write when logging is turned on
    tags: dict[str, str]
    idle_timeout_s: int = MIN_IDLE_TIMEOUT_S  # idle_timeout_s(the served models' timeout_ms)


class Edge(pulumi.ComponentResource):
    dns_name: pulumi.Output[str]
    listener_arn: pulumi.Output[str]

    def __init__(self, name: str, args: EdgeArgs, opts: pulumi.ResourceOptions | None = None) -> None:
        super().__init__("serving-fleet:infra:Edge", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        sg = aws.ec2.SecurityGroup(
            f"{name}-alb", vpc_id=args.vpc_id, description="gateway load balancer", tags=args.tags, opts=child
        )
        for i, cidr in enumerate(args.allowed_cidrs):
            aws.vpc.SecurityGroupIngressRule(
                f"{name}-https-{i}",
                security_group_id=sg.id,
                ip_protocol="tcp",
                from_port=443,
                to_port=443,
                cidr_ipv4=cidr,
                description="HTTPS from clients",
                tags=args.tags,
                opts=child,
            )
        aws.vpc.SecurityGroupEgressRule(
            f"{name}-to-nodes",
            security_group_id=sg.id,
            ip_protocol="tcp",
            from_port=args.node_port,
            to_port=args.node_port,
            referenced_security_group_id=args.node_security_group_id,
            description="to the gateway NodePort",
            tags=args.tags,
            opts=child,
        )
        aws.vpc.SecurityGroupIngressRule(
            f"{name}-nodes-from-alb",
            security_group_id=args.node_security_group_id,
            ip_protocol="tcp",
            from_port=args.node_port,
            to_port=args.node_port,
            referenced_security_group_id=sg.id,
            description="gateway NodePort from its load balancer",
            tags=args.tags,
            opts=child,
        )
        lb = aws.lb.LoadBalancer(
            f"{name}-alb",
            name=elb_name(name, "alb", "application", "internet-facing"),
            load_balancer_type="application",
            internal=False,
            subnets=args.public_subnet_ids,
            security_groups=[sg.id],
            drop_invalid_header_fields=True,
            idle_timeout=args.idle_timeout_s,  # below the gateway's keep-alive: see the module docstring
            access_logs={"bucket": args.logs_bucket, "prefix": ALB_LOG_PREFIX, "enabled": True},
            tags=args.tags,
            opts=pulumi.ResourceOptions(parent=self, depends_on=[args.logs_policy]),
        )
        targets = aws.lb.TargetGroup(
            f"{name}-gateway",
            name=pulumi.Output.from_input(args.vpc_id).apply(
                lambda vpc: elb_name(name, "gw", vpc, args.node_port, "HTTP", "instance")
            ),
            port=args.node_port,
            protocol="HTTP",
            target_type="instance",
            vpc_id=args.vpc_id,
            deregistration_delay=30,  # the gateway drains in-flight requests within its grace period
            health_check={
                "path": READY_PATH,
                "port": "traffic-port",
                "protocol": "HTTP",
                "matcher": "200",
                "interval": 10,
                "healthy_threshold": 2,
                "unhealthy_threshold": 3,
            },
            tags=args.tags,
            opts=child,
        )
        aws.autoscaling.Attachment(
            f"{name}-gateway-nodes",
            autoscaling_group_name=args.node_autoscaling_group,
            lb_target_group_arn=targets.arn,
            opts=child,
        )
        listener = aws.lb.Listener(
            f"{name}-https",
            load_balancer_arn=lb.arn,
            port=443,
            protocol="HTTPS",
            ssl_policy=TLS_POLICY,
            certificate_arn=args.certificate_arn,
            default_actions=[{"type": "forward", "target_group_arn": targets.arn}],
            routing_http_response_strict_transport_security_header_value="max-age=31536000; includeSubDomains",
            tags=args.tags,
            opts=child,
        )
        # belt and braces: the gateway refuses these on its public port anyway
        aws.lb.ListenerRule(
            f"{name}-no-admin",
            listener_arn=listener.arn,
            priority=1,
            actions=[
                {
                    "type": "fixed-response",
                    "fixed_response": {
                        "content_type": "application/json",
                        "status_code": "404",
                        "message_body": '{"error": "not found"}',
                    },
                }
            ],
            conditions=[{"path_pattern": {"values": list(ADMIN_PATHS)}}],
            tags=args.tags,
            opts=child,
        )
        self.dns_name = lb.dns_name
        self.listener_arn = listener.arn
        self.register_outputs({"dns_name": lb.dns_name, "listener_arn": listener.arn})
