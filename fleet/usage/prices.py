"""What a replica-hour of each model costs, as the gateway meters usage at it.

A ``Price`` is the placement's price per replica-hour: ``prices_from_plan`` takes it from
``fleet.planning.costs.inference_costs`` (the replica's share of a node at the stack file's
``nodePools[].hourly_usd``, what ``fleet plan`` prints). In Kubernetes a gateway reads its
prices from ``FLEET_PRICES_FILE`` (the JSON ``write_prices`` writes, a ConfigMap of the
infra); locally from the placement of a stack file (``gateway_prices``). A model without a
price is metered at an unknown cost, never 0.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from fleet.errors import ConfigError

if TYPE_CHECKING:
    from fleet.planning.placement import PlacementPlan
    from fleet.planning.stack import NodePool

log = logging.getLogger("fleet.usage.prices")


@dataclass(frozen=True, slots=True)
class Price:
    """What one replica of a model costs per hour, on which instance, and where that came from."""

    usd_per_replica_hour: float
    instance: str
    source: str


def prices_from_plan(result: PlacementPlan, pools: Sequence[NodePool], where: str) -> dict[str, Price]:
    """Model → its price per replica-hour in ``result`` (what ``fleet plan`` prints as USD/h per
    replica: the replica's share of a node, at the node's ``hourly_usd`` in the stack file
    ``where``)."""
    from fleet.planning.costs import inference_costs
    from fleet.planning.stack import STACK_POOLS_KEY

    groups = {g.name: g for g in result.node_groups}
    out = {}
    for m, cost in zip(result.models, inference_costs(result, pools), strict=True):
        group = groups[m.node_group]
        share = cost.replica_usd_per_hour / group.hourly_usd if group.hourly_usd else 0.0
        source = (
            f"placement: {share:.4g} of a {m.instance_type} node per replica at {where}: "
            f"{STACK_POOLS_KEY}[{m.pool}].hourly_usd {group.hourly_usd:g}"
        )
        out[m.model] = Price(cost.replica_usd_per_hour, m.instance_type, source)
    return out


def prices_from_stack(stack: str, policies: Path) -> dict[str, Price]:
    """``prices_from_plan`` of the plan ``fleet plan -s <stack> --policies <policies>`` prints."""
    from fleet.catalog.policies.loader import load_policies
    from fleet.planning.planner import plan
    from fleet.planning.stack import placement_inputs, read_stack_file, stack_file

    path = stack_file(stack)
    loaded = load_policies(policies)
    pools, models = placement_inputs(read_stack_file(path), str(path), loaded)
    return prices_from_plan(plan(loaded, pools, models), pools, path.name)


def write_prices(prices: Mapping[str, Price]) -> str:
    """``prices`` as the JSON a gateway reads from ``FLEET_PRICES_FILE`` (``read_prices``)."""
    import json

    return json.dumps({m: asdict(p) for m, p in sorted(prices.items())}, indent=2, sort_keys=True)


def read_prices(path: Path) -> dict[str, Price]:
    """Model → price from a JSON file ``{model: {usd_per_replica_hour, instance, source}}``
    (what ``write_prices`` writes; in Kubernetes, the infra's ConfigMap)."""
    import json

    try:
        raw = json.loads(path.read_text())
        return {
            str(m): Price(float(p["usd_per_replica_hour"]), str(p["instance"]), str(p["source"]))
            for m, p in raw.items()
            if math.isfinite(float(p["usd_per_replica_hour"])) and float(p["usd_per_replica_hour"]) >= 0
        }
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ConfigError(
            f"{path}: not a price file ({exc}); expected JSON {{model: {{usd_per_replica_hour, instance, source}}}}}}}}"
        ) from None


def gateway_prices(policies: Path) -> tuple[dict[str, Price], str]:
    """(the prices a gateway meters cost with, where they came from): ``FLEET_PRICES_FILE``,
    else the placement of the stack ``FLEET_PRICE_STACK`` names (default ``dev``, what a
    local fleet would cost placed as the dev stack), else none (cost unknown)."""
    import os

    from fleet.planning.stack import stack_file

    file = os.environ.get("FLEET_PRICES_FILE", "").strip()
    if file:
        return read_prices(Path(file)), file
    stack = os.environ.get("FLEET_PRICE_STACK", "").strip()
    path = stack_file(stack or "dev")
    if not stack and not path.is_file():
        return {}, "none (set FLEET_PRICES_FILE or FLEET_PRICE_STACK)"
    try:
        return prices_from_stack(str(path), policies), str(path)
    except ConfigError as exc:
        if stack:
            raise
        log.warning("no prices for usage costs: %s", exc)
        return {}, "none"
