"""``fleet plan``: the placement plan of a stack — where each model runs, the Karpenter
NodePools of the model nodes (instance type, capacity type, taints, limits with the canary
surge, cost bounds), what the whole stack costs per hour and how its GPUs compare with the
guardrails' ceiling.

Only gathers inputs (the policies, the node pools, system nodes and network of
``Pulumi.<stack>.yaml`` as ``fleet.planning.stack`` parses them, the guardrail pack's config) and prints
what ``fleet.planning.planner.plan`` and ``fleet.planning.costs.stack_cost`` decide; the Pulumi program sizes its
node groups from the same function and exports the same cost, so this is what ``pulumi up``
would build.

The tables are built here rather than with ``_output.table`` because they need column-level
control to stay readable at 80 columns: names never wrap (each is one token a reader copies),
lists go one item per line, and only free text wraps, at spaces.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich import box
from rich.table import Table
from rich.text import Text

from fleet.cli._output import JsonFlag, console, emit_json

if TYPE_CHECKING:  # imported where used: `fleet --help` stays fast
    from collections.abc import Sequence

    from fleet.planning.costs import EksSupport, InferenceCost, StackCost
    from fleet.planning.karpenter import NodePoolPlan
    from fleet.planning.placement import ModelPlacement, PlacementPlan
    from fleet.planning.stack import GpuCeiling

StackOpt = Annotated[
    str, typer.Option("--stack", "-s", help="Stack name (reads Pulumi.<stack>.yaml) or a stack file path.")
]
PoliciesOpt = Annotated[
    Path, typer.Option("--policies", envvar="FLEET_POLICIES", help="Policy folder or file.", show_envvar=True)
]
GuardrailsOpt = Annotated[
    Path | None,
    typer.Option(
        "--guardrails",
        help="The guardrail pack config with the GPU ceiling (default <policies>/guardrails/<stack>.json, "
        "what `pulumi up --policy-pack-config` is given).",
    ),
]


def plan_cmd(
    stack: StackOpt = "dev",
    policies: PoliciesOpt = Path("policies"),
    guardrails: GuardrailsOpt = None,
    json: JsonFlag = False,
) -> None:
    """Place the stack's models on its node pools: GPUs per replica, replicas, each replica's GPU
    type, tensor-parallel degree and memory (weights, KV cache and where its size came from),
    what scales each model and its cost per 1,000 inferences, node-group sizes, the whole
    stack's cost per hour and the GPU ceiling."""
    from fleet.catalog.policies.loader import load_policies
    from fleet.planning.costs import eks_support, inference_costs, stack_cost
    from fleet.planning.karpenter import node_pools
    from fleet.planning.planner import plan
    from fleet.planning.stack import (
        build_inputs,
        gpu_ceiling,
        guardrail_config_file,
        placement_inputs,
        read_stack_file,
        stack_file,
    )

    path = stack_file(stack)
    config = read_stack_file(path)
    loaded = load_policies(policies)
    pools, models = placement_inputs(config, str(path), loaded)
    result = plan(loaded, pools, models)
    per_inference = inference_costs(result, pools)
    build = build_inputs(config, str(path))
    cost = stack_cost(result, build, path.name, pools=pools)
    karpenter = node_pools(result, pools)
    gpus = sum(p.limit_gpus for p in karpenter)  # what the NodePools' limits let Karpenter launch
    ceiling = (
        gpu_ceiling(guardrails, required=True) if guardrails else gpu_ceiling(guardrail_config_file(path, policies))
    )
    if json:
        within = None if ceiling.max_gpus is None else gpus <= ceiling.max_gpus
        emit_json(
            {
                **result.to_dict(),
                "node_pools": [p.to_dict() for p in karpenter],
                "max_gpus": gpus,
                "cost": cost.to_dict(),
                "gpu_ceiling": {**ceiling.to_dict(), "within": within},
                "per_inference": [c.to_dict() for c in per_inference],
            }
        )
        return
    tables = (
        _placement_table(result, path),
        _memory_table(result),
        _scaling_table(result, per_inference),
        _node_pool_table(karpenter),
        _taint_table(karpenter),
        _cost_table(cost, path),
    )
    for table in tables:
        console.print(table)
        console.print()
    for line in _summary(result, karpenter, cost, ceiling, eks_support(build.kubernetesVersion)):
        console.print(line, markup=False, highlight=False)


def _table(title: str) -> Table:
    # no vertical rules and one space of padding: six columns of names and numbers fit 80 columns
    return Table(title=Text(title), title_justify="left", box=box.SIMPLE_HEAD, show_edge=False, padding=(0, 1, 0, 0))


def _name_column(t: Table, header: str) -> None:
    """A column of names: never wrapped at a space or cut short with "…", so each stays whole on one line."""
    t.add_column(header, no_wrap=True, overflow="fold")  # fold: only a name wider than the screen


def _text_column(t: Table, header: str, *, right: bool = False) -> None:
    """A column of words: wraps at spaces; a single token longer than the column folds."""
    t.add_column(header, overflow="fold", justify="right" if right else "left")


def _row(t: Table, *cells: str, end_section: bool = False) -> None:
    """Cells as plain text: a name like ``nodePools[a10g-1]`` is not rich markup."""
    t.add_row(*(Text(c) for c in cells), end_section=end_section)


def _placement_table(result: PlacementPlan, path: Path) -> Table:
    t = _table(f"placement ({path})")
    _name_column(t, "model")
    _name_column(t, "node group")
    _text_column(t, "GPUs / replica")
    _text_column(t, "GPU GiB / replica", right=True)
    _text_column(t, "replicas", right=True)
    _text_column(t, "isolated for")
    for m in result.models:
        gib = f"{m.gpu_memory_gib:g}" if m.gpus else "-"
        _row(
            t,
            m.model,
            m.node_group,
            _gpus(m),
            gib,
            f"{m.min_replicas}-{m.max_replicas}",
            "\n".join(m.isolated_for) or "-",
        )
    return t


def _memory_table(result: PlacementPlan) -> Table:
    from fleet.planning.memory import KV_DEFAULT_SHARE, RUNTIME_OVERHEAD

    t = _table(f"memory per replica, GiB: (weights + KV cache) × {1 + RUNTIME_OVERHEAD:g}")
    t.caption = Text(
        "* resources.gpu × gpu_memory_gib of the policy, above the estimate; "
        "CPU models hold weights and KV cache in RAM"
    )
    t.caption_justify = "left"
    _name_column(t, "model")
    _name_column(t, "GPU")
    _text_column(t, "TP", right=True)
    _text_column(t, "weights", right=True)
    _text_column(t, "KV cache", right=True)
    _text_column(t, "KV from")
    _text_column(t, "total", right=True)
    kv_from = {"kv_cache_gib": "kv_cache_gib", "default share": f"{KV_DEFAULT_SHARE:.0%} of weights", "none": "-"}
    for m in result.models:
        source = kv_from.get(m.kv_source, m.kv_source)
        if m.kv_source == "architecture" and m.kv_tokens and m.context_tokens:  # sequences × their context
            source = f"architecture\n{m.kv_tokens // m.context_tokens} × {m.context_tokens} tokens"
        gpu = "CPU" if not m.gpus else (m.gpu_type or "?") + (" shared" if m.shared_gpu else "")
        total = "-" if not m.gpus else f"{m.gpu_memory_gib:.2f}" + ("*" if m.gpu_memory_from == "resources" else "")
        kv = _gib(m.kv_cache_gib) if m.kv_source != "none" else "-"
        _row(t, m.model, gpu, str(m.tensor_parallel) if m.gpus else "-", _gib(m.weights_gib), kv, source, total)
    return t


def _gib(value: float) -> str:
    return "<0.01" if 0 < value < 0.005 else f"{value:.2f}"


_UNITS = {"qps": "/replica", "p99_ms": " ms", "queue_depth": "/replica", "gpu_utilization": " %"}


def _scaling_table(result: PlacementPlan, per_inference: Sequence[InferenceCost]) -> Table:
    t = _table("autoscaling and cost per inference (at the QPS target, nodes full)")
    _name_column(t, "model")
    _text_column(t, "scales on (KEDA)")
    _text_column(t, "USD/h / replica", right=True)
    _text_column(t, "USD / 1k inferences", right=True)
    costs = {c.model: c for c in per_inference}
    for m in result.models:
        triggers = [f"{name} {m.target(name):g}{_UNITS[name]}" for name in m.triggers]
        c = costs[m.model]
        _row(t, m.model, "\n".join(triggers), f"{c.replica_usd_per_hour:.3f}", f"{c.usd_per_1k_inferences:.4f}")
    return t


def _node_pool_table(pools: Sequence[NodePoolPlan]) -> Table:
    t = _table("model nodes: Karpenter NodePools (limits include one canary's surge)")
    t.caption = Text("nodes: min (min_replicas) - max (max_replicas) + canary surge; USD/h on demand")
    t.caption_justify = "left"
    _name_column(t, "node pool")
    _name_column(t, "instance")
    _name_column(t, "capacity")  # one type per line
    _text_column(t, "nodes", right=True)
    _name_column(t, "limits")  # one resource per line
    _text_column(t, "USD/h", right=True)
    for p in pools:
        low, high = p.usd_per_hour
        _row(
            t,
            p.name,
            p.instance_type,
            "\n".join(p.capacity_types),
            f"{p.min_nodes}-{p.max_nodes}+{p.surge_nodes}",
            "\n".join(f"{k} {v}" for k, v in p.limits.items()),
            f"{low:.2f}-{high:.2f}",
            end_section=True,
        )
    return t


def _taint_table(pools: Sequence[NodePoolPlan]) -> Table:
    t = _table("NodePool taints (model pods tolerate them) and models")
    _name_column(t, "node pool")
    _name_column(t, "taints")  # one per line
    _name_column(t, "models")  # one per line
    for p in pools:
        taints = "\n".join(f"{k}={v}:{e}" for k, v, e in p.taints)
        _row(t, p.name, taints, "\n".join(p.models), end_section=True)
    return t


def _cost_table(cost: StackCost, path: Path) -> Table:
    t = _table(f"cost per hour, USD, at min and max size ({path.name})")
    t.caption = Text("source: hourly_usd of the stack file's key, or AWS list price")
    t.caption_justify = "left"
    _text_column(t, "part")
    _name_column(t, "count")
    _text_column(t, "min", right=True)
    _text_column(t, "max", right=True)
    _text_column(t, "price source")
    for p in cost.parts:
        _row(
            t,
            p.part,
            p.count,
            _usd(p.usd_per_hour[0]),
            _usd(p.usd_per_hour[1]),
            p.label,
            end_section=p is cost.parts[-1],
        )
    low, high = cost.usd_per_hour
    _row(t, "total", "", _usd(low), _usd(high), "sum of the parts")
    return t


def _summary(
    result: PlacementPlan, pools: Sequence[NodePoolPlan], cost: StackCost, ceiling: GpuCeiling, eks: EksSupport
) -> list[str]:
    """The totals in words: model nodes at the NodePools' limits, GPUs against the guardrails'
    ceiling, surge the pools' max_nodes cut, the whole stack."""
    low, high = sum(p.usd_per_hour[0] for p in pools), sum(p.usd_per_hour[1] for p in pools)
    unused = f"; unused pools: {', '.join(result.unused_pools)}" if result.unused_pools else ""
    count = sum(p.limit_gpus for p in pools)
    gpus = f"{count} GPU{'' if count == 1 else 's'}"
    lines = [f"model nodes: at most {gpus}, {low:.2f}-{high:.2f} USD/hour{unused}"]
    for p in pools:
        if p.surge_short:
            lines.append(
                f"canary surge: {p.name} needs {p.surge_short} node{'' if p.surge_short == 1 else 's'} more than "
                f"nodePools[{p.pool}].max_nodes allows: a canary at peak waits for its stable to scale down"
            )
    if ceiling.max_gpus is None:
        lines.append(f"GPU ceiling: at most {gpus}; none known ({ceiling.source})")
    else:
        over = " — OVER the ceiling: the guardrails will refuse `pulumi up`" if count > ceiling.max_gpus else ""
        lines.append(f"GPU ceiling: at most {gpus} of the guardrail's {ceiling.max_gpus} ({ceiling.source}){over}")
    lines.append(eks.note)
    low, high = cost.usd_per_hour
    lines.append(f"whole stack: {low:.2f}-{high:.2f} USD/hour on demand; left out: {cost.left_out}")
    return lines


def _usd(value: float) -> str:
    # four decimals: every list price here (e.g. the ALB's 0.0225) shows exactly, so the parts add up to the total
    return f"{value:.4f}"


def _gpus(m: ModelPlacement) -> str:
    if not m.gpus:
        return "0 (CPU)"
    if m.shared_gpu:
        return "1 shared"
    return f"{m.gpus} (tensor parallel)" if m.tensor_parallel > 1 else "1"
