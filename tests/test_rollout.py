"""The rollout state machine tick by tick, against fakes: a memory store, a fake runtime,
in-memory metrics and a clock the test moves (the end-to-end flow is in test_rollout_flow)."""

from __future__ import annotations

from pathlib import Path

import pytest

from fleet.analysis.sources import MemoryMetrics
from fleet.catalog.policies.loader import load_policies
from fleet.catalog.registry import Registry, State, TensorSpec, VersionMetadata
from fleet.catalog.rollouts import RolloutState, state_key
from fleet.catalog.routes.store import Router
from fleet.control.rollout.effects import Rollout, apply_overrides
from fleet.errors import Conflict, InvalidInput
from fleet.store import MemoryStore
from tests.fakes import Clock, FakeRuntime

ROOT = Path(__file__).resolve().parents[1]
MODEL = "demo"


def meta(accuracy: float = 0.95, inputs: int = 4) -> VersionMetadata:
    return VersionMetadata(
        framework="torch",
        metrics={"accuracy": accuracy},
        inputs=[TensorSpec(name="features", datatype="FP32", shape=[-1, inputs])],
        outputs=[TensorSpec(name="probabilities", datatype="FP32", shape=[-1, 2])],
    )


@pytest.fixture
def world(tmp_path: Path) -> dict:
    store = MemoryStore()
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "w").write_text("w")
    reg = Registry(store)
    reg.register(MODEL, "1.0.0", tmp_path / "a", meta())
    reg.register(MODEL, "1.1.0", tmp_path / "a", meta(0.951))
    reg.register(MODEL, "1.2.0", tmp_path / "a", meta(0.80))  # worse offline
    reg.register(MODEL, "2.0.0", tmp_path / "a", meta(inputs=5))  # another input shape
    Router(store).set(MODEL, stable="1.0.0", why="first")
    policy = apply_overrides(
        load_policies(ROOT / "policies").rollout["default"],
        {
            "steps": [10, 50, 100],
            "analysis_window_s": 60,
            "min_samples": 100,
            "hold_deadline_s": 600,
            "gates": {"max_error_rate_increase": 0.02},
            "method": "fixed",
        },
    )  # the sequential method's own tests set it
    clock, metrics, events = Clock(), MemoryMetrics(), []
    runtime = FakeRuntime({(MODEL, "1.0.0"): 1}, clock=clock)

    def not_routed(model: str, version: str) -> None:  # an undeploy while a route still points at it is a bug
        assert version not in Router(store).get(model).referenced_versions(), f"{version} still routed"

    runtime.before_undeploy = not_routed
    rollout = Rollout(
        store,
        runtime,
        metrics,
        policy,
        clock=clock,
        notify=lambda s: None,
        emit=lambda e, p: events.append(e),
        who="test",
    )
    return {
        "store": store,
        "rollout": rollout,
        "clock": clock,
        "metrics": metrics,
        "events": events,
        "runtime": runtime,
        "router": Router(store),
        "registry": reg,
    }


def traffic(w: dict, version_rates: dict[str, tuple[int, float, float]], seconds: int = 60) -> None:
    """Per version: requests/s, error share, latency ms; spread over the next ``seconds``."""
    clock, metrics = w["clock"], w["metrics"]
    for s in range(seconds):
        at = clock.now + s
        for version, (rps, error_share, latency) in version_rates.items():
            failed = round(rps * error_share)
            if rps - failed:
                metrics.answered(MODEL, version, at=at, latency_ms=latency, scores=[0.3, 0.8], count=rps - failed)
            if failed:
                metrics.failed(MODEL, version, at=at, count=failed)
    clock.now += seconds


def test_a_good_canary_advances_step_by_step_and_is_promoted(world: dict) -> None:
    r, router = world["rollout"], world["router"]
    state = r.begin(MODEL, "1.1.0", "run-1")
    state = r.run_preflight(state)
    assert state.phase == "deploy" and [c["status"] for c in state.preflight] == ["pass"] * 3
    state = r.deploy(state)
    assert (state.phase, state.step, state.weight) == ("step", 0, 10.0)
    assert router.get(MODEL).canary.weight == 10 and world["runtime"].log == ["deploy demo:1.1.0"]
    for step, weight in ((0, 10.0), (1, 50.0)):
        traffic(world, {"1.0.0": (20, 0, 10), "1.1.0": (20, 0, 10)})
        state, verdict = r.tick(state)
        assert verdict.outcome == "advance", verdict.summary
        assert state.reports[step].outcome == "advance" and state.reports[step].weight == weight
    assert (state.phase, state.weight) == ("step", 100.0) and router.get(MODEL).canary.weight == 100
    traffic(world, {"1.1.0": (40, 0, 10)})  # at 100 % the stable serves nothing: judged against the last baseline
    state, verdict = r.tick(state)
    assert verdict.outcome == "advance" and state.phase == "promote"
    state = r.promote(state)
    table = router.get(MODEL)
    assert state.phase == "promoted" and table.stable == "1.1.0" and table.canary is None
    assert world["registry"].states(MODEL)["1.0.0"] == State.RETIRED
    assert r.retire_previous(state) and set(world["runtime"].running) == {(MODEL, "1.1.0")}
    assert world["events"][0] == "fleet.rollout.started" and world["events"][-1] == "fleet.rollout.promoted"


def test_thin_traffic_holds_with_how_much_more_is_needed_then_fails_at_the_deadline(world: dict) -> None:
    r, router = world["rollout"], world["router"]
    state = r.deploy(r.run_preflight(r.begin(MODEL, "1.1.0", "run-1")))
    for _ in range(9):  # 9 windows of 60 s: still inside the 600 s deadline
        traffic(world, {"1.0.0": (1, 0, 10)})  # the canary gets next to nothing
        state, verdict = r.tick(state)
        assert verdict.outcome == "hold" and state.phase == "step" and router.get(MODEL).canary.weight == 10
        assert verdict.more_canary and verdict.more_canary > 0
    traffic(world, {"1.0.0": (1, 0, 10)})
    state, verdict = r.tick(state)
    assert verdict.outcome == "rollback" and state.phase == "rolled_back"
    assert state.breached == ["deadline"] and "still undecided" in state.reason


def test_a_failing_canary_is_rolled_back_rejected_and_undeployed_after_traffic_moved(world: dict) -> None:
    r, router, reg = world["rollout"], world["router"], world["registry"]
    state = r.deploy(r.run_preflight(r.begin(MODEL, "1.1.0", "run-1")))
    traffic(world, {"1.0.0": (20, 0, 10), "1.1.0": (20, 0.10, 10)})
    state, verdict = r.tick(state)
    assert verdict.outcome == "rollback" and state.phase == "rolled_back"
    assert "error_rate" in state.breached and "error_rate" in state.reason
    table = router.get(MODEL)
    assert table.stable == "1.0.0" and table.canary is None
    assert reg.states(MODEL)["1.1.0"] == State.REJECTED
    assert world["runtime"].log == ["deploy demo:1.1.0", "undeploy demo:1.1.0"]  # not_routed checks the order


def test_a_slow_canary_is_rolled_back_on_latency(world: dict) -> None:
    r = world["rollout"]
    state = r.deploy(r.run_preflight(r.begin(MODEL, "1.1.0", "run-1")))
    traffic(world, {"1.0.0": (20, 0, 10), "1.1.0": (20, 0, 35)})
    state, _ = r.tick(state)
    assert state.phase == "rolled_back" and "latency_p99" in state.breached


@pytest.mark.parametrize(("version", "check"), [("1.2.0", "offline metrics"), ("2.0.0", "schema")])
def test_preflight_refuses_and_nothing_is_routed(world: dict, version: str, check: str) -> None:
    r = world["rollout"]
    state = r.run_preflight(r.begin(MODEL, version, "run-1"))
    assert state.phase == "rejected" and state.breached == [check] and check in state.reason
    assert world["router"].get(MODEL).canary is None and world["runtime"].log == []
    assert world["registry"].states(MODEL)[version] == State.REJECTED


def test_a_canary_that_cannot_start_is_rolled_back_before_any_traffic(world: dict) -> None:
    r = world["rollout"]
    world["runtime"].fail = "demo:1.1.0 exited while starting"
    state = r.deploy(r.run_preflight(r.begin(MODEL, "1.1.0", "run-1")))
    assert state.phase == "rolled_back" and state.breached == ["deploy"] and "exited while starting" in state.reason
    assert world["router"].get(MODEL).revision == 1  # the canary never got weight


def test_an_interrupted_rollout_resumes_from_stored_state(world: dict) -> None:
    r = world["rollout"]
    state = r.deploy(r.run_preflight(r.begin(MODEL, "1.1.0", "run-1")))
    traffic(world, {"1.0.0": (20, 0, 10), "1.1.0": (20, 0, 10)})
    r.tick(state)  # now at 50 %; then the flow process dies
    resumed = r.begin(MODEL, "1.1.0", "run-2")
    assert (resumed.phase, resumed.weight, resumed.run_id) == ("step", 50.0, "run-2")
    assert resumed.step_started == world["clock"].now  # the step's window starts over
    assert world["events"].count("fleet.rollout.resumed") == 1


def test_a_resumed_rollout_whose_canary_is_gone_is_rolled_back(world: dict) -> None:
    r = world["rollout"]
    r.deploy(r.run_preflight(r.begin(MODEL, "1.1.0", "run-1")))
    world["runtime"].running.pop((MODEL, "1.1.0"))  # the machine rebooted, say
    state = r.begin(MODEL, "1.1.0", "run-2")
    assert state.phase == "rolled_back" and "not running" in state.reason
    assert world["router"].get(MODEL).canary is None


def test_an_abandoned_rollout_of_another_version_is_rolled_back_first(world: dict) -> None:
    r = world["rollout"]
    r.deploy(r.run_preflight(r.begin(MODEL, "1.1.0", "run-1")))
    state = r.begin(MODEL, "1.2.0", "run-2")
    assert state.version == "1.2.0" and state.phase == "preflight"
    assert world["registry"].states(MODEL)["1.1.0"] == State.REJECTED
    assert world["router"].get(MODEL).canary is None


def test_a_route_changed_outside_the_rollout_ends_it(world: dict) -> None:
    from fleet.catalog.routes.rollback import rollback

    r = world["rollout"]
    state = r.deploy(r.run_preflight(r.begin(MODEL, "1.1.0", "run-1")))
    rollback(world["router"], MODEL, why="operator saw errors")
    state, verdict = r.tick(state)
    assert verdict is None and state.phase == "rolled_back" and "operator saw errors" in state.reason


def test_manual_approval_pauses_before_100_and_a_no_rolls_back(world: dict) -> None:
    r = world["rollout"]
    r.policy = r.policy.model_copy(update={"manual_approval": True})
    state = r.deploy(r.run_preflight(r.begin(MODEL, "1.1.0", "run-1")))
    for _ in range(2):
        traffic(world, {"1.0.0": (20, 0, 10), "1.1.0": (20, 0, 10)})
        state, _ = r.tick(state)
    assert state.phase == "approval" and world["router"].get(MODEL).canary.weight == 50
    with pytest.raises(Conflict):
        r.approve(state.model_copy(update={"phase": "step"}), True, "ops")
    state = r.approve(state, False, "ops", "not before the holidays")
    assert state.phase == "rolled_back" and state.reason == "not approved by ops: not before the holidays"


def test_begin_refuses_what_cannot_be_rolled_out(world: dict) -> None:
    r = world["rollout"]
    with pytest.raises(Conflict, match="already the stable"):
        r.begin(MODEL, "1.0.0", "run-1")
    world["router"].set(MODEL, canary="1.1.0", weight=5, why="by hand")
    with pytest.raises(Conflict, match="no rollout owns"):
        r.begin(MODEL, "1.2.0", "run-1")


def test_policy_overrides_are_validated_as_a_whole(world: dict) -> None:
    policy = world["rollout"].policy
    assert apply_overrides(policy, {"gates": {"max_p99_ratio": 2.0}}).gates.max_p99_ratio == 2.0
    with pytest.raises(InvalidInput, match="steps"):
        apply_overrides(policy, {"steps": [50, 10]})


def test_unreadable_metrics_hold_until_the_deadline_then_roll_back(world: dict) -> None:
    r, metrics = world["rollout"], world["metrics"]
    state = r.deploy(r.run_preflight(r.begin(MODEL, "1.1.0", "run-1")))
    metrics.unavailable = "gateway down"
    world["clock"].now += 60
    state, verdict = r.tick(state)
    assert verdict is None and state.phase == "step"  # no data is not bad data
    world["clock"].now += 600
    state, _ = r.tick(state)
    assert state.phase == "rolled_back" and state.breached == ["metrics"] and "gateway down" in state.reason


def test_a_rollout_straight_to_100_is_judged_against_the_stables_recent_traffic(world: dict) -> None:
    r = world["rollout"]
    r.policy = r.policy.model_copy(update={"steps": [100]})
    traffic(world, {"1.0.0": (20, 0, 10)}, seconds=300)  # before the rollout
    state = r.deploy(r.run_preflight(r.begin(MODEL, "1.1.0", "run-1")))
    assert state.weight == 100 and state.baseline["requests"] == 6000
    traffic(world, {"1.1.0": (20, 0, 10)})
    state, verdict = r.tick(state)
    assert verdict.outcome == "advance" and state.phase == "promote"
    state = r.promote(state)
    again = r.begin(MODEL, "1.1.0", "run-2")  # run again after the promotion: nothing to do
    assert (again.phase, again.run_id) == ("promoted", "run-1")


def test_a_baseline_that_cannot_be_read_holds_the_step_to_100_until_it_can(world: dict) -> None:
    """Straight to 100 % with the gateways' metrics down: the stable's traffic before is all a
    100 % step can be judged against (nothing serves beside it), so the version waits ready and
    unrouted — a warning, not a failed flow, and no traffic moved — until it can be read."""
    r, metrics, router = world["rollout"], world["metrics"], world["router"]
    r.policy = r.policy.model_copy(update={"steps": [100]})
    state = r.run_preflight(r.begin(MODEL, "1.1.0", "run-1"))
    metrics.unavailable = "gateway down"
    state = r.deploy(state)
    assert state.waiting and state.ready_at is not None and router.get(MODEL).canary is None
    assert world["events"][-1] == "fleet.rollout.waiting-for-baseline"
    assert state.shown == "deploy (waiting for the stable's baseline)"  # as fleet status and top show it
    world["clock"].now += 60
    state, verdict = r.tick(state)
    assert verdict is None and state.waiting and router.get(MODEL).canary is None  # held: no data is not bad data
    metrics.unavailable = None
    traffic(world, {"1.0.0": (20, 0, 10)})  # 1,200 of the stable's requests to judge against
    state, _ = r.tick(state)
    assert (state.phase, state.weight) == ("step", 100.0) and state.baseline["requests"] == 1200
    assert router.get(MODEL).canary.weight == 100


def test_a_step_to_100_without_enough_baseline_by_its_deadline_moves_no_traffic(world: dict) -> None:
    """A stable too quiet to judge a 100 % step against (fewer requests in the 5 minutes before
    than the p99 gate needs: 299 at 95 %): the version waits, then at ``hold_deadline_s`` is
    rolled back without a request having been routed to it."""
    r, router = world["rollout"], world["router"]
    r.policy = r.policy.model_copy(update={"steps": [100]})

    def quiet() -> None:  # a request every other second: 150 in any 300 s
        traffic(world, {"1.0.0": (1, 0, 10)}, seconds=30)
        world["clock"].now += 30

    for _ in range(5):
        quiet()
    state = r.deploy(r.run_preflight(r.begin(MODEL, "1.1.0", "run-1")))
    assert state.waiting and router.get(MODEL).canary is None
    for _ in range(9):  # 540 s of the 600 s deadline
        quiet()
        state, _ = r.tick(state)
        assert state.waiting, state.reason
    quiet()
    state, _ = r.tick(state)
    assert state.phase == "rolled_back" and state.breached == ["baseline"]
    assert "gave 150 answers" in state.reason and "299 are needed" in state.reason, state.reason
    assert "no traffic was moved" in state.reason
    assert all(e.after is None or e.after.get("canary") is None for e in router.history(MODEL) if e.kind == "route")
    assert (MODEL, "1.1.0") not in world["runtime"].running


def stored(w: dict) -> RolloutState:
    return RolloutState.model_validate_json(w["store"].get(state_key(MODEL)).data)


def test_a_run_whose_guard_refuses_routes_and_writes_nothing_more(world: dict) -> None:
    """The flow's guard is its lease's check: once the lease is lost, the run stops dead."""
    r, router = world["rollout"], world["router"]
    state = r.deploy(r.run_preflight(r.begin(MODEL, "1.1.0", "run-1")))
    before, revision = stored(world), router.get(MODEL).revision

    def lost() -> None:
        raise Conflict("the rollout of demo: lost the lease")

    r.guard = lost
    traffic(world, {"1.0.0": (20, 0, 10), "1.1.0": (20, 0, 10)})
    with pytest.raises(Conflict, match="lost the lease"):
        r.tick(state)
    with pytest.raises(Conflict, match="lost the lease"):
        r.promote(state)
    with pytest.raises(Conflict, match="lost the lease"):
        r.approve(state.model_copy(update={"phase": "approval"}), False, "ops")  # a rollback is a route change too
    assert stored(world) == before and router.get(MODEL).revision == revision
    assert router.get(MODEL).canary.weight == 10 and world["runtime"].log == ["deploy demo:1.1.0"]


def test_a_second_run_that_wrote_the_state_stops_the_first_before_it_routes(world: dict) -> None:
    r, router = world["rollout"], world["router"]
    state = r.deploy(r.run_preflight(r.begin(MODEL, "1.1.0", "run-1")))
    second = Rollout(
        world["store"],
        world["runtime"],
        world["metrics"],
        r.policy,
        clock=world["clock"],
        notify=lambda s: None,
        who="test",
    )
    second.begin(MODEL, "1.1.0", "run-2")  # took the rollout over (resumed it)
    revision = router.get(MODEL).revision
    traffic(world, {"1.0.0": (20, 0, 10), "1.1.0": (20, 0, 10)})
    with pytest.raises(Conflict, match=r"rollouts/demo.json was changed by another run since run run-1"):
        r.tick(state)  # its state write is conditional: it loses, and routes nothing after
    with pytest.raises(Conflict, match="changed by another run"):
        r.promote(state)  # a route change first checks the state is still the one it wrote
    assert router.get(MODEL).revision == revision and router.get(MODEL).canary.weight == 10
    assert stored(world).run_id == "run-2" and stored(world).reports[-1].ticks == 0


def test_a_route_changed_during_a_long_deploy_is_not_overwritten(world: dict) -> None:
    """An operator's change made while the canary deploys wins; the rollout ends, rolled back."""
    r, router = world["rollout"], world["router"]
    world["runtime"].while_deploying = lambda: router.set(MODEL, canary="1.2.0", weight=5, why="hotfix by hand")
    state = r.deploy(r.run_preflight(r.begin(MODEL, "1.1.0", "run-1")))
    assert state.phase == "rolled_back" and state.breached == ["route"] and "hotfix by hand" in state.reason
    table = router.get(MODEL)
    assert (table.stable, table.canary.version, table.canary.weight) == ("1.0.0", "1.2.0", 5)
    assert world["registry"].states(MODEL)["1.1.0"] == State.REJECTED
    assert world["runtime"].log == ["deploy demo:1.1.0", "undeploy demo:1.1.0"]


# -- the sequential method (fleet.analysis.sequential) -------------------------------------------------


def sequential(world: dict, **overrides: object) -> Rollout:
    r = world["rollout"]
    r.policy = apply_overrides(
        r.policy,
        {
            "method": "sequential",
            "analysis_window_s": 5,
            "min_samples": 20,
            "gates": {"max_error_rate_increase": 0.005},
            **overrides,
        },
    )
    return r


def run_ticks(world: dict, state: RolloutState, rates: dict[str, tuple[int, float, float]], limit: int = 200):
    """Tick every analysis_window_s with ``rates`` of traffic until a step changes or it ends."""
    r = world["rollout"]
    for _ in range(limit):
        traffic(world, rates, seconds=int(r.policy.analysis_window_s))
        before = (state.phase, state.step)
        state, verdict = r.tick(state)
        if (state.phase, state.step) != before:
            return state, verdict
    raise AssertionError(f"still {state.phase} at step {state.step} after {limit} ticks")


def test_the_sequential_method_promotes_a_good_canary_once_it_is_shown_within_the_margins(world: dict) -> None:
    r = sequential(world)
    state = r.deploy(r.run_preflight(r.begin(MODEL, "1.1.0", "run-1")))
    summaries = []
    while state.phase == "step":
        weight = state.weight
        canary_rps = round(40 * weight / 100)
        rates = {"1.1.0": (canary_rps, 0.0, 10)} | ({"1.0.0": (40 - canary_rps, 0.0, 10)} if weight < 100 else {})
        state, verdict = run_ticks(world, state, rates)
        summaries.append(verdict.summary)
    assert state.phase == "promote", summaries
    steps = [(rep.weight, rep.ticks, rep.outcome) for rep in state.reports]
    # 10 %: 20 canary requests are enough to advance; 50 %: until within the margins is shown on
    # everything served since the first step; 100 %: a bake of min_samples
    assert [(w, o) for w, _, o in steps] == [(10, "advance"), (50, "advance"), (100, "advance")], steps
    assert steps[0][1] == 1 and steps[1][1] > 1 and steps[2][1] == 1, steps
    assert "non-inferiority shown" in summaries[1] and "non-inferiority" not in summaries[0] + summaries[2]
    assert state.evidence["looks"] == sum(t for _, t, _ in steps)
    assert state.served["canary"]["requests"] > state.served["stable"]["requests"] > 0


def test_the_sequential_method_rolls_a_clearly_worse_canary_back_within_its_first_step(world: dict) -> None:
    r = sequential(world)
    state = r.deploy(r.run_preflight(r.begin(MODEL, "1.1.0", "run-1")))
    state, verdict = run_ticks(world, state, {"1.1.0": (4, 0.25, 10), "1.0.0": (36, 0.0, 10)})
    assert state.phase == "rolled_back" and state.breached == ["error_rate"], state.reason
    assert state.reports[-1].weight == 10 and "e-value" in state.reason
    assert world["router"].get(MODEL).canary is None


def test_the_sequential_evidence_survives_a_restart_and_a_step_starts_over(world: dict) -> None:
    r = sequential(world)
    state = r.deploy(r.run_preflight(r.begin(MODEL, "1.1.0", "run-1")))
    traffic(world, {"1.1.0": (2, 0.0, 10), "1.0.0": (38, 0.0, 10)}, seconds=5)
    state, _ = r.tick(state)  # 10 canary requests: short of min_samples
    assert state.phase == "step" and state.evidence["looks"] == 1
    kept = stored(world)
    assert kept.evidence == state.evidence and kept.served["canary"]["requests"] == 10
    resumed = r.begin(MODEL, "1.1.0", "run-2")  # the flow died and a new run resumes it
    assert resumed.evidence == kept.evidence and resumed.served == kept.served
    assert resumed.step_started == world["clock"].now  # the step's window starts over, its evidence stays
    traffic(world, {"1.1.0": (4, 0.0, 10), "1.0.0": (36, 0.0, 10)}, seconds=5)
    after, _ = r.tick(resumed)
    assert after.evidence["looks"] == 2 and after.served["canary"]["requests"] == 30
    assert after.step == 1  # 20 canary requests in the restarted step: it advances


def test_the_sequential_method_straight_to_100_is_judged_against_the_stables_recent_traffic(world: dict) -> None:
    r = sequential(world, steps=[100])
    traffic(world, {"1.0.0": (40, 0.0, 10)}, seconds=300)  # before the rollout: 12,000 stable requests
    state = r.deploy(r.run_preflight(r.begin(MODEL, "1.1.0", "run-1")))
    state, verdict = run_ticks(world, state, {"1.1.0": (40, 0.0, 10)})
    assert state.phase == "promote" and "non-inferiority shown" in verdict.summary


def test_sequential_ticks_read_each_whole_second_once_as_a_per_second_source_counts(world: dict) -> None:
    """The gateways' source counts by the second, a window covering every second from
    floor(start) to floor(end): ticks at any times must cover each second once, or a second's
    requests would count twice in the evidence."""
    r = sequential(world, analysis_window_s=2)
    reads: list[tuple[float, float]] = []
    source = r.metrics

    class Recorded:
        def window(self, model: str, version: str, start: float, end: float):  # noqa: ANN202
            if version == "1.1.0":
                reads.append((start, end))
            return source.window(model, version, start, end)

    r.metrics = Recorded()
    state = r.deploy(r.run_preflight(r.begin(MODEL, "1.1.0", "run-1")))
    for pause in (1.3, 0.4, 2.7, 0.2, 3.9, 1.0, 0.6):
        world["clock"].now += pause
        state, _ = r.tick(state)
    seconds = [s for start, end in reads for s in range(int(start // 1), int(end // 1) + 1)]
    assert len(seconds) == len(set(seconds)), reads
    assert seconds == list(range(seconds[0], seconds[-1] + 1))  # and none is skipped
    assert seconds[-1] == int(world["clock"].now // 1) - 1  # the second still running is left for the next tick
