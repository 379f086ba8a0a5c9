"""One bad record never takes the fleet down.

A store seeded with one corrupt tenant, one corrupt manifest and one corrupt route table:
the gateway starts, serves the good models, reports each bad record once (health, metric,
log) and keeps applying later changes; the listing commands skip and name them; ``fleet
doctor`` lists them with what to do, and changes nothing unless asked.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import httpx
import pytest

from fleet import records
from fleet.catalog.registry import Registry
from fleet.catalog.routes.store import Router
from fleet.catalog.routes.table import Shadow
from fleet.catalog.tenants import Quota, Tenants
from fleet.control import doctor
from fleet.errors import FleetError, InvalidInput
from fleet.gateway.view import FleetView
from fleet.store import MemoryStore
from tests.fakes import FakeRuntime
from tests.gateway_env import ADMIN_TOKEN, MODEL, GatewayEnv, infer, metric, wait_for
from tests.quiet import assert_quiet
from tests.serving_env import FLEET
from tests.test_registry import META

MANIFEST = f"models/{MODEL}/1.1.0/manifest.json"
ROUTE = "routes/ghost-model.json"
TENANT = "tenants/evil.json"
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


def corrupt(env: GatewayEnv) -> bytes:
    """Three bad records beside good ones; returns the manifest's good bytes."""
    good_manifest = env.store.get(MANIFEST).data
    env.store.put(MANIFEST, good_manifest.replace(b'"framework": "torch"', b'"framework": 7'))
    env.store.put(ROUTE, b'{"model": "ghost-model", "stable": ')  # a writer died mid-file
    Tenants(env.store).create("evil", {MODEL: ["*"]}, Quota(rps=5, burst=5))
    env.store.put(TENANT, env.store.get(TENANT).data.replace(b'"rps": 5.0', b'"rps": null'))
    return good_manifest


def fleet(env: GatewayEnv, *args: str) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        [FLEET, *args], env=env.env(COLUMNS="200"), cwd=env.root, capture_output=True, text=True, timeout=60
    )
    assert_quiet(proc.stdout + proc.stderr, f"fleet {' '.join(args)}")
    return proc


def test_a_gateway_starts_on_a_store_with_bad_records_serves_the_good_ones_and_reports_them(tmp_path: Path) -> None:
    env = GatewayEnv(tmp_path)
    try:
        env.register("1.0.0", "1.1.0")
        env.stub("1.0.0")
        env.route(stable="1.0.0")
        env.route(canary="1.1.0", weight=100)  # every request would go to the canary ...
        key = env.tenant("apps")
        good_manifest = corrupt(env)  # ... whose manifest is now unreadable
        url, _ = env.gateway()
        with httpx.Client(base_url=url, timeout=10) as c:
            ready = c.get("/v2/health/ready")
            assert ready.status_code == 200, ready.text
            health = ready.json()
            assert (health["routing_state"], health["store_reachable"]) == ("current", True)
            # anyone sees how many; the keys and reasons (tenant names, the store) need the admin token
            assert health["bad_records"] == {"ModelVersion": 1, "RouteTable": 1, "Tenant": 1}
            assert "evil" not in ready.text and "ghost" not in ready.text
            detail = c.get("/v2/health/ready", headers=ADMIN).json()["bad_records"]
            assert {b["key"] for b in detail} == {MANIFEST, ROUTE, TENANT}
            assert metric(url, "fleet_store_bad_records") == 3
            assert metric(url, "fleet_store_bad_records", kind="Tenant") == 1
            for _ in range(5):  # the unreadable canary is left out: its traffic stays on stable
                r = infer(c, key)
                assert r.status_code == 200, r.text
                assert r.headers["x-fleet-model-version"] == "1.0.0"
            # later changes still apply: a tenant created now can call at once
            late = env.tenant("late")
            wait_for(lambda: infer(c, late).status_code == 200, timeout=20, what="a new tenant's key to work")
            # a fixed manifest is picked up again without a restart
            env.store.put(MANIFEST, good_manifest)
            wait_for(
                lambda: "ModelVersion" not in c.get("/v2/health/ready").json()["bad_records"],
                timeout=20,
                what="the fixed manifest to leave the bad records",
            )
        log = next(tmp_path.glob("gateway-*.log")).read_text()
        assert log.count("skipping a bad record") >= 3 and ROUTE in log and TENANT in log
    finally:
        env.stop()


def test_listing_commands_skip_and_name_bad_records_and_doctor_lists_what_to_do(tmp_path: Path) -> None:
    env = GatewayEnv(tmp_path)
    env.register("1.0.0", "1.1.0")
    env.route(stable="1.0.0")
    env.tenant("apps")
    corrupt(env)
    models = fleet(env, "models", "list")
    assert models.returncode == 0, models.stderr
    assert "1.0.0" in models.stdout and f"skipped {MANIFEST}" in models.stderr
    listed = fleet(env, "models", "list", "--json")
    assert [v["version"] for v in json.loads(listed.stdout)] == ["1.0.0"]
    tenants = fleet(env, "tenants", "list", "--json")
    assert tenants.returncode == 0, tenants.stderr
    assert [t["name"] for t in json.loads(tenants.stdout)] == ["apps"]
    env.store.put(f"rollouts/{MODEL}.json", b'{"model": "not a rollout"')  # a torn rollout record
    status = fleet(env, "status", "--json")
    assert status.returncode == 0, status.stderr
    assert ROUTE in status.stderr and TENANT in status.stderr
    env.store.delete(f"rollouts/{MODEL}.json")
    found = fleet(env, "doctor", "--json")
    assert found.returncode == 1  # bad records remain
    report = {f["key"]: f for f in json.loads(found.stdout)}
    assert set(report) == {MANIFEST, ROUTE, TENANT}
    assert "--restore-route" in report[ROUTE]["advice"] and "--remove" in report[TENANT]["advice"]
    assert "framework" in report[MANIFEST]["reason"]
    assert env.store.get(TENANT).data  # listing changed nothing
    removed = fleet(env, "doctor", "--remove", TENANT)
    assert removed.returncode == 0, removed.stderr
    kept = [k for k in env.store.list("quarantine/") if k.endswith(TENANT)]
    assert len(kept) == 1 and b'"rps": null' in env.store.get(kept[0]).data  # moved aside, not lost
    assert {f["key"] for f in json.loads(fleet(env, "doctor", "--json").stdout)} == {MANIFEST, ROUTE}


def test_doctor_restores_a_route_from_its_last_audited_revision(router: Router) -> None:
    router.set("demo", stable="1.0.0", why="first")
    router.set("demo", canary="1.1.0", weight=10, why="canary")
    router.store.put("routes/demo.json", b"not json")
    with pytest.raises(InvalidInput, match="not a bad record"):
        doctor.restore_route(router.store, "routes/other.json")
    restored = doctor.restore_route(router.store, "routes/demo.json")
    assert (restored.revision, restored.stable, restored.canary.weight) == (3, "1.0.0", 10)
    assert router.get("demo").canary.version == "1.1.0"
    assert doctor.scan(router.store) == []
    last = [e for e in router.history("demo") if e.kind == "route"][-1]  # the restore is audited
    assert (last.revision, last.why) == (3, "restored r2 by fleet doctor")
    router.set("demo", weight=20, why="and on")  # the next change follows on
    assert router.get("demo").revision == 4


def test_a_record_that_turns_bad_keeps_its_last_good_copy_in_the_gateway(tmp_path: Path) -> None:
    store = MemoryStore()
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "w").write_text("w")
    Registry(store).register("demo", "1.0.0", tmp_path / "a", META)
    Router(store).set("demo", stable="1.0.0", why="first")
    # bytes written by hand name no journal entry: the listings' comparison finds them (here every poll)
    view = FleetView(store, FakeRuntime(), resync_s=0)
    assert view.refresh()
    store.put("routes/demo.json", b'{"model": "demo", "stable": 1}')
    view.refresh()
    assert view.snapshot.routes["demo"].stable == "1.0.0"
    assert [b.key for b in view.bad_records] == ["routes/demo.json"]
    assert "last good copy" in view.bad_records[0].reason
    store.delete("routes/demo.json")
    view.refresh()
    assert view.bad_records == [] and "demo" not in view.snapshot.routes


def test_a_record_that_would_not_read_back_is_never_written() -> None:
    store = MemoryStore()
    with pytest.raises(InvalidInput, match="would not read back"):
        records.dump(_Loose(value=float("inf")))
    assert list(store.list()) == []


class _Loose(records.BaseModel):  # a model that forgot allow_inf_nan=False
    value: float


def test_a_copied_tenant_file_cannot_keep_a_revoked_key_working(tmp_path: Path) -> None:
    store = MemoryStore()
    tenants = Tenants(store)
    _, key = tenants.create("acme", {"demo": ["*"]})
    store.put("tenants/acme.backup.json", store.get("tenants/acme.json").data)
    store.put("tenants/old/acme.json", store.get("tenants/acme.json").data)
    tenants.revoke("acme")
    found, bad = tenants.scan()
    assert [t.name for t in found] == ["acme"] and {b.key for b in bad} == {
        "tenants/acme.backup.json",
        "tenants/old/acme.json",
    }
    with pytest.raises(FleetError, match="unknown, revoked or expired"):
        tenants.authenticate(key)
    view = FleetView(store, FakeRuntime())
    view.refresh()
    assert view.snapshot.tenant_for(key) is None
    assert {b.key for b in view.bad_records} == {"tenants/acme.backup.json", "tenants/old/acme.json"}


def test_a_table_stored_with_shadow_equal_to_stable_stays_readable_and_fixable(router: Router) -> None:
    router.set("demo", stable="1.0.0", why="first")
    t = router.get("demo")
    # written before shadow = stable was refused: reading it must not turn it into a bad record
    old = t.model_copy(update={"shadow": Shadow(version="1.0.0", percent=10)})
    router.store.put("routes/demo.json", records.dump(old))
    assert router.get("demo").shadow is not None and doctor.scan(router.store) == []
    with pytest.raises(InvalidInput, match="shadow 1.0.0 is already the stable version"):
        router.set("demo", shadow_percent=20, why="still refused on write")
    router.set("demo", clear_shadow=True, why="fix it")
    assert router.get("demo").shadow is None


def test_a_new_route_is_seen_only_together_with_its_replicas(tmp_path: Path) -> None:
    """A version is started, then routed to (a rollback's target, a canary). The gateway's
    requests (on the event loop) must never see the new route before ``on_change`` has given
    the pools its replica: in between, the version has no replica and the caller gets a 503."""
    import asyncio

    store = MemoryStore()
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "w").write_text("w")
    for version in ("1.0.0", "1.1.0"):
        Registry(store).register("demo", version, tmp_path / "a", META)
    Router(store).set("demo", stable="1.0.0", why="first")
    runtime = FakeRuntime({("demo", "1.0.0"): 1, ("demo", "1.1.0"): 1})
    view = FleetView(store, runtime, interval=0.005)

    def canary(snapshot) -> str | None:  # noqa: ANN001
        table = snapshot.routes.get("demo")
        return None if table is None else (table.canary.version if table.canary else "none")

    async def main() -> list[str]:
        published: list[str | None] = []
        early: list[str] = []

        def on_change(snapshot) -> None:  # noqa: ANN001
            published.append(canary(snapshot))

        async def requests() -> None:  # what a request handler reads, at every turn of the loop
            while True:
                seen = canary(view.snapshot)
                if seen is not None and (not published or seen != published[-1]):
                    early.append(seen)
                await asyncio.sleep(0)

        poller, reader = asyncio.create_task(view.run(on_change)), asyncio.create_task(requests())
        try:
            for round_ in range(40):
                if round_ % 2 == 0:
                    Router(store).set("demo", canary="1.1.0", weight=10, why=f"round {round_}")
                else:
                    Router(store).set("demo", clear_canary=True, why=f"round {round_}")
                target = "1.1.0" if round_ % 2 == 0 else "none"
                async with asyncio.timeout(10):
                    while not published or published[-1] != target:
                        await asyncio.sleep(0)
        finally:
            poller.cancel()
            reader.cancel()
        return early

    assert asyncio.run(main()) == []
