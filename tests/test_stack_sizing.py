"""What a stack is sized and priced by, beside the models: the system pool holds the platform and
the gateways, and the Kubernetes version is one EKS offers, priced by its support period."""

from __future__ import annotations

import json
from datetime import date

import pulumi
import pytest
from infra_harness import ROOT, build, stack_config

from fleet.planning import system_pool
from fleet.planning.costs import EKS_CONTROL_PLANE_USD, EKS_EXTENDED_SUPPORT_USD, eks_support, stack_cost
from fleet.planning.stack import KUBERNETES_VERSION, build_inputs


def test_a_nodes_allocatable_is_eks_reservations_less_the_daemonsets() -> None:
    # m6i.xlarge: 4 vCPU, 16 GiB, 58 pods. kube-reserved CPU 60+10+5+5 = 80m; memory 255 + 11 × 58
    # = 893 MiB, and 100 MiB of hard eviction; DaemonSets 205m / 184 MiB
    assert system_pool.allocatable("m6i.xlarge") == (4000 - 80 - 205, 16384 - 893 - 100 - 184)


@pytest.mark.parametrize(
    ("instance", "min_size", "max_size", "gateways", "cpu", "needs"),
    [
        ("t3.large", 2, 3, (2, 3), 1.0, "min_size 2 × t3.large"),  # dev before: the platform alone fills 3
        ("m6i.xlarge", 3, 6, (3, 12), 2.0, "max_size 6 × m6i.xlarge"),  # prod before: 12 gateways of 2 CPU
    ],
)
def test_the_pools_the_review_found_short_are_refused(
    instance: str, min_size: int, max_size: int, gateways: tuple[int, int], cpu: float, needs: str
) -> None:
    found = system_pool.problems(instance, min_size, max_size, gateways, cpu, cpu)
    assert found and found[0].startswith(needs) and "needs at least" in found[0], found


@pytest.mark.parametrize("stack", ["dev", "prod"])
def test_the_example_stacks_system_pools_hold_the_platform_at_both_ends(stack: str) -> None:
    config = stack_config(stack)
    nodes, gateway = json.loads(config["serving-fleet:systemNodes"]), json.loads(config["serving-fleet:gateway"])
    cpu = gateway.get("cpu", gateway["workers"])
    assert (
        system_pool.problems(
            nodes["instance_type"],
            nodes["min_size"],
            nodes["max_size"],
            (gateway["min_replicas"], gateway["max_replicas"]),
            cpu,
            gateway.get("memory_gib", 1.0),
        )
        == []
    )


def test_an_undersized_system_pool_stops_the_program_with_the_nodes_it_needs() -> None:
    config = stack_config("prod")
    config["serving-fleet:systemNodes"] = json.dumps(
        {"instance_type": "m6i.xlarge", "min_size": 3, "max_size": 6, "hourly_usd": 0.192}
    )
    with pytest.raises(pulumi.RunError, match=r"serving-fleet:systemNodes: .*max_size 6 × m6i.xlarge cannot hold"):
        build("prod", config)


def test_eks_support_and_its_price_follow_the_calendar() -> None:
    day = date(2026, 12, 7)
    assert eks_support("1.35", day).support == "standard" and eks_support("1.35", day).usd_per_hour == 0.10
    old = eks_support("1.33", day)  # left standard support on 2026-07-29
    assert (old.support, old.until, old.usd_per_hour) == ("extended", date(2027, 7, 29), EKS_EXTENDED_SUPPORT_USD)
    assert eks_support("1.34", date(2026, 12, 2)).support == "standard"  # the last day
    assert eks_support("1.34", date(2026, 12, 3)).support == "extended"
    assert eks_support("1.30", day).support == "ended"
    assert eks_support("1.36", day).support == "unknown" and eks_support("1.36", day).usd_per_hour == 0.10
    assert eks_support(KUBERNETES_VERSION, day).support == "standard"


def test_the_cost_table_prices_the_control_plane_by_its_support() -> None:

    from fleet.catalog.policies.loader import load_policies
    from fleet.planning.planner import plan
    from fleet.planning.stack import placement_inputs, read_stack_file

    policies = load_policies(ROOT / "policies")
    raw = read_stack_file(ROOT / "Pulumi.dev.yaml")
    pools, models = placement_inputs(raw, "dev", policies)
    placed = plan(policies, pools, models)
    day = date(2026, 12, 7)
    for version, price in (("1.35", EKS_CONTROL_PLANE_USD), ("1.33", EKS_EXTENDED_SUPPORT_USD)):
        config = {**raw, "serving-fleet:kubernetesVersion": version}
        cost = stack_cost(placed, build_inputs(config, "Pulumi.dev.yaml"), "Pulumi.dev.yaml", today=day, pools=pools)
        (row,) = [p for p in cost.parts if p.part == "EKS control plane"]
        assert row.usd_per_hour == (price, price) and version in row.count


def test_a_version_past_extended_support_is_refused() -> None:
    config = stack_config("dev")
    config["serving-fleet:kubernetesVersion"] = "1.30"
    with pytest.raises(pulumi.RunError, match=r"kubernetesVersion: got '1.30' — expected a version EKS still supports"):
        build("dev", config)


def test_the_platform_table_asks_what_the_karpenter_release_asks() -> None:
    """The system pool is sized from fleet.planning.system_pool's table: a release that asks
    more than the table says would leave the pool short at peak without any check noticing."""
    import yaml

    from infra.karpenter import CONTROLLER_RESOURCES

    cpu, memory_mib, replicas = system_pool.PLATFORM["karpenter"]
    requests = CONTROLLER_RESOURCES["requests"]
    assert (f"{cpu}m", f"{memory_mib}Mi") == (requests["cpu"], requests["memory"])
    chart = ROOT / "tests" / "fixtures" / "karpenter" / "karpenter-1.14.1" / "values.yaml"
    assert yaml.safe_load(chart.read_text())["replicas"] == replicas  # the chart's default, which values() keeps
