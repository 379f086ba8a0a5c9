"""The rollout's executor (canary or blue-green): it gathers observations, asks the pure state machine
(``fleet.control.rollout.machine.step``) what to do, and does it.

``rollouts/<model>.json`` holds where a rollout is (``fleet.catalog.rollouts.RolloutState``);
every public method here reads what its decision needs (the store, the route table, the
runtime, the metrics the machine's ``needs`` names), steps the machine, performs the
actions in order and returns the stored state. The Prefect flow (``flows/rollout.py``) only
calls these in order and sleeps between ticks, so a flow that died is resumed — or rolled
back — by the next run from the stored state alone.

Invariant: routing never points at a version that is not running. The canary is deployed
and ready before it gets weight (blue-green's green at the stable's replica count, with the
stable's own floor held there, so the stable keeps full capacity through the bake, and both
floors released once it ends: ``Runtime.release``); a rollback moves traffic first and undeploys after; the
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

import logging
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from pydantic import ValidationError

from fleet import audit, records
from fleet.analysis.canary import Verdict
from fleet.analysis.sources import MetricsUnavailable
from fleet.catalog import gateway_directory
from fleet.catalog.policies.rollout import RolloutPolicy
from fleet.catalog.registry import Registry, State
from fleet.catalog.rollouts import JUDGED, Phase, RolloutState, state_key
from fleet.catalog.routes.rollback import rollback
from fleet.catalog.routes.store import Router
from fleet.catalog.routes.table import RouteTable
from fleet.control.rollout import machine, preflight
from fleet.control.rollout.machine import (
    Answered,
    Begin,
    Checked,
    Deployed,
    Emit,
    Looked,
    Promoting,
    Reject,
    RollBack,
    Route,
    RouteMoved,
    Save,
    SetRoute,
    Transition,
)
from fleet.control.rollout.reading import Read, needs
from fleet.errors import Conflict, FleetError, InvalidInput, NotFound, PreconditionFailed
from fleet.runtime.base import Runtime
from fleet.types import ArmWindow, MetricsSource, ObjectStore
from fleet.validation import explain

# The rollout lease is renewed by a heartbeat every third of this, whatever the step (deploy,
# packaging, a pause for approval), so it need not outlast any step: it only says how soon a
# holder that died on another host is replaced (on the same host, at once).
LEASE_TTL = timedelta(seconds=30)

log = logging.getLogger(__name__)


class _RouteMoved(Exception):
    """The route is no longer as the rollout left it; carries the table found."""

    def __init__(self, table: RouteTable) -> None:
        super().__init__(f"route of {table.model} changed outside the rollout")
        self.table = table


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


def route_of(table: RouteTable) -> Route:
    """What the machine sees of a route table."""
    return Route(
        stable=table.stable,
        canary=table.canary.version if table.canary else None,
        weight=table.canary.weight if table.canary else 0.0,
        shadow=table.shadow.version if table.shadow else None,
        revision=table.revision,
        updated_by=table.updated_by,
        reason=table.reason,
    )


class Rollout:
    def __init__(
        self,
        store: ObjectStore,
        runtime: Runtime,
        metrics: MetricsSource,
        policy: RolloutPolicy,
        *,
        clock: Callable[[], float] = time.time,
        notify: Callable[[ObjectStore], object] = gateway_directory.tell,
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

    # -- the steps the flow calls -------------------------------------------------------
    def begin(self, model: str, version: str, run_id: str) -> RolloutState:
        """Start a rollout, or resume the stored one of the same version; call under the lease.
        An unfinished rollout of another version is rolled back first."""
        state = self._begin(model, version, run_id)
        if state.version != version:  # that was the abandoned one, now rolled back: start this one
            state = self._begin(model, version, run_id)
        return state

    def _begin(self, model: str, version: str, run_id: str) -> RolloutState:
        stored = self._read(model)
        table = self.router.get(model)
        resuming = stored is not None and not stored.done and stored.version == version
        running = self._running(model, version) if resuming else None
        strategy = self.policy.strategy
        replicas = self._replicas(model, table.stable) if strategy == "blue-green" and table.stable else 1
        seen = Begin(model, version, run_id, self.clock(), audit.now(), route_of(table), running, strategy, replicas)
        return self._act(stored, seen)  # type: ignore[return-value] - begin always yields a state

    def run_preflight(self, state: RolloutState) -> RolloutState:
        """Checksums (``Registry.verify`` raises on any difference), schema compatible with the
        champion, offline metrics not worse than it."""
        candidate = self.registry.verify(state.model, state.version)
        champion = self.registry.get(state.model, state.champion)
        found = preflight.checks(candidate, champion, self.policy.offline_tolerance)
        return self._act(state, Checked(tuple(found), candidate.state == State.REGISTERED))

    def deploy(self, state: RolloutState) -> RolloutState:
        """Run the canary (``state.replicas`` of it) and wait until it is ready; only then does it
        get traffic. Blue-green first holds the stable at that count, so that it keeps its
        capacity while green serves everything (KEDA would otherwise scale it down as its
        traffic left) and a switch back lands on replicas already running."""
        try:
            if state.strategy == "blue-green":  # never fewer than run now: a deploy sets the count
                blue = max(state.replicas, self._replicas(state.model, state.champion))
                self.runtime.deploy(state.model, state.champion, blue)
            self.runtime.deploy(state.model, state.version, state.replicas)
        except FleetError as exc:
            return self._act(state, Deployed(self.clock(), failed=str(exc)))
        now = self.clock()
        return self._act(state, Deployed(now, baseline=self._baseline(state, now)))

    def tick(self, state: RolloutState) -> tuple[RolloutState, Verdict | None]:
        """Judge the current step's traffic so far and act on the verdict (or, ``waiting``, read
        the stable's baseline again)."""
        if state.phase not in JUDGED and not state.waiting:
            return state, None
        route = route_of(self.router.get(state.model))
        now = self.clock()
        wanted = needs(state, self.policy, now)
        windows: dict[str, ArmWindow] = {}
        unavailable = None
        baseline = None
        try:
            for read in wanted.ticks:
                windows[read.arm] = self._window(state.model, read)  # type: ignore[assignment]
            baseline = self._window(state.model, wanted.baseline)
        except MetricsUnavailable as exc:
            unavailable = str(exc)  # the machine holds until the step's deadline
        seen = Looked(now, route, windows.get("canary"), windows.get("stable"), unavailable, baseline)
        transition = machine.step(state, seen, self.policy)
        return self._perform(state, transition), transition.verdict

    def approve(self, state: RolloutState, approved: bool, by: str, note: str = "") -> RolloutState:
        now = self.clock()
        baseline = self._baseline(state, now) if approved else None
        return self._act(state, Answered(now, approved, by, note, baseline))

    def promote(self, state: RolloutState) -> RolloutState:
        self._owned(state)  # a run that may no longer act learns it first, whatever the phase
        state = self._act(state, Promoting(route_of(self.router.get(state.model))))
        if state.phase == Phase.PROMOTED and state.strategy == "blue-green":
            self._release(state, state.version)  # green, started at blue's count, scales by load now
        return state

    def retire_previous(self, state: RolloutState) -> bool:
        """Undeploy the previous stable unless something routes to it again; True if undeployed."""
        table = self.router.get(state.model)
        if state.champion in table.referenced_versions():
            return False
        self.runtime.undeploy(state.model, state.champion)
        return True

    # -- observing ------------------------------------------------------------------------
    def _running(self, model: str, version: str) -> bool:
        return any(d.model == model and d.version == version for d in self.runtime.list())

    def _replicas(self, model: str, version: str) -> int:
        """How many replicas of ``version`` run now (at least one): green's count."""
        found = [len(d.endpoints) for d in self.runtime.list() if d.model == model and d.version == version]
        return max(1, *found) if found else 1

    def _baseline(self, state: RolloutState, now: float) -> ArmWindow | None:
        """The stable's traffic before the rollout, when the first step may begin now; None when
        metrics cannot be read: a first step below 100 % then begins without one (the stable's
        own traffic beside it stands in); one at 100 % waits for it (``machine``)."""
        try:
            return self._window(state.model, needs(state, self.policy, now).baseline)
        except MetricsUnavailable as exc:
            log.warning("rollout %s:%s: no baseline yet (%s)", state.model, state.version, exc)
            return None

    def _window(self, model: str, read: Read | None) -> ArmWindow | None:
        """The window ``read`` names (None for none); ``MetricsUnavailable`` goes to the caller."""
        return None if read is None else self.metrics.window(model, read.version, read.start, read.end)

    # -- acting -----------------------------------------------------------------------------
    def _act(self, state: RolloutState | None, seen: machine.Observation) -> RolloutState:
        return self._perform(state, machine.step(state, seen, self.policy))  # type: ignore[return-value]

    def _perform(self, state: RolloutState | None, transition: Transition) -> RolloutState | None:
        """The transition's actions in order; the state as last stored. A route change that
        finds the route moved stops them: the machine then ends the rollout from there."""
        current, saved = state, False
        for action in transition.actions:
            if isinstance(action, Save):
                current, saved = self._save(action.state), True
            elif isinstance(action, Emit):
                self.emit(action.event, dict(action.payload))
            elif current is None:  # the machine stores a new rollout before it acts on it
                raise AssertionError(f"{action} before the rollout was stored")
            elif isinstance(action, SetRoute):
                try:
                    self._route(current, action)
                except _RouteMoved as moved:
                    moved_on = machine.step(current, RouteMoved(route_of(moved.table)), self.policy)
                    return self._perform(current, moved_on)
            elif isinstance(action, RollBack):
                self._roll_back(current, action)
            elif isinstance(action, Reject):
                self._owned(current)  # a run that lost its lease marks nothing
                self.registry.transition(
                    current.model, current.version, State.REJECTED, why=action.reason, who=self.who
                )
        return current if saved else transition.state

    def _read(self, model: str) -> RolloutState | None:
        """The stored state, whose ETag the next write of this run is conditional on."""
        state, self._etags[model] = records.load_or_none(self.store, state_key(model), RolloutState)
        return state

    def _save(self, state: RolloutState) -> RolloutState:
        self.guard()
        new = state.model_copy(update={"updated_at": audit.now()})
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

    def _route(self, state: RolloutState, change: SetRoute) -> None:
        """Set the route's fields, only while this run owns the rollout and only if the route
        is still as the rollout left it (else ``_RouteMoved``, nothing written)."""
        self._owned(state)

        def apply(table: RouteTable) -> RouteTable:
            canary = table.canary.version if table.canary else None
            if table.stable != change.expect_stable or canary != change.expect_canary:
                raise _RouteMoved(table)
            return RouteTable.model_validate({**table.model_dump(), **change.fields})

        self.router.update(state.model, apply, why=f"rollout of {state.version}: {change.why}", who=self.who)
        self.notify(self.store)

    def _roll_back(self, state: RolloutState, action: RollBack) -> None:
        """Traffic back on the champion first; then the version rejected and its process gone."""
        self._owned(state)
        why = f"rollout of {state.version}: {action.reason}"
        table = self.router.get(state.model)
        if table.canary is not None and table.canary.version == state.version:
            rollback(self.router, state.model, why=why, who=self.who)
        if table.shadow is not None and table.shadow.version == state.version:
            self.router.set(state.model, clear_shadow=True, why=why, who=self.who)
        self.notify(self.store)
        if self.registry.states(state.model).get(state.version) in (State.REGISTERED, State.CANARY):
            self.registry.transition(state.model, state.version, State.REJECTED, why=action.reason, who=self.who)
        if state.version not in self.router.get(state.model).referenced_versions():
            self.runtime.undeploy(state.model, state.version)  # traffic moved first, then the process goes
        if state.strategy == "blue-green" and state.preflight:  # past preflight: blue's floor was (or is) held
            self._release(state, state.champion)

    def _release(self, state: RolloutState, version: str) -> None:
        """The floor blue-green raised, back to the version's own (``Runtime.release``). The
        rollout's outcome stands whatever happens here: a failure is logged with what to do."""
        try:
            self.runtime.release(state.model, version)
        except Exception as exc:  # noqa: BLE001 - a floor left raised costs replicas, not the rollout
            log.warning(
                "%s:%s keeps the replica floor blue-green raised (%s); lower its ScaledObject's minReplicaCount "
                "and PodDisruptionBudget's minAvailable by hand",
                state.model,
                version,
                exc,
            )
