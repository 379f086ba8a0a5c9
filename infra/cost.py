"""What a stack costs per hour while it runs, at its minimum and at its maximum size.

The parts and their prices are ``fleet.planning.costs.stack_cost``'s, the same ``fleet plan`` prints
row by row: system nodes (stack config), model nodes (Karpenter's NodePools from the placement plan), and the EKS
control plane, NAT gateways with their Elastic IPs, the load balancer, the VPC interface
endpoints, the quota store's ElastiCache nodes and Prefect's RDS instance at AWS list prices
in us-east-1 (the tables are in fleet/planning/stack.py, one place for both), and the S3
requests of the gateways' control plane and of the inference log. Data transfer,
load-balancer capacity units, NAT data processing, EBS volumes, S3 storage, RDS storage and
backups and ElastiCache backups depend on traffic and data, and are left out.
"""

from __future__ import annotations

from fleet.planning.costs import stack_cost
from fleet.planning.stack import StackBuild
from infra.config import StackConfig


def usd_per_hour(stack: StackConfig, nat_gateways: int) -> dict[str, float]:
    """``{"min": ..., "max": ...}`` in USD per hour, rounded to cents; ``nat_gateways`` is
    what infra/network.py built, which must be what the cost counts."""
    s = stack.settings
    build = StackBuild.model_validate(
        {
            "systemNodes": s.systemNodes.model_dump(),
            "azCount": s.azCount,
            "singleNatGateway": s.singleNatGateway,
            "redis": s.redis.model_dump(),
            # its processes decide the control plane's S3 requests (fleet plan reads the same keys)
            "gateway": {k: getattr(s.gateway, k) for k in ("min_replicas", "max_replicas", "workers")},
            "kubernetesVersion": s.kubernetesVersion,  # extended support costs six times standard
            # Prefect's RDS instance (none with external_host; Multi-AZ for env prod: infra/prefect_db.py)
            "prefectDatabase": {
                "instance_class": s.prefectDatabase.instance_class,
                "external_host": None
                if s.prefectDatabase.external_host is None
                else str(s.prefectDatabase.external_host),
                "hourly_usd": s.prefectDatabase.hourly_usd,
            },
            "env": s.env,
        }
    )
    if build.nat_gateways != nat_gateways:  # a bug between network.py and fleet.planning.stack, not a config mistake
        raise RuntimeError(f"the network has {nat_gateways} NAT gateways but the cost counts {build.nat_gateways}")
    low, high = stack_cost(stack.plan, build, f"Pulumi.{stack.stack}.yaml", pools=stack.pools).usd_per_hour
    return {"min": round(low, 2), "max": round(high, 2)}
