"""Canary rollout as a state machine over stored state, one tick at a time.

``rollouts/<model>.json`` holds where a rollout is (``RolloutState``); every method here
reads what it needs, acts (a route change, a deploy, a verdict), stores the new state and
returns it. The Prefect flow (``flows/rollout.py``) only calls these in order and sleeps
between ticks, so a flow that died is resumed — or rolled back — by the next run from the
stored state alone.

Phases: ``preflight`` → ``deploy`` → ``shadow`` (optional) → ``step`` (one per weight of
the policy, judged by ``fleet.analysis.canary``) → ``approval`` (optional, before 100 %) →
``promote`` → ``promoted``; or ``rolled_back`` (weights back to stable, canary undeployed
and ``rejected``) or ``rejected`` (preflight refused it; nothing was routed).

Invariant: routing never points at a version that is not running. The canary is deployed
and ready before it gets weight; a rollback moves traffic first and undeploys after; the
previous stable is undeployed only after the rollback window, and only if nothing routes
to it any more.

One writer per rollout. Before every route change and every state write the ``guard`` is
asked (the flow passes its lease's ``check``: it raises once the lease is lost or about to
be). State writes are conditional on the ETag this ``Rollout`` last read or wrote, and a
route change first checks that ETag is still the stored one: a second run that wrote the
state makes this one's next act raise ``Conflict`` before it routes anything. A route change
is itself conditional on the route being as the rollout left it (the champion stable, the
canary absent before the first step and this version after): a route someone else changed
meanwhile — `fleet rollback` during a long deploy, say — is never overwritten; the rollout
ends as changed elsewhere.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from datetime import datetime, timedelta
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from fleet import audit, records
from fleet.analysis import sequential
from fleet.analysis.canary import Verdict, judge
from fleet.analysis.sources import MetricsUnavailable, empty_window, sum_windows
from fleet.catalog import gateway_directory
from fleet.catalog.policies.rollout import RolloutPolicy
from fleet.catalog.registry import ModelVersion, Registry, State
from fleet.catalog.routes.rollback import rollback
from fleet.catalog.routes.store import Router
from fleet.catalog.routes.table import Canary, RouteTable, Shadow
from fleet.errors import Conflict, FleetError, InvalidInput, NotFound, PreconditionFailed
from fleet.runtime.base import Runtime
from fleet.types import ArmWindow, MetricsSource, ObjectStore
from fleet.validation import explain

Phase = Literal["preflight", "deploy", "shadow", "step", "approval", "promote", "promoted", "rolled_back", "rejected"]
TERMINAL = frozenset({"promoted", "rolled_back", "rejected"})
READ_SLACK_S = 0.001  # a tick reads [since, upto - this): whole seconds, never the second at upto
BASELINE_S = 300  # the stable's traffic before the rollout that the 100 % step is judged against
# The rollout lease is renewed by a heartbeat every third of this, whatever the step (deploy,
# packaging, a pause for approval), so it need not outlast any step: it only says how soon a
# holder that died on another host is replaced (on the same host, at once).
LEASE_TTL = timedelta(seconds=30)


class RolloutFailed(FleetError):
    """The rollout ended without promoting; the message names the breached gate."""

    status = 409


class _RouteMoved(Exception):
    """The route is no longer as the rollout left it; carries what to end the rollout with."""

    def __init__(self, state: RolloutState, table: RouteTable) -> None:
        super().__init__(f"route of {table.model} changed outside the rollout")
        self.state, self.table = state, table


class StepReport(BaseModel):
    model_config = ConfigDict(extra="forbid")

    phase: str  # shadow | step
    weight: float
    started: float
    ended: float | None = None
    outcome: str = "running"  # running | advance | rollback | interrupted
    summary: str = ""
    gates: list[dict[str, str]] = []
    canary_requests: int = 0
    stable_requests: int = 0
    ticks: int = 0


class RolloutState(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str
    version: str
    champion: str  # the stable version the rollout started from
    run_id: str
    phase: Phase = "preflight"
    step: int = -1  # index into the policy's steps; -1 before the first
    weight: float = 0.0
    step_started: float = 0.0
    # what the 100 % step is judged against: the stable at full traffic before the rollout,
    # or a passed step's stable window if that saw more requests
    baseline: dict[str, Any] | None = None
    reports: list[StepReport] = []
    # policy method "sequential" (fleet.analysis.sequential): what both arms served since the first
    # step, the tests' evidence, and where the last tick's window ended
    served: dict[str, dict[str, Any]] = {}
    step_served: dict[str, dict[str, Any]] = {}  # ... since the step began
    step_of: float = 0.0  # the step_started step_served belongs to (a restarted step starts over)
    evidence: dict[str, Any] | None = None
    ticked_at: float = 0.0  # the whole second up to which both arms were read
    preflight: list[dict[str, str]] = []
    reason: str = ""
    breached: list[str] = []
    started_at: datetime
    updated_at: datetime

    @property
    def done(self) -> bool:
        return self.phase in TERMINAL


def state_key(model: str) -> str:
    return f"rollouts/{model}.json"


def lease_key(model: str) -> str:
    return f"rollouts/{model}.lease"


def apply_overrides(policy: RolloutPolicy, overrides: dict[str, Any]) -> RolloutPolicy:
    """The policy with ``overrides`` merged in (nested for ``gates``), validated as a whole."""
    if not overrides:
        return policy
    data = policy.model_dump()
    for key, value in overrides.items():
        data[key] = {**data[key], **value} if isinstance(value, dict) and isinstance(data.get(key), dict) else value
    try:
        return RolloutPolicy.model_validate(data)
    except ValidationError as exc:
        raise InvalidInput("rollout policy overrides refused: " + "; ".join(explain(exc, RolloutPolicy))) from None


def _windows(served: dict[str, dict[str, Any]], arm: str) -> list[ArmWindow]:
    return [_window(served[arm])] if arm in served else []


def _window(data: dict[str, Any]) -> ArmWindow:
    histograms = ("latency_ms", "predictions", "tpot_ms", "output_tokens")
    return ArmWindow(**{**data, **{k: tuple(data[k]) for k in histograms if k in data}})


class Rollout:
    def __init__(
        self,
        store: ObjectStore,
        runtime: Runtime,
        metrics: MetricsSource,
        policy: RolloutPolicy,
        *,
        clock: Callable[[], float] = time.time,
        notify: Callable[[ObjectStore], object] = gateway_directory.notify,
        emit: Callable[[str, dict[str, Any]], None] = lambda event, payload: None,
        who: str = "",
        guard: Callable[[], None] = lambda: None,
    ) -> None:
        """``guard`` is called before every route change and state write and raises
        (``Conflict``) when this run may no longer act: the flow passes its lease's ``check``."""
        self.store, self.runtime, self.metrics, self.policy = store, runtime, metrics, policy
        self.registry = Registry(store)
        self.router = Router(store, self.registry)
        self.clock, self.notify, self.emit = clock, notify, emit
        self.who = who or audit.actor()
        self.guard = guard
        self._etags: dict[str, str | None] = {}  # model → ETag of the state this run last read or wrote

    # -- state --------------------------------------------------------------------------
    def load(self, model: str) -> RolloutState | None:
        return records.load_or_none(self.store, state_key(model), RolloutState)[0]

    def _read(self, model: str) -> RolloutState | None:
        """The stored state, whose ETag the next write of this run is conditional on."""
        state, self._etags[model] = records.load_or_none(self.store, state_key(model), RolloutState)
        return state

    def _save(self, state: RolloutState, **changes: Any) -> RolloutState:
        self.guard()
        new = state.model_copy(update={**changes, "updated_at": audit.now()})
        etag = self._etags.get(state.model)
        condition: dict[str, Any] = {"if_match": etag} if etag else {"if_none_match": True}
        try:
            self._etags[state.model] = self.store.put(state_key(state.model), records.dump(new), **condition)
        except PreconditionFailed:
            raise self._taken(state) from None
        return new

    def _owned(self, state: RolloutState) -> None:
        """Return if this run may still act on ``state``'s model, else raise ``Conflict``:
        the guard passes and the stored state is still the one this run last read or wrote."""
        self.guard()
        try:
            etag: str | None = self.store.get(state_key(state.model)).etag
        except NotFound:
            etag = None
        if etag != self._etags.get(state.model):
            raise self._taken(state)

    def _taken(self, state: RolloutState) -> Conflict:
        return Conflict(
            f"{state_key(state.model)} was changed by another run since run {state.run_id} of "
            f"{state.model}:{state.version} last read or wrote it; expected to be its only writer, "
            "this run stops without routing or writing anything more"
        )

    def _event(self, name: str, state: RolloutState, **extra: Any) -> None:
        self.emit(
            f"fleet.rollout.{name}",
            {
                "model": state.model,
                "version": state.version,
                "phase": state.phase,
                "weight": state.weight,
                "run_id": state.run_id,
                **extra,
            },
        )

    def _route(self, state: RolloutState, why: str, **fields: Any) -> None:
        """Set ``fields`` of the route table, only while this run owns the rollout and only
        if the route is still as the rollout left it (else ``_RouteMoved``, nothing written)."""
        self._owned(state)

        def change(table: RouteTable) -> RouteTable:
            canary = table.canary.version if table.canary else None
            if table.stable != state.champion or canary != (state.version if state.step >= 0 else None):
                raise _RouteMoved(state, table)
            return RouteTable.model_validate({**table.model_dump(), **fields})

        self.router.update(state.model, change, why=f"rollout of {state.version}: {why}", who=self.who)
        self.notify(self.store)

    def _unless_moved(self, act: Callable[[], RolloutState]) -> RolloutState:
        """``act()``, or the rollback that ends the rollout if the route moved under it."""
        try:
            return act()
        except _RouteMoved as moved:
            return self._ended_elsewhere(moved.state, moved.table)

    # -- begin / resume -----------------------------------------------------------------
    def begin(self, model: str, version: str, run_id: str) -> RolloutState:
        """Start a rollout, or resume the stored one of the same version; call under the lease."""
        stored = self._read(model)
        if stored is not None and stored.phase == "promoted" and stored.version == version:
            if self.router.get(model).stable == version:
                return stored  # run again after it finished: nothing left to do
        if stored is not None and not stored.done:
            if stored.version == version:
                state = self._save(stored, run_id=run_id)
                self._event("resumed", state)
                return self._recover(state)
            self._rollback(stored, f"abandoned: a rollout of {version} started after this one's run stopped", [])
        table = self.router.get(model)
        if table.stable is None:
            raise InvalidInput(
                f"{model} has no stable version to canary against; set one with `fleet route set --stable`"
            )
        if table.stable == version:
            raise Conflict(f"{model}:{version} is already the stable version")
        if table.canary is not None:
            raise Conflict(
                f"{model} already has canary {table.canary.version} at {table.canary.weight:g}% that no "
                "rollout owns; remove it (fleet route set --no-canary) or roll it back first"
            )
        now = audit.now()
        state = RolloutState(
            model=model, version=version, champion=table.stable, run_id=run_id, started_at=now, updated_at=now
        )
        state = self._save(state)
        self._event("started", state, champion=table.stable)
        return state

    def _recover(self, state: RolloutState) -> RolloutState:
        """After an interruption: go on only if routing still matches what was stored and the
        canary still runs; otherwise roll back (the safe way out)."""
        if state.phase in ("preflight", "deploy"):
            return state
        table = self.router.get(state.model)
        running = any(d.model == state.model and d.version == state.version for d in self.runtime.list())
        routed = (
            (table.canary and table.canary.version == state.version)
            or (table.shadow and table.shadow.version == state.version)
            or table.stable == state.version
        )
        if not running and state.phase != "promoted":
            return self._rollback(state, "the canary was not running when the interrupted rollout resumed", [])
        if state.phase in ("step", "shadow") and not routed:
            return self._ended_elsewhere(state, table)
        if state.phase in ("step", "shadow"):  # the step starts over: its window before the crash is not trusted
            return self._save(state, step_started=self.clock())
        return state

    # -- preflight ------------------------------------------------------------------------
    def run_preflight(self, state: RolloutState) -> RolloutState:
        """Checksums, schema compatible with the champion, offline metrics not worse than it."""
        candidate = self.registry.verify(state.model, state.version)
        champion = self.registry.get(state.model, state.champion)
        checks = [
            {"check": "checksums", "status": "pass", "detail": f"{len(candidate.files)} file(s) match the manifest"},
            _schema_check(candidate, champion),
            _offline_check(candidate, champion, self.policy.offline_tolerance),
        ]
        if candidate.state not in (State.REGISTERED, State.CANARY):
            checks.append(
                {
                    "check": "state",
                    "status": "fail",
                    "detail": f"{candidate.ref} is {candidate.state}; expected registered",
                }
            )
        failed = [c for c in checks if c["status"] == "fail"]
        if failed:
            reason = "preflight failed: " + "; ".join(f"{c['check']}: {c['detail']}" for c in failed)
            if candidate.state == State.REGISTERED:
                self.registry.transition(state.model, state.version, State.REJECTED, why=reason, who=self.who)
            state = self._save(
                state, phase="rejected", preflight=checks, reason=reason, breached=[c["check"] for c in failed]
            )
            self._event("rejected", state, reason=reason)
            return state
        return self._save(state, phase="deploy", preflight=checks)

    # -- deploy -------------------------------------------------------------------------
    def deploy(self, state: RolloutState, replicas: int = 1) -> RolloutState:
        """Run the canary and wait until it is ready; only then does it get traffic."""
        try:
            self.runtime.deploy(state.model, state.version, replicas)
        except FleetError as exc:
            return self._rollback(state, f"the canary did not start: {exc}", ["deploy"])
        self._event("deployed", state)
        return self._unless_moved(lambda: self._first_arm(state))

    def _first_arm(self, state: RolloutState) -> RolloutState:
        if self.policy.shadow_percent > 0 and self.policy.shadow_duration_s > 0:
            shadow = Shadow(version=state.version, percent=self.policy.shadow_percent)
            self._route(state, f"shadow {self.policy.shadow_percent:g}%", shadow=shadow.model_dump())
            now = self.clock()
            report = StepReport(phase="shadow", weight=0.0, started=now)
            return self._save(state, phase="shadow", step_started=now, reports=[*state.reports, report])
        return self._next_step(state)

    def _next_step(self, state: RolloutState) -> RolloutState:
        step = state.step + 1
        if step >= len(self.policy.steps):
            return self._save(state, phase="promote")
        weight = float(self.policy.steps[step])
        if weight >= 100 and self.policy.manual_approval and state.phase != "approval":
            state = self._save(state, phase="approval")
            self._event("awaiting-approval", state)
            return state
        if step == 0:
            # At 100 % nothing serves on stable, so the canary is judged against the stable as it
            # was at full traffic just before the rollout: the same load, not a step's share of it.
            now = self.clock()
            recent = self.metrics.window(state.model, state.champion, now - BASELINE_S, now)
            if recent.requests >= self.policy.min_samples or weight >= 100:
                state = self._save(state, baseline=asdict(recent))
        canary = Canary(version=state.version, weight=weight)
        self._route(state, f"step {step + 1}/{len(self.policy.steps)} at {weight:g}%", canary=canary.model_dump())
        now = self.clock()
        report = StepReport(phase="step", weight=weight, started=now)
        state = self._save(
            state, phase="step", step=step, weight=weight, step_started=now, reports=[*state.reports, report]
        )
        self._event("step", state, step=step + 1, steps=len(self.policy.steps))
        return state

    # -- ticks ----------------------------------------------------------------------------
    def tick(self, state: RolloutState) -> tuple[RolloutState, Verdict | None]:
        """Judge the current step's traffic so far and act on the verdict."""
        if state.phase not in ("shadow", "step"):
            return state, None
        table = self.router.get(state.model)
        mine = (
            table.shadow.version == state.version
            if state.phase == "shadow" and table.shadow
            else (table.canary is not None and table.canary.version == state.version)
        )
        if not mine:
            return self._ended_elsewhere(state, table), None
        now = self.clock()
        t0 = state.step_started
        stable = None
        try:
            if state.phase == "step" and self.policy.method == "sequential":
                verdict, state = self._sequential(state, now)
            else:
                stable = self.metrics.window(state.model, state.champion, t0, now)
                canary = self.metrics.window(state.model, state.version, t0, now)
        except MetricsUnavailable as exc:
            # no data is not bad data: hold, and fail only once the step's deadline passed
            if now < t0 + self.policy.hold_deadline_s:
                self._event("verdict", state, outcome="hold", summary=f"metrics unavailable: {exc}")
                return state, None
            return self._rollback(
                state, f"gate metrics breached: unreadable until the step's deadline ({exc})", ["metrics"]
            ), None
        if stable is not None:
            reference, concurrent = stable, True
            if state.phase == "step" and state.weight >= 100 and state.baseline:
                reference, concurrent = _window(state.baseline), False
            verdict = judge(
                reference,
                canary,
                self.policy,
                step_started=t0,
                concurrent=concurrent,
                phase="shadow" if state.phase == "shadow" else "canary",
            )
        report = state.reports[-1].model_copy(
            update={
                "summary": verdict.summary,
                "gates": verdict.table(),
                "canary_requests": verdict.canary_requests,
                "stable_requests": verdict.stable_requests,
                "ticks": state.reports[-1].ticks + 1,
            }
        )
        state = self._save(state, reports=[*state.reports[:-1], report])
        self._event("verdict", state, outcome=verdict.outcome, summary=verdict.summary)
        if verdict.outcome == "hold":
            return state, verdict
        if verdict.outcome == "rollback":
            closed = report.model_copy(update={"outcome": "rollback", "ended": now})
            state = self._save(state, reports=[*state.reports[:-1], closed])
            gates = [g.gate for g in verdict.breaches]
            reason = (
                f"gate {', '.join(gates)} breached at {state.weight:g}%: {verdict.summary.removeprefix('roll back: ')}"
            )
            return self._rollback(state, reason, gates), verdict
        if state.phase == "shadow" and now - t0 < self.policy.shadow_duration_s:
            return state, verdict  # the gates pass; the shadow phase still runs its full duration
        closed = report.model_copy(update={"outcome": "advance", "ended": now})
        # the stable at full traffic before the rollout is the better baseline, unless it saw
        # less than this step did (a rollout started right after traffic did): keep the larger.
        # (The sequential method keeps every step's stable in its totals already.)
        baseline = state.baseline
        if stable is not None and stable.requests > (baseline or {}).get("requests", 0):
            baseline = asdict(stable)
        state = self._save(state, reports=[*state.reports[:-1], closed], baseline=baseline)
        return self._unless_moved(lambda: self._advance(state)), verdict

    def _sequential(self, state: RolloutState, now: float) -> tuple[Verdict, RolloutState]:
        """One tick of ``fleet.analysis.sequential``. Each tick reads both arms over the whole seconds
        since the last one read (a metrics source counts by the second: reading a second
        twice would count its requests twice), adds them to the totals since the first step
        and since the step began, which the state keeps, and feeds the tests' evidence. No
        window longer than a tick is read, so a step may last longer than a source keeps."""
        upto = math.floor(now)
        step_from = math.ceil(state.step_started)
        since = max(step_from, int(state.ticked_at))
        if since < upto:  # [since, upto): whole seconds, the one still running left for the next tick
            tick_c = self.metrics.window(state.model, state.version, since, upto - READ_SLACK_S)
            tick_s = self.metrics.window(state.model, state.champion, since, upto - READ_SLACK_S)
        else:
            tick_c = empty_window(state.model, state.version, since, since)
            tick_s = empty_window(state.model, state.champion, since, since)
            upto = since
        kept = state.step_served if state.step_of == state.step_started else {}

        def plus(totals: dict[str, dict[str, Any]], arm: str, window: ArmWindow) -> ArmWindow:
            return sum_windows([*_windows(totals, arm), window], window.model, window.version, since, upto)

        served = {"canary": plus(state.served, "canary", tick_c), "stable": plus(state.served, "stable", tick_s)}
        step = {"canary": plus(kept, "canary", tick_c), "stable": plus(kept, "stable", tick_s)}
        stable_all = served["stable"]
        if stable_all.requests == 0 and state.baseline:
            # a rollout straight to 100 %: the stable at full traffic before it is all there is
            stable_all = replace(_window(state.baseline), version=state.champion)
        arms = sequential.Arms(tick_c, tick_s, served["canary"], stable_all, step["canary"], step["stable"])
        verdict, evidence = sequential.judge(
            arms,
            self.policy,
            sequential.Evidence.from_dict(state.evidence),
            step=state.step,
            step_started=state.step_started,
        )
        state = self._save(
            state,
            served={k: asdict(w) for k, w in served.items()},
            step_served={k: asdict(w) for k, w in step.items()},
            step_of=state.step_started,
            evidence=evidence.to_dict(),
            ticked_at=upto,
        )
        return verdict, state

    def _advance(self, state: RolloutState) -> RolloutState:
        if state.phase == "shadow":
            self._route(state, "shadow phase passed", shadow=None)
        return self._next_step(state)

    def approve(self, state: RolloutState, approved: bool, by: str, note: str = "") -> RolloutState:
        if state.phase != "approval":
            raise Conflict(f"the rollout of {state.model}:{state.version} is {state.phase}, not waiting for approval")
        if not approved:
            return self._rollback(state, f"not approved by {by}{': ' + note if note else ''}", ["approval"])
        self._event("approved", state, by=by)
        return self._unless_moved(lambda: self._next_step(state))

    # -- endings --------------------------------------------------------------------------
    def promote(self, state: RolloutState) -> RolloutState:
        return self._unless_moved(lambda: self._promote(state))

    def _promote(self, state: RolloutState) -> RolloutState:
        shadow = {"shadow": None} if _shadowed(self.router, state) else {}
        self._route(state, "promoted: every step passed", stable=state.version, canary=None, **shadow)
        state = self._save(state, phase="promoted", weight=100.0, reason="every step passed")
        self._event("promoted", state, previous=state.champion)
        return state

    def retire_previous(self, state: RolloutState) -> bool:
        """Undeploy the previous stable unless something routes to it again; True if undeployed."""
        table = self.router.get(state.model)
        if state.champion in table.referenced_versions():
            return False
        self.runtime.undeploy(state.model, state.champion)
        return True

    def _rollback(self, state: RolloutState, reason: str, breached: list[str]) -> RolloutState:
        self._owned(state)
        table = self.router.get(state.model)
        if table.canary is not None and table.canary.version == state.version:
            rollback(self.router, state.model, why=f"rollout of {state.version}: {reason}", who=self.who)
        if table.shadow is not None and table.shadow.version == state.version:
            self.router.set(state.model, clear_shadow=True, why=f"rollout of {state.version}: {reason}", who=self.who)
        self.notify(self.store)
        if self.registry.states(state.model).get(state.version) in (State.REGISTERED, State.CANARY):
            self.registry.transition(state.model, state.version, State.REJECTED, why=reason, who=self.who)
        if state.version not in self.router.get(state.model).referenced_versions():
            self.runtime.undeploy(state.model, state.version)  # traffic moved first, then the process goes
        state = self._save(state, phase="rolled_back", weight=0.0, reason=reason, breached=breached)
        self._event("rolled-back", state, reason=reason, breached=breached)
        return state

    def _ended_elsewhere(self, state: RolloutState, table: Any) -> RolloutState:
        """Someone changed the route under the rollout (a manual rollback, say): stop here."""
        reason = (
            f"the route changed outside the rollout (revision {table.revision} by {table.updated_by}: {table.reason})"
        )
        return self._rollback(state, reason, ["route"])


def _shadowed(router: Router, state: RolloutState) -> bool:
    table = router.get(state.model)
    return table.shadow is not None and table.shadow.version == state.version


def _schema_check(candidate: ModelVersion, champion: ModelVersion) -> dict[str, str]:
    """The candidate must accept what the champion accepts and answer in the same shape."""
    problems = []
    for kind in ("inputs", "outputs"):
        mine, theirs = getattr(candidate, kind), getattr(champion, kind)
        by_name = {t.name: t for t in mine}
        for spec in theirs:
            got = by_name.get(spec.name)
            if got is None:
                problems.append(f"{kind} {spec.name!r} is missing")
            elif (
                got.datatype != spec.datatype
                or len(got.shape) != len(spec.shape)
                or any(a != -1 and a != b for a, b in zip(got.shape, spec.shape))
            ):
                problems.append(
                    f"{kind} {spec.name!r} is {got.datatype} {got.shape}, the champion's {spec.datatype} {spec.shape}"
                )
    if problems:
        return {
            "check": "schema",
            "status": "fail",
            "detail": f"not compatible with {champion.ref}: " + "; ".join(problems),
        }
    return {"check": "schema", "status": "pass", "detail": f"inputs and outputs compatible with {champion.ref}"}


def _offline_check(candidate: ModelVersion, champion: ModelVersion, tolerance: float) -> dict[str, str]:
    if candidate.parent_version == champion.version and "champion_accuracy" in candidate.metrics:
        # a retrain measured both on one holdout: that comparison is the fair one
        mine, theirs = candidate.metrics.get("accuracy", 0.0), candidate.metrics["champion_accuracy"]
        detail = f"accuracy {mine:.4f} vs champion {champion.version} {theirs:.4f} on the same holdout (tolerance {tolerance:g})"
        return {
            "check": "offline metrics",
            "status": "pass" if mine >= theirs - tolerance else "fail",
            "detail": detail,
        }
    # accuracy and f1 of classifiers, exact match of generative models (tiny-lm's holdout)
    metric = next(
        (m for m in ("accuracy", "f1", "exact_match") if m in candidate.metrics and m in champion.metrics), None
    )
    if metric is None:
        return {"check": "offline metrics", "status": "pass", "detail": "no metric both versions report; not compared"}
    mine, theirs = candidate.metrics[metric], champion.metrics[metric]
    detail = f"{metric} {mine:.4f} vs champion {champion.version} {theirs:.4f} (tolerance {tolerance:g})"
    return {"check": "offline metrics", "status": "pass" if mine >= theirs - tolerance else "fail", "detail": detail}
