"""The rollout's decisions tick by tick, on the pure machine alone: no store, no runtime, no
metrics source (``tests/rollout_driver.py`` builds the observations; test_rollout runs the
executor against fakes)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from fleet.analysis.reference import BASELINE_S
from fleet.catalog.rollouts import Phase
from fleet.control.rollout.machine import (
    Checked,
    Deployed,
    Emit,
    Promoting,
    Reject,
    RollBack,
    Route,
    RouteMoved,
    Save,
    SetRoute,
    step,
)
from fleet.control.rollout.reading import needs
from fleet.errors import Conflict, InvalidInput
from tests.rollout_driver import CANARY, MODEL, STABLE, Run, Traffic, policy


def kinds(t) -> list[str]:  # noqa: ANN001
    return [type(a).__name__ if not isinstance(a, Emit) else a.event.removeprefix("fleet.rollout.") for a in t.actions]


def routes(run: Run) -> list[dict]:
    return [dict(a.fields) for t in run.transitions for a in t.actions if isinstance(a, SetRoute)]


def test_a_good_canary_goes_through_every_step_and_is_promoted() -> None:
    run = Run(policy())
    t = run.begin()
    assert kinds(t) == ["Save", "started"] and t.state.champion == STABLE and t.state.phase == Phase.PREFLIGHT
    t = run.do(Checked(tuple({"check": c, "status": "pass", "detail": ""} for c in "ab"), registered=True))
    assert t.state.phase == Phase.DEPLOY and kinds(t) == ["Save"]
    t = run.do(Deployed(run.now))
    assert kinds(t) == ["deployed", "SetRoute", "Save", "step"]
    assert (t.state.phase, t.state.step, t.state.weight) == (Phase.STEP, 0, 10.0)
    assert t.actions[1] == SetRoute("step 1/3 at 10%", {"canary": {"version": CANARY, "weight": 10.0}}, STABLE, None)
    for weight in (50.0, 100.0):
        t = run.tick()
        assert t.verdict.outcome == "advance", t.verdict.summary
        assert kinds(t) == ["Save", "verdict", "SetRoute", "Save", "step"]
        assert t.state.weight == weight and t.actions[2].expect_canary == CANARY  # the route as it left it
    # at 100 % the stable serves nothing: judged against the largest stable window of a passed step
    assert t.state.baseline["requests"] == 36 * 60 and run.route.weight == 100  # the 10 % step's stable
    t = run.tick()
    assert t.verdict.outcome == "advance" and t.state.phase == Phase.PROMOTE and kinds(t)[-1] == "Save"
    t = run.promote()
    assert kinds(t) == ["SetRoute", "Save", "promoted"] and t.state.phase == Phase.PROMOTED
    assert t.actions[0].fields == {"stable": CANARY, "canary": None} and t.actions[2].payload["previous"] == STABLE
    assert [r.outcome for r in t.state.reports] == ["advance"] * 3
    assert (run.route.stable, run.route.canary) == (CANARY, None)


def test_promote_is_refused_except_from_the_promote_phase() -> None:
    run = Run(policy())
    run.to_first_arm()
    with pytest.raises(Conflict, match="is step, not ready to promote"):
        step(run.state, Promoting(run.route), run.policy)


@pytest.mark.parametrize(
    ("canary", "gate"),
    [
        (Traffic(errors=0.10), "error_rate"),
        (Traffic(latency_ms=35.0), "latency_p99"),
        (Traffic(scores=(0.95, 0.97)), "predictions"),
    ],
)
def test_each_gate_rolls_a_bad_canary_back_traffic_first(canary: Traffic, gate: str) -> None:
    run = Run(policy(), canary=canary)
    run.to_first_arm()
    t = run.tick()
    assert t.verdict.outcome == "rollback" and t.state.phase == Phase.ROLLED_BACK
    assert kinds(t) == ["Save", "verdict", "RollBack", "Save", "rolled-back"]
    rollback = t.actions[2]
    assert gate in rollback.breached and rollback.breached == tuple(t.state.breached)
    assert t.state.reason.startswith(f"gate {', '.join(t.state.breached)} breached at 10%: ")
    assert t.state.reports[-1].outcome == "rollback" and run.route.canary is None
    after = run.tick()
    assert after.state == t.state and after.actions == () and after.verdict is None  # it is over


def test_the_sequential_method_rolls_a_worse_canary_back_on_its_evidence() -> None:
    run = Run(
        policy(method="sequential", analysis_window_s=5, min_samples=20, gates={"max_error_rate_increase": 0.005})
    )
    run.canary = Traffic(errors=0.25)
    run.to_first_arm()
    state = run.until_done()
    assert state.phase == Phase.ROLLED_BACK and state.breached == ["error_rate"] and "e-value" in state.reason
    assert state.evidence["looks"] >= 1 and state.served["canary"]["requests"] > 0


def test_thin_traffic_holds_with_how_much_more_is_needed_then_fails_at_the_deadline() -> None:
    run = Run(policy(), rps=1.0)
    run.to_first_arm()
    for _ in range(9):
        t = run.tick()
        assert t.verdict.outcome == "hold" and t.state.phase == Phase.STEP and kinds(t) == ["Save", "verdict"]
        assert t.verdict.more_canary and t.verdict.more_canary > 0
    t = run.tick()
    assert (
        t.state.phase == Phase.ROLLED_BACK and t.state.breached == ["deadline"] and "still undecided" in t.state.reason
    )


def test_no_data_is_not_bad_data_unreadable_metrics_hold_until_the_deadline() -> None:
    run = Run(policy())
    run.to_first_arm()
    held = run.state
    t = run.tick(unavailable="gateway down")
    assert t.state == held and t.verdict is None and kinds(t) == ["verdict"]  # nothing stored, no route change
    assert t.actions[0].payload["outcome"] == "hold" and "gateway down" in t.actions[0].payload["summary"]
    t = run.tick(seconds=540, unavailable="gateway down")  # at the deadline, still unreadable
    assert t.state.phase == Phase.ROLLED_BACK and t.state.breached == ["metrics"] and "gateway down" in t.state.reason


def test_manual_approval_pauses_before_100_and_a_yes_goes_on() -> None:
    run = Run(policy(manual_approval=True))
    run.to_first_arm()
    run.tick()
    t = run.tick()
    assert t.state.phase == Phase.APPROVAL and kinds(t)[-2:] == ["Save", "awaiting-approval"]
    assert run.route.weight == 50  # no route change to 100 % without a yes
    t = run.answer(True, by="ops")
    assert kinds(t) == ["approved", "SetRoute", "Save", "step"] and t.state.weight == 100.0
    assert run.until_done().phase == Phase.PROMOTED


def test_a_no_rolls_back_and_an_answer_while_not_waiting_is_refused() -> None:
    run = Run(policy(manual_approval=True))
    run.to_first_arm()
    with pytest.raises(Conflict, match="not waiting for approval"):
        run.answer(True)
    run.tick(), run.tick()
    t = run.answer(False, by="ops", note="not before the holidays")
    assert t.state.reason == "not approved by ops: not before the holidays" and t.state.breached == ["approval"]
    assert kinds(t) == ["RollBack", "Save", "rolled-back"]


def test_a_straight_to_100_rollout_with_approval_takes_the_baseline_when_approved() -> None:
    run = Run(policy(steps=[100], manual_approval=True))
    t = run.to_first_arm()
    # read before asking (the step must be judgeable first), kept, and read again at the answer
    assert t.state.phase == Phase.APPROVAL and t.state.baseline["requests"] == 40 * BASELINE_S
    assert run.route.canary is None and needs(t.state, run.policy, run.now).baseline.start == run.now - BASELINE_S
    t = run.answer(True)
    assert t.state.baseline["requests"] == 40 * BASELINE_S and t.actions[1].expect_canary is None


def test_a_route_changed_elsewhere_ends_the_rollout_without_touching_the_route() -> None:
    run = Run(policy())
    run.to_first_arm()
    run.moved_by_hand("operator saw errors")
    t = run.tick()
    assert t.verdict is None and t.state.phase == Phase.ROLLED_BACK and t.state.breached == ["route"]
    assert "revision 3 by ops: operator saw errors" in t.state.reason and kinds(t) == [
        "RollBack",
        "Save",
        "rolled-back",
    ]
    # a route change the executor found moved comes back as RouteMoved: the same ending
    state = Run(policy()).to_first_arm().state
    moved = step(
        state, RouteMoved(Route(STABLE, "1.2.0", 5.0, revision=4, updated_by="ops", reason="hotfix")), run.policy
    )
    assert moved.state.breached == ["route"] and "hotfix" in moved.state.reason


def test_a_failed_deploy_rolls_back_before_any_traffic() -> None:
    run = Run(policy())
    run.begin(), run.do(Checked(tuple(), registered=True))
    t = run.do(Deployed(run.now, failed="demo:1.1.0 exited while starting"))
    assert kinds(t) == ["RollBack", "Save", "rolled-back"] and run.route.canary is None
    assert (
        t.state.breached == ["deploy"]
        and t.state.reason == "the canary did not start: demo:1.1.0 exited while starting"
    )


def test_preflight_refuses_a_failed_check_and_rejects_only_a_registered_version() -> None:
    failed = ({"check": "schema", "status": "fail", "detail": "inputs 'x' is missing"},)
    for registered, first in ((True, ["Reject"]), (False, [])):
        run = Run(policy())
        run.begin()
        t = run.do(Checked(failed, registered=registered))
        assert kinds(t) == [*first, "Save", "rejected"] and t.state.phase == Phase.REJECTED
        assert t.state.reason == "preflight failed: schema: inputs 'x' is missing" and t.state.breached == ["schema"]
        assert not registered or t.actions[0] == Reject(t.state.reason)


def test_an_interrupted_rollout_resumes_and_its_step_starts_over() -> None:
    run = Run(policy())
    run.to_first_arm()
    run.tick()  # at 50 %; then the flow process dies
    run.now += 30
    t = run.begin(running=True)
    assert kinds(t) == ["Save", "resumed", "Save"] and t.state.run_id == "run-1"
    assert (t.state.phase, t.state.weight, t.state.step_started) == (Phase.STEP, 50.0, run.now)


@pytest.mark.parametrize("phase", [Phase.PREFLIGHT, Phase.DEPLOY])
def test_a_rollout_interrupted_before_any_traffic_resumes_where_it_was(phase: Phase) -> None:
    run = Run(policy())
    run.begin()
    run.state = run.state.model_copy(update={"phase": phase})
    t = run.begin(running=False)
    assert t.state.phase == phase and kinds(t) == ["Save", "resumed"]


def test_a_resumed_rollout_whose_canary_is_gone_or_unrouted_is_rolled_back() -> None:
    run = Run(policy())
    run.to_first_arm()
    t = run.begin(running=False)  # the machine rebooted, say
    assert t.state.phase == Phase.ROLLED_BACK and "not running" in t.state.reason and t.state.breached == []
    run = Run(policy())
    run.to_first_arm()
    run.moved_by_hand()
    t = run.begin(running=True)
    assert t.state.breached == ["route"]


def test_an_abandoned_rollout_of_another_version_ends_first_then_the_new_one_starts() -> None:
    run = Run(policy())
    run.to_first_arm()
    t = run.begin(version="1.2.0")
    assert t.state.version == CANARY and t.state.phase == Phase.ROLLED_BACK and kinds(t)[0] == "RollBack"
    assert t.state.reason == "abandoned: a rollout of 1.2.0 started after this one's run stopped"
    t = run.begin(version="1.2.0")  # the executor begins again from what is stored now
    assert (t.state.version, t.state.phase) == ("1.2.0", Phase.PREFLIGHT)


def test_begin_after_a_promotion_does_nothing_and_refuses_what_cannot_be_rolled_out() -> None:
    run = Run(policy(steps=[100]))
    run.to_first_arm()
    assert run.until_done().phase == Phase.PROMOTED
    promoted = run.state
    t = run.begin()
    assert t.state is promoted and t.actions == ()  # run again after it finished: nothing left to do
    with pytest.raises(Conflict, match="already the stable"):
        step(None, replace(_begin(run), route=Route(CANARY)), run.policy)
    with pytest.raises(InvalidInput, match="no stable version"):
        step(None, replace(_begin(run), route=Route(None)), run.policy)
    with pytest.raises(Conflict, match="canary 1.2.0 at 5% that no rollout owns"):
        step(None, replace(_begin(run), route=Route(STABLE, "1.2.0", 5.0)), run.policy)


def _begin(run: Run):  # noqa: ANN202 - a Begin
    from datetime import UTC, datetime

    from fleet.control.rollout.machine import Begin

    return Begin(MODEL, CANARY, "run-9", run.now, datetime.fromtimestamp(run.now, UTC), Route(STABLE), None)


def test_a_shadow_phase_runs_its_full_duration_then_the_first_step_takes_the_baseline() -> None:
    run = Run(policy(shadow_percent=10, shadow_duration_s=120))
    t = run.to_first_arm()
    assert t.state.phase == Phase.SHADOW and run.route.shadow == CANARY and run.route.canary is None
    assert needs(t.state, run.policy, run.now + 60).baseline is None  # not before it may end
    assert needs(t.state, run.policy, run.now + 120).baseline is not None


def test_sequential_ticks_read_whole_seconds_once() -> None:
    """Within a step each whole second is read once, whatever the pauses between ticks (a
    source counts by the second: a second read twice counts twice in the evidence)."""
    run = Run(policy(method="sequential", analysis_window_s=2, min_samples=10_000))  # it stays in its step
    run.to_first_arm()
    seconds: list[int] = []
    for pause in (1.3, 0.4, 2.7, 0.2, 3.9, 1.0, 0.6):
        run.now += pause
        for r in needs(run.state, run.policy, run.now).ticks:
            if r.arm == "canary":
                seconds += range(int(r.start // 1), int(r.end // 1) + 1)
        run.tick(seconds=0)
    assert len(seconds) == len(set(seconds)) and seconds == list(range(seconds[0], seconds[-1] + 1))
    assert seconds[-1] == int(run.now // 1) - 1 and run.state.ticked_at == int(run.now // 1)


def test_good_traffic_saves_every_tick_and_a_hold_keeps_the_route() -> None:
    run = Run(policy(min_samples=10_000))
    run.to_first_arm()
    t = run.tick()
    assert t.verdict.outcome == "hold" and isinstance(t.actions[0], Save) and t.state.reports[-1].ticks == 1
    assert not any(isinstance(a, (SetRoute, RollBack)) for a in t.actions) and run.route.weight == 10
