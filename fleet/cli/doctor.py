"""``fleet doctor``: list the stored records nothing can read, and what to do about each."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Annotated

import typer

from fleet.cli._output import JsonFlag, console, emit_json, err_console, table
from fleet.records import BadRecord
from fleet.store import open_store

if TYPE_CHECKING:  # fleet.control.doctor imports the rollout machinery: not at every command's start
    from fleet.control.doctor import Finding


def skipped(bad: Iterable[BadRecord | Finding]) -> None:
    """One stderr line per record a listing left out, so a table never hides one silently."""
    for b in bad:
        err_console.print(
            f"skipped {b.key}: {b.reason}; run `fleet doctor`", markup=False, highlight=False, soft_wrap=True
        )


def doctor_cmd(
    remove: Annotated[
        str | None, typer.Option("--remove", metavar="KEY", help="Move this bad record aside under quarantine/.")
    ] = None,
    restore_route: Annotated[
        str | None,
        typer.Option(
            "--restore-route", metavar="KEY", help="Rewrite this bad routes/MODEL.json from its last audited revision."
        ),
    ] = None,
    json: JsonFlag = False,
) -> None:
    """List stored records that cannot be read (routes, tenants, manifests, rollouts, events), and what to do.

    Nothing is changed unless --remove or --restore-route names a record; exits 1 while bad records remain.
    """
    from fleet.control import doctor

    store = open_store()
    if remove and restore_route:
        raise typer.BadParameter("give --remove or --restore-route, not both")
    if remove:
        moved = doctor.remove(store, remove)
        _done(json, {"removed": remove, "kept_at": moved}, f"moved {remove} aside to {moved}")
        return
    if restore_route:
        t = doctor.restore_route(store, restore_route)
        _done(
            json,
            {"restored": restore_route, "revision": t.revision},
            f"restored {restore_route} to revision {t.revision}",
        )
        return
    found = doctor.scan(store)
    if json:
        emit_json([f.__dict__ for f in found])
    elif not found:
        console.print(f"no bad records in {store.url}")
    else:
        table(
            f"bad records in {store.url}",
            ["key", "problem", "what to do"],
            [[f.key, f.reason, f.advice] for f in found],
        )
    if found:
        raise typer.Exit(1)


def _done(json: bool, value: dict, line: str) -> None:
    if json:
        emit_json(value)
    else:
        console.print(line, markup=False, highlight=False)
