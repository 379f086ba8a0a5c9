"""Rollback: end a canary (and reject it), or go back to the previous stable; on every store."""

from __future__ import annotations

import pytest

from fleet.catalog.registry import State
from fleet.catalog.routes.rollback import rollback
from fleet.catalog.routes.store import Router
from fleet.errors import Conflict, InvalidInput


def test_rolling_back_a_canary_sends_all_traffic_to_stable_and_rejects_it(router: Router) -> None:
    router.set("demo", stable="1.0.0", why="first")
    router.set("demo", canary="1.1.0", weight=20, why="canary")
    result = rollback(router, "demo", why="errors up")
    assert (result.from_version, result.to_version, result.rejected) == ("1.1.0", "1.0.0", "1.1.0")
    table = router.get("demo")
    assert table.stable == "1.0.0" and table.canary is None and table.reason == "rollback: errors up"
    states = router.registry.states("demo")
    assert states["1.1.0"] == State.REJECTED and states["1.0.0"] == State.STABLE
    assert "rolled back: errors up" in router.registry.get("demo", "1.1.0").state_reason


def test_without_a_canary_the_previous_stable_comes_back(router: Router) -> None:
    router.set("demo", stable="1.0.0", why="first")
    router.set("demo", canary="1.1.0", weight=50, why="canary")
    router.set("demo", stable="1.1.0", why="promote")
    assert router.registry.states("demo")["1.0.0"] == State.RETIRED
    result = rollback(router, "demo", why="1.1 misbehaves at full traffic")
    assert (result.from_version, result.to_version, result.rejected) == ("1.1.0", "1.0.0", None)
    states = router.registry.states("demo")
    assert router.get("demo").stable == "1.0.0" and states["1.0.0"] == State.STABLE
    assert states["1.1.0"] == State.RETIRED  # it may come back; only a canary is rejected


def test_rollback_to_a_named_version_and_the_refusals(router: Router) -> None:
    with pytest.raises(Conflict, match="no stable version"):
        rollback(router, "demo", why="x")
    router.set("demo", stable="1.0.0", why="first")
    with pytest.raises(Conflict, match="no stable version before 1.0.0; name one"):
        rollback(router, "demo", why="x")
    with pytest.raises(InvalidInput, match="9.9.9 is not registered"):
        rollback(router, "demo", "9.9.9", why="x")
    router.set("demo", canary="1.1.0", weight=10, why="canary")
    router.set("demo", stable="1.1.0", why="promote")
    assert rollback(router, "demo", "1.0.0", why="back to the first").table.stable == "1.0.0"


def test_a_target_that_is_not_running_is_started_first_or_refused(router: Router) -> None:
    from fleet.types import Deployment

    class Runtime:
        def __init__(self) -> None:
            self.running = {"1.1.0"}

        def list(self) -> list[Deployment]:
            return [Deployment("demo", v, ("http://x",)) for v in self.running]

        def deploy(self, model: str, version: str, replicas: int = 1) -> Deployment:
            assert router.get(model).stable != version  # started before traffic moves
            self.running.add(version)
            return Deployment(model, version, ("http://x",))

    router.set("demo", stable="1.0.0", why="first")
    router.set("demo", canary="1.1.0", weight=10, why="canary")
    router.set("demo", stable="1.1.0", why="promote")
    runtime = Runtime()  # 1.0.0 was undeployed after its rollback window
    with pytest.raises(Conflict, match="1.0.0 is not running"):
        rollback(router, "demo", why="x", runtime=runtime, start_missing=False)
    assert router.get("demo").stable == "1.1.0"
    assert rollback(router, "demo", why="x", runtime=runtime).to_version == "1.0.0"
    assert "1.0.0" in runtime.running
