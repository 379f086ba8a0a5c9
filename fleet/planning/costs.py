"""What the fleet costs, in one place: the AWS list prices of a stack's fixed parts, what the
whole stack costs per hour at its minimum and maximum size (``stack_cost``: ``fleet plan`` and
the ``usdPerHour`` stack output), and what one inference costs per model at its autoscaling
target (``inference_costs``: ``fleet plan`` and the prices usage is costed at).

Nodes are priced by the stack file's ``hourly_usd``; the quota store's Valkey nodes by
``fleet.planning.stack.VALKEY_NODE_USD`` unless the stack file states a price (a default of
the stack file's, checked when it is parsed).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from datetime import UTC, date, datetime
from typing import Any

from fleet.planning.karpenter import node_pools
from fleet.planning.node_groups import capacity, demand
from fleet.planning.placement import PlacementPlan
from fleet.planning.stack import (
    STACK_POOLS_KEY,
    STACK_PREFECT_DB_KEY,
    STACK_REDIS_KEY,
    STACK_SYSTEM_KEY,
    NodePool,
    StackBuild,
)

# The fixed parts of a stack's hourly cost, in USD per hour: AWS list prices in us-east-1,
# the region of the example stacks (nodes are priced by the stack file's hourly_usd). One
# table for `fleet plan` and the `usdPerHour` stack output (infra/cost.py). Prices change:
# check them against the pages named before relying on them. Recorded from those pages when
# this table was written; not re-checked on 2026-12-01 (the build machine cannot reach them).
AWS_PRICE_SOURCE = "AWS list price, us-east-1"
AWS_PRICE_LABEL = "AWS us-east-1"
EKS_CONTROL_PLANE_USD = 0.10  # per cluster-hour, standard support (aws.amazon.com/eks/pricing)
EKS_EXTENDED_SUPPORT_USD = 0.60  # per cluster-hour once a version is past standard support (same page)
# EKS's Kubernetes calendar (docs.aws.amazon.com/eks/latest/userguide/kubernetes-versions.html):
# minor → (end of standard support, end of extended support). Standard support is 14 months
# from EKS's release, extended 12 more, at six times the price; past that EKS upgrades the
# cluster itself. A version newer than the table is taken as standard and said so.
EKS_VERSIONS = {
    "1.30": (date(2025, 7, 23), date(2026, 7, 23)),
    "1.31": (date(2025, 11, 26), date(2026, 11, 26)),
    "1.32": (date(2026, 3, 23), date(2027, 3, 23)),
    "1.33": (date(2026, 7, 29), date(2027, 7, 29)),
    "1.34": (date(2026, 12, 2), date(2027, 12, 2)),
    "1.35": (date(2027, 3, 27), date(2028, 3, 27)),
}
NAT_GATEWAY_USD = 0.045  # per NAT gateway-hour, before $0.045/GB processed (aws.amazon.com/vpc/pricing)
PUBLIC_IPV4_USD = 0.005  # per public IPv4 address-hour: each NAT gateway's Elastic IP (same page)
ALB_USD = 0.0225  # per Application Load Balancer-hour, before LCUs (aws.amazon.com/elasticloadbalancing/pricing)
VPC_ENDPOINT_USD = 0.01  # per interface endpoint and AZ-hour, before $0.01/GB (aws.amazon.com/privatelink/pricing)
INTERFACE_ENDPOINTS = (
    "ecr.api",
    "ecr.dkr",
)  # the VPC's interface endpoints (infra/network.py); S3's is a free gateway one
# Not in the totals: billed by traffic or storage, growing with load (the ALB adds public
# IPv4s as it scales out), or by the month (KMS keys).
COST_LEFT_OUT = (
    "data transfer, NAT data processing, ALB capacity units and public IPv4s, "
    "EBS volumes, S3 storage, RDS storage and backups, ElastiCache backups, SQS and EventBridge, "
    "KMS keys, CloudWatch"
)

# S3 requests (aws.amazon.com/s3/pricing, Standard, us-east-1), per request: GET; PUT and
# LIST (DELETE is free).
S3_GET_USD = 0.0004 / 1000
S3_PUT_LIST_USD = 0.005 / 1000
# What one gateway process asks the store, per second, steadily (the figures are the gateway's
# own constants; tests/test_plan_cli.py checks they agree):
# GET: the change journal every 2 s while the change bus (the stack's Valkey) is up
# (fleet.gateway.view.BUS_POLL_S); PUT: its heartbeat every 5 s
# (fleet.catalog.gateway_directory.HEARTBEAT_S), when it last asked each version at most as
# often (fleet.logs.activity), a usage part every 30 s (fleet.usage.meter.FLUSH_S); LIST: the
# peer count every 10 s (one listing) and the listings' comparison every 300 s
# (fleet.gateway.sync.RESYNC_S; a page per 1,000 tenants, counted here as one each).
GATEWAY_GET_PER_S = 1 / 2.0
GATEWAY_PUT_PER_S = 1 / 5.0 + 1 / 5.0 + 1 / 30.0
GATEWAY_LIST_PER_S = 1 / 10.0 + 2 / 300.0
# The log tables (fleet.logs): each gateway process stages one file per flush, every model in
# it, at most every 60 s (fleet.logs.inference.FLUSH_S) while it has traffic; the committer
# runs every 300 s (fleet.logs.committer.EVERY_S) and writes per run one data file per busy
# model (partition) of the inference table, an intent, a manifest, a manifest list and the
# table's metadata (PUTs), reads each staged file and the table's metadata and lists the four
# staging prefixes (GET, LIST); compaction rewrites each model-hour once (one PUT, and reads).
# Feedback and outcomes add one staged file per feedback call: not counted (the plan knows no
# feedback rate).
LOG_STAGED_PER_PROCESS_S = 1 / 60.0
LOG_COMMIT_EVERY_S = 300.0
LOG_COMMIT_PUTS = 4  # intent, manifest, manifest list, metadata, beside one data file per busy model
LOG_COMMIT_GETS = 4  # metadata, manifest list, manifests read back, beside one GET per staged file
LOG_COMMIT_LISTS = 5  # the four tables' staging and the intents
SECONDS_PER_MONTH = 730 * 3600


@dataclass(frozen=True)
class CostPart:
    """One row of a stack's hourly cost: what, how many, USD at minimum and maximum size, and
    where the price came from: ``source`` in full (the stack file's key, or the AWS list price
    above), ``label`` short enough for a table column at 80 characters."""

    part: str
    count: str
    usd_per_hour: tuple[float, float]
    source: str
    label: str


@dataclass(frozen=True)
class StackCost:
    parts: tuple[CostPart, ...]
    left_out: str = COST_LEFT_OUT

    @property
    def usd_per_hour(self) -> tuple[float, float]:
        """The whole stack at its minimum and at its maximum size: the sum of the parts."""
        return sum(p.usd_per_hour[0] for p in self.parts), sum(p.usd_per_hour[1] for p in self.parts)

    def to_dict(self) -> dict[str, Any]:
        # rounded to 6 decimals: float sums like 1.6200999999999999 say more than they know
        parts = [{**asdict(p), "usd_per_hour": _usd(p.usd_per_hour)} for p in self.parts]
        return {"parts": parts, "usd_per_hour": _usd(self.usd_per_hour), "left_out": self.left_out}


def _usd(pair: tuple[float, float]) -> tuple[float, float]:
    return round(pair[0], 6), round(pair[1], 6)


@dataclass(frozen=True)
class EksSupport:
    """Where a Kubernetes minor stands in EKS's calendar on a day, and its control plane's price."""

    version: str
    support: str  # "standard", "extended", "ended" or "unknown" (newer than EKS_VERSIONS)
    until: date | None  # the end of the period it is in
    usd_per_hour: float

    @property
    def count(self) -> str:
        """The cost table's count column (narrow: the table fits 80 columns)."""
        return f"{self.version}, {self.support}"

    @property
    def note(self) -> str:
        """One line for under the table: the support period and what follows it."""
        price = f"control plane {self.usd_per_hour:.2f} USD/hour"
        if self.support == "unknown":
            return (
                f"Kubernetes {self.version}: not in EKS_VERSIONS (fleet/planning/costs.py), priced as standard support"
            )
        if self.support == "standard":
            return (
                f"Kubernetes {self.version}: EKS standard support until {self.until.isoformat()} ({price}; "
                f"{EKS_EXTENDED_SUPPORT_USD:.2f} in extended support after it)"
            )
        if self.support == "extended":
            return (
                f"Kubernetes {self.version}: EKS extended support until {self.until.isoformat()} ({price}); "
                "upgrade to return to standard support's price"
            )
        return f"Kubernetes {self.version}: EKS support has ended; upgrade (EKS upgrades such a cluster itself)"


def eks_support(version: str, today: date | None = None) -> EksSupport:
    """``version``'s EKS support on ``today`` (UTC today by default)."""
    today = today or datetime.now(UTC).date()
    if version not in EKS_VERSIONS:
        newest = max(EKS_VERSIONS, key=lambda v: tuple(map(int, v.split("."))))
        if tuple(map(int, version.split("."))) > tuple(map(int, newest.split("."))):
            return EksSupport(version, "unknown", None, EKS_CONTROL_PLANE_USD)
        return EksSupport(version, "ended", None, EKS_EXTENDED_SUPPORT_USD)
    standard, extended = EKS_VERSIONS[version]
    if today <= standard:
        return EksSupport(version, "standard", standard, EKS_CONTROL_PLANE_USD)
    if today <= extended:
        return EksSupport(version, "extended", extended, EKS_EXTENDED_SUPPORT_USD)
    return EksSupport(version, "ended", extended, EKS_EXTENDED_SUPPORT_USD)


def stack_cost(
    plan: PlacementPlan, build: StackBuild, where: str, today: date | None = None, *, pools: Sequence[NodePool]
) -> StackCost:
    """Every part of the stack that ``pulumi up`` builds and AWS bills by the hour; ``where``
    (the stack file's name) goes into the sources of the node prices, ``pools`` (the stack's node
    pools) size the Karpenter NodePools. The control plane is
    priced by the stack's Kubernetes version on ``today`` (standard or extended support)."""
    system = build.systemNodes
    parts = [
        _nodes(
            "system nodes",
            system.min_size,
            system.max_size,
            system.instance_type,
            system.hourly_usd,
            f"{where}: {STACK_SYSTEM_KEY}.hourly_usd",
            STACK_SYSTEM_KEY,
        )
    ]
    # the model nodes: each Karpenter NodePool from the nodes its models' minimum holds to its
    # limit (canary surge included), at the pool's on-demand price
    parts += [
        _nodes(
            f"node pool {p.name}",
            p.min_nodes,
            p.limit_nodes,
            p.instance_type,
            p.hourly_usd,
            f"{where}: {STACK_POOLS_KEY}[{p.pool}].hourly_usd",
            STACK_POOLS_KEY,  # the table's column is narrow: the pool is in the full source
        )
        for p in node_pools(plan, pools)
    ]
    nats = build.nat_gateways
    eks = eks_support(build.kubernetesVersion, today)
    per_az = f"1 for {build.azCount} AZs" if build.singleNatGateway else f"{nats}, 1 per AZ"
    parts += [
        _fixed("EKS control plane", 1, eks.count, eks.usd_per_hour),
        _fixed("NAT gateways", nats, per_az, NAT_GATEWAY_USD),
        _fixed("NAT Elastic IPs", nats, f"{nats}", PUBLIC_IPV4_USD),
        _fixed("load balancer", 1, "1 ALB", ALB_USD),
        _fixed(
            "VPC interface endpoints",
            len(INTERFACE_ENDPOINTS) * build.azCount,
            f"{len(INTERFACE_ENDPOINTS)} × {build.azCount} AZs",
            VPC_ENDPOINT_USD,
        ),
    ]
    redis = build.redis
    if redis.hourly_usd is None:
        parts.append(
            _fixed("quota store (Valkey)", redis.nodes, f"{redis.nodes} × {redis.node_type}", redis.usd_per_node)
        )
    else:
        parts.append(
            _nodes(
                "quota store (Valkey)",
                redis.nodes,
                redis.nodes,
                redis.node_type,
                redis.hourly_usd,
                f"{where}: {STACK_REDIS_KEY}.hourly_usd",
                STACK_REDIS_KEY,
            )
        )
    db = build.prefectDatabase
    if db.external_host is None:  # else the database is someone else's bill
        instances = 2 if build.env == "prod" else 1  # Multi-AZ: a standby
        count = f"{db.instance_class}{', Multi-AZ' if instances == 2 else ''}"
        if db.hourly_usd is None:
            parts.append(_fixed("Prefect database (RDS)", instances, count, db.usd_per_instance))
        else:
            parts.append(
                _nodes(
                    "Prefect database (RDS)",
                    instances,
                    instances,
                    db.instance_class,
                    db.hourly_usd,
                    f"{where}: {STACK_PREFECT_DB_KEY}.hourly_usd",
                    STACK_PREFECT_DB_KEY,
                )
            )
    parts += store_requests(build, len(plan.models))
    return StackCost(tuple(parts))


def log_requests(processes: int, models: int) -> tuple[float, float, float]:
    """The log tables' S3 requests per second at ``processes`` busy gateway processes and
    ``models`` busy models: (PUT, GET, LIST)."""
    staged = processes * LOG_STAGED_PER_PROCESS_S
    commits = 1 / LOG_COMMIT_EVERY_S
    puts = staged + commits * (LOG_COMMIT_PUTS + models) + models / 3600
    gets = staged + commits * LOG_COMMIT_GETS + models / 3600
    return puts, gets, commits * LOG_COMMIT_LISTS


def store_requests(build: StackBuild, models: int) -> list[CostPart]:
    """The S3 requests of the gateways' control plane and of the log tables, per hour, at the
    stack's fewest and most gateway processes."""
    low, high = build.gateway.processes
    per_process = 3600 * (GATEWAY_GET_PER_S * S3_GET_USD + (GATEWAY_PUT_PER_S + GATEWAY_LIST_PER_S) * S3_PUT_LIST_USD)
    count = f"{low}-{high} processes" if low != high else f"{low} processes"
    puts, gets, lists = log_requests(high, models)
    objects = puts * SECONDS_PER_MONTH
    return [
        CostPart(
            "gateway S3 requests",
            count,
            (low * per_process, high * per_process),
            f"{AWS_PRICE_SOURCE} (S3 requests), at the gateway's steady request rates",
            AWS_PRICE_LABEL,
        ),
        CostPart(
            "log S3 requests",
            f"{_short(objects)} obj/mo",
            (0.0, 3600 * ((puts + lists) * S3_PUT_LIST_USD + gets * S3_GET_USD)),
            f"{AWS_PRICE_SOURCE} (S3 requests): none idle; at the most, every process and model busy: "
            f"{_short(puts * SECONDS_PER_MONTH)} PUT, {_short(gets * SECONDS_PER_MONTH)} GET, "
            f"{_short(lists * SECONDS_PER_MONTH)} LIST a month (staged files, commits, compaction)",
            AWS_PRICE_LABEL,
        ),
    ]


def _short(n: float) -> str:
    for unit, size in (("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f}"


def _nodes(part: str, low: int, high: int, instance_type: str, hourly: float, source: str, label: str) -> CostPart:
    count = f"{low} × {instance_type}" if low == high else f"{low}-{high} × {instance_type}"
    return CostPart(part, count, (low * hourly, high * hourly), source, label)


def _fixed(part: str, n: int, count: str, hourly: float) -> CostPart:
    return CostPart(part, count, (n * hourly, n * hourly), AWS_PRICE_SOURCE, AWS_PRICE_LABEL)


@dataclass(frozen=True)
class InferenceCost:
    """What one replica of a model costs and serves at its autoscaling target."""

    model: str
    replica_usd_per_hour: float  # its share of a node (the largest of GPU, vCPU, RAM), at the node's price
    qps_per_replica: float  # autoscaling.target_qps_per_replica: the load KEDA keeps a replica at

    @property
    def usd_per_1k_inferences(self) -> float:
        return self.replica_usd_per_hour / (self.qps_per_replica * 3600) * 1000

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "usd_per_1k_inferences": self.usd_per_1k_inferences}


def inference_costs(result: PlacementPlan, pools: Sequence[NodePool]) -> tuple[InferenceCost, ...]:
    """Cost per inference of each model at its target QPS on full nodes: the floor a busy
    fleet pays; a half-empty node or a replica below its target costs more per inference."""
    by_pool = {p.name: p for p in pools}
    groups = {g.name: g for g in result.node_groups}
    costs = []
    for m in result.models:
        group = groups[m.node_group]
        cap = capacity(by_pool[m.pool], group.gpu_slices)
        share = max(d / c for d, c in zip(demand(m), cap, strict=True) if c)
        costs.append(InferenceCost(m.model, round(share * group.hourly_usd, 6), m.target_qps_per_replica))
    return tuple(costs)
