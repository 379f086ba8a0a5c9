"""Tenants: who may call which model versions, at what rate, with which API keys.

An API key is shown once, when it is made; the store keeps only its SHA-256. Keys look
like ``sfk_<key id>_<secret>``: the key id lets a server index keys in memory (``key_index``)
instead of hashing against every tenant, and the hash is compared in constant time
(``lookup``). That is the one authentication rule: the gateway looks keys up in the index
its routing snapshot holds, ``Tenants.authenticate`` in one built from the store.

A key is live until it is revoked or its ``expires_at`` passes. Expiry is checked against
the clock on every lookup, not only when an index is built: a gateway rebuilds its index
only when a record changes, and nothing changes in the store when a rotated key's grace
period runs out.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import secrets
from collections.abc import Callable, Iterable, Mapping
from datetime import UTC, datetime, timedelta
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_serializer

from fleet import audit, records
from fleet.errors import Conflict, InvalidInput, NotFound, PreconditionFailed
from fleet.names import check_name, check_version
from fleet.records import BadRecord
from fleet.types import ObjectStore

KEY_PREFIX = "sfk_"
MAX_KEY_LENGTH = 128  # a made key is about 60 characters; anything far longer is not one
MAX_GRACE = timedelta(days=30)  # a rotated key left alive longer than this is not rotated
ENTITLEMENT_FORM = "MODEL (every version) or MODEL:VERSION[,VERSION]"

# JSON has no inf or NaN (they are written as null and then refused on every read), so no
# tenant record may hold one.
_RECORD = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)


class Quota(BaseModel):
    model_config = _RECORD

    rps: float = Field(gt=0)
    burst: int = Field(ge=1)
    concurrency: int | None = Field(None, ge=1)  # requests in flight at once, across every gateway
    tokens_per_minute: int | None = Field(None, ge=1)  # generation: prompt + completion tokens, across every gateway

    @model_serializer(mode="wrap")
    def _without_unset_tokens(self, handler: Callable[[Quota], dict[str, Any]]) -> dict[str, Any]:
        """No ``tokens_per_minute: null`` in a record: a gateway of the release before it
        (which forbids unknown fields) still reads every quota that has none."""
        data = handler(self)
        if data.get("tokens_per_minute") is None:
            data.pop("tokens_per_minute", None)
        return data


MAX_WEIGHT = 1000.0


def make_quota(rps: float, burst: int, concurrency: int | None = None, tokens_per_minute: int | None = None) -> Quota:
    """A quota from user input, refused in one line that says what is expected."""
    if not (math.isfinite(rps) and rps > 0):
        raise InvalidInput(f"rps {rps:g} is not valid; expected a finite number > 0")
    if burst < 1:
        raise InvalidInput(f"burst {burst} is not valid; expected a whole number >= 1")
    if concurrency is not None and concurrency < 1:
        raise InvalidInput(f"concurrency {concurrency} is not valid; expected a whole number >= 1 (requests in flight)")
    if tokens_per_minute is not None and tokens_per_minute < 1:
        raise InvalidInput(
            f"tokens per minute {tokens_per_minute} is not valid; expected a whole number >= 1 "
            "(prompt and completion tokens of generative models)"
        )
    return Quota(rps=rps, burst=burst, concurrency=concurrency, tokens_per_minute=tokens_per_minute)


def check_weight(weight: float) -> float:
    """A fair-queuing weight from user input: finite, > 0, at most ``MAX_WEIGHT``."""
    if not (math.isfinite(weight) and 0 < weight <= MAX_WEIGHT):
        raise InvalidInput(
            f"weight {weight:g} is not valid; expected a number > 0 and <= {MAX_WEIGHT:g} (1 is the default share)"
        )
    return float(weight)


class ApiKey(BaseModel):
    model_config = _RECORD

    id: str
    sha256: str
    created_at: datetime
    revoked_at: datetime | None = None
    expires_at: datetime | None = None  # set by a rotation: the end of its grace period
    replaced_by: str | None = None  # the id of the key a rotation made to replace this one

    @field_validator("expires_at")
    @classmethod
    def _utc(cls, value: datetime | None) -> datetime | None:
        """A hand-written time without a zone is UTC; naive and aware times cannot be compared."""
        return value.replace(tzinfo=UTC) if value is not None and value.tzinfo is None else value

    def live(self, at: datetime) -> bool:
        """Usable at ``at``: not revoked and not past its expiry."""
        return self.revoked_at is None and (self.expires_at is None or self.expires_at > at)

    @property
    def ends_at(self) -> datetime | None:
        """When it stops (stopped) working: revocation or expiry, whichever comes first."""
        ends = [t for t in (self.revoked_at, self.expires_at) if t is not None]
        return min(ends) if ends else None


class Tenant(BaseModel):
    model_config = _RECORD

    name: str
    # model → allowed versions: ["*"] for every version, else exact versions.
    entitlements: dict[str, list[str]]
    quota: Quota | None = None
    # share of a saturated version's slots against other waiting tenants (fair queuing);
    # None: the policy's tenants: section's, else 1
    weight: float | None = Field(None, gt=0, le=MAX_WEIGHT)
    keys: list[ApiKey] = []
    created_at: datetime
    created_by: str

    @property
    def active(self) -> bool:
        return bool(self.live_keys())

    def live_keys(self, at: datetime | None = None) -> list[ApiKey]:
        """Keys usable at ``at`` (default: now): asked on every request, so only comparisons."""
        at = at or audit.now()
        return [k for k in self.keys if k.live(at)]

    def replaced(self, key_id: str) -> list[ApiKey]:
        """The keys a rotation retired in favour of ``key_id``."""
        return [k for k in self.keys if k.replaced_by == key_id]

    def allows(self, model: str, version: str | None = None) -> bool:
        allowed = self.entitlements.get(model)
        if not allowed:
            return False
        return version is None or "*" in allowed or version in allowed

    def matches(self, api_key: str, at: datetime | None = None) -> bool:
        """Constant-time check of ``api_key`` against the keys live at ``at`` (default: now)."""
        digest = _hash(api_key)
        hits = [hmac.compare_digest(digest, k.sha256) for k in self.live_keys(at)]
        return any(hits)


def _hash(api_key: str) -> str:
    return hashlib.sha256(api_key.encode()).hexdigest()


def key_index(tenants: Iterable[Tenant], at: datetime | None = None) -> dict[str, Tenant]:
    """Key id → tenant, for every key live at ``at`` (default: now).

    A key may expire after the index is built: ``lookup`` checks the clock again.
    """
    at = at or audit.now()
    return {k.id: t for t in tenants for k in t.keys if k.live(at)}


def lookup(index: Mapping[str, Tenant], api_key: str) -> Tenant | None:
    """The tenant owning a key live now, or None (unknown, revoked, expired or malformed)."""
    if not api_key.startswith(KEY_PREFIX) or len(api_key) > MAX_KEY_LENGTH:
        return None
    tenant = index.get(api_key[len(KEY_PREFIX) :].split("_", 1)[0])
    return tenant if tenant is not None and tenant.matches(api_key) else None


def _new_key() -> tuple[str, ApiKey]:
    key_id = secrets.token_hex(4)
    plaintext = f"{KEY_PREFIX}{key_id}_{secrets.token_urlsafe(32)}"
    return plaintext, ApiKey(id=key_id, sha256=_hash(plaintext), created_at=audit.now())


def parse_entitlements(specs: list[str]) -> dict[str, list[str]]:
    """``["demo", "other:1.0.0,1.1.0"]`` → ``{"demo": ["*"], "other": ["1.0.0", "1.1.0"]}``.

    ``demo:`` with nothing after the colon is refused rather than read as every version:
    a version list that went missing (an unset shell variable) must not widen access.
    """
    out: dict[str, list[str]] = {}
    for spec in specs:
        model, colon, versions = spec.partition(":")
        check_name("model", model)
        vs = [v.strip() for v in versions.split(",") if v.strip()] if colon else ["*"]
        if not vs:
            raise InvalidInput(f"{spec!r} names no version; expected {ENTITLEMENT_FORM}")
        for v in vs:
            if v != "*":
                check_version(v)
        out.setdefault(model, [])
        out[model] = sorted(set(out[model]) | set(vs))
    if not out:
        raise InvalidInput(f"a tenant needs at least one entitlement; expected {ENTITLEMENT_FORM}")
    return out


def public(tenant: Tenant) -> dict[str, Any]:
    """A tenant as the admin API and the CLI's --json show it: everything but its keys' hashes."""
    keys = [k.model_dump(mode="json", exclude={"sha256"}) for k in tenant.keys]
    return tenant.model_dump(mode="json", exclude={"keys"}) | {"keys": keys}


def misplaced(key: str, tenant: Tenant) -> BadRecord | None:
    """A tenant record anywhere but ``tenants/<its name>.json`` is bad: a copy (a backup, a
    file in a subfolder) would otherwise keep keys working that were revoked in the original."""
    if key == f"tenants/{tenant.name}.json":
        return None
    return BadRecord(
        key,
        f"{key!r} holds tenant {tenant.name!r}; expected it at tenants/{tenant.name}.json "
        "(a copy must not keep revoked keys working)",
        "Tenant",
    )


def check_grace(grace: timedelta) -> timedelta:
    """A rotation's grace period: 0 (revoke at once) up to ``MAX_GRACE``."""
    if grace < timedelta(0) or grace > MAX_GRACE:
        raise InvalidInput(
            f"grace {span(grace)} is not valid; expected 0 (stop the old key at once) up to {span(MAX_GRACE)}"
        )
    return grace


def span(duration: timedelta) -> str:
    """``timedelta(hours=2)`` → ``2h``: the largest unit that says it exactly (d, h, m, s)."""
    seconds = duration.total_seconds()
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds and seconds % size == 0:
            return f"{seconds / size:g}{unit}"
    return f"{seconds:g}s"


class Tenants:
    def __init__(self, store: ObjectStore) -> None:
        self.store = store

    @staticmethod
    def _key(name: str) -> str:
        return f"tenants/{check_name('tenant', name)}.json"

    def get(self, name: str) -> Tenant:
        try:
            return records.load(self.store, self._key(name), Tenant)[0]
        except NotFound:
            raise NotFound(f"tenant {name!r} does not exist") from None

    def scan(self) -> tuple[list[Tenant], list[BadRecord]]:
        """Every readable tenant, and the records that cannot be read (skipped, not fatal:
        one corrupt file must not hide every other tenant)."""
        good, bad = records.load_all(self.store, "tenants/", Tenant)
        found = []
        for key, tenant in good.items():
            if (wrong := misplaced(key, tenant)) is not None:
                records.report(wrong)
                bad.append(wrong)
            else:
                found.append(tenant)
        return found, bad

    def list(self) -> list[Tenant]:
        return self.scan()[0]

    def create(
        self,
        name: str,
        entitlements: dict[str, list[str]],
        quota: Quota | None = None,
        *,
        weight: float | None = None,
        who: str | None = None,
    ) -> tuple[Tenant, str]:
        """Create a tenant with one API key; return it and the key's only plaintext copy."""
        plaintext, key = _new_key()
        tenant = Tenant(
            name=check_name("tenant", name),
            entitlements=entitlements,
            quota=quota,
            weight=None if weight is None else check_weight(weight),
            keys=[key],
            created_at=audit.now(),
            created_by=who or audit.actor(),
        )
        try:
            records.create(self.store, self._key(name), tenant)
        except PreconditionFailed:
            raise Conflict(
                f"tenant {name!r} already exists; pick another name or add a key to it with "
                f"`fleet tenants add-key {name}`"
            ) from None
        return tenant, plaintext

    def set_limits(
        self, name: str, *, quota: Quota | None = None, clear_quota: bool = False, weight: float | None = None
    ) -> Tenant:
        """Change a tenant's quota (or remove it: ``clear_quota``) and/or weight; the gateways
        apply it at their next refresh (about a second)."""
        update: dict[str, object] = {}
        if quota is not None or clear_quota:
            update["quota"] = quota
        if weight is not None:
            update["weight"] = check_weight(weight)
        if not update:
            raise InvalidInput(
                "nothing to change; expected --rps and --burst (with an optional --concurrency), "
                "--no-quota, or --weight"
            )
        _, after = records.update(
            self.store, self._key(name), Tenant, lambda t: self._existing(name, t).model_copy(update=update)
        )
        return after

    def add_key(self, name: str) -> tuple[Tenant, str]:
        """Add a key, whatever state the others are in (all revoked or expired included)."""
        plaintext, key = _new_key()
        _, after = records.update(
            self.store,
            self._key(name),
            Tenant,
            lambda t: self._existing(name, t).model_copy(update={"keys": [*t.keys, key]}),
        )
        return after, plaintext

    def rotate(
        self, name: str, key_id: str | None = None, *, grace: timedelta = timedelta(hours=1)
    ) -> tuple[Tenant, str]:
        """Add a key and retire the live ones (or only ``key_id``) after ``grace``.

        Callers get ``grace`` to switch to the new key; grace 0 revokes the old ones at once.
        A rotation never lengthens a key's life: an earlier expiry is kept. The retired keys
        name the new one (``replaced_by``), so ``Tenant.replaced`` says what a rotation did.
        Returns the tenant and the new key's only plaintext copy.
        """
        check_grace(grace)
        plaintext, new = _new_key()
        at = new.created_at
        ends = at + grace

        def retire(k: ApiKey) -> ApiKey:
            if not grace:
                return k.model_copy(update={"revoked_at": at, "replaced_by": new.id})
            expires = min(ends, k.expires_at) if k.expires_at is not None else ends
            return k.model_copy(update={"expires_at": expires, "replaced_by": new.id})

        def change(t: Tenant | None) -> Tenant:
            t = self._existing(name, t)
            targets = {k.id for k in self._targets(t, key_id, at)}
            keys = [retire(k) if k.id in targets else k for k in t.keys]
            return t.model_copy(update={"keys": [*keys, new]})

        return records.update(self.store, self._key(name), Tenant, change)[1], plaintext

    @staticmethod
    def _targets(t: Tenant, key_id: str | None, at: datetime) -> list[ApiKey]:
        """The live keys a rotation retires; refused when there is none to retire."""
        if key_id is not None and key_id not in {k.id for k in t.keys}:
            raise NotFound(f"tenant {t.name!r} has no key {key_id!r}; keys: {', '.join(k.id for k in t.keys)}")
        live = [k for k in t.live_keys(at) if key_id in (None, k.id)]
        if live:
            return live
        add = f"add a key with `fleet tenants add-key {t.name}`"
        if key_id is not None:
            raise Conflict(
                f"key {key_id!r} of tenant {t.name!r} is already revoked or expired; nothing to rotate; {add}"
            )
        raise Conflict(f"tenant {t.name!r} has no live key to rotate (all revoked or expired); {add}")

    def revoke(self, name: str, key_id: str | None = None) -> Tenant:
        """Revoke one key, or every live key of the tenant when ``key_id`` is None."""

        def change(t: Tenant | None) -> Tenant:
            t = self._existing(name, t)
            if key_id is not None and key_id not in {k.id for k in t.keys}:
                raise NotFound(f"tenant {name!r} has no key {key_id!r}; keys: {', '.join(k.id for k in t.keys)}")
            live = [k for k in t.keys if k.revoked_at is None and key_id in (None, k.id)]
            if not live:
                what = f"key {key_id!r}" if key_id else "every key"
                raise Conflict(f"{what} of tenant {name!r} is already revoked; nothing to revoke")
            at = audit.now()
            keys = [
                k.model_copy(update={"revoked_at": at}) if k.revoked_at is None and key_id in (None, k.id) else k
                for k in t.keys
            ]
            return t.model_copy(update={"keys": keys})

        return records.update(self.store, self._key(name), Tenant, change)[1]

    @staticmethod
    def _existing(name: str, tenant: Tenant | None) -> Tenant:
        if tenant is None:
            raise NotFound(f"tenant {name!r} does not exist")
        return tenant

    def authenticate(self, api_key: str) -> Tenant:
        """Find the tenant a key belongs to; ``NotFound`` for unknown, revoked or expired keys."""
        found = lookup(key_index(self.list()), api_key)
        if found is None:
            raise NotFound("unknown, revoked or expired API key")
        return found
