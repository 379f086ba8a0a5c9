"""Tenants: who may call which model versions, at what rate, with which API keys.

An API key is shown once, when it is made; the store keeps only its SHA-256. Keys look
like ``sfk_<key id>_<secret>``: the key id lets a server index keys in memory (``key_index``)
instead of hashing against every tenant, and the hash is compared in constant time
(``lookup``). That is the one authentication rule: the gateway looks keys up in the index
its routing snapshot holds, ``Tenants.authenticate`` in one built from the store.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Iterable, Mapping
from datetime import datetime

from pydantic import BaseModel, ConfigDict, Field

from fleet import audit, records
from fleet.errors import Conflict, InvalidInput, NotFound, PreconditionFailed
from fleet.names import check_name, check_version
from fleet.types import ObjectStore

KEY_PREFIX = "sfk_"
MAX_KEY_LENGTH = 128  # a made key is about 60 characters; anything far longer is not one


class Quota(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    rps: float = Field(gt=0)
    burst: int = Field(ge=1)


class ApiKey(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    id: str
    sha256: str
    created_at: datetime
    revoked_at: datetime | None = None


class Tenant(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    # model → allowed versions: ["*"] for every version, else exact versions.
    entitlements: dict[str, list[str]]
    quota: Quota | None = None
    keys: list[ApiKey] = []
    created_at: datetime
    created_by: str

    @property
    def active(self) -> bool:
        return any(k.revoked_at is None for k in self.keys)

    def allows(self, model: str, version: str | None = None) -> bool:
        allowed = self.entitlements.get(model)
        if not allowed:
            return False
        return version is None or "*" in allowed or version in allowed

    def matches(self, api_key: str) -> bool:
        """Constant-time check of ``api_key`` against this tenant's live keys."""
        digest = _hash(api_key)
        hits = [hmac.compare_digest(digest, k.sha256) for k in self.keys if k.revoked_at is None]
        return any(hits)


def _hash(api_key: str) -> str:
    return hashlib.sha256(api_key.encode()).hexdigest()


def key_index(tenants: Iterable[Tenant]) -> dict[str, Tenant]:
    """Key id → tenant, for every live key."""
    return {k.id: t for t in tenants for k in t.keys if k.revoked_at is None}


def lookup(index: Mapping[str, Tenant], api_key: str) -> Tenant | None:
    """The tenant owning a live ``api_key``, or None (unknown, revoked or malformed)."""
    if not api_key.startswith(KEY_PREFIX) or len(api_key) > MAX_KEY_LENGTH:
        return None
    tenant = index.get(api_key[len(KEY_PREFIX):].split("_", 1)[0])
    return tenant if tenant is not None and tenant.matches(api_key) else None


def _new_key() -> tuple[str, ApiKey]:
    key_id = secrets.token_hex(4)
    plaintext = f"{KEY_PREFIX}{key_id}_{secrets.token_urlsafe(32)}"
    return plaintext, ApiKey(id=key_id, sha256=_hash(plaintext), created_at=audit.now())


def parse_entitlements(specs: list[str]) -> dict[str, list[str]]:
    """``["demo", "other:1.0.0,1.1.0"]`` → ``{"demo": ["*"], "other": ["1.0.0", "1.1.0"]}``."""
    out: dict[str, list[str]] = {}
    for spec in specs:
        model, _, versions = spec.partition(":")
        check_name("model", model)
        vs = [v.strip() for v in versions.split(",") if v.strip()] if versions else ["*"]
        for v in vs:
            if v != "*":
                check_version(v)
        out.setdefault(model, [])
        out[model] = sorted(set(out[model]) | set(vs))
    if not out:
        raise InvalidInput("a tenant needs at least one entitlement; expected MODEL or MODEL:VERSION[,VERSION]")
    return out


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

    def list(self) -> list[Tenant]:
        return [
            records.load(self.store, key, Tenant)[0]
            for key in self.store.list("tenants/")
            if key.endswith(".json")
        ]

    def create(
        self,
        name: str,
        entitlements: dict[str, list[str]],
        quota: Quota | None = None,
        *,
        who: str | None = None,
    ) -> tuple[Tenant, str]:
        """Create a tenant with one API key; return it and the key's only plaintext copy."""
        plaintext, key = _new_key()
        tenant = Tenant(
            name=check_name("tenant", name), entitlements=entitlements, quota=quota,
            keys=[key], created_at=audit.now(), created_by=who or audit.actor(),
        )  # fmt: skip
        try:
            records.create(self.store, self._key(name), tenant)
        except PreconditionFailed:
            raise Conflict(f"tenant {name!r} already exists; pick another name or add a key to it") from None
        return tenant, plaintext

    def add_key(self, name: str) -> tuple[Tenant, str]:
        plaintext, key = _new_key()
        _, after = records.update(
            self.store, self._key(name), Tenant,
            lambda t: self._existing(name, t).model_copy(update={"keys": [*t.keys, key]}),
        )  # fmt: skip
        return after, plaintext

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
                k.model_copy(update={"revoked_at": at})
                if k.revoked_at is None and key_id in (None, k.id)
                else k
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
        """Find the tenant a key belongs to; ``NotFound`` for unknown or revoked keys."""
        found = lookup(key_index(self.list()), api_key)
        if found is None:
            raise NotFound("unknown or revoked API key")
        return found
