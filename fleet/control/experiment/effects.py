"""The A/B experiment's executor: what it checks before it starts, what it reads for each
look, what it stores, and how it ends (``fleet.control.experiment.machine`` decides).

A (the stable) and B share the traffic by the canary split, sticky by routing key. Each
look reads the gateways' counters of both arms first (the gateways' source reads only
windows ending now, and reading the logs may take seconds), then every logged request's
outcome since the start per arm, then the stop key (``fleet experiment stop``). The state
is ``experiments/<model>.json``. When it ends, traffic goes back to A alone (if this run
still holds the model's rollout lease) and B is undeployed unless it won and is to be
rolled out.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

from fleet import records
from fleet.analysis.ab import check_min_effect
from fleet.analysis.sources import MetricsUnavailable
from fleet.catalog import gateway_directory
from fleet.catalog.experiments import ExperimentState, state_key, stop_key
from fleet.catalog.policies.loader import Policies
from fleet.catalog.registry import Registry
from fleet.catalog.registry import State as VersionState
from fleet.catalog.routes.store import Router
from fleet.control.experiment import machine
from fleet.errors import Conflict, InvalidInput
from fleet.logs.increments import Looked, OutcomeJoin
from fleet.runtime.base import Runtime
from fleet.types import MetricsSource, ObjectStore


def load(store: ObjectStore, model: str) -> ExperimentState | None:
    state, _ = records.load_or_none(store, state_key(model), ExperimentState)
    return state


def ask_to_stop(store: ObjectStore, model: str, asked: str) -> None:
    """Ask the model's running experiment to end at its next look; ``asked``: who, and why."""
    store.put(stop_key(model), asked.encode())


log = logging.getLogger("fleet.control.experiment")


class Experiment:
    def __init__(
        self,
        store: ObjectStore,
        runtime: Runtime,
        metrics: MetricsSource,
        policies: Policies,
        *,
        who: str,
        guard: Callable[[], None] = lambda: None,
        clock: Callable[[], float] = time.time,
        notify: Callable[[ObjectStore], object] = gateway_directory.tell,
    ) -> None:
        """``guard`` raises (``Conflict``) once this run may no longer change the route: the
        flow passes its lease's ``check``."""
        self.store, self.runtime, self.metrics, self.policies = store, runtime, metrics, policies
        self.router = Router(store)
        self.who, self.guard, self.clock, self.notify = who, guard, clock, notify
        self.unreadable: list[str] = []  # the staged log files the last look's commit refused (not Parquet)
        self._join: tuple[tuple, OutcomeJoin] | None = None  # the running experiment's (fleet.logs.increments)
        self.looked: Looked | None = None  # what the last look read
        self.commit_failed: str | None = None  # why the last look's commit failed, if it did

    def check(
        self, model: str, arms: list[str], metric: str, min_effect: float, alpha: float
    ) -> tuple[str, str, float]:
        """Refuse, before anything changes, what cannot be run; return (A, B, the metric's range)."""
        if len(arms) != 2 or arms[0] == arms[1]:
            raise InvalidInput(
                f"arms {arms}; expected two different versions: the stable first, then the one to compare"
            )
        a, b = arms
        table = self.router.get(model)
        if table.stable != a:
            raise InvalidInput(f"arm {a} is not {model}'s stable ({table.stable}); expected the stable first")
        if table.canary is not None:
            raise Conflict(f"{model} has a canary ({table.canary.version}); an experiment starts when no rollout runs")
        state = Registry(self.store).states(model).get(b)
        if state not in (VersionState.REGISTERED, VersionState.CANARY):
            raise InvalidInput(f"arm {model}:{b} is {state or 'not registered'}; expected a registered version")
        spec = self.policies.models.get(model)
        declared = sorted(spec.outcomes) if spec else []
        if metric == "accuracy":
            if spec is not None and spec.generative:
                raise InvalidInput(
                    f"{model} is generative: accuracy needs classes; expected an outcome: {declared or 'none declared'}"
                )
            span = 1.0
        elif spec is None or metric not in declared:
            raise InvalidInput(
                f"metric {metric!r} is not accuracy or an outcome of {model}; declared outcomes: "
                f"{', '.join(declared) or 'none (add them under the model outcomes: in its policy)'}"
            )
        else:
            bounds = spec.outcomes[metric]
            if bounds.min is None or bounds.max is None or bounds.max <= bounds.min:
                raise InvalidInput(
                    f"outcome {metric} of {model} has no range (min {bounds.min}, max {bounds.max}); an "
                    "experiment compares bounded outcomes: declare min and max in its policy (a few "
                    "tenants' extreme values must not decide it)"
                )
            span = bounds.max - bounds.min
        if not 0 < alpha < 0.5 or min_effect <= 0:
            raise InvalidInput(
                f"alpha {alpha} and min_effect {min_effect}; expected 0 < alpha < 0.5 and min_effect > 0"
            )
        try:
            check_min_effect(min_effect, span, metric)
        except ValueError as exc:
            raise InvalidInput(str(exc)) from None
        return a, b, span

    def forget_stop(self, model: str) -> None:
        """An old stop request is not this run's."""
        self.store.delete(stop_key(model))

    def split(self, state: ExperimentState) -> None:
        """B gets its share of the traffic (deployed and ready before: the caller's part);
        the state is stored."""
        (a, b), shares = state.arms, state.split
        self.guard()
        why = f"experiment {a} vs {b} on {state.metric}"
        self.router.set(state.model, canary=b, weight=shares[1], why=why, who=self.who)
        self.notify(self.store)
        self.save(state)

    def look(self, state: ExperimentState, now: float | None = None) -> tuple[ExperimentState, str | None]:
        """One look: (the new state, stored; or the state as it was and why the look was
        skipped — the metrics or the logs could not be read, and the time is not up)."""
        now = self.clock() if now is None else now
        try:
            seen = self._look(state, now)
        except (MetricsUnavailable, OSError) as exc:  # no data is not a decision
            seen = machine.Look(now, unavailable=str(exc))
        new = machine.step(state, seen, self.policies.rollout_for(state.model))
        if new is state:
            return state, seen.unavailable
        self.guard()  # a run that lost its lease writes nothing
        self.save(new)
        return new, None

    def _look(self, state: ExperimentState, now: float) -> machine.Look:
        """The counters first (the gateways' source reads only windows ending now, and reading
        the logs may take seconds), then the outcomes, then the stop key."""
        tick_a = tick_b = None
        wanted = machine.reads(state, now, self.metrics.max_window_s)
        if wanted is not None:
            tick_a, tick_b = (self.metrics.window(state.model, r.version, r.start, r.end) for r in wanted)
        end = datetime.fromtimestamp(now, UTC) + timedelta(seconds=1)
        looked = self._outcomes(state, end)
        self.looked = looked
        stop = None
        if records.exists(self.store, stop_key(state.model)):
            stop = self.store.get(stop_key(state.model)).data.decode(errors="replace")
        return machine.Look(
            now,
            tick_a,
            tick_b,
            sums=looked.sums,
            settled=looked.settled,
            settled_until=looked.settled_until,
            stop=stop,
        )

    def _outcomes(self, state: ExperimentState, end: datetime) -> Looked:
        """What was staged is committed first (unless the committer is at it: then its last
        commit is what this look reads), then the join takes what was committed since the last
        look. Staged files the commit refused (not the table's Parquet) are named in
        ``unreadable``."""
        from fleet.logs import committer, tables

        self.unreadable, self.commit_failed = [], None
        if tables.tables_for(self.store) is not None:
            try:
                done = committer.run(self.store, who=self.who, maintain=False)
                self.unreadable = [key for d in done for key in d.rejected]
            except Conflict:
                pass  # the committer is at it: this look reads its last commit
            except Exception as exc:  # noqa: BLE001 - a commit that failed is not the experiment's end
                log.warning("could not commit the staged logs before this look (it reads what is committed): %s", exc)
                self.commit_failed = str(exc)
        key = (state.model, state.run_id, state.started_at)
        if self._join is None or self._join[0] != key:
            join = OutcomeJoin(
                self.store, state.model, state.metric, state.started_at, state.settled, state.settled_until
            )
            self._join = (key, join)
        looked = self._join[1].look(end)
        self.unreadable += looked.unreadable
        return looked

    def stopped_by(self, state: ExperimentState, error: BaseException) -> ExperimentState:
        """The state as ended by ``error``; stored only while this run holds the lease (a run
        that lost it leaves the record to the one that took it)."""
        state = machine.errored(state, error)
        if self._holds():
            self.save(state)
        return state

    def end(self, state: ExperimentState) -> None:
        """Traffic back on A alone, if this run may still change the route (one that lost its
        lease leaves it alone); B undeployed unless it won and is to be rolled out (a rollout
        deploys it again otherwise)."""
        model, b = state.model, state.arms[1]
        table = self.router.get(model)
        if table.canary is not None and table.canary.version == b and self._holds():
            self.router.set(model, clear_canary=True, why=f"experiment ended: {state.status}", who=self.who)
            self.notify(self.store)
        if not machine.keeps_b(state) and b not in self.router.get(model).referenced_versions():
            self.runtime.undeploy(model, b)

    def save(self, state: ExperimentState) -> None:
        self.store.put(state_key(state.model), records.dump(state))

    def _holds(self) -> bool:
        try:
            self.guard()
        except Conflict:
            return False
        return True
