"""Tenants: keys are shown once and stored hashed; entitlements; revocation, expiry and
rotation; records validated on write and one bad record never hiding the others."""

from __future__ import annotations

import hashlib
import json
import math
import os
import subprocess
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from pydantic import ValidationError

from fleet import records
from fleet.catalog.tenants import ApiKey, Quota, Tenant, Tenants, key_index, lookup, make_quota, parse_entitlements
from fleet.errors import Conflict, IntegrityError, InvalidInput, NotFound
from fleet.store import open_store
from fleet.types import ObjectStore
from tests.quiet import assert_quiet
from tests.serving_env import FLEET


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


# -- records validated on write -------------------------------------------------------------


@pytest.mark.parametrize("rps", [math.inf, -math.inf, math.nan])
def test_a_quota_refuses_inf_and_nan(rps: float) -> None:
    """JSON has no inf or NaN: stored, they came back as null and broke every reader."""
    with pytest.raises(ValidationError):
        Quota(rps=rps, burst=5)
    with pytest.raises(InvalidInput, match=r"^rps (inf|-inf|nan) is not valid; expected a finite number > 0$"):
        make_quota(rps, 5)
    with pytest.raises(InvalidInput, match="burst 0 is not valid; expected a whole number >= 1"):
        make_quota(5, 0)
    for tokens in (0, -5):
        with pytest.raises(
            InvalidInput, match=f"tokens per minute {tokens} is not valid; expected a whole number >= 1"
        ):
            make_quota(5, 5, tokens_per_minute=tokens)
    with pytest.raises(ValidationError):
        Quota(rps=5, burst=5, tokens_per_minute=0)


def fleet(store_url: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "FLEET_STORE": store_url, "FLEET_ACTOR": "tenants-test", "COLUMNS": "250"}
    proc = subprocess.run([FLEET, *args], capture_output=True, text=True, env=env, timeout=60)
    assert_quiet(proc.stdout + proc.stderr, f"fleet {' '.join(args)}")
    return proc


def test_the_cli_refuses_an_infinite_or_nan_rate_in_one_line_and_stores_nothing(tmp_path: Path) -> None:
    url = f"file://{tmp_path / 'store'}"
    for rps in ("inf", "nan"):
        proc = fleet(url, "tenants", "create", "x", "--model", "m", "--rps", rps, "--burst", "5")
        assert proc.returncode == 1, proc.stdout
        assert proc.stderr == f"error: rps {rps} is not valid; expected a finite number > 0\n"
    listed = fleet(url, "tenants", "list", "--json")
    assert listed.returncode == 0 and json.loads(listed.stdout) == [] and listed.stderr == ""


@pytest.mark.parametrize("spec", ["churn:", "churn:,", "churn: , "])
def test_an_entitlement_with_a_colon_but_no_version_is_refused_not_widened(spec: str) -> None:
    with pytest.raises(InvalidInput, match="names no version; expected MODEL \\(every version\\) or MODEL:VERSION"):
        parse_entitlements([spec])
    assert parse_entitlements(["churn"]) == {"churn": ["*"]}  # every version is said without a colon


def test_the_duplicate_tenant_error_names_the_command_that_adds_a_key(store: ObjectStore) -> None:
    Tenants(store).create("acme", {"demo": ["*"]})
    with pytest.raises(Conflict, match="add a key to it with `fleet tenants add-key acme`"):
        Tenants(store).create("acme", {"demo": ["*"]})


# -- one bad record is skipped, not fatal ---------------------------------------------------

# what `--rps inf` used to store: every reader of it failed
_NULL_RPS = {
    "name": "nulls",
    "entitlements": {"m": ["*"]},
    "quota": {"rps": None, "burst": 5},
    "keys": [],
    "created_at": "2026-01-01T00:00:00Z",
    "created_by": "old-cli",
}


def corrupt(store: ObjectStore) -> None:
    store.put("tenants/nulls.json", json.dumps(_NULL_RPS).encode())
    store.put("tenants/broken.json", b"{not json")


def test_list_skips_a_bad_tenant_record_and_still_lists_the_others(store: ObjectStore) -> None:
    tenants = Tenants(store)
    tenants.create("acme", {"demo": ["*"]})
    tenants.create("globex", {"demo": ["1.0.0"]})
    corrupt(store)
    assert sorted(t.name for t in tenants.list()) == ["acme", "globex"]
    good, bad = tenants.scan()
    assert sorted(t.name for t in good) == ["acme", "globex"]
    assert sorted(b.key for b in bad) == ["tenants/broken.json", "tenants/nulls.json"]
    assert all(b.kind == "Tenant" for b in bad)
    assert "quota.rps" in next(b.reason for b in bad if b.key == "tenants/nulls.json")
    _, key = tenants.add_key("acme")
    assert tenants.authenticate(key).name == "acme"  # authentication reads past the bad ones


@pytest.mark.parametrize("operation", ["revoke", "add_key", "rotate", "get"])
def test_changing_a_tenant_whose_own_record_is_bad_fails_naming_the_key(store: ObjectStore, operation: str) -> None:
    corrupt(store)
    with pytest.raises(IntegrityError, match=r"^'tenants/nulls.json' in .* is not a valid Tenant record"):
        getattr(Tenants(store), operation)("nulls")


def test_the_cli_lists_the_good_tenants_and_names_each_bad_one_on_stderr(tmp_path: Path) -> None:
    url = f"file://{tmp_path / 'store'}"
    assert fleet(url, "tenants", "create", "acme", "--model", "demo").returncode == 0
    corrupt(open_store(url))
    proc = fleet(url, "tenants", "list")
    assert proc.returncode == 0 and "acme" in proc.stdout and "nulls" not in proc.stdout
    lines = proc.stderr.splitlines()
    assert len(lines) == 2, proc.stderr
    assert lines[0].startswith("skipped tenants/broken.json: ") and lines[0].endswith("; run `fleet doctor`")
    assert lines[1].startswith("skipped tenants/nulls.json: ") and "quota.rps" in lines[1]
    assert [t["name"] for t in json.loads(fleet(url, "tenants", "list", "--json").stdout)] == ["acme"]


# -- expiry ---------------------------------------------------------------------------------

NOW = datetime.now(UTC)


def key(key_id: str, **fields: datetime | None) -> tuple[str, ApiKey]:
    """A plaintext key and its record, with the times a test chooses."""
    plaintext = f"sfk_{key_id}_secret-{key_id}"
    sha = hashlib.sha256(plaintext.encode()).hexdigest()
    return plaintext, ApiKey(id=key_id, sha256=sha, created_at=NOW - timedelta(days=1), **fields)


def tenant(*keys: ApiKey) -> Tenant:
    return Tenant(name="acme", entitlements={"demo": ["*"]}, keys=list(keys), created_at=NOW, created_by="t")


def test_an_expired_key_answers_like_an_unknown_one_and_a_future_expiry_still_works() -> None:
    old, old_key = key("0000aaaa", expires_at=NOW - timedelta(seconds=1))
    soon, soon_key = key("0000bbbb", expires_at=NOW + timedelta(hours=1))
    gone, gone_key = key("0000cccc", revoked_at=NOW - timedelta(hours=1), expires_at=NOW + timedelta(hours=1))
    t = tenant(old_key, soon_key, gone_key)
    index = key_index([t])
    assert set(index) == {"0000bbbb"}
    assert lookup(index, soon) == t and t.matches(soon) and t.active
    assert lookup(index, old) is None and lookup(index, gone) is None
    assert lookup(index, old) == lookup(index, "sfk_0000dddd_unknown")
    assert not tenant(old_key, gone_key).active


def test_a_key_that_expires_after_the_index_was_built_is_refused_at_lookup() -> None:
    """The gateway rebuilds its index only when a record changes; a grace period ends without one."""
    plaintext, k = key("0000aaaa", expires_at=NOW - timedelta(seconds=1))
    index = key_index([tenant(k)], at=NOW - timedelta(minutes=1))  # built while it was live
    assert "0000aaaa" in index
    assert lookup(index, plaintext) is None
    assert tenant(k).matches(plaintext, at=NOW - timedelta(minutes=1))  # it was live then


def test_records_without_expiry_stay_valid_and_a_zoneless_expiry_is_utc(store: ObjectStore) -> None:
    _, k = key("0000aaaa")
    raw = tenant(k).model_dump(mode="json")
    del raw["keys"][0]["expires_at"], raw["keys"][0]["replaced_by"]  # a record written before them
    store.put("tenants/acme.json", json.dumps(raw).encode())
    assert Tenants(store).get("acme").keys[0].expires_at is None
    naive = ApiKey.model_validate({**raw["keys"][0], "expires_at": "2030-01-01T00:00:00"})
    assert naive.expires_at == datetime(2030, 1, 1, tzinfo=UTC)


# -- add-key and rotate ---------------------------------------------------------------------


def expire_all_but(store: ObjectStore, name: str, keep: str | None = None) -> None:
    """Move every key's expiry (but ``keep``'s) into the past, as if a grace period had run out:
    explicit times instead of sleeping through one."""
    past = datetime.now(UTC) - timedelta(seconds=1)
    records.update(
        store,
        f"tenants/{name}.json",
        Tenant,
        lambda t: t.model_copy(
            update={"keys": [k if k.id == keep else k.model_copy(update={"expires_at": past}) for k in t.keys]}
        ),
    )


def test_add_key_works_for_a_tenant_whose_keys_are_all_revoked_or_expired(store: ObjectStore) -> None:
    tenants = Tenants(store)
    _, first = tenants.create("acme", {"demo": ["*"]})
    tenants.revoke("acme")
    assert not tenants.get("acme").active
    _, second = tenants.add_key("acme")
    assert tenants.authenticate(second).name == "acme" and tenants.get("acme").active
    expire_all_but(store, "acme")
    with pytest.raises(NotFound, match="unknown, revoked or expired"):
        tenants.authenticate(second)
    _, third = tenants.add_key("acme")
    assert tenants.authenticate(third).name == "acme"
    for dead in (first, second):
        with pytest.raises(NotFound):
            tenants.authenticate(dead)


def test_rotate_adds_a_key_and_retires_the_old_ones_after_the_grace(store: ObjectStore) -> None:
    tenants = Tenants(store)
    _, a = tenants.create("acme", {"demo": ["*"]})
    _, b = tenants.add_key("acme")
    before = datetime.now(UTC)
    t, new = tenants.rotate("acme", grace=timedelta(hours=1))
    new_id = t.keys[-1].id
    assert new.startswith(f"sfk_{new_id}_") and len(t.keys) == 3
    for k in t.keys[:2]:
        assert k.replaced_by == new_id and k.revoked_at is None
        assert before + timedelta(hours=1) <= k.expires_at <= datetime.now(UTC) + timedelta(hours=1)
    assert [k.id for k in t.replaced(new_id)] == [k.id for k in t.keys[:2]]
    assert {tenants.authenticate(x).name for x in (a, b, new)} == {"acme"}  # all work during the grace
    expire_all_but(store, "acme", new_id)  # the grace runs out
    for old in (a, b):
        with pytest.raises(NotFound):
            tenants.authenticate(old)
    assert tenants.authenticate(new).name == "acme"


def test_rotate_with_no_grace_revokes_at_once_and_key_id_retires_only_that_key(store: ObjectStore) -> None:
    tenants = Tenants(store)
    _, a = tenants.create("acme", {"demo": ["*"]})
    t, b = tenants.add_key("acme")
    a_id, b_id = t.keys[0].id, t.keys[1].id
    t, c = tenants.rotate("acme", a_id, grace=timedelta(0))
    retired = t.replaced(t.keys[-1].id)
    assert [k.id for k in retired] == [a_id] and retired[0].revoked_at == t.keys[-1].created_at
    with pytest.raises(NotFound):
        tenants.authenticate(a)
    assert tenants.authenticate(b).name == tenants.authenticate(c).name == "acme"
    assert tenants.get("acme").keys[1].expires_at is None  # b untouched
    with pytest.raises(Conflict, match=f"key '{a_id}' of tenant 'acme' is already revoked or expired"):
        tenants.rotate("acme", a_id, grace=timedelta(0))
    with pytest.raises(NotFound, match="has no key 'nope'"):
        tenants.rotate("acme", "nope")
    assert b_id in {k.id for k in tenants.get("acme").live_keys()}


def test_a_rotation_never_lengthens_a_key_s_life(store: ObjectStore) -> None:
    tenants = Tenants(store)
    tenants.create("acme", {"demo": ["*"]})
    t, _ = tenants.rotate("acme", grace=timedelta(minutes=5))
    first_expiry = t.keys[0].expires_at
    t, _ = tenants.rotate("acme", grace=timedelta(days=2))
    assert t.keys[0].expires_at == first_expiry  # still 5 minutes, not 2 days
    assert t.keys[1].expires_at > first_expiry + timedelta(days=1)


@pytest.mark.parametrize(("grace", "said"), [(timedelta(seconds=-1), "-1s"), (timedelta(days=31), "31d")])
def test_rotate_refuses_a_negative_or_absurd_grace_and_writes_nothing(
    store: ObjectStore, grace: timedelta, said: str
) -> None:
    tenants = Tenants(store)
    tenants.create("acme", {"demo": ["*"]})
    etag = store.get("tenants/acme.json").etag
    with pytest.raises(
        InvalidInput, match=f"^grace {said} is not valid; expected 0 \\(stop the old key at once\\) up to 30d$"
    ):
        tenants.rotate("acme", grace=grace)
    assert store.get("tenants/acme.json").etag == etag


def test_rotate_refuses_a_tenant_without_a_live_key_and_points_at_add_key(store: ObjectStore) -> None:
    tenants = Tenants(store)
    tenants.create("acme", {"demo": ["*"]})
    tenants.revoke("acme")
    with pytest.raises(Conflict, match="has no live key to rotate .*`fleet tenants add-key acme`"):
        tenants.rotate("acme")
    with pytest.raises(NotFound, match="tenant 'ghost' does not exist"):
        tenants.rotate("ghost")


def test_the_cli_adds_and_rotates_keys_and_shows_when_the_old_ones_stop(tmp_path: Path) -> None:
    url = f"file://{tmp_path / 'store'}"
    assert fleet(url, "tenants", "create", "acme", "--model", "demo").returncode == 0
    added = fleet(url, "tenants", "add-key", "acme", "--json")
    assert added.returncode == 0, added.stderr
    added_key = json.loads(added.stdout)["api_key"]
    rotated = fleet(url, "tenants", "rotate", "acme", "--grace", "90s")
    assert rotated.returncode == 0, rotated.stderr
    new_key = next(line for line in rotated.stdout.splitlines() if line.startswith("sfk_"))
    stops = [line for line in rotated.stdout.splitlines() if line.startswith("old key ")]
    assert len(stops) == 2 and all(" stops working at 20" in line and line.count(" UTC (") == 1 for line in stops)
    tenants = Tenants(open_store(url))
    assert tenants.authenticate(new_key).name == tenants.authenticate(added_key).name == "acme"
    listed = fleet(url, "tenants", "list").stdout
    assert listed.count("(expires 20") == 2 and " UTC)" in listed
    expire_all_but(tenants.store, "acme", new_key.split("_")[1])
    assert fleet(url, "tenants", "list").stdout.count("(expired)") == 2
    revoked = fleet(url, "tenants", "rotate", "acme", "--grace", "0")
    assert "(revoked, no grace)" in revoked.stdout and "(revoked)" in fleet(url, "tenants", "list").stdout
    for bad in ("90", "1w", "-1h", "31d"):
        proc = fleet(url, "tenants", "rotate", "acme", "--grace", bad)
        assert proc.returncode == 1 and proc.stderr.count("\n") == 1 and "expected 0" in proc.stderr, proc.stderr
