"""Stored route tables: audited conditional updates, version states, history, repair."""

from __future__ import annotations

import subprocess
import sys
import threading
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from fleet import audit, records
from fleet.catalog.registry import Registry, State
from fleet.catalog.routes.store import Router
from fleet.catalog.routes.table import Canary, RouteTable, Shadow
from fleet.catalog.tenants import Tenants
from fleet.errors import Forbidden, InvalidInput, NotFound
from fleet.store import MemoryStore, open_store
from tests.test_registry import META, register_demo

WORKER = Path(__file__).with_name("race_worker.py")


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


def test_removing_the_last_pin_retires_the_old_stable(router: Router) -> None:
    router.set("demo", stable="1.0.0", why="first")
    Tenants(router.store).create("globex", {"demo": ["*"]})
    router.pin("demo", "globex", "1.0.0", why="globex stays")
    router.set("demo", canary="1.1.0", weight=50, why="canary")
    router.set("demo", stable="1.1.0", why="promote")
    assert router.registry.states("demo")["1.0.0"] == State.STABLE  # still pinned
    router.unpin("demo", "globex", why="globex moves on")
    assert router.registry.states("demo") == {"1.0.0": State.RETIRED, "1.1.0": State.STABLE, "1.2.0": State.REGISTERED}


def test_states_catch_up_after_a_writer_died_between_route_and_states(router: Router) -> None:
    router.set("demo", stable="1.0.0", why="first")
    t = router.get("demo")
    crashed = t.model_copy(update={"canary": Canary(version="1.1.0", weight=5), "revision": 2})
    router.store.put("routes/demo.json", records.dump(crashed), if_match=router.store.get("routes/demo.json").etag)
    assert router.registry.states("demo")["1.1.0"] == State.REGISTERED  # the crash left it behind
    router.set("demo", weight=10, why="next change")
    assert router.registry.states("demo")["1.1.0"] == State.CANARY
    assert [e.revision for e in router.history("demo") if e.kind == "route"] == [1, 2, 3]


def test_an_audit_gap_in_the_middle_is_rebuilt_exactly(router: Router) -> None:
    router.set("demo", stable="1.0.0", why="first", who="ann")
    router.set("demo", canary="1.1.0", weight=5, why="canary", who="bob")
    router.set("demo", weight=20, why="more", who="cy")
    router.store.delete(audit.route_event_key("demo", 2))  # bob's writer died before logging
    events = {e.revision: e for e in router.history("demo") if e.kind == "route"}
    assert sorted(events) == [1, 2, 3]
    assert (events[2].who, events[2].why) == ("bob", "canary")
    assert events[2].before["canary"] is None and events[2].after["canary"]["weight"] == 5.0
    assert router.at("demo", events[2].at).canary == Canary(version="1.1.0", weight=5)


def test_route_updates_from_two_processes_keep_every_revision_and_state(store_url: str, tmp_path: Path) -> None:
    store = open_store(store_url)
    reg = register_demo(store, tmp_path)
    Router(store, reg).set("demo", stable="1.0.0", canary="1.1.0", weight=0, why="start")
    times = 8
    procs = [
        subprocess.Popen([sys.executable, str(WORKER), store_url, "demo", str(times), name, "--weights"])
        for name in ("p1", "p2")
    ]
    for p in procs:
        assert p.wait(timeout=180) == 0
    router = Router(store, reg)
    final = router.get("demo")
    assert final.revision == 1 + 2 * times
    route_events = [e for e in router.history("demo") if e.kind == "route"]
    assert [e.revision for e in route_events] == list(range(1, final.revision + 1))
    for earlier, later in zip(route_events, route_events[1:]):
        assert later.before == earlier.after  # no revision was written over another
    assert reg.states("demo") == {"1.0.0": State.STABLE, "1.1.0": State.CANARY}
