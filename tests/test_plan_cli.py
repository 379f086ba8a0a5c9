"""``fleet plan`` as a user reads it at 80 columns, for every stack file of the repo: whole
names, the whole stack's cost part by part with each price's source, the README's totals and
the guardrails' GPU ceiling; and the demo example's metadata file, which the README registers."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from fleet.errors import ConfigError
from fleet.planning.costs import ALB_USD, EKS_CONTROL_PLANE_USD, NAT_GATEWAY_USD, PUBLIC_IPV4_USD, VPC_ENDPOINT_USD
from fleet.planning.stack import RDS_POSTGRES_USD, VALKEY_NODE_USD, build_inputs, gpu_ceiling, guardrail_config_file
from tests.quiet import assert_quiet

ROOT = Path(__file__).resolve().parents[1]
FLEET = str(Path(sys.executable).with_name("fleet"))
STACKS = sorted(p.name.split(".")[1] for p in ROOT.glob("Pulumi.*.yaml"))
EXAMPLE = ROOT / "examples" / "demo-classifier"
WIDTH = 80
USD = r"\d+\.\d{4}"
COST_ROW = re.compile(rf"^(?P<part>.*?)\s+(?P<min>{USD})\s+(?P<max>{USD})\s+(?P<source>\S.*?)\s*$")


def fleet_plan(*args: str, ok: bool = True) -> subprocess.CompletedProcess[str]:
    """The real command, from the project root as the README runs it, on an 80-column screen."""
    # PYTHONPATH: this checkout's fleet, whatever copy the script's environment has installed
    env = {
        **os.environ,
        "COLUMNS": str(WIDTH),
        "FLEET_STORE": "file:///nonexistent-not-needed",
        "PYTHONPATH": str(ROOT),
    }
    env.pop("FLEET_POLICIES", None)
    proc = subprocess.run([FLEET, "plan", *args], capture_output=True, text=True, env=env, cwd=ROOT, timeout=60)
    assert_quiet(proc.stdout + proc.stderr, f"fleet plan {' '.join(args)}")
    if ok:
        assert proc.returncode == 0, proc.stderr
    return proc


def plan_json(stack: str) -> dict:
    return json.loads(fleet_plan("-s", stack, "--json").stdout)


def whole(name: str) -> re.Pattern[str]:
    """``name`` as a token of its own: not a piece of a longer name, not cut."""
    return re.compile(rf"(?<![\w.-]){re.escape(name)}(?![\w.-])")


def readme_totals() -> dict[str, tuple[float, float]]:
    """Stack → (min, max) USD/hour from the README's cost table."""
    rows = re.findall(r"^\| (\w+) \|.*\| ([\d.]+) → ([\d.]+) \|", (ROOT / "README.md").read_text(), re.M)
    return {stack: (float(low), float(high)) for stack, low, high in rows}


def test_the_repo_has_stack_files() -> None:
    assert {"dev", "prod"} <= set(STACKS)


@pytest.mark.parametrize("stack", STACKS)
def test_plan_fits_80_columns_and_keeps_every_name_whole(stack: str) -> None:
    data = plan_json(stack)
    lines = fleet_plan("-s", stack).stdout.splitlines()
    too_wide = [line for line in lines if len(line) > WIDTH]
    assert not too_wide, f"lines wider than {WIDTH}: {too_wide}"
    models = [m["model"] for m in data["models"]]
    groups = [g["name"] for g in data["node_groups"]]
    # a model is in the placement and taint tables, a node group (a NodePool) in those, the
    # NodePool table and the cost table
    for names, tables in ((models, 2), (groups, 4)):
        for name in names:
            found = sum(len(whole(name).findall(line)) for line in lines)
            assert found >= tables, f"{name} is whole on {found} lines, expected {tables}: {lines}"
    fragments = [
        (token, line)
        for line in lines
        for token in re.split(r"[\s,;()]+", line)
        if len(token) >= 3
        and token not in models + groups
        and any(n != token and (n.startswith(token) or n.endswith(token)) for n in models + groups)
    ]
    assert not fragments, f"names cut mid-word: {fragments}"
    assert "GPU GiB" in "\n".join(lines)  # the memory column says it is GPU memory


@pytest.mark.parametrize("stack", STACKS)
def test_cost_rows_name_their_source_and_add_up_to_the_total(stack: str) -> None:
    lines = fleet_plan("-s", stack).stdout.splitlines()
    rows = [m for line in lines if (m := COST_ROW.match(line))]
    *parts, total = rows
    assert total["part"].strip() == "total" and len(parts) >= 6
    for row in parts:
        assert re.fullmatch(r"AWS us-east-1|systemNodes|nodePools", row["source"]), f"no price source: {row.string!r}"
    for side in ("min", "max"):
        assert sum(float(r[side]) for r in parts) == pytest.approx(float(total[side]), abs=1e-9 + 5e-5 * len(parts))
    text = "\n".join(lines)
    for part in ("system nodes", "EKS control plane", "NAT gateways", "load balancer"):
        assert part in text


@pytest.mark.parametrize("stack", STACKS)
def test_json_has_the_cost_parts_their_sources_and_the_gpu_ceiling(stack: str) -> None:
    data = plan_json(stack)
    cost = data["cost"]
    parts = cost["parts"]
    for side in (0, 1):
        assert sum(p["usd_per_hour"][side] for p in parts) == pytest.approx(cost["usd_per_hour"][side])
    by_part = {p["part"]: p for p in parts}
    assert by_part["system nodes"]["source"] == f"Pulumi.{stack}.yaml: systemNodes.hourly_usd"
    assert {p["name"] for p in data["node_pools"]} == {g["name"] for g in data["node_groups"]}
    for p in data["node_pools"]:
        assert by_part[f"node pool {p['name']}"]["source"] == f"Pulumi.{stack}.yaml: nodePools[{p['pool']}].hourly_usd"
        assert tuple(by_part[f"node pool {p['name']}"]["usd_per_hour"]) == pytest.approx(tuple(p["usd_per_hour"]))
    assert not any(part.startswith("node group") for part in by_part)  # no managed node groups for models
    assert all(
        by_part[p]["source"].startswith("AWS list price")
        for p in ("EKS control plane", "NAT gateways", "load balancer")
    )
    assert "data transfer" in cost["left_out"]
    ceiling = json.loads((ROOT / "policies" / "guardrails" / f"{stack}.json").read_text())["gpu-ceiling"]["maxGpus"]
    assert data["gpu_ceiling"] == {
        "max_gpus": ceiling,
        "source": f"policies/guardrails/{stack}.json: gpu-ceiling.maxGpus",
        "within": True,
    }


@pytest.mark.parametrize("stack", STACKS)
def test_whole_stack_total_is_the_readme_s_and_the_gpu_ceiling_is_shown(stack: str) -> None:
    data = plan_json(stack)
    text = " ".join(fleet_plan("-s", stack).stdout.split())  # joined: a summary line may wrap
    low, high = (round(x, 2) for x in data["cost"]["usd_per_hour"])
    assert readme_totals()[stack] == (low, high), "README.md's cost table and `fleet plan` disagree"
    assert f"whole stack: {low:.2f}-{high:.2f} USD/hour" in text
    gpus = data["max_gpus"]
    ceiling = data["gpu_ceiling"]["max_gpus"]
    assert f"at most {gpus} GPU{'' if gpus == 1 else 's'} of the guardrail's {ceiling}" in text


def test_the_dev_stack_costs_what_its_parts_cost() -> None:
    # dev: 2-3 × t3.xlarge, NodePools cpu (1-2 × m6i.large + 1 node of canary surge: max_nodes 3)
    # and a10g-1 (1 × g5.xlarge + 1 for a canary of embed-small), one NAT for two AZs, one ALB,
    # ECR's two interface endpoints in each of the two AZs, one Valkey node, Prefect's db.t4g.small
    parts = {p["part"]: p["usd_per_hour"] for p in plan_json("dev")["cost"]["parts"]}
    assert {k: pytest.approx(v) for k, v in parts.items()} == {
        "system nodes": [2 * 0.1664, 3 * 0.1664],
        "node pool a10g-1": [1.006, 2 * 1.006],
        "node pool cpu": [0.096, 3 * 0.096],
        "EKS control plane": [EKS_CONTROL_PLANE_USD] * 2,
        "NAT gateways": [NAT_GATEWAY_USD] * 2,
        "NAT Elastic IPs": [PUBLIC_IPV4_USD] * 2,
        "load balancer": [ALB_USD] * 2,
        "VPC interface endpoints": [4 * VPC_ENDPOINT_USD] * 2,
        "quota store (Valkey)": [VALKEY_NODE_USD["cache.t4g.small"]] * 2,  # one node in dev
        "Prefect database (RDS)": [RDS_POSTGRES_USD["db.t4g.small"]] * 2,  # single-AZ in dev
        # 2-3 gateway pods of one worker; the log's objects: none idle, 2 models busy on 3 at most
        "gateway S3 requests": [2 * GATEWAY_PROCESS_USD, 3 * GATEWAY_PROCESS_USD],
        # staged files (3 processes, a minute each), a commit every 5 minutes (4 PUTs and a data file per
        # busy model; 4 GETs and one per staged file; 5 LISTs), each model-hour compacted once
        "log S3 requests": [
            0.0,
            round(  # as printed: to 6 places
                3600
                * (
                    (3 / 60 + (4 + 2) / 300 + 2 / 3600 + 5 / 300) * 0.005 / 1000
                    + (3 / 60 + 4 / 300 + 2 / 3600) * 0.0004 / 1000
                ),
                6,
            ),
        ],
    }


GATEWAY_PROCESS_USD = 3600 * (0.5 * 0.0004 + (1 / 5 + 1 / 5 + 1 / 30 + 1 / 10 + 2 / 300) * 0.005) / 1000


def test_the_store_request_rows_use_the_gateway_s_own_rates() -> None:
    from fleet.catalog import gateway_directory
    from fleet.gateway import background, sync, view
    from fleet.logs import committer, inference
    from fleet.planning import costs
    from fleet.usage import meter

    assert costs.GATEWAY_GET_PER_S == 1 / view.BUS_POLL_S
    assert costs.GATEWAY_PUT_PER_S == pytest.approx(2 / gateway_directory.HEARTBEAT_S + 1 / meter.FLUSH_S)
    every = gateway_directory.HEARTBEAT_S * background.PEER_COUNT_EVERY
    assert costs.GATEWAY_LIST_PER_S == pytest.approx(1 / every + 2 / sync.RESYNC_S)
    assert costs.LOG_STAGED_PER_PROCESS_S == 1 / inference.FLUSH_S
    assert costs.LOG_COMMIT_EVERY_S == committer.EVERY_S


def test_over_the_ceiling_is_said_and_a_named_guardrail_file_must_exist(tmp_path: Path) -> None:
    config = tmp_path / "ceiling.json"
    config.write_text(json.dumps({"gpu-ceiling": {"maxGpus": 0}}))
    out = " ".join(fleet_plan("-s", "dev", "--guardrails", str(config)).stdout.split())
    assert "of the guardrail's 0" in out and "OVER the ceiling" in out
    assert (
        json.loads(fleet_plan("-s", "dev", "--guardrails", str(config), "--json").stdout)["gpu_ceiling"]["within"]
        is False
    )
    missing = fleet_plan("-s", "dev", "--guardrails", str(tmp_path / "nope.json"), ok=False)
    assert missing.returncode == 1 and missing.stderr.count("\n") == 1 and "nope.json: not found" in missing.stderr
    config.write_text(json.dumps({"gpu-ceiling": {"maxGpus": "many"}}))
    with pytest.raises(ConfigError, match=r"gpu-ceiling\.maxGpus: got 'many' — expected an integer >= 0"):
        gpu_ceiling(config)


def test_guardrail_config_follows_the_stack_name(tmp_path: Path) -> None:
    assert guardrail_config_file(Path("Pulumi.prod.yaml"), ROOT / "policies") == ROOT / "policies/guardrails/prod.json"
    assert guardrail_config_file(Path("elsewhere/stack.yaml"), ROOT / "policies") is None
    assert gpu_ceiling(tmp_path / "absent.json").max_gpus is None  # the default file may be absent: no ceiling known


def test_stack_values_as_pulumi_config_set_writes_them() -> None:
    system = {"instance_type": "t3.large", "hourly_usd": 0.0832}
    build = build_inputs({"serving-fleet:systemNodes": system, "serving-fleet:azCount": "3"}, "Pulumi.x.yaml")
    assert (build.nat_gateways, build.systemNodes.min_size) == (3, 2)  # one NAT per AZ by default
    single = build_inputs(
        {"serving-fleet:systemNodes": json.dumps(system), "serving-fleet:singleNatGateway": "true"}, "s"
    )
    assert single.nat_gateways == 1
    with pytest.raises(ConfigError, match=r"Pulumi.x.yaml: serving-fleet:systemNodes: missing required key"):
        build_inputs({}, "Pulumi.x.yaml")
    with pytest.raises(
        ConfigError, match=r"serving-fleet:systemNodes.min_size: got 5 — expected an integer <= max_size"
    ):
        build_inputs({"serving-fleet:systemNodes": {**system, "min_size": 5, "max_size": 3}}, "Pulumi.x.yaml")


# --- examples/demo-classifier/meta.yaml --------------------------------------------------------


def test_demo_meta_parses_with_the_register_loader() -> None:
    from fleet.catalog.registry import VersionMetadata
    from fleet.validation import load_yaml_file

    meta = load_yaml_file(EXAMPLE / "meta.yaml", VersionMetadata)  # what `fleet models register --meta` does
    config = json.loads((EXAMPLE / "artifact" / "config.json").read_text())
    assert meta.inputs[0].shape == [-1, config["inputs"]] and meta.outputs[0].shape == [-1, config["outputs"]]
    assert meta.hyperparameters.get("hidden", config["hidden"]) == config["hidden"]
    if not any((EXAMPLE / "artifact").glob("*.pt")):  # no weights: nothing was trained or measured
        assert meta.training_data is None and not meta.metrics


def test_every_file_the_demo_meta_names_exists() -> None:
    text = (EXAMPLE / "meta.yaml").read_text()  # comments too: they tell a reader which files to use
    uris = re.findall(r"file://([^\s'\"}]+)", text)
    paths = re.findall(r"(?<![\w/.])(examples/[\w./-]+)", text)
    assert paths, "meta.yaml names the artifact it describes"
    for rel in uris + paths:
        assert (ROOT / rel).exists(), f"meta.yaml names {rel}, which is not in the repo"


def test_the_plan_says_what_scales_each_model_and_what_an_inference_costs() -> None:
    """Cost per 1,000 inferences = a replica's share of its node, priced by the node, over what
    it serves at its QPS target."""
    data = plan_json("prod")
    models = {m["model"]: m for m in data["models"]}
    groups = {g["name"]: g for g in data["node_groups"]}
    from fleet.planning.stack import read_stack_file

    pools = {p["name"]: p for p in read_stack_file(ROOT / "Pulumi.prod.yaml")["serving-fleet:nodePools"]}
    for c in data["per_inference"]:
        m = models[c["model"]]
        group, pool = groups[m["node_group"]], pools[m["pool"]]
        shares = [
            m["cpu"] / (pool["vcpu"] * 0.9),
            m["memory_gib"] / (pool["memory_gib"] * 0.9),
        ]  # 10 % kept by the node
        if m["gpus"]:
            shares.append(m["gpus"] / (pool["gpus"] * group["gpu_slices"]))
        assert c["replica_usd_per_hour"] == pytest.approx(max(shares) * pool["hourly_usd"], rel=1e-4)
        assert c["usd_per_1k_inferences"] == pytest.approx(
            c["replica_usd_per_hour"] / (m["target_qps_per_replica"] * 3.6)
        )
    assert models["llm-7b"]["triggers"] == ["queue_depth", "gpu_utilization", "p99_ms"]  # policies/models-gpu.yaml
    assert models["demo-classifier"]["triggers"] == ["qps", "p99_ms"]  # the default
    text = fleet_plan("--stack", "prod").stdout
    assert re.search(r"llm-7b\s+queue_depth 12/replica", text) and "gpu_utilization 75 %" in text
    assert re.search(r"llm-70b\s+qps 1/replica\s+21\.960\s+6\.1000", text)  # a whole p4d at 1 QPS


def test_the_plan_shows_each_replica_s_gpu_type_degree_and_memory_breakdown() -> None:
    """llm-70b (policies/models-gpu.yaml): 130.39 GiB of bf16 weights and a KV cache of 8
    sequences × 16384 tokens × 80 layers × 1024 × 2 × 2 bytes = 40 GiB, × 1.2 = 204.46 GiB:
    tensor parallel over the 8 A100-40GB of one p4d."""
    models = {m["model"]: m for m in plan_json("prod")["models"]}
    big = models["llm-70b"]
    assert (big["gpu_type"], big["tensor_parallel"], big["kv_source"]) == ("A100-40GB", 8, "architecture")
    assert (big["weights_gib"], big["kv_cache_gib"], big["gpu_memory_gib"]) == (
        pytest.approx(130.385, abs=1e-3),
        40.0,
        204.46,
    )
    assert (big["kv_tokens"], big["context_tokens"], big["gpu_memory_from"]) == (8 * 16384, 16384, "estimate")
    assert big["gpu_memory_utilization"] == 0.639  # 204.46 GiB over 8 × 40 GiB: vLLM's share of each GPU
    assert (models["llm-7b"]["gpu_type"], models["llm-7b"]["kv_cache_gib"]) == ("A10G", 4.0)
    assert (models["embed-small"]["kv_source"], models["embed-small"]["gpu_memory_from"]) == ("none", "resources")
    assert (models["demo-lm"]["gpu_type"], models["demo-lm"]["kv_source"]) == (None, "default share")  # on CPU
    text = fleet_plan("-s", "prod").stdout
    assert re.search(r"^llm-70b\s+A100-40GB\s+8\s+130\.39\s+40\.00\s+architecture\s+204\.46\s*$", text, re.M), text
    assert re.search(r"^\s+8 × 16384 tokens\s*$", text, re.M)
    assert re.search(r"^llm-7b\s+A10G\s+1\s+13\.04\s+4\.00\s+architecture\s+20\.45\s*$", text, re.M)
    assert re.search(r"^embed-small\s+A10G shared\s+1\s+0\.20\s+-\s+-\s+2\.00\*\s*$", text, re.M)
    assert re.search(r"^demo-lm\s+CPU\s+-\s+0\.01\s+<0\.01\s+30% of weights\s+-\s*$", text, re.M)


def test_the_plan_prints_the_nodepools_with_capacity_taints_limits_and_cost_bounds() -> None:
    """prod: llm-70b's p4d pool on-demand only (large), embed-small's spot first; every pool
    tainted for models; limits and cost bounds at the canary surge; what max_nodes cut said."""
    data = plan_json("prod")
    pools = {p["name"]: p for p in data["node_pools"]}
    assert pools["a100-8"]["capacity_types"] == ["on-demand"]
    assert pools["a10g-1"]["capacity_types"] == ["spot", "on-demand"]
    assert pools["a10g-1-llm-7b"]["nodes"] == [1, 4, 6] and pools["a10g-1-llm-7b"]["surge_short"] == 2
    assert pools["a10g-1-llm-7b"]["limits"] == {"cpu": "24", "memory": "96Gi", "nodes": "6", "nvidia.com/gpu": "6"}
    assert pools["a10g-1-llm-7b"]["usd_per_hour"] == pytest.approx([1.006, 6 * 1.006])
    assert all(["fleet.io/model-node", "true", "NoSchedule"] in p["taints"] for p in pools.values())
    assert data["max_gpus"] == sum(int(p["limits"].get("nvidia.com/gpu", 0)) for p in pools.values()) == 24
    text = fleet_plan("-s", "prod").stdout
    assert re.search(r"^a10g-1-llm-7b\s+g5\.xlarge\s+on-demand\s+1-4\+2\s+cpu 24\s+1\.01-6\.04\s*$", text, re.M), text
    assert re.search(r"^a10g-1\s+g5\.xlarge\s+spot\s+1-1\+1\s+cpu 8\s+1\.01-2\.01\s*$", text, re.M)
    assert re.search(r"^\s+nvidia\.com/gpu 16\s*$", text, re.M)  # a100-8's GPU limit, on a line of its own
    assert re.search(r"^a10g-1-llm-7b\s+nvidia\.com/gpu=present:NoSchedule\s+llm-7b\s*$", text, re.M)
    assert re.search(r"^\s+fleet\.io/dedicated=llm-7b:NoSchedule\s*$", text, re.M)
    joined = " ".join(text.split())
    assert "canary surge: a100-8 needs 2 nodes more than nodePools[a100-8].max_nodes allows" in joined
