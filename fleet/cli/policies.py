"""``fleet policies``: validate the declarative policy files."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from fleet.cli._output import JsonFlag, console, emit_json

app = typer.Typer(help="Validate fleet policies (policies/*.yaml).", no_args_is_help=True)


@app.command()
def check(
    path: Annotated[Path, typer.Argument(help="Policy folder or file.")] = Path("policies"),
    json: JsonFlag = False,
) -> None:
    """Parse and cross-check every policy file; name the file, key and value of each problem."""
    from fleet.catalog.policies.loader import load_policies

    policies = load_policies(path)
    counts = {section: len(getattr(policies, section)) for section in ("models", "tenants", "rollout", "monitoring")}
    if json:
        emit_json({"ok": True, **counts})
        return
    console.print(f"{path}: ok — " + ", ".join(f"{n} {section}" for section, n in counts.items()))
