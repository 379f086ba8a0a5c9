"""Placement of large generative models: the KV cache from the architecture, its precedence,
the tensor-parallel degree it leads to, the GPU type, and what reaches the engine's pod."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import yaml
from k8s_schemas import validate

from fleet.catalog.policies.loader import load_policies
from fleet.errors import ConfigError
from fleet.planning.memory import (
    KV_DEFAULT_SHARE,
    RUNTIME_OVERHEAD,
    kv_cache_bytes,
    kv_dtype,
    memory,
    tensor_parallel_ok,
)
from fleet.planning.placement import PlacementError
from fleet.planning.planner import plan
from fleet.planning.stack import GPU_TYPES, NodePool, placement_inputs, pools_from_config, read_stack_file
from fleet.runtime.kubernetes.manifests import config_map_data, engine_env, manifests, placement_from_dict
from tests.test_placement import A10G_4, A10G_SLICED, A100_8, CPU, gib, model, policies, pools

ROOT = Path(__file__).resolve().parents[1]
GiB = 2**30
LLAMA_70B = {"layers": 80, "hidden": 8192, "heads": 64, "kv_heads": 8}
LLAMA_7B = {"layers": 32, "hidden": 4096, "heads": 32, "kv_heads": 32}


def llm(
    params: float,
    arch: dict | None,
    *,
    running: int = 32,
    context: int = 4096,
    dtype: str = "fp16",
    budget: int = 8192,
    **extra,
) -> dict:
    spec = model(params, dtype=dtype, generative=True, cpu=8, mem=64, replicas=(1, 1), **extra)
    spec["generation"] = {"max_running": running, "kv_budget_tokens": budget}
    if arch is not None:
        spec["architecture"] = {**arch, "context_tokens": context}
    return spec


def one(spec: dict):  # noqa: ANN201
    return policies({"m": spec}).models["m"]


# --- the KV formula, by hand ---------------------------------------------------------------


def test_kv_cache_of_a_70b_model_with_gqa_is_40_gib_at_32_sequences_of_4096_tokens() -> None:
    spec = one(llm(70000, LLAMA_70B, running=32, context=4096, dtype="bf16"))
    assert spec.architecture.kv_width == 8192 * 8 // 64 == 1024
    assert kv_cache_bytes(spec) == 32 * 4096 * 80 * 1024 * 2 * 2 == 40 * GiB
    m = memory(spec)
    assert (m.kv_source, m.kv_cache_gib, m.kv_tokens, m.context_tokens) == ("architecture", 40.0, 131072, 4096)
    assert m.estimate_gib == pytest.approx((70e9 * 2 / GiB + 40) * (1 + RUNTIME_OVERHEAD))
    assert "32 sequences × 4096 tokens × 80 layers × 1024 × 2 × 2 bytes bf16" in m.how


def test_kv_cache_of_a_7b_model_without_gqa_uses_the_whole_hidden_width() -> None:
    spec = one(llm(7000, LLAMA_7B, running=8, context=1024))
    assert spec.architecture.kv_width == 4096
    assert kv_cache_bytes(spec) == 8 * 1024 * 32 * 4096 * 2 * 2 == 4 * GiB
    no_heads = one(llm(7000, {"layers": 32, "hidden": 4096}, running=8, context=1024))  # heads unstated: MHA
    assert kv_cache_bytes(no_heads) == 4 * GiB


@pytest.mark.parametrize(
    ("dtype", "stated", "kv", "nbytes"),
    [
        ("fp32", None, "fp32", 4),
        ("bf16", None, "bf16", 2),
        ("int8", None, "fp16", 2),
        ("int4", None, "fp16", 2),
        ("fp16", "fp8", "fp8", 1),
        ("int4", "int8", "int8", 1),
    ],
)
def test_kv_dtype_follows_the_model_but_quantized_weights_keep_a_16_bit_cache(dtype, stated, kv, nbytes) -> None:  # noqa: ANN001
    arch = {"layers": 2, "hidden": 64, "heads": 4, "kv_heads": 2} | ({"kv_dtype": stated} if stated else {})
    spec = one(llm(100, arch, running=4, context=512, dtype=dtype, budget=2048))
    assert kv_dtype(spec) == kv
    assert kv_cache_bytes(spec) == 4 * 512 * 2 * 32 * 2 * nbytes


# --- precedence ----------------------------------------------------------------------------


def test_stated_kv_cache_gib_wins_then_the_architecture_then_the_default_share() -> None:
    p = policies(
        {
            "stated": llm(7000, LLAMA_7B, running=8, context=1024, kv_cache_gib=6.5),
            "arch": llm(7000, LLAMA_7B, running=8, context=1024),
            "share": llm(7000, None),
            "plain": model(7000),
        }
    )
    weights = gib(7000, "fp16")
    got = {name: memory(spec) for name, spec in p.models.items()}
    assert (got["stated"].kv_source, got["stated"].kv_cache_gib, got["stated"].kv_tokens) == ("kv_cache_gib", 6.5, None)
    assert (got["arch"].kv_source, got["arch"].kv_cache_gib) == ("architecture", 4.0)
    assert got["share"].kv_source == "default share" and got["share"].kv_cache_gib == pytest.approx(
        KV_DEFAULT_SHARE * weights
    )
    assert (got["plain"].kv_source, got["plain"].kv_cache_gib) == ("none", 0.0)
    result = plan(p, pools(A10G_4, A100_8))
    placed = {m.model: m for m in result.models}
    assert placed["arch"].kv_source == "architecture" and placed["arch"].kv_tokens == 8 * 1024
    assert placed["stated"].kv_source == "kv_cache_gib" and placed["stated"].context_tokens is None


# --- validation ----------------------------------------------------------------------------


def _load(tmp_path: Path, change) -> str:  # noqa: ANN001
    """The ConfigError of the repo's policies with the llm-70b policy changed by ``change``."""
    data = yaml.safe_load((ROOT / "policies" / "models-gpu.yaml").read_text())
    change(data["models"]["llm-70b"])
    (tmp_path / "models-gpu.yaml").write_text(yaml.safe_dump(data))
    (tmp_path / "fleet.yaml").write_text((ROOT / "policies" / "fleet.yaml").read_text())
    with pytest.raises(ConfigError) as err:
        load_policies(tmp_path)
    return str(err.value).replace(f"{tmp_path}/", "")


PROBLEMS = {
    "kv_heads without heads": (
        lambda s: s["architecture"].pop("heads"),
        "architecture.heads: got None — expected the number of query heads when kv_heads is set (kv_heads 8)",
    ),
    "heads not dividing hidden": (
        lambda s: s["architecture"].update(heads=60),
        "architecture.heads: got 60 — expected a number of heads that divides hidden (8192)",
    ),
    "kv_heads not dividing heads": (
        lambda s: s["architecture"].update(kv_heads=6),
        "architecture.kv_heads: got 6 — expected a number of key/value heads that divides heads (64)",
    ),
    "no layers": (
        lambda s: s["architecture"].update(layers=0),
        "architecture.layers: got 0 — expected an integer >= 1",
    ),
    "int4 KV": (
        lambda s: s["architecture"].update(kv_dtype="int4"),
        "architecture.kv_dtype: got 'int4' — expected one of",
    ),
    "context below max_tokens": (
        lambda s: s["architecture"].update(context_tokens=200),
        "architecture.context_tokens: got 200 — expected more than generation.max_tokens (256)",
    ),
    "budget above the reservation": (
        lambda s: s["generation"].update(kv_budget_tokens=200000),
        "generation.kv_budget_tokens: got 200000 — expected at most generation.max_running × "
        "architecture.context_tokens = 8 × 16384 = 131072",
    ),
    "not generative": (
        lambda s: (s.update(generative=False), s.pop("generation")),
        "generative: got False — expected true when architecture: is set",
    ),
}


@pytest.mark.parametrize("case", PROBLEMS)
def test_architecture_problems_name_the_key_the_value_and_what_was_expected(tmp_path, case) -> None:  # noqa: ANN001
    change, message = PROBLEMS[case]
    got = _load(tmp_path, change)
    assert f"models-gpu.yaml: models.llm-70b.{message}" in got, got


# --- the tensor-parallel degree ------------------------------------------------------------


def test_the_degree_is_the_smallest_power_of_two_whose_gpus_hold_weights_and_kv() -> None:
    # 30B fp16 = 55.9 GiB weights; KV 4 × 4096 × 60 × 1024 × 2 × 2 = 3.75 GiB; × 1.2 = 71.6 GiB:
    # more than 1 A100-40GB (36 usable), within 2 (72)
    arch = {"layers": 60, "hidden": 8192, "heads": 64, "kv_heads": 8}
    spec = llm(30000, arch, running=4, context=4096)
    need = (gib(30000, "fp16") + 3.75) * (1 + RUNTIME_OVERHEAD)
    assert 36 < need <= 72
    placed = plan(policies({"m": spec}), pools(A100_8)).placement("m")
    assert (placed.tensor_parallel, placed.gpus, placed.gpu_type) == (2, 2, "A100-40GB")
    assert placed.gpu_memory_gib == pytest.approx(need, abs=0.01)
    # a longer context needs more: 4 × 16384 tokens = 15 GiB of KV, (55.9 + 15) × 1.2 = 85 GiB → 4 GPUs
    longer = plan(policies({"m": llm(30000, arch, running=4, context=16384, budget=8192)}), pools(A100_8)).placement(
        "m"
    )
    assert (longer.tensor_parallel, longer.kv_cache_gib) == (4, 15.0)


def test_the_70b_model_is_sharded_over_the_eight_a100s_of_one_node_not_four_a10gs() -> None:
    p = policies({"llm-70b": llm(70000, LLAMA_70B, running=32, context=4096, dtype="bf16")})
    result = plan(p, pools(A10G_4, A100_8))
    llm70 = result.placement("llm-70b")
    assert (llm70.pool, llm70.tensor_parallel, llm70.gpu_type) == ("a100-8", 8, "A100-40GB")
    assert (llm70.weights_gib, llm70.kv_cache_gib) == (pytest.approx(130.385, abs=1e-3), 40.0)
    assert llm70.gpu_memory_gib == pytest.approx((70e9 * 2 / GiB + 40) * 1.2, abs=0.01)  # 204.46 > 4 × 36


def test_the_degree_divides_the_heads_or_the_model_does_not_fit() -> None:
    # 6 heads: tensor parallel 2 divides them, 4 does not; ~50 GiB needs 4 A10Gs or 2 A100s
    arch = {"layers": 24, "hidden": 768, "heads": 6, "kv_heads": 6}
    spec = one(llm(22000, arch, running=1, context=512, budget=512))
    assert [tp for tp in (1, 2, 4, 8) if tensor_parallel_ok(spec, tp)] == [1, 2]
    with pytest.raises(
        PlacementError, match=r"tensor parallelism stays within one node and divides architecture.heads \(6\)"
    ):
        plan(policies({"m": llm(22000, arch, running=1, context=512, budget=512)}), pools(A10G_4))
    placed = plan(
        policies({"m": llm(22000, arch, running=1, context=512, budget=512)}), pools(A10G_4, A100_8)
    ).placement("m")
    assert (placed.pool, placed.tensor_parallel) == ("a100-8", 2)
    gqa = one(llm(100, {"layers": 2, "hidden": 64, "heads": 8, "kv_heads": 2}, running=1, context=512, budget=512))
    assert [tp for tp in (1, 2, 4, 8) if tensor_parallel_ok(gqa, tp)] == [1, 2, 4, 8]  # 4, 8: kv heads replicate


def test_kv_heads_replicate_when_the_degree_exceeds_them() -> None:
    # 2 KV heads over 4 GPUs: each KV head is held twice, so the cache doubles
    arch = {"layers": 40, "hidden": 5120, "heads": 40, "kv_heads": 2}
    spec = one(llm(30000, arch, running=16, context=8192, budget=8192))
    assert kv_cache_bytes(spec, 4) == 2 * kv_cache_bytes(spec, 1) and kv_cache_bytes(spec, 2) == kv_cache_bytes(spec, 1)
    assert "× 2 copies of each KV head at tensor parallel 4" in memory(spec, 4).how
    base = kv_cache_bytes(spec) / GiB  # 16 × 8192 × 40 × 256 × 2 × 2 = 5 GiB
    assert base == 5.0
    # (55.9 + 5) × 1.2 = 73.1 GiB is more than 2 × 36; at 4 GPUs the cache is 10 GiB: 79.1 GiB
    placed = plan(policies({"m": llm(30000, arch, running=16, context=8192, budget=8192)}), pools(A100_8)).placement(
        "m"
    )
    assert (placed.tensor_parallel, placed.kv_cache_gib) == (4, 10.0)
    assert placed.gpu_memory_gib == pytest.approx((gib(30000, "fp16") + 10) * 1.2, abs=0.01)


# --- GPU type ------------------------------------------------------------------------------


def test_a_pool_s_gpu_type_comes_from_its_instance_family_or_the_stack_file() -> None:
    a10g, a100, stated, cpu = pools(A10G_4, A100_8, {**A10G_SLICED, "gpu_type": "A10G-24GB"}, CPU)
    assert (a10g.gpu_type, a100.gpu_type, stated.gpu_type, cpu.gpu_type) == ("A10G", "A100-40GB", "A10G-24GB", None)
    assert GPU_TYPES["p5"] == "H100-80GB"
    with pytest.raises(ConfigError) as err:
        pools_from_config([{**CPU, "gpu_type": "A10G"}, {**A100_8, "instance_type": "x9.large"}], "Pulumi.t.yaml")
    lines = str(err.value).splitlines()
    assert "Pulumi.t.yaml: nodePools[0].gpu_type: got 'A10G' — expected no gpu_type for a pool without GPUs" in lines
    assert lines[1].startswith(
        "Pulumi.t.yaml: nodePools[1].gpu_type: got None — expected the GPU model of x9.large, e.g. A10G"
    )


def test_every_placed_gpu_replica_carries_its_pool_s_gpu_type() -> None:
    p = policies({"small": model(100), "mid": model(4000), "cpu": model(1, gpu=0)})
    result = plan(p, pools(A10G_SLICED, {**A10G_4, "gpu_type": "A10G-stated"}, CPU))
    got = {m.model: (m.pool, m.gpu_type, m.tensor_parallel) for m in result.models}
    assert got == {"small": ("a10g-1", "A10G", 1), "mid": ("a10g-4", "A10G-stated", 1), "cpu": ("cpu", None, 0)}


# --- small generative models on CPU --------------------------------------------------------


def test_small_generative_models_place_on_cpu_and_large_ones_on_cpu_are_refused() -> None:
    tiny = {
        **llm(4, {"layers": 4, "hidden": 256, "heads": 8, "kv_heads": 4}, running=32, context=512, budget=4096),
        "resources": {"gpu": 0, "cpu": 2, "memory_gib": 2},
    }
    placed = plan(policies({"tiny": tiny}), pools(A10G_SLICED, CPU)).placement("tiny")
    assert (placed.pool, placed.gpus, placed.tensor_parallel, placed.gpu_type, placed.gpu_memory_from) == (
        "cpu",
        0,
        0,
        None,
        "cpu",
    )
    assert placed.kv_cache_gib == 32 * 512 * 4 * 128 * 2 * 2 / GiB  # fp16 model: a 16-bit cache, in RAM
    big = {**llm(7000, LLAMA_7B, running=8, context=1024), "resources": {"gpu": 0, "cpu": 2, "memory_gib": 8}}
    with pytest.raises(
        PlacementError,
        match=r"model big runs on CPU \(resources.gpu 0\) and needs 20\.4 GiB of RAM .*"
        r"expected resources.memory_gib >= 20\.5, got 8, or resources.gpu >= 1",
    ):
        plan(policies({"big": big}), pools(CPU))


def test_demo_lm_of_the_repo_places_on_cpu_in_prod() -> None:
    loaded = load_policies(ROOT / "policies")
    found, models = placement_inputs(read_stack_file(ROOT / "Pulumi.prod.yaml"), "Pulumi.prod.yaml", loaded)
    result = plan(loaded, found, models)
    lm = result.placement("demo-lm")
    assert loaded.models["demo-lm"].generative and loaded.models["demo-lm"].resources.gpu == 0
    assert (lm.node_group, lm.gpus, lm.tensor_parallel, lm.gpu_type, lm.kv_source) == (
        "cpu",
        0,
        0,
        None,
        "default share",
    )
    big = result.placement("llm-70b")
    assert (big.node_group, big.tensor_parallel, big.gpu_type, big.kv_source) == (
        "a100-8",
        8,
        "A100-40GB",
        "architecture",
    )
    assert (big.kv_cache_gib, big.kv_tokens, big.context_tokens) == (40.0, 8 * 16384, 16384)
    small = result.placement("llm-7b")
    assert (small.tensor_parallel, small.gpu_type, small.kv_cache_gib, small.gpu_memory_gib) == (1, "A10G", 4.0, 20.45)


# --- what reaches the engine ---------------------------------------------------------------


@pytest.fixture(scope="module")
def prod():  # noqa: ANN201
    loaded = load_policies(ROOT / "policies")
    found, models = placement_inputs(read_stack_file(ROOT / "Pulumi.prod.yaml"), "Pulumi.prod.yaml", loaded)
    return plan(loaded, found, models)


def env_of(deployment: dict) -> dict[str, str]:
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return {e["name"]: e["value"] for e in container["env"]}


def test_the_engine_is_told_its_degree_gpu_type_and_kv_budget(prod) -> None:  # noqa: ANN001
    image = "123456789012.dkr.ecr.us-east-1.amazonaws.com/llm@sha256:" + "0" * 64
    objs = manifests("llm-70b", "1.0.0", image, prod.placement("llm-70b"), floor=1, prometheus_url="http://prom:9090")
    for obj in objs:
        validate(obj)  # kubernetes-validate, strict, or the CRD's schema
    deployment = next(o for o in objs if o["kind"] == "Deployment")
    assert env_of(deployment) == {
        "FLEET_MODEL": "llm-70b",
        "FLEET_VERSION": "1.0.0",
        "FLEET_TENSOR_PARALLEL": "8",
        "FLEET_GPU_TYPE": "A100-40GB",
        "FLEET_GPU_MEMORY_UTILIZATION": "0.639",
        "FLEET_KV_CACHE_GIB": "40",
        "FLEET_KV_CACHE_TOKENS": "131072",
        "FLEET_CONTEXT_TOKENS": "16384",
        # the weights fetch (fleet.runtime.kubernetes.node_cache): 16 GETs per GPU, at most 64
        "FLEET_CACHE_DIR": "/var/cache/fleet-weights",
        # its weights twice (stable and canary) and 10 %: the node cache's budget
        "FLEET_CACHE_MAX_BYTES": str(math.ceil(prod.placement("llm-70b").weights_gib * 2 * 1.1 * 2**30)),
        "FLEET_FETCH_CONCURRENCY": "64",
    }
    resources = deployment["spec"]["template"]["spec"]["containers"][0]["resources"]
    assert resources["limits"]["nvidia.com/gpu"] == "8"  # the degree is also what the pod asks for
    small = env_of(manifests("llm-7b", "1.0.0", image, prod.placement("llm-7b"), floor=1, prometheus_url="http://p")[0])
    assert (small["FLEET_TENSOR_PARALLEL"], small["FLEET_GPU_TYPE"], small["FLEET_KV_CACHE_GIB"]) == ("1", "A10G", "4")
    shared = env_of(
        manifests("embed-small", "1.0.0", image, prod.placement("embed-small"), floor=1, prometheus_url="http://p")[0]
    )
    assert shared["FLEET_GPU_TYPE"] == "A10G" and "FLEET_KV_CACHE_GIB" not in shared  # not generative
    assert shared["FLEET_GPU_MEMORY_UTILIZATION"] == "0.0834"  # 2 GiB of a 24 GiB A10G that four replicas share
    lm = env_of(manifests("demo-lm", "1.0.0", image, prod.placement("demo-lm"), floor=1, prometheus_url="http://p")[0])
    assert lm["FLEET_TENSOR_PARALLEL"] == "1" and "FLEET_GPU_TYPE" not in lm and "FLEET_CONTEXT_TOKENS" not in lm
    assert float(lm["FLEET_KV_CACHE_GIB"]) == pytest.approx(prod.placement("demo-lm").kv_cache_gib, abs=1e-3)


def test_the_gpu_memory_share_the_engine_may_fill_is_what_placement_reserved(prod) -> None:  # noqa: ANN001
    pools_by_name = {
        p.name: p
        for p in placement_inputs(read_stack_file(ROOT / "Pulumi.prod.yaml"), "p", load_policies(ROOT / "policies"))[0]
    }
    groups = {g.name: g for g in prod.node_groups}
    for m in prod.models:
        if not m.gpus:
            assert m.gpu_memory_utilization is None
            continue
        pool = pools_by_name[m.pool]
        assert (
            m.gpu_memory_utilization * m.tensor_parallel * pool.gpu_memory_gib >= m.gpu_memory_gib - 0.005
        )  # (rounded)
        assert m.gpu_memory_utilization <= 0.9 / groups[m.node_group].gpu_slices + 1e-4  # GPU_HEADROOM, and the slice
    assert prod.placement("llm-70b").gpu_memory_utilization == 0.639  # 204.46 GiB over 8 × 40 GiB


def test_the_placement_the_runtime_reads_back_keeps_the_new_fields_and_old_plans_still_load(prod) -> None:  # noqa: ANN001
    data = config_map_data(prod, {"llm": "repo"}, "http://prom", {"llm-70b": 60000})
    back = {m["model"]: placement_from_dict(m) for m in json.loads(data["placement.json"])["models"]}
    assert back["llm-70b"] == prod.placement("llm-70b")
    old = {
        k: v
        for k, v in json.loads(data["placement.json"])["models"][0].items()
        if k
        not in (
            "gpu_type",
            "weights_gib",
            "kv_cache_gib",
            "kv_source",
            "kv_tokens",
            "context_tokens",
            "gpu_memory_from",
        )
    }
    legacy = placement_from_dict(old)  # a ConfigMap written before these fields: the engine gets the degree only
    assert [e["name"] for e in engine_env(legacy)][:1] == ["FLEET_TENSOR_PARALLEL"]


def test_a_node_pool_model_round_trips_with_its_gpu_type() -> None:
    (pool,) = pools(A100_8)
    assert NodePool.model_validate(pool.model_dump()) == pool and pool.model_dump()["gpu_type"] == "A100-40GB"
