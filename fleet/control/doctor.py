"""``fleet doctor``: find the stored records nothing can read, say what to do, repair on request.

Every reader that lists many records skips a bad one (``fleet.records.load_all``); this is
where an operator sees them all at once. Nothing is changed unless asked: ``remove`` copies a
record's bytes under ``quarantine/`` and then deletes the key (it checks first that the bad
bytes are still there; the store has no conditional delete, so a fix landing in the instant
between the check and the delete is deleted too, and still kept in quarantine);
``restore_route`` rewrites a route table from its last audited revision with a conditional
write, so a table fixed meanwhile by someone else is never overwritten.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from pydantic import BaseModel

from fleet import audit, changes, records
from fleet.catalog.registry import Registry
from fleet.catalog.rollouts import RolloutState
from fleet.catalog.routes.store import Router
from fleet.catalog.routes.table import RouteTable
from fleet.catalog.tenants import Tenants
from fleet.errors import Conflict, InvalidInput, NotFound, PreconditionFailed
from fleet.types import ObjectStore

QUARANTINE = "quarantine/"


def _top(key: str) -> bool:
    return key.count("/") == 1


@dataclass(frozen=True)
class _Kind:
    prefix: str
    cls: type[BaseModel]
    keep: Callable[[str], bool] | None
    advice: str


_ROUTE_ADVICE = (
    "the model is not served from this table: `fleet doctor --restore-route {key}` rewrites its last "
    "audited revision (see `fleet route history`), or fix the JSON by hand"
)
_TENANT_ADVICE = (
    "this record's keys do not work: fix the JSON, or `fleet doctor --remove {key}` and, if the tenant is "
    "gone with it, create it again (it gets new keys)"
)
_KINDS = (
    _Kind(
        "rollouts/",
        RolloutState,
        _top,
        "the model's rollout cannot resume: `fleet doctor --remove {key}`, then start the rollout again",
    ),
    _Kind(
        "events/",
        audit.AuditEvent,
        None,
        "one audit event is unreadable (history skips it): restore it from a backup, or `fleet doctor --remove {key}`",
    ),
)
_MANIFEST_ADVICE = (
    "this version cannot be listed, routed or deployed: restore the manifest from a backup (its artifact "
    "files are intact), or `fleet doctor --remove {key}` to unregister it"
)


@dataclass(frozen=True)
class Finding:
    key: str
    kind: str
    reason: str
    advice: str


def scan(
    store: ObjectStore, *, history: bool = True, bad_manifests: list[records.BadRecord] | None = None
) -> list[Finding]:
    """Every stored record that does not parse as what its key says it is, by key.

    ``history=False`` leaves out rollouts and audit events (every event is one read: on S3,
    thousands of GETs), for a quick look such as ``fleet status``'s; ``bad_manifests``: what
    a caller's own ``Registry.scan`` found, so the manifests are not read twice.
    """
    if bad_manifests is None:
        bad_manifests = Registry(store).scan()[1]
    found = [Finding(b.key, b.kind, b.reason, _MANIFEST_ADVICE.format(key=b.key)) for b in bad_manifests]
    found += [Finding(b.key, b.kind, b.reason, _TENANT_ADVICE.format(key=b.key)) for b in Tenants(store).scan()[1]]
    routes, bad = records.load_all(store, "routes/", RouteTable, keep=_top)
    for key, table in routes.items():
        if key != f"routes/{table.model}.json":
            bad.append(records.BadRecord(key, f"{key!r} holds the route of {table.model!r}", "RouteTable"))
    found += [Finding(b.key, b.kind, b.reason, _ROUTE_ADVICE.format(key=b.key)) for b in bad]
    for kind in _KINDS if history else ():
        for b in records.load_all(store, kind.prefix, kind.cls, keep=kind.keep)[1]:
            found.append(Finding(b.key, b.kind, b.reason, kind.advice.format(key=b.key)))
    return sorted(found, key=lambda f: f.key)


def _bad(store: ObjectStore, key: str) -> tuple[Finding, str]:
    """The finding for ``key`` and the ETag of its bad bytes; refuses a key that is fine."""
    for finding in scan(store):
        if finding.key == key:
            return finding, store.get(key).etag
    raise InvalidInput(f"{key} is not a bad record (or does not exist); expected a key that `fleet doctor` lists")


def remove(store: ObjectStore, key: str) -> str:
    """Move a bad record aside to ``quarantine/<time>/<key>``; return where it went."""
    _bad(store, key)
    obj = store.get(key)
    moved = f"{QUARANTINE}{audit.now().strftime('%Y%m%dT%H%M%SZ')}/{key}"
    store.put(moved, obj.data)
    current = store.get(key)
    if current.etag != obj.etag:
        store.delete(moved)
        raise Conflict(f"{key} changed while it was being moved aside; run `fleet doctor` again")
    store.delete(key)
    changes.note(store, key, None)  # a gateway serving its last good copy lets it go
    return moved


def restore_route(store: ObjectStore, key: str, *, who: str | None = None) -> RouteTable:
    """Rewrite a bad route table from its last audited revision, as a new audited revision.

    Written only over the bad bytes (a conditional write); then logged and states reconciled
    like any route change, so history shows the restore and who did it.
    """
    finding, etag = _bad(store, key)
    if finding.kind != "RouteTable":
        raise InvalidInput(f"{key} is a {finding.kind} record; --restore-route takes a routes/<model>.json key")
    model = key.removeprefix("routes/").removesuffix(".json")
    revisions = [e for e in audit.events(store, model) if e.kind == "route" and e.after is not None]
    if not revisions:
        raise NotFound(f"{model} has no audited route revision to restore; fix {key} by hand")
    last = max(revisions, key=lambda e: e.revision or 0)
    who = who or audit.actor()
    restored = RouteTable.model_validate(last.after)
    table = restored.model_copy(
        update={
            "revision": restored.revision + 1,
            "updated_at": audit.now(),
            "updated_by": who,
            "reason": f"restored r{restored.revision} by fleet doctor",
        }
    )
    try:
        changes.note(store, key, store.put(key, records.dump(table), if_match=etag))
    except PreconditionFailed:
        raise Conflict(f"{key} changed while it was being restored; run `fleet doctor` again") from None
    router = Router(store)
    router._log(restored, table)
    router._reconcile_states(model, who)
    return table
