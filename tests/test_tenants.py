"""Tenants: keys are shown once and stored hashed; entitlements; revocation."""

from __future__ import annotations

import hashlib

import pytest

from fleet.errors import Conflict, InvalidInput, NotFound
from fleet.tenants import Quota, Tenants, parse_entitlements
from fleet.types import ObjectStore


def test_create_stores_only_the_hash_of_the_key(store: ObjectStore) -> None:
    tenants = Tenants(store)
    tenant, key = tenants.create("acme", {"demo": ["*"]}, Quota(rps=5, burst=10), who="ann")
    raw = store.get("tenants/acme.json").data.decode()
    assert key.startswith("sfk_") and key not in raw
    assert hashlib.sha256(key.encode()).hexdigest() in raw
    assert tenants.authenticate(key).name == "acme"
    assert tenants.get("acme").quota == Quota(rps=5, burst=10)


def test_unknown_and_revoked_keys_do_not_authenticate(store: ObjectStore) -> None:
    tenants = Tenants(store)
    _, key = tenants.create("acme", {"demo": ["*"]})
    _, second = tenants.add_key("acme")
    with pytest.raises(NotFound):
        tenants.authenticate(key[:-1] + ("x" if key[-1] != "x" else "y"))
    key_id = key.split("_")[1]
    tenants.revoke("acme", key_id)
    with pytest.raises(NotFound):
        tenants.authenticate(key)
    assert tenants.authenticate(second).name == "acme"
    with pytest.raises(Conflict, match=f"key '{key_id}' of tenant 'acme' is already revoked"):
        tenants.revoke("acme", key_id)
    tenants.revoke("acme")
    with pytest.raises(NotFound):
        tenants.authenticate(second)
    assert not tenants.get("acme").active
    with pytest.raises(Conflict, match="every key of tenant 'acme' is already revoked"):
        tenants.revoke("acme")


def test_duplicate_tenant_and_unknown_key_id_are_refused(store: ObjectStore) -> None:
    tenants = Tenants(store)
    tenants.create("acme", {"demo": ["*"]})
    with pytest.raises(Conflict, match="already exists"):
        tenants.create("acme", {"demo": ["*"]})
    with pytest.raises(NotFound, match="has no key 'nope'"):
        tenants.revoke("acme", "nope")
    with pytest.raises(NotFound, match="tenant 'ghost' does not exist"):
        tenants.revoke("ghost")


def test_entitlements_parse_and_allow() -> None:
    ents = parse_entitlements(["demo", "other:1.0.0,1.1.0"])
    assert ents == {"demo": ["*"], "other": ["1.0.0", "1.1.0"]}
    with pytest.raises(InvalidInput, match="not a semantic version"):
        parse_entitlements(["demo:latest"])
    with pytest.raises(InvalidInput, match="at least one entitlement"):
        parse_entitlements([])


def test_allows_checks_model_and_version(store: ObjectStore) -> None:
    tenant, _ = Tenants(store).create("acme", {"demo": ["*"], "other": ["1.0.0"]})
    assert tenant.allows("demo", "9.9.9") and tenant.allows("other", "1.0.0")
    assert not tenant.allows("other", "1.1.0") and not tenant.allows("third")
