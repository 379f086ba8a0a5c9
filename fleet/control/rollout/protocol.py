"""What the rollout machine (``fleet.control.rollout.machine``) takes and gives: the
observations the executor gathers, the actions it performs in order, and the transition
that carries them."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from fleet.analysis.canary import Verdict
from fleet.catalog.rollouts import RolloutState
from fleet.types import ArmWindow

# -- observations: what the executor saw ----------------------------------------------------


@dataclass(frozen=True)
class Route:
    """The model's route table, as far as a rollout cares (``effects.route_of`` reads one)."""

    stable: str | None
    canary: str | None = None
    weight: float = 0.0  # the canary's
    shadow: str | None = None
    revision: int = 0
    updated_by: str | None = None
    reason: str | None = None


@dataclass(frozen=True)
class Begin:
    """A run asks to roll ``version`` out; ``step`` gets the stored state (or None) with it."""

    model: str
    version: str
    run_id: str
    now: float  # the rollout clock
    at: datetime  # the wall clock, for started_at
    route: Route
    running: bool | None = None  # for a resumed rollout: does the canary still run? (None: not looked)
    strategy: str = "canary"  # the policy's, for a new rollout
    replicas: int = 1  # the new version's: blue-green starts green at the stable's count


@dataclass(frozen=True)
class Checked:
    """Preflight's checks (``fleet.control.rollout.preflight.checks``), in order."""

    checks: tuple[Mapping[str, str], ...]
    registered: bool  # the candidate is ``registered``: a refusal marks it ``rejected``


@dataclass(frozen=True)
class Deployed:
    """The canary's deploy ended: ready, or ``failed`` says why not."""

    now: float
    failed: str | None = None  # why it did not start; None: it is ready
    baseline: ArmWindow | None = None  # when ``needs`` asked for it


@dataclass(frozen=True)
class Looked:
    """One analysis tick: the route, and the windows ``needs`` named (or why they are unreadable)."""

    now: float
    route: Route
    canary: ArmWindow | None = None
    stable: ArmWindow | None = None
    unavailable: str | None = None  # the metrics could not be read: why (no data is not bad data)
    baseline: ArmWindow | None = None


@dataclass(frozen=True)
class Answered:
    """An approver's answer to the pause before 100 %."""

    now: float
    approved: bool
    by: str
    note: str = ""
    baseline: ArmWindow | None = None


@dataclass(frozen=True)
class Promoting:
    """The flow asks to promote; the route says whether a shadow is still to be removed."""

    route: Route


@dataclass(frozen=True)
class RouteMoved:
    """A route change found the route no longer as the rollout left it."""

    route: Route


Observation = Begin | Checked | Deployed | Looked | Answered | Promoting | RouteMoved

# -- actions: what the executor does, in order ----------------------------------------------


@dataclass(frozen=True)
class Save:
    """Write ``state`` (conditionally on the ETag this run last read or wrote)."""

    state: RolloutState


@dataclass(frozen=True)
class SetRoute:
    """Set ``fields`` of the route table, only if its stable is ``expect_stable`` and its
    canary ``expect_canary`` (the route as the rollout left it); else ``RouteMoved``."""

    why: str
    fields: Mapping[str, Any]
    expect_stable: str
    expect_canary: str | None


@dataclass(frozen=True)
class RollBack:
    """Traffic back on the champion (canary and shadow removed if they are this version),
    the version ``rejected``, then its process undeployed once nothing routes to it."""

    reason: str
    breached: tuple[str, ...]


@dataclass(frozen=True)
class Reject:
    """Mark the (registered) version ``rejected`` in the registry."""

    reason: str


@dataclass(frozen=True)
class Emit:
    event: str  # fleet.rollout.<name>
    payload: Mapping[str, Any]


Action = Save | SetRoute | RollBack | Reject | Emit


@dataclass(frozen=True)
class Transition:
    state: RolloutState | None  # None: nothing stored yet and nothing to store
    actions: tuple[Action, ...] = ()
    verdict: Verdict | None = None  # a tick's verdict, for the flow's report
