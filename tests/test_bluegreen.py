"""Blue-green by name: the machine's decisions (pure), the executor against fakes (green at
blue's replica count, blue held and kept), the simulator and ``fleet rollout --dry-run``.
The real fleet under load is test_bluegreen_flow's."""

from __future__ import annotations

from dataclasses import replace

import pytest
from typer.testing import CliRunner

from fleet.analysis.simulate import estimate
from fleet.catalog.registry import State
from fleet.catalog.rollouts import Phase
from fleet.control.rollout.machine import Checked, Deployed, Emit, RollBack, SetRoute
from tests.rollout_driver import CANARY, PASS, STABLE, Run, Traffic, policy
from tests.test_rollout import MODEL, traffic, world  # noqa: F401 - the executor's fixture

BAKE_S = 180.0


def bg(**overrides: object):  # noqa: ANN201 - a RolloutPolicy
    return policy(strategy="blue-green", bake_s=BAKE_S, **overrides)


def events(t) -> list[str]:  # noqa: ANN001
    return [a.event.removeprefix("fleet.rollout.") for a in t.actions if isinstance(a, Emit)]


def test_green_takes_everything_in_one_switch_bakes_its_whole_window_then_is_promoted() -> None:
    run = Run(bg())
    run.replicas = 3
    t = run.begin()
    assert (t.state.strategy, t.state.replicas) == ("blue-green", 3)
    run.do(Checked(PASS, registered=True))
    t = run.do(Deployed(run.now, baseline=run._baseline()))
    switch = [a for a in t.actions if isinstance(a, SetRoute)]
    assert len(switch) == 1 and switch[0].fields == {"canary": {"version": CANARY, "weight": 100.0}}
    assert switch[0].why == f"switch: 100% to {CANARY}, {STABLE} kept ready"
    assert (t.state.phase, t.state.weight, t.state.switched_at) == (Phase.BAKE, 100.0, run.now)
    assert events(t) == ["deployed", "switched"] and t.state.baseline is not None  # judged against blue's before
    assert (run.route.stable, run.route.canary, run.route.weight) == (STABLE, CANARY, 100.0)  # blue stays the stable
    # gates that pass early do not end the bake: green serves every second of it
    while run.now + run.policy.analysis_window_s - t.state.step_started < BAKE_S:
        t = run.tick()
        assert t.state.phase == Phase.BAKE, (run.now, t.verdict and t.verdict.summary)
    assert t.verdict.outcome == "advance"  # it had passed, and still waited
    t = run.tick()
    assert t.state.phase == Phase.PROMOTE and run.now - t.state.step_started >= BAKE_S
    t = run.promote()
    assert t.state.phase == Phase.PROMOTED and t.state.reason == "the bake passed"
    assert (run.route.stable, run.route.canary) == (CANARY, None)
    assert [r.phase for r in t.state.reports] == ["bake"]


def test_green_waits_unrouted_until_blue_served_enough_to_judge_it_against() -> None:
    """The bake is judged against blue's traffic before the switch, all the reference there is:
    with too little of it (150 requests in 300 s where the p99 gate needs 299) green would stay
    undecided to its deadline at 100 %. So it waits ready and unrouted, blue serving everything,
    and switches once blue's traffic is enough. (The end-to-end test found it: load that began
    with the rollout gave blue 224 requests, and green was switched back 93 s into an 8 s bake.)"""
    run = Run(bg(), rps=0.5)
    run.begin()
    run.do(Checked(PASS, registered=True))
    t = run.do(Deployed(run.now, baseline=run._baseline()))
    assert t.state.waiting and events(t) == ["deployed", "waiting-for-baseline"] and run.route.canary is None
    t = run.tick()
    assert t.state.waiting and t.actions == () and run.route.canary is None  # nothing stored again meanwhile
    run.rps = 40.0
    t = run.tick()
    assert t.state.phase == Phase.BAKE and events(t) == ["switched"] and run.route.weight == 100.0
    assert t.state.baseline["requests"] >= 299


def _waiting() -> tuple[Run, object]:
    run = Run(bg(), rps=0.5)  # 150 of blue's answers in 300 s: fewer than 299
    run.begin()
    run.do(Checked(PASS, registered=True))
    return run, run.do(Deployed(run.now, baseline=run._baseline()))


def test_a_resumed_run_that_was_waiting_waits_on_from_where_it_was() -> None:
    run, t = _waiting()
    ready_at = t.state.ready_at
    run.now += 120
    run.begin(running=True)  # the flow died; its next run deploys again (idempotent) and goes on
    t = run.do(Deployed(run.now, baseline=run._baseline()))
    assert t.state.waiting and t.state.ready_at == ready_at and events(t) == ["deployed"]
    assert run.route.canary is None and run.route.shadow is None


def test_a_route_moved_while_green_waits_ends_the_rollout_and_metrics_down_hold_it_to_the_deadline() -> None:
    run, _ = _waiting()
    t = run.tick(unavailable="gateways unreachable")
    assert t.state.waiting  # no data is not bad data
    while run.now - t.state.ready_at < run.policy.hold_deadline_s:
        t = run.tick(unavailable="gateways unreachable")
    assert t.state.phase == Phase.ROLLED_BACK and "could not be read (gateways unreachable)" in t.state.reason
    assert "no traffic was moved" in t.state.reason
    run, _ = _waiting()
    run.route = replace(run.route, stable="0.9.0", revision=run.route.revision + 1, updated_by="ops")
    t = run.tick()
    assert t.state.phase == Phase.ROLLED_BACK and t.state.breached == ["route"]


def test_an_approved_switch_keeps_the_baseline_it_waited_for_though_traffic_fell_before_the_answer() -> None:
    run = Run(bg(manual_approval=True), rps=40.0)
    run.to_first_arm()
    assert run.state.phase == Phase.APPROVAL and run.state.baseline["requests"] >= 299
    run.rps = 0.1  # the traffic fell while nobody answered
    run.now += 600
    t = run.answer(True)
    assert t.state.phase == Phase.BAKE and t.state.baseline["requests"] >= 299 and run.route.weight == 100.0


def test_a_breach_during_the_bake_switches_back_to_blue_at_once() -> None:
    run = Run(bg(), canary=Traffic(errors=0.2))
    run.to_first_arm()
    t = run.tick()
    assert t.state.phase == Phase.ROLLED_BACK and isinstance(t.actions[2], RollBack)
    assert "into the bake, switched back to 1.0.0" in t.state.reason and "error_rate" in t.state.breached
    assert (run.route.stable, run.route.canary) == (STABLE, None)


def test_the_shadow_phase_and_approval_come_before_the_switch() -> None:
    run = Run(bg(shadow_percent=20, shadow_duration_s=120, manual_approval=True))
    t = run.to_first_arm()
    assert t.state.phase == Phase.SHADOW and run.route.shadow == CANARY and run.route.canary is None
    for _ in range(3):
        t = run.tick()
    assert t.state.phase == Phase.APPROVAL and run.route.canary is None  # nothing switched yet
    t = run.answer(True)
    assert t.state.phase == Phase.BAKE and run.route.weight == 100 and run.route.shadow is None
    assert [r.phase for r in t.state.reports] == ["shadow", "bake"]


def test_a_resumed_run_keeps_the_strategy_it_began_with() -> None:
    run = Run(bg())
    run.to_first_arm()
    run.policy = policy()  # the policy changed under the stored rollout
    t = run.tick()
    assert t.state.phase == Phase.BAKE and t.state.strategy == "blue-green"


def test_the_executor_starts_green_at_blues_replica_count_and_keeps_blue_whole(world: dict) -> None:  # noqa: F811
    r, runtime, router = world["rollout"], world["runtime"], world["router"]
    runtime.running[MODEL, "1.0.0"] = 3
    r.policy = r.policy.model_copy(update={"strategy": "blue-green", "bake_s": 120.0})
    traffic(world, {"1.0.0": (30, 0, 10)}, seconds=300)  # blue before: the bake's baseline
    state = r.run_preflight(r.begin(MODEL, "1.1.0", "run-1"))
    assert state.replicas == 3
    state = r.deploy(state)
    assert runtime.running[MODEL, "1.1.0"] == 3 and runtime.running[MODEL, "1.0.0"] == 3
    assert runtime.log == ["deploy demo:1.0.0", "deploy demo:1.1.0"]  # blue's floor held first, then green
    assert state.phase == "bake" and router.get(MODEL).canary.weight == 100
    traffic(world, {"1.1.0": (30, 0, 10)})
    state, verdict = r.tick(state)
    assert verdict.outcome == "advance" and state.phase == "bake"  # 60 s of a 120 s bake
    assert runtime.running[MODEL, "1.0.0"] == 3  # blue whole through the bake
    traffic(world, {"1.1.0": (30, 0, 10)})
    state, _ = r.tick(state)
    state = r.promote(r.tick(state)[0] if state.phase == "bake" else state)
    assert state.phase == "promoted" and router.get(MODEL).stable == "1.1.0"
    assert runtime.log[-1] == "release demo:1.1.0"  # green's floor (blue's count) goes back to its own
    assert runtime.running[MODEL, "1.0.0"] == 3  # kept for the rollback window ...
    assert r.retire_previous(state) and (MODEL, "1.0.0") not in runtime.running  # ... then stopped


def test_blue_scaled_out_since_the_rollout_began_is_never_scaled_in_by_it(world: dict) -> None:  # noqa: F811
    r, runtime = world["rollout"], world["runtime"]
    runtime.running[MODEL, "1.0.0"] = 2
    r.policy = r.policy.model_copy(update={"strategy": "blue-green", "bake_s": 60.0})
    state = r.run_preflight(r.begin(MODEL, "1.1.0", "run-1"))
    runtime.running[MODEL, "1.0.0"] = 4  # the autoscaler added two meanwhile
    r.deploy(state)
    assert runtime.running[MODEL, "1.0.0"] == 4 and runtime.running[MODEL, "1.1.0"] == 2


def test_the_executor_switches_back_and_stops_green_on_a_breach(world: dict) -> None:  # noqa: F811
    r, runtime, router = world["rollout"], world["runtime"], world["router"]
    runtime.running[MODEL, "1.0.0"] = 2
    r.policy = r.policy.model_copy(update={"strategy": "blue-green", "bake_s": 300.0})
    traffic(world, {"1.0.0": (30, 0, 10)}, seconds=300)
    state = r.deploy(r.run_preflight(r.begin(MODEL, "1.1.0", "run-1")))
    traffic(world, {"1.1.0": (30, 0.2, 10)})
    state, verdict = r.tick(state)
    assert verdict.outcome == "rollback" and state.phase == "rolled_back"
    table = router.get(MODEL)
    assert (table.stable, table.canary) == ("1.0.0", None)
    assert runtime.running == {(MODEL, "1.0.0"): 2}  # blue as it was, green gone
    assert runtime.log[-2:] == ["undeploy demo:1.1.0", "release demo:1.0.0"]  # and blue's held floor released
    assert world["registry"].states(MODEL)["1.1.0"] == State.REJECTED


@pytest.mark.parametrize("method", ["fixed", "sequential"])
def test_the_simulator_bakes_a_good_green_and_catches_bad_ones(method: str) -> None:
    p = bg(method=method, analysis_window_s=10, min_samples=50, gates={"max_error_rate_increase": 0.01})
    found = {e.canary: e for e in estimate(p, rps=20, runs=10)}
    good = found["good"]
    assert good.promoted >= 0.8 and good.median_s >= BAKE_S  # never promoted before the bake ends
    worst = found["errors +4 pp (4x the margin)"]
    assert worst.rolled_back >= 0.8 and worst.median_s < BAKE_S  # switched back inside the bake


def test_the_dry_run_says_when_the_switch_would_wait_for_a_baseline() -> None:
    """At 0.5 req/s blue serves ~150 requests in 300 s, fewer than the p99 gate's 299 at 95 %:
    the switch would wait and, at that traffic, roll back at the deadline without moving any."""
    from fleet.analysis.simulate import switch_waits

    assert switch_waits(bg(), 20.0) is None
    said = switch_waits(bg(), 0.5)
    assert said is not None and "~150 requests" in said and "299 are needed" in said
    assert switch_waits(policy(steps=[20, 100]), 0.5) is None  # a canary's first step has the stable beside it


def test_dry_run_says_it_simulates_a_blue_green_switch(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:  # noqa: ANN001
    from fleet.cli import app

    monkeypatch.setenv("FLEET_STORE", f"file://{tmp_path}/store")
    runner = CliRunner()
    result = runner.invoke(
        app,
        ["rollout", "demo-classifier", "9.9.9", "--strategy", "blue-green", "--dry-run", "--rps", "20"]
        + ["--set", "bake_s=60", "--set", "hold_deadline_s=120"],  # a short horizon: a quick simulation
    )
    assert result.exit_code == 0, result.output
    assert "blue-green, one switch then a 60 s bake" in result.output
    bad = runner.invoke(app, ["rollout", "demo-classifier", "9.9.9", "--strategy", "purple", "--dry-run"])
    assert bad.exit_code != 0 and "expected canary or blue-green" in str(bad.exception or bad.output)


def test_fleet_rollback_during_the_bake_switches_back_at_once_and_ends_the_rollout(world: dict) -> None:  # noqa: F811
    from fleet.catalog.routes.rollback import rollback

    r, runtime, router = world["rollout"], world["runtime"], world["router"]
    r.policy = r.policy.model_copy(update={"strategy": "blue-green", "bake_s": 300.0})
    traffic(world, {"1.0.0": (30, 0, 10)}, seconds=300)
    state = r.deploy(r.run_preflight(r.begin(MODEL, "1.1.0", "run-1")))
    assert state.phase == "bake"
    done = rollback(router, MODEL, why="an operator saw a bad dashboard", who="ops")  # what `fleet rollback` runs
    assert (done.from_version, done.to_version) == ("1.1.0", "1.0.0")
    table = router.get(MODEL)
    assert (table.stable, table.canary) == ("1.0.0", None)  # every request on blue, at once
    traffic(world, {"1.0.0": (30, 0, 10)})
    state, _ = r.tick(state)
    assert state.phase == "rolled_back" and state.breached == ["route"] and "changed outside" in state.reason
    assert runtime.running.get((MODEL, "1.0.0")) == 1 and (MODEL, "1.1.0") not in runtime.running
