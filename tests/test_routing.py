"""Routing: the pure version choice, validation, audited updates and history."""

from __future__ import annotations

import threading
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from fleet import audit, records
from fleet.errors import Forbidden, InvalidInput, NotFound
from fleet.registry import Registry, State
from fleet.routing import Canary, RouteTable, Router, Shadow, choose_version, should_shadow, validate_states
from fleet.store import MemoryStore
from fleet.tenants import Tenant, Tenants
from fleet.types import ObjectStore

from tests.test_registry import META

KEYS = [f"user-{i}" for i in range(100_000)]


def tenant(name: str = "acme", versions: list[str] | None = None) -> Tenant:
    return Tenant(
        name=name, entitlements={"demo": versions or ["*"]}, created_at=audit.now(), created_by="t"
    )  # fmt: skip


def table(weight: float, **kw) -> RouteTable:
    return RouteTable(model="demo", stable="1.0.0", canary=Canary(version="1.1.0", weight=weight), **kw)


# -- pure choice -----------------------------------------------------------------------


def test_choice_is_sticky_per_routing_key() -> None:
    t = table(30)
    first = [choose_version(t, None, k).version for k in KEYS[:2000]]
    assert first == [choose_version(t, None, k).version for k in KEYS[:2000]]


def test_raising_the_weight_only_moves_keys_from_stable_to_canary() -> None:
    previous = {k: choose_version(table(0), None, k).version for k in KEYS[:20_000]}
    assert set(previous.values()) == {"1.0.0"}
    for weight in (0.5, 1, 5, 10, 25, 50, 75, 99, 100):
        current = {k: choose_version(table(weight), None, k).version for k in KEYS[:20_000]}
        moved_back = [k for k in KEYS[:20_000] if previous[k] == "1.1.0" and current[k] == "1.0.0"]
        assert moved_back == [], f"weight {weight} moved keys back to stable"
        previous = current
    assert set(previous.values()) == {"1.1.0"}


@pytest.mark.parametrize("weight", [1, 10, 33.3, 50, 90])
def test_split_matches_the_weight_over_100k_keys(weight: float) -> None:
    t = table(weight)
    share = sum(choose_version(t, None, k).version == "1.1.0" for k in KEYS) / len(KEYS)
    # binomial sd at n=100k is <= 0.16 %; allow ~4 sd
    assert abs(share - weight / 100) < 0.007


def test_reason_tells_why_a_version_was_chosen() -> None:
    t = table(50)
    reasons = {choose_version(t, None, k).reason for k in KEYS[:200]}
    assert reasons == {"stable", "canary"}


def test_pin_beats_the_split_and_requested_version_beats_the_pin() -> None:
    t = table(100, pins={"acme": "0.9.0"})
    assert choose_version(t, tenant("acme"), "k").version == "0.9.0"
    assert choose_version(t, tenant("acme"), "k").reason == "pinned"
    assert choose_version(t, tenant("other"), "k").version == "1.1.0"
    chosen = choose_version(t, tenant("acme"), "k", requested_version="1.0.0")
    assert (chosen.version, chosen.reason) == ("1.0.0", "requested")


def test_requested_version_must_be_allowed_and_served() -> None:
    t = table(10)
    with pytest.raises(Forbidden, match=r"tenant 'acme' may not use demo:1.1.0; allowed: 1.0.0"):
        choose_version(t, tenant("acme", ["1.0.0"]), "k", requested_version="1.1.0")
    with pytest.raises(NotFound, match="version 2.0.0 of demo is not served; served: 1.0.0, 1.1.0"):
        choose_version(t, tenant(), "k", requested_version="2.0.0")


def test_a_model_without_stable_has_nothing_to_serve() -> None:
    with pytest.raises(NotFound, match="no stable version"):
        choose_version(RouteTable(model="demo"), None, "k")


def test_shadow_sampling_follows_its_percent() -> None:
    t = table(0, shadow=Shadow(version="1.1.0", percent=20))
    share = sum(should_shadow(t, k) for k in KEYS[:50_000]) / 50_000
    assert abs(share - 0.2) < 0.01
    assert not any(should_shadow(table(0), k) for k in KEYS[:1000])


# -- validation ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"canary": {"version": "1.1.0", "weight": 5}}, "a canary needs a stable"),
        ({"stable": "1.0.0", "canary": {"version": "1.0.0", "weight": 5}}, "already the stable"),
        ({"stable": "1.0.0", "canary": {"version": "1.1.0", "weight": 101}}, "less than or equal to 100"),
        ({"shadow": {"version": "1.1.0", "percent": 5}}, "a shadow needs a stable"),
    ],
)
def test_table_shape_is_validated(data: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        RouteTable(model="demo", **data)


def test_states_are_validated_per_role() -> None:
    states = {"1.0.0": State.STABLE, "1.1.0": State.REJECTED, "1.2.0": State.REGISTERED, "0.9.0": State.RETIRED}
    with pytest.raises(InvalidInput, match="canary 1.1.0 is rejected"):
        validate_states(table(5), states, "1.0.0")
    with pytest.raises(InvalidInput, match="stable 9.9.9 is not registered"):
        validate_states(RouteTable(model="demo", stable="9.9.9"), states, "1.0.0")
    with pytest.raises(InvalidInput, match="roll it out as a canary first"):
        validate_states(RouteTable(model="demo", stable="1.2.0"), states, "1.0.0")
    with pytest.raises(InvalidInput, match="pin of acme 0.9.0 is retired"):
        validate_states(RouteTable(model="demo", stable="1.0.0", pins={"acme": "0.9.0"}), states, "1.0.0")
    validate_states(RouteTable(model="demo", stable="1.2.0"), states, None)  # first rollout
    validate_states(RouteTable(model="demo", stable="0.9.0"), states, "1.0.0")  # rollback


# -- stored routes ---------------------------------------------------------------------


@pytest.fixture
def router(store: ObjectStore, tmp_path: Path) -> Router:
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "w").write_text("w")
    reg = Registry(store)
    for v in ("1.0.0", "1.1.0", "1.2.0"):
        reg.register("demo", v, tmp_path / "a", META)
    return Router(store, reg)


def test_a_rollout_moves_version_states_with_the_route(router: Router) -> None:
    router.set("demo", stable="1.0.0", why="first", who="ann")
    router.set("demo", canary="1.1.0", weight=10, why="canary")
    router.set("demo", weight=50, why="more")
    assert router.get("demo").canary == Canary(version="1.1.0", weight=50)
    router.set("demo", stable="1.1.0", why="promote")
    t = router.get("demo")
    assert (t.stable, t.canary, t.revision) == ("1.1.0", None, 4)
    assert router.registry.states("demo") == {"1.0.0": State.RETIRED, "1.1.0": State.STABLE, "1.2.0": State.REGISTERED}
    router.set("demo", stable="1.0.0", why="roll back")  # retired → stable
    assert router.registry.states("demo")["1.0.0"] == State.STABLE


def test_refused_changes_write_nothing(router: Router) -> None:
    router.set("demo", stable="1.0.0", why="first")
    with pytest.raises(InvalidInput, match="roll it out as a canary first"):
        router.set("demo", stable="1.2.0", why="skip the canary")
    with pytest.raises(InvalidInput, match="has no canary to change; expected --canary VERSION"):
        router.set("demo", weight=10, why="x")
    with pytest.raises(InvalidInput, match="needs a reason"):
        router.set("demo", canary="1.1.0", weight=5, why=" ")
    with pytest.raises(NotFound, match="'ghost' has no registered versions"):
        router.set("ghost", stable="1.0.0", why="x")
    assert router.get("demo").revision == 1
    assert [e.revision for e in router.history("demo") if e.kind == "route"] == [1]


def test_pins_are_set_and_removed(router: Router) -> None:
    router.set("demo", stable="1.0.0", why="first")
    Tenants(router.store).create("acme", {"demo": ["*"]})
    router.pin("demo", "acme", "1.2.0", why="acme tests 1.2")
    assert router.get("demo").pins == {"acme": "1.2.0"}
    router.unpin("demo", "acme", why="done")
    assert router.get("demo").pins == {}
    with pytest.raises(NotFound, match="no pin"):
        router.unpin("demo", "acme", why="again")


def test_a_pin_needs_a_tenant_entitled_to_the_version(router: Router) -> None:
    router.set("demo", stable="1.0.0", why="first")
    Tenants(router.store).create("globex", {"demo": ["1.0.0"]})
    with pytest.raises(Forbidden, match="'globex' may not use demo:1.2.0; allowed: 1.0.0"):
        router.pin("demo", "globex", "1.2.0", why="x")
    with pytest.raises(NotFound, match="tenant 'ghost' does not exist"):
        router.pin("demo", "ghost", "1.0.0", why="x")
    assert router.get("demo").pins == {}


def test_history_records_who_why_before_and_after(router: Router) -> None:
    router.set("demo", stable="1.0.0", why="first", who="ann")
    router.set("demo", canary="1.1.0", weight=5, why="canary", who="bob")
    route_events = [e for e in router.history("demo") if e.kind == "route"]
    assert [(e.revision, e.who, e.why) for e in route_events] == [(1, "ann", "first"), (2, "bob", "canary")]
    assert route_events[1].before["canary"] is None
    assert route_events[1].after["canary"] == {"version": "1.1.0", "weight": 5.0}


def test_at_answers_what_served_at_a_past_time(router: Router) -> None:
    before_any = audit.now()
    router.set("demo", stable="1.0.0", why="first")
    after_first = audit.now()
    router.set("demo", canary="1.1.0", weight=20, why="canary")
    assert router.at("demo", before_any - timedelta(seconds=1)) is None
    assert router.at("demo", after_first).canary is None
    assert router.at("demo", audit.now()).canary == Canary(version="1.1.0", weight=20)
    with pytest.raises(InvalidInput, match="no timezone"):
        router.at("demo", datetime(2026, 1, 1))


def test_a_lost_audit_event_is_rebuilt_from_the_route(router: Router) -> None:
    router.set("demo", stable="1.0.0", why="first", who="ann")
    router.set("demo", canary="1.1.0", weight=5, why="canary", who="bob")
    router.store.delete(audit.route_event_key("demo", 2))  # the writer died before logging
    events = [e for e in router.history("demo") if e.kind == "route"]
    assert [(e.revision, e.who, e.why) for e in events] == [(1, "ann", "first"), (2, "bob", "canary")]
    assert events[-1].before["canary"] is None
    assert events[-1].after["canary"] == {"version": "1.1.0", "weight": 5.0}


def test_concurrent_route_updates_each_get_their_own_revision() -> None:
    store = MemoryStore()
    reg = Registry(store)
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        Path(d, "w").write_text("w")
        for v in ("1.0.0", "1.1.0"):
            reg.register("demo", v, d, META)
    router = Router(store, reg)
    router.set("demo", stable="1.0.0", why="first")
    router.set("demo", canary="1.1.0", weight=0, why="canary")
    errors: list[BaseException] = []

    def pin(i: int) -> None:
        try:
            Tenants(store).create(f"tenant-{i}", {"demo": ["*"]})
            Router(store, reg).pin("demo", f"tenant-{i}", "1.0.0", why=f"pin {i}")
        except BaseException as exc:  # noqa: BLE001 - surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=pin, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    final = router.get("demo")
    assert final.revision == 10 and len(final.pins) == 8
    assert sorted(e.revision for e in router.history("demo") if e.kind == "route") == list(range(1, 11))


def test_route_file_is_plain_json_that_validates(router: Router) -> None:
    router.set("demo", stable="1.0.0", why="first")
    t, _ = records.load(router.store, "routes/demo.json", RouteTable)
    assert t.updated_at is not None and t.updated_at.tzinfo is not None and t.updated_at <= datetime.now(UTC)


def test_shadow_is_set_resized_and_removed_without_touching_states(router: Router) -> None:
    router.set("demo", stable="1.0.0", why="first")
    with pytest.raises(InvalidInput, match="has no shadow to change"):
        router.set("demo", shadow_percent=5, why="x")
    router.set("demo", shadow="1.2.0", why="mirror everything")
    assert router.get("demo").shadow == Shadow(version="1.2.0", percent=100)
    router.set("demo", shadow_percent=5, why="less")
    assert router.get("demo").shadow == Shadow(version="1.2.0", percent=5)
    assert router.registry.states("demo")["1.2.0"] == State.REGISTERED
    router.set("demo", clear_shadow=True, why="done")
    assert router.get("demo").shadow is None
