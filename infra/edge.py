"""Edge: an internet-facing Application Load Balancer in front of the gateway, HTTPS only.

There is one listener, on 443, with the stack's ACM certificate and a TLS 1.3 policy; no
plain-HTTP listener exists, so nothing can be served unencrypted. Targets are the system
nodes on the gateway Service's NodePort (the nodes' autoscaling group is attached to the
target group, so new nodes join by themselves); the health check is the gateway's readiness
endpoint. Access logs go to the logs bucket.
"""

from __future__ import annotations

from dataclasses import dataclass

import pulumi
import pulumi_aws as aws

from infra.storage import ALB_LOG_PREFIX

TLS_POLICY = "ELBSecurityPolicy-TLS13-1-2-2021-06"  # TLS 1.3, and 1.2 with forward secrecy only
READY_PATH = "/v2/health/ready"  # the gateway's readiness endpoint (Open Inference Protocol)


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
            load_balancer_type="application",
            internal=False,
            subnets=args.public_subnet_ids,
            security_groups=[sg.id],
            drop_invalid_header_fields=True,
            idle_timeout=120,  # LLM answers take a while
            access_logs={"bucket": args.logs_bucket, "prefix": ALB_LOG_PREFIX, "enabled": True},
            tags=args.tags,
            opts=pulumi.ResourceOptions(parent=self, depends_on=[args.logs_policy]),
        )
        targets = aws.lb.TargetGroup(
            f"{name}-gateway",
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
        self.dns_name = lb.dns_name
        self.listener_arn = listener.arn
        self.register_outputs({"dns_name": lb.dns_name, "listener_arn": listener.arn})
