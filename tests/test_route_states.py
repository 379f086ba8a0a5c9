"""Version states are a function of the route, and route changes mean what they say.

A Hypothesis property drives random sequences of route changes (stable, canary and weight,
shadow, pins, clears, rollbacks) and checks after each one that the states follow the table,
that every state is the last audited transition, and that a change that changes nothing
writes nothing.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fleet import audit, records
from fleet.catalog.registry import Registry, State
from fleet.catalog.routes.rollback import rollback
from fleet.catalog.routes.store import Router
from fleet.catalog.routes.table import Canary
from fleet.catalog.tenants import Tenants, parse_entitlements
from fleet.errors import Conflict, FleetError, InvalidInput
from fleet.store import MemoryStore
from tests.test_registry import META

VERSIONS = ("1.0.0", "1.1.0", "1.2.0", "1.3.0")
STAMP = {"revision", "updated_at", "updated_by", "reason"}


def check_invariant(router: Router) -> None:
    table = router.get("demo")
    states = router.registry.states("demo")
    canary = table.canary.version if table.canary else None
    for version, state in states.items():
        where = f"{version} is {state} under {table.model_dump(exclude={'updated_at', 'updated_by', 'reason'})}"
        assert (state == State.CANARY) == (version == canary), where
        if version == table.stable:
            assert state == State.STABLE, where
        if state == State.STABLE:
            assert version == table.stable or version in table.referenced_versions(), where
    # the transitions stay audited: each version's state is its last state event
    last: dict[str, str] = {}
    for e in audit.events(router.store, "demo"):
        if e.kind == "state":
            last[e.version] = e.after  # type: ignore[index]
    assert last == {v: s.value for v, s in states.items()}


def fresh(tmp: Path) -> Router:
    store = MemoryStore()
    art = tmp / "a"
    if not art.exists():
        art.mkdir()
        (art / "w").write_text("w")
    reg = Registry(store)
    for v in VERSIONS:
        reg.register("demo", v, art, META)
    Tenants(store).create("acme", {"demo": ["*"]})
    router = Router(store, reg)
    router.set("demo", stable="1.0.0", why="first")
    return router


version = st.sampled_from(VERSIONS)
weight = st.sampled_from([0.0, 5.0, 50.0, 100.0])
changes = st.one_of(
    st.tuples(st.just("stable"), version),
    st.tuples(st.just("canary"), version, st.none() | weight),
    st.tuples(st.just("weight"), weight),
    st.tuples(st.just("no-canary")),
    st.tuples(st.just("shadow"), version),
    st.tuples(st.just("no-shadow")),
    st.tuples(st.just("pin"), version),
    st.tuples(st.just("unpin")),
    st.tuples(st.just("rollback")),
)


def apply(router: Router, change: tuple) -> None:
    kind, *args = change
    why = f"test {kind}"
    if kind == "stable":
        router.set("demo", stable=args[0], why=why)
    elif kind == "canary":
        router.set("demo", canary=args[0], weight=args[1], why=why)
    elif kind == "weight":
        router.set("demo", weight=args[0], why=why)
    elif kind == "no-canary":
        router.set("demo", clear_canary=True, why=why)
    elif kind == "shadow":
        router.set("demo", shadow=args[0], why=why)
    elif kind == "no-shadow":
        router.set("demo", clear_shadow=True, why=why)
    elif kind == "pin":
        router.pin("demo", "acme", args[0], why=why)
    elif kind == "unpin":
        router.unpin("demo", "acme", why=why)
    else:
        rollback(router, "demo", why=why)


@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sequence=st.lists(changes, min_size=1, max_size=12))
def test_states_follow_the_route_under_any_sequence_of_changes(tmp_path: Path, sequence: list[tuple]) -> None:
    router = fresh(tmp_path)
    check_invariant(router)
    for change in sequence:
        before = router.get("demo")
        events = len(audit.events(router.store, "demo"))
        try:
            apply(router, change)
        except FleetError:
            assert router.get("demo") == before  # a refused change writes nothing
            check_invariant(router)
            continue
        after = router.get("demo")
        same = after.model_dump(exclude=STAMP) == before.model_dump(exclude=STAMP)
        if change[0] != "rollback":
            assert router.unchanged == same  # a no-op is detected exactly, never a real change
        if same:  # and writes nothing: no revision, no event
            assert after == before and len(audit.events(router.store, "demo")) == events
        check_invariant(router)


def test_a_replaced_or_cleared_canary_is_registered_again(router: Router) -> None:
    router.set("demo", stable="1.0.0", why="first")
    router.set("demo", canary="1.1.0", weight=0, why="try 1.1")
    router.set("demo", canary="1.2.0", why="try 1.2 instead")  # the old canary had no traffic
    states = router.registry.states("demo")
    assert (states["1.1.0"], states["1.2.0"]) == (State.REGISTERED, State.CANARY)
    router.set("demo", clear_canary=True, why="no canary now")
    assert router.registry.states("demo")["1.2.0"] == State.REGISTERED
    router.set("demo", canary="1.1.0", weight=5, why="1.1 may be rolled out again")
    assert router.registry.states("demo")["1.1.0"] == State.CANARY


def test_a_new_canary_never_silently_takes_or_drops_the_old_ones_traffic(router: Router) -> None:
    router.set("demo", stable="1.0.0", why="first")
    router.set("demo", canary="1.1.0", weight=30, why="canary")
    with pytest.raises(
        InvalidInput, match=r"canary 1.1.0 of demo takes 30% of traffic; replacing it with 1.2.0 needs --weight"
    ):
        router.set("demo", canary="1.2.0", why="replace")
    assert router.get("demo").canary == Canary(version="1.1.0", weight=30)
    router.set("demo", canary="1.2.0", weight=10, why="replace, at 10 %")
    assert router.get("demo").canary == Canary(version="1.2.0", weight=10)
    router.set("demo", canary="1.2.0", why="same canary: keeps its weight")
    assert router.get("demo").canary == Canary(version="1.2.0", weight=10)


def test_a_change_that_changes_nothing_writes_no_revision(router: Router) -> None:
    router.set("demo", stable="1.0.0", why="first")
    router.set("demo", canary="1.1.0", weight=10, why="canary")
    t = router.set("demo", weight=10, why="again")
    assert router.unchanged and t.revision == 2
    assert [e.revision for e in router.history("demo") if e.kind == "route"] == [1, 2]
    router.set("demo", weight=20, why="more")
    assert not router.unchanged and router.get("demo").revision == 3


def test_shadow_of_the_stable_version_is_refused_like_a_canary_of_it(router: Router) -> None:
    router.set("demo", stable="1.0.0", why="first")
    with pytest.raises(InvalidInput, match="shadow 1.0.0 is already the stable version"):
        router.set("demo", shadow="1.0.0", why="mirror to itself")
    router.set("demo", shadow="1.1.0", why="mirror")
    router.set("demo", canary="1.1.0", weight=0, why="canary too")
    router.set("demo", stable="1.1.0", why="promote: the shadow of the new stable ends")
    assert router.get("demo").shadow is None


def test_an_entitlement_with_an_empty_version_list_is_an_error() -> None:
    for spec in ("churn:", "churn:,", "churn: , "):
        with pytest.raises(InvalidInput, match="names no version"):
            parse_entitlements([spec])
    assert parse_entitlements(["churn", "other:1.0.0"]) == {"churn": ["*"], "other": ["1.0.0"]}


def test_rerunning_a_change_whose_writer_died_repairs_the_states(router: Router) -> None:
    router.set("demo", stable="1.0.0", why="first")
    t = router.get("demo")
    # a writer died after its route write, before reconciling states (and logging)
    crashed = t.model_copy(update={"canary": Canary(version="1.1.0", weight=10), "revision": t.revision + 1})
    router.store.put("routes/demo.json", records.dump(crashed))
    assert router.registry.states("demo")["1.1.0"] == State.REGISTERED
    router.set("demo", canary="1.1.0", weight=10, why="again")  # the operator runs it again
    assert router.unchanged  # nothing to write ...
    assert router.registry.states("demo")["1.1.0"] == State.CANARY  # ... and the states caught up
    assert [e.revision for e in router.history("demo") if e.kind == "route"] == [1, 2]  # the event too
    router.set("demo", stable="1.1.0", why="so the promotion is not refused")
    assert router.registry.states("demo")["1.1.0"] == State.STABLE


def test_a_move_decided_from_an_old_state_is_not_applied(router: Router) -> None:
    router.set("demo", stable="1.0.0", why="first")
    with pytest.raises(Conflict, match="is registered, no longer canary"):
        router.registry.transition("demo", "1.1.0", State.REGISTERED, why="stale", expect=State.CANARY)
    assert router.registry.states("demo")["1.1.0"] == State.REGISTERED
