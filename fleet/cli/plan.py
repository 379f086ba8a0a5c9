"""``fleet plan``: the placement plan of a stack — where each model runs and the node-group sizes.

Only gathers inputs (the policies, and the node pools of ``Pulumi.<stack>.yaml`` as
``fleet.stack`` parses them) and prints
what ``fleet.placement.plan`` decides; the Pulumi program sizes its node groups from the
same function, so this is what ``pulumi up`` would build.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from fleet.cli._output import JsonFlag, console, emit_json, table

StackOpt = Annotated[
    str, typer.Option("--stack", "-s", help="Stack name (reads Pulumi.<stack>.yaml) or a stack file path.")
]
PoliciesOpt = Annotated[
    Path, typer.Option("--policies", envvar="FLEET_POLICIES", help="Policy folder or file.", show_envvar=True)
]


def plan_cmd(
    stack: StackOpt = "dev",
    policies: PoliciesOpt = Path("policies"),
    json: JsonFlag = False,
) -> None:
    """Place the stack's models on its node pools: GPUs per replica, replicas, node-group sizes, cost."""
    from fleet.placement import plan
    from fleet.spec import load_policies
    from fleet.stack import placement_inputs, read_stack_file, stack_file

    path = stack_file(stack)
    config = read_stack_file(path)
    loaded = load_policies(policies)
    result = plan(loaded, *placement_inputs(config, str(path), loaded))
    if json:
        emit_json(result.to_dict())
        return
    table(
        f"placement ({path})",
        ["model", "node group", "instance", "GPUs / replica", "GiB / replica", "replicas", "isolated for"],
        [[m.model, m.node_group, m.instance_type, _gpus(m), f"{m.gpu_memory_gib:g}" if m.gpus else "-",
          f"{m.min_replicas}-{m.max_replicas}", ", ".join(m.isolated_for) or "-"] for m in result.models],
    )  # fmt: skip
    table(
        "node groups",
        ["node group", "instance", "GPUs / node", "nodes", "max GPUs", "USD / hour", "models"],
        [[g.name, g.instance_type, _per_node(g), f"{g.min_size}-{g.max_size}", g.max_gpus,
          f"{g.usd_per_hour[0]:.2f}-{g.usd_per_hour[1]:.2f}", ", ".join(g.models)] for g in result.node_groups],
    )  # fmt: skip
    low, high = result.usd_per_hour
    unused = f"; unused pools: {', '.join(result.unused_pools)}" if result.unused_pools else ""
    gpus = f"{result.max_gpus} GPU{'' if result.max_gpus == 1 else 's'}"
    console.print(f"model nodes: at most {gpus}, {low:.2f}-{high:.2f} USD/hour{unused}")


def _gpus(m) -> str:  # noqa: ANN001 - a ModelPlacement
    if not m.gpus:
        return "0 (CPU)"
    if m.shared_gpu:
        return "1 shared"
    return f"{m.gpus} (tensor parallel)" if m.tensor_parallel > 1 else "1"


def _per_node(g) -> str:  # noqa: ANN001 - a NodeGroupPlan
    if not g.gpus_per_node:
        return "0"
    return f"{g.gpus_per_node} × {g.gpu_slices} shares" if g.gpu_slices > 1 else str(g.gpus_per_node)
