"""Driving the pure rollout machine by hand, without a store, a runtime or a metrics source.

``Run`` holds the state, a clock it moves, and the route table as the actions leave it (a
``SetRoute`` must find the route as it expects; a ``RollBack`` takes this version off it);
it builds each observation from ``needs`` and steady ``Traffic``, and checks the machine's
invariants on every transition (``check``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path

from fleet.analysis.sources import empty_window
from fleet.catalog.policies.loader import load_policies
from fleet.catalog.policies.rollout import RolloutPolicy
from fleet.catalog.rollouts import TERMINAL, Phase, RolloutState
from fleet.control.rollout.effects import apply_overrides
from fleet.control.rollout.machine import (
    Answered,
    Begin,
    Checked,
    Deployed,
    Looked,
    Observation,
    Promoting,
    RollBack,
    Route,
    Save,
    SetRoute,
    Transition,
    schedule,
    step,
)
from fleet.control.rollout.reading import Read, needs
from fleet.types import ArmWindow, latency_bucket, score_bins

ROOT = Path(__file__).resolve().parents[1]
MODEL, STABLE, CANARY = "demo", "1.0.0", "1.1.0"
T0 = 1_000_000.0
PASS = tuple({"check": c, "status": "pass", "detail": "fine"} for c in ("checksums", "schema", "offline metrics"))


def policy(**overrides: object) -> RolloutPolicy:
    """test_rollout's: steps 10/50/100 judged by the fixed method, a minute a tick."""
    base = {
        "steps": [10, 50, 100],
        "analysis_window_s": 60,
        "min_samples": 100,
        "hold_deadline_s": 600,
        "gates": {"max_error_rate_increase": 0.02},
        "method": "fixed",
    }
    return apply_overrides(load_policies(ROOT / "policies").rollout["default"], {**base, **overrides})


@dataclass(frozen=True)
class Traffic:
    """How a version serves: its answers' error share, latency and output scores."""

    errors: float = 0.0
    latency_ms: float = 10.0
    scores: tuple[float, ...] = (0.3, 0.8)


GOOD = Traffic()


def served(version: str, start: float, end: float, rps: float, traffic: Traffic) -> ArmWindow:
    """``rps`` requests a second of ``traffic`` over [start, end)."""
    n = round(rps * max(end - start, 0.0))
    failed = round(n * traffic.errors)
    base = empty_window(MODEL, version, start, end)
    latency, predictions = list(base.latency_ms), list(base.predictions)
    latency[latency_bucket(traffic.latency_ms)] += n - failed
    for i, k in enumerate(score_bins(list(traffic.scores))):
        predictions[i] += k * (n - failed)
    errors = {**base.errors, "5xx": failed}
    return replace(base, requests=n, errors=errors, latency_ms=tuple(latency), predictions=tuple(predictions))


class Run:
    """One rollout of CANARY against STABLE: ``rps`` split by the route's weight."""

    def __init__(self, policy: RolloutPolicy, canary: Traffic = GOOD, rps: float = 40.0) -> None:
        self.policy, self.canary, self.rps = policy, canary, rps
        self.replicas = 1  # blue's, for a blue-green Begin
        self.now = T0
        self.route = Route(STABLE, revision=1, updated_by="ops", reason="first")
        self.state: RolloutState | None = None
        self.transitions: list[Transition] = []

    # -- observations ---------------------------------------------------------------------
    def do(self, obs: Observation) -> Transition:
        before = self.state
        t = step(before, obs, self.policy)
        check(before, obs, t, self.policy)
        for action in t.actions:
            self._apply(action)
        self.state = t.state
        self.transitions.append(t)
        return t

    def begin(self, running: bool | None = None, version: str = CANARY) -> Transition:
        at = datetime.fromtimestamp(self.now, UTC)
        strategy = self.policy.strategy
        return self.do(Begin(MODEL, version, "run-1", self.now, at, self.route, running, strategy, self.replicas))

    def to_first_arm(self) -> Transition:
        self.begin()
        self.do(Checked(PASS, registered=True))
        return self.do(Deployed(self.now, baseline=self._baseline()))

    def tick(self, seconds: float | None = None, unavailable: str | None = None) -> Transition:
        self.now += self.policy.analysis_window_s if seconds is None else seconds
        wanted = needs(self.state, self.policy, self.now)
        windows = {r.arm: self.window(r) for r in wanted.ticks}
        seen = Looked(self.now, self.route, windows.get("canary"), windows.get("stable"), unavailable, self._baseline())
        return self.do(seen)

    def answer(self, approved: bool, by: str = "ops", note: str = "") -> Transition:
        return self.do(Answered(self.now, approved, by, note, self._baseline()))

    def promote(self) -> Transition:
        return self.do(Promoting(self.route))

    def until_done(self, ticks: int = 200) -> RolloutState:
        for _ in range(ticks):
            if self.state.phase == Phase.PROMOTE:
                self.promote()
            if self.state.done:
                return self.state
            self.tick()
        raise AssertionError(f"still {self.state.phase} at step {self.state.step} after {ticks} ticks")

    def window(self, read: Read) -> ArmWindow:
        share = (self.route.weight if self.route.canary == CANARY else 0.0) / 100
        if read.arm == "canary":
            if self.route.shadow == CANARY and not share:  # the shadow phase: a mirrored share, the stable whole
                share = self.policy.shadow_percent / 100
                return served(read.version, read.start, read.end, self.rps * share, self.canary)
            return served(read.version, read.start, read.end, self.rps * share, self.canary)
        return served(read.version, read.start, read.end, self.rps * (1 - share), GOOD)

    def _baseline(self) -> ArmWindow | None:
        read = needs(self.state, self.policy, self.now).baseline if self.state else None
        return None if read is None else served(read.version, read.start, read.end, self.rps, GOOD)

    # -- the route table as the actions leave it --------------------------------------------
    def _apply(self, action: object) -> None:
        r = self.route
        if isinstance(action, SetRoute):
            assert (r.stable, r.canary) == (action.expect_stable, action.expect_canary), (r, action)
            fields = dict(action.fields)
            canary = fields.get("canary", {"version": r.canary, "weight": r.weight}) or {"version": None, "weight": 0}
            shadow = fields.get("shadow", {"version": r.shadow}) or {"version": None}
            stable = fields.get("stable", r.stable)
            self.route = Route(
                stable, canary["version"], canary["weight"], shadow["version"], r.revision + 1, "rollout"
            )
        elif isinstance(action, RollBack):
            gone = self.state.version if self.state else None
            canary, weight = (None, 0.0) if r.canary == gone else (r.canary, r.weight)
            shadow = None if r.shadow == gone else r.shadow
            self.route = Route(r.stable, canary, weight, shadow, r.revision + 1, "rollout")

    def moved_by_hand(self, reason: str = "operator saw errors") -> None:
        self.route = Route(self.route.stable, None, 0.0, None, self.route.revision + 1, "ops", reason)


def check(before: RolloutState | None, obs: Observation, t: Transition, policy: RolloutPolicy) -> None:
    """The invariants every transition keeps."""
    after, actions = t.state, t.actions
    saves = [a for a in actions if isinstance(a, Save)]
    rollbacks = [a for a in actions if isinstance(a, RollBack)]
    if before is not None and before.done and not isinstance(obs, Begin):
        assert after == before and not actions, "terminal phases absorb"
        return
    if saves:
        assert saves[-1].state == after, "the state returned is the state last saved"
    elif after is not None and before is not None and after.version == before.version:
        assert after == before, "a state that changed is saved"
    # a rollback action always accompanies entering rolled_back, and only that
    entered = after is not None and after.phase == Phase.ROLLED_BACK and getattr(before, "phase", None) != after.phase
    assert len(rollbacks) == (1 if entered else 0), actions
    if after is None:
        return
    came_from = before.phase if before is not None and before.version == after.version else None
    steps = schedule(after, policy)  # the canary's steps, or blue-green's one switch
    if after.phase == Phase.PROMOTE and came_from != Phase.PROMOTE:
        assert came_from in (Phase.STEP, Phase.BAKE) and before.step == len(steps) - 1, (
            "promote only after the last step"
        )
        if came_from == Phase.BAKE:
            assert obs.now - before.step_started >= policy.bake_s, "promote only after the whole bake"
    if after.phase == Phase.PROMOTED and came_from != Phase.PROMOTED:
        assert came_from == Phase.PROMOTE and isinstance(obs, Promoting)
    assert after.weight in {0.0, *steps}, "weight only from the policy's steps"
    assert (after.phase == Phase.STEP) <= (after.strategy == "canary"), "weight steps are the canary's"
    assert (after.phase == Phase.BAKE) <= (after.strategy == "blue-green"), "a bake is blue-green's"
    if after.phase in (Phase.STEP, Phase.BAKE):
        assert after.weight == steps[after.step]
    for change in actions:
        if isinstance(change, SetRoute) and change.fields.get("canary"):
            assert change.fields["canary"]["weight"] in steps
            assert came_from in (Phase.DEPLOY, Phase.SHADOW, Phase.STEP, Phase.APPROVAL), "weight only once deployed"
            if after.strategy == "blue-green":  # one switch of everything, blue the stable behind it
                assert change.fields["canary"]["weight"] == 100 and after.phase == Phase.BAKE
                assert after.switched_at is not None
            assert not isinstance(obs, Deployed) or obs.failed is None
    if after.phase in TERMINAL and came_from not in TERMINAL and came_from is not None:
        assert actions, "ending a rollout is never silent"
