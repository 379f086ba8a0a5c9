"""Stored route tables: audited, conditional changes and the history of what served when.

``routes/<model>.json`` is changed only through ``Router.update``: one conditional write
per revision, then one audit event (``events/<model>/routes/<revision>.json``) holding the
whole table before and after, then version states brought in line with the table.

Those three writes are not atomic. Each step can be redone from what is stored: the table
carries who/why/when of its last change, and an event's ``before`` is the previous
revision's table, so events a crashed writer never wrote are rebuilt, and states are
reconciled against the current table on every change.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime

from pydantic import ValidationError

from fleet import audit, records
from fleet.catalog.registry import TRANSITIONS, Registry, State
from fleet.catalog.routes.table import Canary, RouteTable, Shadow, forbidden, validate_states
from fleet.catalog.tenants import Tenants
from fleet.errors import Conflict, IntegrityError, InvalidInput, NotFound
from fleet.names import check_name, check_version
from fleet.types import ObjectStore
from fleet.validation import explain

# Rounds of reconciling against a table that moved meanwhile (each round re-reads it).
_RECONCILE_ROUNDS = 5

# What a change writes besides the route itself: a change that differs only here is no change.
_STAMP = {"revision", "updated_at", "updated_by", "reason"}


class _Unchanged(Exception):
    def __init__(self, table: RouteTable) -> None:
        self.table = table


class Router:
    def __init__(self, store: ObjectStore, registry: Registry | None = None) -> None:
        self.store = store
        self.registry = registry or Registry(store)
        self.unchanged = False  # whether the last update found nothing to change (and wrote nothing)

    @staticmethod
    def _key(model: str) -> str:
        return f"routes/{check_name('model', model)}.json"

    def get(self, model: str) -> RouteTable:
        table, _ = records.load_or_none(self.store, self._key(model), RouteTable)
        if table is not None:
            return table
        if not self.registry.versions(model):
            raise NotFound(f"model {model!r} has no registered versions")
        return RouteTable(model=model)

    def update(
        self,
        model: str,
        change: Callable[[RouteTable], RouteTable],
        *,
        why: str,
        who: str | None = None,
    ) -> RouteTable:
        """Apply ``change`` as one audited revision; retried from a fresh read on a lost race.

        A change that leaves the table as it is writes nothing (no revision, no event) and
        returns the stored table with ``self.unchanged`` set.
        """
        who = who or audit.actor()
        if not why.strip():
            raise InvalidInput("a route change needs a reason; expected a non-empty --reason")

        def apply(before: RouteTable | None) -> RouteTable:
            before = before or RouteTable(model=model)
            after = change(before).model_copy(update={"model": model})
            if after.model_dump(exclude=_STAMP) == before.model_dump(exclude=_STAMP):
                raise _Unchanged(before)
            versions, bad = self.registry.scan(model)
            unreadable = frozenset(b.key.split("/")[2] for b in bad)
            validate_states(after, {mv.version: mv.state for mv in versions}, before.stable, unreadable)
            return after.model_copy(
                update={
                    "revision": before.revision + 1,
                    "updated_at": audit.now(),
                    "updated_by": who,
                    "reason": why,
                }
            )

        self.get(model)  # NotFound for a model that was never registered
        try:
            before, after = records.update(self.store, self._key(model), RouteTable, apply)
        except _Unchanged as same:
            # nothing to write, but what a writer that died after its route write left undone
            # is still caught up: re-running the command is how an operator repairs it
            self.unchanged = True
            self._repair_audit(model)
            self._reconcile_states(model, who)
            return same.table
        self.unchanged = False
        self._log(before, after)
        self._repair_audit(model)
        self._reconcile_states(model, who)
        return after

    def set(
        self,
        model: str,
        *,
        stable: str | None = None,
        canary: str | None = None,
        weight: float | None = None,
        shadow: str | None = None,
        shadow_percent: float | None = None,
        clear_canary: bool = False,
        clear_shadow: bool = False,
        why: str,
        who: str | None = None,
    ) -> RouteTable:
        """Change some fields of the route; unnamed fields keep their value."""
        for v in (stable, canary, shadow):
            if v is not None:
                check_version(v)

        def change(t: RouteTable) -> RouteTable:
            data = t.model_dump()
            if stable is not None:
                data["stable"] = stable
                if t.canary and t.canary.version == stable:
                    data["canary"] = None  # promoting the canary ends the split
                if t.shadow and t.shadow.version == stable:
                    data["shadow"] = None  # and a version cannot mirror its own traffic
            if clear_canary:
                data["canary"] = None
            elif canary is not None or weight is not None:
                if t.canary and canary not in (None, t.canary.version) and weight is None and t.canary.weight > 0:
                    raise InvalidInput(
                        f"canary {t.canary.version} of {model} takes {t.canary.weight:g}% of traffic; replacing it "
                        f"with {canary} needs --weight (e.g. --weight 0 to start it without traffic)"
                    )
                data["canary"] = _arm(model, "canary", t.canary, canary, "weight", weight, default=0.0)
            if clear_shadow:
                data["shadow"] = None
            elif shadow is not None or shadow_percent is not None:
                data["shadow"] = _arm(model, "shadow", t.shadow, shadow, "percent", shadow_percent, default=100.0)
            return _table(data)

        return self.update(model, change, why=why, who=who)

    def pin(self, model: str, tenant: str, version: str, *, why: str, who: str | None = None) -> RouteTable:
        check_version(version)
        record = Tenants(self.store).get(tenant)
        if not record.allows(model, version):
            raise forbidden(model, version, record)
        return self.update(
            model, lambda t: _table({**t.model_dump(), "pins": {**t.pins, tenant: version}}), why=why, who=who
        )

    def unpin(self, model: str, tenant: str, *, why: str, who: str | None = None) -> RouteTable:
        def change(t: RouteTable) -> RouteTable:
            if tenant not in t.pins:
                raise NotFound(f"tenant {tenant!r} has no pin on {model}")
            return _table({**t.model_dump(), "pins": {k: v for k, v in t.pins.items() if k != tenant}})

        return self.update(model, change, why=why, who=who)

    # -- history ------------------------------------------------------------------------
    def history(self, model: str) -> list[audit.AuditEvent]:
        """Every route and state change of ``model``, oldest first."""
        self.get(model)
        self._repair_audit(model)
        return audit.events(self.store, model)

    def at(self, model: str, when: datetime) -> RouteTable | None:
        """The route table in force at ``when`` (None: the model had no route yet)."""
        if when.tzinfo is None:
            raise InvalidInput(f"time {when.isoformat()} has no timezone; expected e.g. 2026-12-01T14:02:00Z")
        in_force = None
        for event in self.history(model):
            if event.kind == "route" and event.at <= when:
                in_force = event.after
        return RouteTable.model_validate(in_force) if in_force is not None else None

    # -- repair -------------------------------------------------------------------------
    def _log(self, before: RouteTable | None, after: RouteTable) -> None:
        audit.append(
            self.store,
            audit.AuditEvent(
                model=after.model,
                kind="route",
                at=after.updated_at or audit.now(),
                who=after.updated_by or "",
                why=after.reason or "",
                revision=after.revision,
                before=before.model_dump(mode="json") if before else None,
                after=after.model_dump(mode="json"),
            ),
        )

    def _repair_audit(self, model: str) -> None:
        """Write the events of revisions whose writer died before logging them.

        A missing revision r is rebuilt from the table itself (r is current) or from the
        ``before`` of event r+1; its ``before`` from event r-1. Only when two writers in a
        row died is a revision's table gone for good; it is then left out, not guessed.
        """
        table, _ = records.load_or_none(self.store, self._key(model), RouteTable)
        if table is None or table.revision == 0:
            return
        prefix = f"events/{model}/routes/"
        names = (k[len(prefix) :].removesuffix(".json") for k in self.store.list(prefix) if k.endswith(".json"))
        logged = {int(n) for n in names if n.isdigit()}  # a stray file is not a revision
        missing = [r for r in range(1, table.revision + 1) if r not in logged]
        if not missing:
            return
        tables: dict[int, dict[str, object] | None] = {0: None, table.revision: table.model_dump(mode="json")}
        for r in {n for m in missing for n in (m - 1, m + 1)} & logged:
            try:
                event = records.load(self.store, audit.route_event_key(model, r), audit.AuditEvent)[0]
            except (IntegrityError, NotFound):
                continue  # an unreadable neighbour (fleet doctor names it) only means less to rebuild from
            tables[r] = event.after
            tables.setdefault(r - 1, event.before)
        for r in missing:
            if tables.get(r) is None:
                continue
            after = RouteTable.model_validate(tables[r])
            before = tables.get(r - 1)
            self._log(RouteTable.model_validate(before) if before else None, after)

    def _reconcile_states(self, model: str, who: str) -> None:
        """Move version states to match the current table (after the route write won).

        States are a function of the table: its stable is ``stable``, its canary ``canary``;
        a ``canary`` version out of the canary slot (replaced or cleared without a verdict)
        is ``registered`` again, and a ``stable`` version the table no longer uses (not
        stable, pinned or shadow) is ``retired``. Each move is an audited transition.
        """
        for _ in range(_RECONCILE_ROUNDS):
            table = self.get(model)
            for version, state in self.registry.states(model).items():
                wanted = wanted_state(table, version, state)
                if state != wanted and wanted in TRANSITIONS[state]:
                    try:
                        self.registry.transition(
                            model,
                            version,
                            wanted,
                            why=f"route r{table.revision}: {table.reason}",
                            who=who,
                            expect=state,
                        )
                    except Conflict:
                        pass  # another writer moved it first; the next round sees where it is
            # a newer revision written meanwhile may have been reconciled by its writer
            # against states this round then changed: settle against the latest table
            if self.get(model).revision == table.revision:
                return


def wanted_state(table: RouteTable, version: str, state: State) -> State:
    """The state ``version`` (now in ``state``) has under ``table``: the one rule."""
    if version == table.stable:
        return State.STABLE
    if table.canary and version == table.canary.version:
        return State.CANARY
    if state == State.CANARY:
        return State.REGISTERED
    if state == State.STABLE and version not in table.referenced_versions():
        return State.RETIRED
    return state


def _arm(
    model: str,
    role: str,
    current: Canary | Shadow | None,
    version: str | None,
    field: str,
    amount: float | None,
    *,
    default: float,
) -> dict[str, object]:
    """The canary or shadow after a change of version, amount, or both.

    A new version starts at ``default`` unless an amount is given; naming only an amount
    changes the current arm's.
    """
    version = version or (current.version if current else None)
    if version is None:
        raise InvalidInput(f"{model} has no {role} to change; expected --{role} VERSION")
    kept = getattr(current, field) if current is not None and current.version == version else default
    return {"version": version, field: kept if amount is None else amount}


def _table(data: dict[str, object]) -> RouteTable:
    try:
        return RouteTable.model_validate(data)
    except ValidationError as exc:
        raise InvalidInput("route refused: " + "; ".join(explain(exc, RouteTable))) from None
