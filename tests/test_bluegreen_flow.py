"""Blue-green end to end: real Bentos (blue at two replicas), two real gateways, a real
Prefect API, steady load through both gateways.

A good green is started at blue's replica count, switched to in one route change that every
gateway serves within the propagation target (1 s), bakes, and is kept; a bad green is
switched back inside its bake. Blue keeps both replicas ready from the switch to the end of
the bake, and callers see no failure in either case (a request green fails is answered by
blue, the route's stable behind it).
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from fleet.catalog.registry import Registry, State
from fleet.catalog.routes.store import Router
from fleet.runtime.local import LocalRuntime
from tests.rollout_env import FAST, MODEL, Load, Watch, rollout_watched, route_changes, serving_fleet
from tests.serving_env import FleetEnv

PROPAGATION_TARGET_S = 1.0  # a route written -> every gateway serves it (README: the push's target)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory, prefect_api: str) -> Iterator[dict]:
    env = FleetEnv(tmp_path_factory.mktemp("bluegreen"))
    with serving_fleet(env) as fleet:
        env.fleet("deploy", MODEL, "1.0.0", "--replicas", "2")
        fleet["urls"] = [fleet["url"], env.start_gateway()]
        yield fleet


def change(fleet: dict, text: str, after: float) -> tuple[int, float]:
    revision, at, _ = next(c for c in route_changes(fleet) if text in c[2] and c[1] >= after)
    return revision, at


def rollout(fleet: dict, version: str, bake_s: float) -> tuple[object, Load, Load, Watch]:
    policy = {**FAST, "strategy": "blue-green", "bake_s": bake_s}
    state, (load_a, load_b), watch = rollout_watched(fleet, version, policy)
    return state, load_a, load_b, watch


def assert_switch_reached_every_gateway(fleet: dict, watch: Watch, revision: int, at: float) -> None:
    for url in fleet["urls"]:
        took = watch.seen_at(url, revision) - at
        assert took <= PROPAGATION_TARGET_S, f"{url} served the switch {took:.3f} s after it was written"


def test_a_good_green_is_switched_to_baked_and_kept(fleet: dict) -> None:
    fleet["env"].fleet("models", "train", MODEL, "1.1.0", "--rows", "20000", "--epochs", "15", "--seed", "11")
    started = time.time()
    state, load_a, load_b, watch = rollout(fleet, "1.1.0", bake_s=8)
    print(f"good green: {load_a.report()}; {load_b.report()}; flow: {state.message}")
    assert state.is_completed(), state.message
    switch_rev, switched = change(fleet, "switch: 100% to 1.1.0", started)
    promoted_rev, promoted = change(fleet, "promoted: the bake passed", switched)
    assert promoted - switched >= 8  # the whole bake, however early the gates passed
    assert_switch_reached_every_gateway(fleet, watch, switch_rev, switched)
    # blue kept both replicas ready from the switch until the bake ended
    during = [n for t, n in watch.blue_ready if switched <= t <= promoted]
    assert during and set(during) == {2}, watch.blue_ready
    green = [d for d in LocalRuntime(fleet["env"].root / "run").list() if d.version == "1.1.0"]
    assert len(green) == 1 and len(green[0].endpoints) == 2  # started at blue's count
    assert load_a.failures == [] and load_b.failures == []
    assert load_a.by_version.get("1.1.0", 0) > 0 and load_b.by_version.get("1.1.0", 0) > 0
    table = Router(fleet["store"]).get(MODEL)
    assert (table.stable, table.canary) == ("1.1.0", None) and table.revision == promoted_rev


def test_a_bad_green_is_switched_back_inside_its_bake_with_no_caller_failures(fleet: dict) -> None:
    blue = Router(fleet["store"]).get(MODEL).stable
    fleet["env"].fleet(
        "models", "train", MODEL, "1.2.0", "--rows", "20000", "--epochs", "15", "--fault-error-rate", "0.3"
    )
    started = time.time()
    state, load_a, load_b, watch = rollout(fleet, "1.2.0", bake_s=60)
    print(f"bad green: {load_a.report()}; {load_b.report()}; flow: {state.message}")
    assert state.is_failed() and "switched back to " + blue in state.message, state.message
    switch_rev, switched = change(fleet, "switch: 100% to 1.2.0", started)
    back_rev, back = next((r, t) for r, t, _ in route_changes(fleet) if r > switch_rev)  # the switch back
    assert back_rev > switch_rev and back - switched < 60  # inside the bake
    assert_switch_reached_every_gateway(fleet, watch, switch_rev, switched)
    during = [n for t, n in watch.blue_ready if switched <= t <= back]
    assert during and set(during) == {2}, watch.blue_ready
    assert load_a.failures == [] and load_b.failures == []  # every request green failed was answered by blue
    table = Router(fleet["store"]).get(MODEL)
    assert (table.stable, table.canary) == (blue, None)
    assert Registry(fleet["store"]).states(MODEL)["1.2.0"] == State.REJECTED
    assert not any(d.version == "1.2.0" for d in LocalRuntime(fleet["env"].root / "run").list())
