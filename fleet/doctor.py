"""``fleet doctor``: find the stored records nothing can read, say what to do, repair on request.

Every reader that lists many records skips a bad one (``fleet.records.load_all``); this is
where an operator sees them all at once. Nothing is changed unless asked: ``remove`` moves a
record's bytes aside under ``quarantine/`` (never deletes them), ``restore_route`` rewrites a
route table from its last audited revision. Both are conditional on the bad bytes still
being there, so a record fixed meanwhile by someone else is never overwritten.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from pydantic import BaseModel

from fleet import audit, records
from fleet.errors import Conflict, InvalidInput, NotFound, PreconditionFailed
from fleet.registry import Registry
from fleet.rollout import RolloutState
from fleet.routing import RouteTable
from fleet.tenants import Tenant
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


_KINDS = (
    _Kind("routes/", RouteTable, _top,
          "the model is not served from this table: `fleet doctor --restore-route {key}` rewrites its last "
          "audited revision (see `fleet route history`), or fix the JSON by hand"),
    _Kind("tenants/", Tenant, _top,
          "this tenant's keys do not work: fix the JSON, or `fleet doctor --remove {key}` and create the "
          "tenant again (it gets new keys)"),
    _Kind("rollouts/", RolloutState, _top,
          "the model's rollout cannot resume: `fleet doctor --remove {key}`, then start the rollout again"),
    _Kind("events/", audit.AuditEvent, None,
          "one audit event is unreadable (history skips it): restore it from a backup, or "
          "`fleet doctor --remove {key}`"),
)  # fmt: skip
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


def scan(store: ObjectStore) -> list[Finding]:
    """Every stored record that does not parse as what its key says it is, by key."""
    found = [Finding(b.key, b.kind, b.reason, _MANIFEST_ADVICE.format(key=b.key)) for b in Registry(store).scan()[1]]
    for kind in _KINDS:
        for bad in records.load_all(store, kind.prefix, kind.cls, keep=kind.keep)[1]:
            found.append(Finding(bad.key, bad.kind, bad.reason, kind.advice.format(key=bad.key)))
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
    return moved


def restore_route(store: ObjectStore, key: str, *, who: str | None = None) -> RouteTable:
    """Rewrite a bad route table from its last audited revision (only over the bad bytes)."""
    finding, etag = _bad(store, key)
    if finding.kind != "RouteTable":
        raise InvalidInput(f"{key} is a {finding.kind} record; --restore-route takes a routes/<model>.json key")
    model = key.removeprefix("routes/").removesuffix(".json")
    revisions = [e for e in audit.events(store, model) if e.kind == "route" and e.after is not None]
    if not revisions:
        raise NotFound(f"{model} has no audited route revision to restore; fix {key} by hand")
    last = max(revisions, key=lambda e: e.revision or 0)
    table = RouteTable.model_validate(last.after).model_copy(
        update={"reason": f"restored r{last.revision} by fleet doctor", "updated_by": who or audit.actor()}
    )
    try:
        store.put(key, records.dump(table), if_match=etag)
    except PreconditionFailed:
        raise Conflict(f"{key} changed while it was being restored; run `fleet doctor` again") from None
    return table

