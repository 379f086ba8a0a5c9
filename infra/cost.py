"""What a stack costs per hour while it runs, at its minimum and at its maximum size.

Nodes come from the stack config (system nodes) and the placement plan (model nodes); the
rest are AWS list prices in us-east-1 for the fixed parts. Data transfer, load-balancer
capacity units, NAT data processing, EBS volumes and S3 storage depend on traffic and data,
and are left out.
"""

from __future__ import annotations

from infra.config import StackConfig

EKS_CONTROL_PLANE = 0.10  # USD per cluster-hour (standard support)
NAT_GATEWAY = 0.045  # USD per NAT gateway-hour, before data processing
PUBLIC_IPV4 = 0.005  # USD per public IPv4 address-hour (each NAT gateway's Elastic IP)
ALB = 0.0225  # USD per load balancer-hour, before capacity units


def usd_per_hour(stack: StackConfig, nat_gateways: int) -> dict[str, float]:
    """``{"min": ..., "max": ...}`` in USD per hour, rounded to cents."""
    fixed = EKS_CONTROL_PLANE + nat_gateways * (NAT_GATEWAY + PUBLIC_IPV4) + ALB
    system = stack.settings.systemNodes
    low, high = stack.plan.usd_per_hour
    return {
        "min": round(fixed + system.min_size * system.hourly_usd + low, 2),
        "max": round(fixed + system.max_size * system.hourly_usd + high, 2),
    }
