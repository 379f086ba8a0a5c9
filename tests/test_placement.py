"""fleet.planning.placement: models onto node pools — shared GPUs, tensor parallelism, isolation, sizes."""

from __future__ import annotations

import dataclasses

import pytest

from fleet.catalog.policies.loader import Policies
from fleet.errors import ConfigError
from fleet.planning.memory import BYTES_PER_PARAM, KV_DEFAULT_SHARE, RUNTIME_OVERHEAD, replica_gpu_memory_gib
from fleet.planning.placement import DEDICATED_KEY, GPU_RESOURCE, MODEL_NODE_TOLERATION, POOL_LABEL, PlacementError
from fleet.planning.planner import plan
from fleet.planning.stack import NodePool, models_from_config, placement_inputs, pools_from_config, read_stack_file

CPU = {"name": "cpu", "instance_type": "m6i.xlarge", "vcpu": 4, "memory_gib": 16, "hourly_usd": 0.192}
A10G_SLICED = {
    "name": "a10g-1",
    "instance_type": "g5.xlarge",
    "gpus": 1,
    "gpu_memory_gib": 24,
    "vcpu": 4,
    "memory_gib": 16,
    "hourly_usd": 1.006,
    "gpu_slices": 4,
}
A10G_4 = {
    "name": "a10g-4",
    "instance_type": "g5.12xlarge",
    "gpus": 4,
    "gpu_memory_gib": 24,
    "vcpu": 48,
    "memory_gib": 192,
    "hourly_usd": 5.672,
}
A100_8 = {
    "name": "a100-8",
    "instance_type": "p4d.24xlarge",
    "gpus": 8,
    "gpu_memory_gib": 40,
    "vcpu": 96,
    "memory_gib": 1152,
    "hourly_usd": 21.96,
}


def pools(*raw: dict) -> tuple[NodePool, ...]:
    return pools_from_config(list(raw), "test")


def model(
    params: float,
    *,
    gpu: int = 1,
    gpu_mem: float = 0.5,
    dtype: str = "fp16",
    generative: bool = False,
    replicas: tuple[int, int] = (1, 2),
    cpu: float = 1,
    mem: float = 2,
    **extra,
) -> dict:
    resources = {"gpu": gpu, "gpu_memory_gib": gpu_mem if gpu else 0.0, "cpu": cpu, "memory_gib": mem}
    return {
        "family": "f",
        "size_class": "small",
        "params_millions": params,
        "dtype": dtype,
        "generative": generative,
        "resources": resources,
        "slo": {"p99_ms": 100, "error_rate": 0.01},
        "autoscaling": {
            "min_replicas": replicas[0],
            "max_replicas": replicas[1],
            "target_qps_per_replica": 10,
            "target_p99_ms": 50,
        },
        **extra,
    }


def policies(models: dict, tenants: dict | None = None) -> Policies:
    rollout = {
        "default": {
            "steps": [100],
            "analysis_window_s": 1,
            "min_samples": 1,
            "hold_deadline_s": 1,
            "gates": {"max_error_rate_increase": 0, "confidence": 0.9, "max_p99_ratio": 1, "max_prediction_psi": 1},
        }
    }
    monitoring = {"default": {"schedule": "* * * * *", "window_hours": 1, "min_rows": 1}}
    return Policies.model_validate(
        {"models": models, "tenants": tenants or {}, "rollout": rollout, "monitoring": monitoring}
    )


def gib(params_millions: float, dtype: str) -> float:
    return params_millions * 1e6 * BYTES_PER_PARAM[dtype] / 2**30


# --- memory ---------------------------------------------------------------------------------


def test_memory_is_weights_plus_kv_cache_plus_overhead() -> None:
    p = policies(
        {
            "plain": model(1000, dtype="int8"),
            "chat": model(1000, generative=True),
            "chat-kv": model(1000, generative=True, kv_cache_gib=5.0),
            "declared": model(10, gpu=2, gpu_mem=3.0),
        }
    )
    assert replica_gpu_memory_gib(p.models["plain"]) == pytest.approx(gib(1000, "int8") * (1 + RUNTIME_OVERHEAD))
    chat = gib(1000, "fp16") * (1 + KV_DEFAULT_SHARE) * (1 + RUNTIME_OVERHEAD)
    assert replica_gpu_memory_gib(p.models["chat"]) == pytest.approx(chat)
    assert replica_gpu_memory_gib(p.models["chat-kv"]) == pytest.approx(
        (gib(1000, "fp16") + 5) * (1 + RUNTIME_OVERHEAD)
    )
    # the policy's own figure (2 GPUs × 3 GiB) is larger than the estimate for 10M params, so it wins
    assert replica_gpu_memory_gib(p.models["declared"]) == 6.0


# --- small models ---------------------------------------------------------------------------


def test_cpu_model_goes_to_a_cpu_pool_and_gpu_nodes_stay_free() -> None:
    result = plan(policies({"tiny": model(0.01, gpu=0, replicas=(1, 2))}), pools(A10G_SLICED, CPU))
    tiny = result.placement("tiny")
    assert (tiny.node_group, tiny.gpus, tiny.tensor_parallel, tiny.tolerations) == (
        "cpu",
        0,
        0,
        [MODEL_NODE_TOLERATION],
    )
    assert tiny.node_selector == {POOL_LABEL: "cpu"}
    (group,) = result.node_groups
    assert (group.name, group.taints, group.min_size, group.max_size) == (
        "cpu",
        (),
        1,
        1,
    )  # 2 replicas of 1 vCPU fit one node
    assert result.unused_pools == ("a10g-1",) and result.max_gpus == 0


def test_small_models_share_time_sliced_gpus() -> None:
    # 4 slices of 21.6 usable GiB = 5.4 GiB each; per node: 4 slices, 3.6 vCPU, 14.4 GiB RAM
    p = policies({"a": model(100, replicas=(1, 3)), "b": model(100, replicas=(1, 2))})
    result = plan(p, pools(A10G_SLICED, A10G_4))
    for name in ("a", "b"):
        placed = result.placement(name)
        assert (placed.node_group, placed.gpus, placed.shared_gpu) == ("a10g-1", 1, True)
        assert placed.tolerations == [
            MODEL_NODE_TOLERATION,
            {"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"},
        ]
    (group,) = result.node_groups
    assert group.models == ("a", "b") and group.gpu_slices == 4
    # 5 replicas at max of 1 vCPU each: 3 fit a node (3.6 vCPU), so 2 nodes; 2 replicas at min fit 1
    assert (group.min_size, group.max_size) == (1, 2)
    assert group.taints == ((GPU_RESOURCE, "present", "NoSchedule"),)
    assert group.labels["nvidia.com/device-plugin.config"] == "slices-4"


def test_a_replica_too_big_for_a_slice_gets_whole_gpus() -> None:
    result = plan(policies({"mid": model(4000)}), pools(A10G_SLICED, A10G_4))  # ~9 GiB > 5.4 GiB slice
    mid = result.placement("mid")
    assert (mid.node_group, mid.gpus, mid.shared_gpu) == ("a10g-4", 1, False)


def test_cheapest_replica_wins_and_config_order_breaks_ties() -> None:
    small = policies({"m": model(100)})
    assert plan(small, pools(A10G_4, A10G_SLICED)).placement("m").pool == "a10g-1"  # 1.006/3 < 5.672/4
    twin = {**A10G_4, "name": "twin"}
    assert plan(small, pools(A10G_4, twin)).placement("m").pool == "a10g-4"
    assert plan(small, pools(twin, A10G_4)).placement("m").pool == "twin"


# --- large models ---------------------------------------------------------------------------


def test_a_model_larger_than_one_gpu_gets_the_smallest_tensor_parallel_degree() -> None:
    p = policies(
        {"llm-70b": model(70000, dtype="bf16", generative=True, kv_cache_gib=40, cpu=16, mem=200, replicas=(1, 2))}
    )
    result = plan(p, pools(A10G_4, A100_8))
    llm = result.placement("llm-70b")
    need = (gib(70000, "bf16") + 40) * (1 + RUNTIME_OVERHEAD)  # ~204 GiB: 4 × 36 usable is too little
    assert llm.gpu_memory_gib == pytest.approx(need, abs=0.01)
    assert (llm.node_group, llm.tensor_parallel, llm.gpus) == ("a100-8", 8, 8)
    (group,) = result.node_groups
    assert (group.min_size, group.max_size, group.max_gpus) == (1, 2, 16)  # one replica fills a node
    assert result.usd_per_hour == pytest.approx((21.96, 43.92))


def test_tensor_parallel_degree_is_a_power_of_two_at_least_the_requested_gpus() -> None:
    p = policies({"m": model(100, gpu=3, gpu_mem=1.0)})  # small, but the policy asks for 3 GPUs
    assert plan(p, pools(A10G_4)).placement("m").tensor_parallel == 4
    with pytest.raises(PlacementError):  # 3 GPUs never fit the 1-GPU pool, sliced or not
        plan(p, pools(A10G_SLICED))


def test_a_model_that_fits_no_pool_names_itself_its_need_and_the_largest_pool() -> None:
    p = policies({"llm-405b": model(405000, generative=True, replicas=(1, 1))})
    with pytest.raises(PlacementError) as err:
        plan(p, pools(CPU, A10G_4, A100_8, A10G_SLICED))
    message = str(err.value)
    assert message.startswith("model llm-405b needs ")
    assert "GiB of GPU memory per replica" in message and "405000M params fp16" in message
    assert "the largest is a100-8 (p4d.24xlarge: 8 × 40 GiB, 288.0 GiB usable" in message


def test_host_cpu_counts_too() -> None:
    p = policies({"hungry": model(100, cpu=64)})
    with pytest.raises(PlacementError, match=r"hungry needs .*64 vCPU.*largest is a10g-4"):
        plan(p, pools(A10G_SLICED, A10G_4))


def test_cpu_model_without_a_cpu_pool_says_what_to_add() -> None:
    with pytest.raises(PlacementError, match="tiny runs on CPU.*no node pool is CPU-only; add one with gpus: 0"):
        plan(policies({"tiny": model(1, gpu=0)}), pools(A10G_4))


# --- isolation ------------------------------------------------------------------------------


def test_tenant_isolation_gives_the_model_a_dedicated_tainted_node_group() -> None:
    tenants = {
        "initech": {"entitlements": {"private": ["*"]}, "quota": {"rps": 1, "burst": 1}, "isolation": True},
        "acme": {"entitlements": {"private": ["*"], "public": ["*"]}, "quota": {"rps": 1, "burst": 1}},
    }
    p = policies({"private": model(100), "public": model(100)}, tenants)
    result = plan(p, pools(A10G_SLICED))
    private, public = result.placement("private"), result.placement("public")
    assert private.isolated_for == ("tenant initech",) and public.isolated_for == ()
    assert private.node_group == "a10g-1-private" and public.node_group == "a10g-1"
    assert (private.shared_gpu, public.shared_gpu) == (False, True)  # isolation never time-slices
    assert {
        "key": DEDICATED_KEY,
        "operator": "Equal",
        "value": "private",
        "effect": "NoSchedule",
    } in private.tolerations
    groups = {g.name: g for g in result.node_groups}
    dedicated = groups["a10g-1-private"]
    assert dedicated.dedicated_to == "private" and dedicated.gpu_slices == 1
    assert (DEDICATED_KEY, "private", "NoSchedule") in dedicated.taints
    assert dedicated.labels[DEDICATED_KEY] == "private"
    assert groups["a10g-1"].models == ("public",)


def test_model_policy_isolation_counts_too() -> None:
    result = plan(policies({"solo": model(100, isolation=True)}), pools(A10G_SLICED))
    assert result.placement("solo").isolated_for == ("model policy",)


# --- replica bounds and node-group sizes ----------------------------------------------------


def test_peak_qps_beyond_max_replicas_is_refused() -> None:
    p = policies({"busy": model(100, replicas=(1, 2), peak_qps=35.0)})  # 35 / 10 per replica = 4 replicas
    with pytest.raises(
        PlacementError, match=r"busy: peak_qps 35 .* needs 4 replicas; expected autoscaling.max_replicas >= 4, got 2"
    ):
        plan(p, pools(A10G_SLICED))


def test_scale_to_zero_keeps_min_size_zero_but_max_size_at_least_one() -> None:
    result = plan(policies({"idle": model(100, replicas=(0, 1))}), pools(A10G_SLICED))
    (group,) = result.node_groups
    assert (group.min_size, group.max_size) == (0, 1) and result.usd_per_hour == (0.0, 1.006)


def test_pool_min_nodes_raise_the_floor() -> None:
    result = plan(policies({"m": model(100, replicas=(0, 1))}), pools({**A10G_SLICED, "min_nodes": 2}))
    assert (result.node_groups[0].min_size, result.node_groups[0].max_size) == (2, 2)


def test_a_pool_over_its_max_nodes_is_refused_naming_it() -> None:
    p = policies({"big": model(4000, replicas=(1, 9))})  # one whole GPU each: 9 nodes of g5.xlarge
    with pytest.raises(PlacementError, match="node pool a10g-1 needs 9 nodes .*big.*max_nodes 8"):
        plan(p, pools({**A10G_SLICED, "gpu_slices": 1, "max_nodes": 8}))


def test_only_the_listed_models_are_planned() -> None:
    p = policies({"a": model(100), "b": model(100)})
    assert [m.model for m in plan(p, pools(A10G_SLICED), ["b"]).models] == ["b"]
    with pytest.raises(Exception, match="unknown model 'c'"):
        plan(p, pools(A10G_SLICED), ["c"])


def test_plan_is_frozen_and_serialises() -> None:
    result = plan(policies({"m": model(100)}), pools(A10G_SLICED))
    with pytest.raises(dataclasses.FrozenInstanceError):
        result.models[0].gpus = 2  # type: ignore[misc]
    data = result.to_dict()
    assert data["models"][0]["node_selector"] == {POOL_LABEL: "a10g-1"}
    assert data["node_groups"][0]["max_gpus"] == 1 and data["max_gpus"] == 1


# --- pool config ----------------------------------------------------------------------------


def test_pool_config_problems_name_the_key_the_value_and_what_was_expected() -> None:
    bad = [
        {**A10G_4, "gpu_memory_gib": 0},
        {**CPU, "gpu_slices": 2},
        {**CPU, "name": "cpu", "vcpu": "four"},
        {**CPU, "colour": "red"},
    ]
    with pytest.raises(ConfigError) as err:
        pools_from_config(bad, "Pulumi.dev.yaml")
    lines = str(err.value).splitlines()
    assert "Pulumi.dev.yaml: nodePools[0].gpu_memory_gib: got 0.0 — expected a number > 0 when gpus > 0" in lines
    assert "Pulumi.dev.yaml: nodePools[1].gpu_slices: got 2 — expected 1 for a pool without GPUs" in lines
    assert "Pulumi.dev.yaml: nodePools[2].vcpu: got 'four' — expected an integer > 0" in lines
    assert any(line.startswith("Pulumi.dev.yaml: nodePools[3]: unknown key 'colour'") for line in lines)


def test_pool_names_are_unique_and_the_list_is_not_empty() -> None:
    with pytest.raises(ConfigError, match="pool name 'cpu' appears twice"):
        pools_from_config([CPU, CPU], "s")
    with pytest.raises(ConfigError, match="s: nodePools: got \\[\\] — expected a non-empty list"):
        pools_from_config([], "s")


def test_the_stack_models_list_names_only_models_of_the_policies() -> None:
    p = policies({"a": model(10), "b": model(10)})
    assert models_from_config(None, "s", p) is None  # every model
    assert models_from_config(["b"], "s", p) == ("b",)
    with pytest.raises(ConfigError, match=r"s: models: got unknown model 'c' — expected a model name \(a, b\)"):
        models_from_config(["a", "c"], "s", p)
    with pytest.raises(ConfigError, match=r"s: models: got 'a' — expected a list of model names"):
        models_from_config("a", "s", p)


def test_a_stack_file_gives_the_planner_its_pools_and_models(tmp_path) -> None:  # noqa: ANN001

    stack = tmp_path / "Pulumi.t.yaml"
    stack.write_text(
        "config:\n  aws:region: us-east-1\n  serving-fleet:models: [a]\n"
        "  serving-fleet:nodePools:\n    - {name: cpu, instance_type: m6i.xlarge, vcpu: 4, memory_gib: 16, hourly_usd: 0.2}\n"
    )
    p = policies({"a": model(10, gpu=0), "b": model(10)})
    found, models = placement_inputs(read_stack_file(stack), str(stack), p)
    assert [pool.name for pool in found] == ["cpu"] and models == ("a",)
    assert plan(p, found, models).placement("a").node_group == "cpu"
    stack.write_text("config: [1]\n")
    with pytest.raises(ConfigError, match=r"Pulumi.t.yaml: config: got \[1\] — expected a mapping of config keys"):
        read_stack_file(stack)
    stack.write_text("config:\n  serving-fleet:nodePools: {}\n")
    with pytest.raises(
        ConfigError, match=r"Pulumi.t.yaml: serving-fleet: nodePools: got \{\} — expected a non-empty list"
    ):
        placement_inputs(read_stack_file(stack), str(stack), p)


# --- fleet plan -----------------------------------------------------------------------------


def _fleet(*args: str):  # noqa: ANN202
    from typer.testing import CliRunner

    from fleet.cli import app

    return CliRunner().invoke(app, list(args), catch_exceptions=False)


def test_fleet_plan_json_is_the_plan_of_the_prod_stack() -> None:
    import json
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    out = _fleet("plan", "--stack", str(root / "Pulumi.prod.yaml"), "--policies", str(root / "policies"), "--json")
    assert out.exit_code == 0, out.output
    data = json.loads(out.output)
    by_model = {m["model"]: m for m in data["models"]}
    assert by_model["llm-70b"]["tensor_parallel"] == 8 and by_model["llm-70b"]["node_group"] == "a100-8"
    assert by_model["embed-small"]["shared_gpu"] is True
    assert by_model["llm-7b"]["isolated_for"] == ["tenant initech"]
    assert {g["name"] for g in data["node_groups"]} == {"cpu", "a10g-1", "a10g-1-llm-7b", "a100-8"}


def test_fleet_plan_table_and_a_missing_stack(tmp_path) -> None:  # noqa: ANN001
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    out = _fleet("plan", "-s", str(root / "Pulumi.dev.yaml"), "--policies", str(root / "policies"))
    assert out.exit_code == 0, out.output
    # Karpenter's limits: cpu 1-3 × 0.096, a10g-1 1-2 × 1.006 (each with one canary's surge)
    assert "model nodes: at most 2 GPUs, 1.10-2.30 USD/hour" in out.output
    with pytest.raises(ConfigError, match="Pulumi.nope.yaml: not found"):
        _fleet("plan", "-s", "nope")
