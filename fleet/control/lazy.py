"""Lazy loading: which running versions may be stopped and when, and the controller that stops them.

A model's policy says ``loading: eager`` (every routed version runs until it is undeployed)
or ``lazy``: a version runs only while it is used. The gateway starts a cold version on its
first request (``fleet.gateway.activate``); this module stops it again.

**What the gateways last served** is their activity records (``fleet.logs.activity``): when
each last sent a request to each version.

**The decision is pure** (``idle_unloads``, ``make_room``) over ``Candidate``s: never an
eager model's version, never a version a route has as canary or shadow, never one in a
running rollout (its canary and its champion), never the champion of a finished rollout
within the policy's ``rollback_window_s``. A lazy version is idle once nothing was asked of
it for ``idle_unload_s`` (counted from its start when it never served). Under the runtime's
``memory_budget_mib`` a start first stops unprotected lazy versions, least recently used
first, skipping any asked within ``BUSY_WITHIN_S`` or its ``idle_unload_s`` if shorter (in
use: stopping it would only start it again); a start that still does not fit is refused, never squeezed in.

**The controller** (``LoadController``) reads what runs (the local runtime's ``loaded``),
routes, rollouts and activity, decides, and unloads through the runtime: locally drained
first (out of the gateways' list, then stopped), gateways told at once; on Kubernetes the
ScaledObject's floor goes to 0 and KEDA removes the last pod. ``fleet unload-idle`` and the scheduled flow
``idle-unload`` run its ``unload_idle``; the gateway's activation runs ``make_room``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from fleet import records
from fleet.catalog.policies.loader import Policies
from fleet.errors import FleetError, IntegrityError, NotFound
from fleet.logs.activity import ACTIVITY_PREFIX, last_requests, silent_gateways
from fleet.runtime.base import DeployFailed, Runtime
from fleet.types import ObjectStore

log = logging.getLogger("fleet.control.lazy")

BUSY_WITHIN_S = 10.0  # a version asked this recently is in use: never stopped to make room


# -- the decision (pure) ---------------------------------------------------------------------


@dataclass(frozen=True)
class Candidate:
    """A running version as the decision sees it."""

    model: str
    version: str
    idle_after_s: float | None  # None: never unloaded for idleness (an eager model)
    last_used: float  # unix seconds: its last request, or when it turned ready if later
    memory_mib: float
    protected: str = ""  # why it must keep running ("" if nothing protects it)

    @property
    def ref(self) -> str:
        return f"{self.model}:{self.version}"


@dataclass(frozen=True)
class Unload:
    model: str
    version: str
    reason: str
    memory_mib: float = 0.0


def idle_unloads(running: Iterable[Candidate], now: float) -> list[Unload]:
    """Lazy versions without a request for their ``idle_unload_s``, none of them protected."""
    out = []
    for c in running:
        if c.idle_after_s is None or c.protected:
            continue
        idle = now - c.last_used
        if idle >= c.idle_after_s:
            out.append(
                Unload(c.model, c.version, f"idle for {idle:.0f} s (idle_unload_s {c.idle_after_s:g})", c.memory_mib)
            )
    return out


class NoRoom(DeployFailed):
    """A lazy start that the memory budget cannot hold, even after stopping every idle version.

    The message names what holds the memory (other models: for operators and logs);
    ``summary`` says only that the budget is full, for the tenant whose request it answers."""


def make_room(
    running: Iterable[Candidate], need_mib: float, budget_mib: float | None, now: float, starting: str
) -> list[Unload]:
    """What to stop so that ``need_mib`` more fits ``budget_mib``: unprotected lazy versions not
    asked within ``BUSY_WITHIN_S``, least recently used first. Raise ``NoRoom`` if even all of
    them do not free enough (nothing is to be stopped then: a start refused stops nothing)."""
    running = list(running)
    if budget_mib is None:
        return []
    used = sum(c.memory_mib for c in running)
    if used + need_mib <= budget_mib:
        return []
    evictable = sorted(
        (
            c
            for c in running
            if c.idle_after_s is not None
            and not c.protected
            and now - c.last_used >= min(BUSY_WITHIN_S, c.idle_after_s)
        ),
        key=lambda c: (c.last_used, c.ref),
    )
    out = []
    for c in evictable:
        if used + need_mib <= budget_mib:
            break
        used -= c.memory_mib
        out.append(
            Unload(
                c.model,
                c.version,
                f"memory budget: least recently used (idle {now - c.last_used:.0f} s) to make room for {starting}",
                c.memory_mib,
            )
        )
    if used + need_mib > budget_mib:
        kept = [c for c in running if c not in evictable]
        why = ", ".join(
            f"{c.ref} {c.memory_mib:.0f} MiB ({c.protected or ('eager' if c.idle_after_s is None else 'in use')})"
            for c in sorted(kept, key=lambda c: -c.memory_mib)[:4]
        )
        raise NoRoom(
            f"{starting} needs about {need_mib:.0f} MiB and the runtime's memory_budget_mib is {budget_mib:g}: "
            f"{used:.0f} MiB would stay held by versions that may not be stopped ({why or 'none'}); "
            "expected a larger runtime.memory_budget_mib or fewer eager versions",
            "the runtime's memory budget cannot hold it now, even after stopping idle versions",
        )
    return out


def protections(tables: dict, rollouts: dict, policies: Policies, now: float) -> dict[tuple[str, str], str]:
    """(model, version) → why it must keep running: a route's canary or shadow, a running
    rollout's canary and champion, a finished rollout's champion within its rollback window."""
    out: dict[tuple[str, str], str] = {}
    for model, table in tables.items():
        if table.canary is not None:
            out[model, table.canary.version] = "canary"
        if table.shadow is not None:
            out[model, table.shadow.version] = "shadow"
    for model, state in rollouts.items():
        if not state.done:
            out.setdefault((model, state.version), f"rollout {state.phase}")
            out.setdefault((model, state.champion), "champion of a running rollout")
            continue
        window = policies.rollout[policies.models[model].rollout].rollback_window_s if model in policies.models else 0.0
        until = state.updated_at.timestamp() + window
        if now < until:
            out.setdefault((model, state.champion), f"rollback window ({until - now:.0f} s left)")
    return out


# -- the controller (I/O) ----------------------------------------------------------------------


class LoadController:
    def __init__(
        self,
        store: ObjectStore,
        policies: Policies,
        runtime: Runtime,
        clock: Callable[[], float] = time.time,
        notify: Callable[[], object] | None = None,
    ) -> None:
        self.store, self.policies, self.runtime, self.clock = store, policies, runtime, clock
        self.notify = notify or (lambda: _notify(store))

    def candidates(self) -> list[Candidate]:
        """What runs here, as the decision sees it (memory where the runtime measures it)."""
        from fleet.catalog.rollouts import RolloutState, state_key
        from fleet.catalog.routes.store import Router

        now = self.clock()
        loaded = self.runtime.loaded()
        router = Router(self.store)
        models = sorted({x.model for x in loaded})
        tables = {}
        rollouts = {}
        for model in models:
            try:
                tables[model] = router.get(model)
            except (NotFound, IntegrityError):
                pass
            try:
                state, _ = records.load_or_none(self.store, state_key(model), RolloutState)
            except IntegrityError:
                state = None
            if state is not None:
                rollouts[model] = state
        protected = protections(tables, rollouts, self.policies, now)
        used = last_requests(self.store, now)
        out = []
        for x in loaded:
            spec = self.policies.models.get(x.model)
            idle_after = spec.unload_after_s if spec is not None else None
            last = max(used.get((x.model, x.version), 0.0), x.ready_at)
            out.append(
                Candidate(x.model, x.version, idle_after, last, x.memory_mib, protected.get((x.model, x.version), ""))
            )
        return out

    def unload_idle(self) -> list[Unload]:
        """Stop every idle lazy version (each checked again just before it stops); nothing while
        a live gateway keeps no activity record (its traffic would look like idleness)."""
        now = self.clock()
        if silent := silent_gateways(self.store, now):
            log.warning(
                "not unloading idle versions: live gateway(s) %s keep no activity record (%s*); a gateway "
                "that cannot write there would have its versions stopped under its traffic",
                ", ".join(silent),
                ACTIVITY_PREFIX,
            )
            return []
        return self._stop(idle_unloads(self.candidates(), now), recheck=lambda u, last: now - last >= _idle(self, u))

    def make_room(self, model: str, version: str) -> list[Unload]:
        """Before a lazy start of ``model:version``: stop what the memory budget needs stopped, or raise ``NoRoom``."""
        budget = self.policies.runtime.memory_budget_mib
        if budget is None:
            return []
        running = [c for c in self.candidates() if (c.model, c.version) != (model, version)]
        need = self.expected_mib(model, version)
        plan = make_room(running, need, budget, self.clock(), f"{model}:{version}")
        return self._stop(plan, recheck=lambda u, last: self.clock() - last >= min(BUSY_WITHIN_S, _idle(self, u)))

    def expected_mib(self, model: str, version: str) -> float:
        """What a start of the version is expected to hold: its last start's, else the policy's memory."""
        measured = self.runtime.footprint_mib(model, version)
        if measured is not None:
            return measured
        spec = self.policies.models.get(model)
        return spec.resources.memory_gib * 1024 if spec is not None else 0.0

    def _stop(self, plan: list[Unload], recheck: Callable[[Unload, float], bool]) -> list[Unload]:
        """Unload ``plan`` through the runtime, all at once (locally: one drain for all), each
        version checked again first against the newest activity records."""
        if not plan:
            return []
        fresh = last_requests(self.store, self.clock())
        chosen = []
        for u in plan:
            if recheck(u, fresh.get((u.model, u.version), 0.0)):
                chosen.append(u)
            else:
                log.info("%s:%s was asked again meanwhile: kept", u.model, u.version)
        for u in chosen:
            log.info("stopping %s:%s: %s", u.model, u.version, u.reason)
        if chosen:  # local: drained first; Kubernetes: KEDA's floor to 0
            self.runtime.unload([(u.model, u.version) for u in chosen], on_drain=self.notify)
        return chosen


def _idle(ctl: LoadController, u: Unload) -> float:
    spec = ctl.policies.models.get(u.model)
    after = spec.unload_after_s if spec is not None else None
    return float("inf") if after is None else after


def _notify(store: ObjectStore) -> None:
    from fleet.catalog import gateway_directory

    try:
        gateway_directory.notify(store)
    except (FleetError, OSError) as exc:  # the gateways' own poll picks the change up within a second
        log.warning("could not tell the gateways: %s", exc)
