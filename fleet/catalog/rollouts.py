"""``rollouts/<model>.json``: where a model's rollout (canary or blue-green) stands (the stored record).

``fleet.control.rollout.machine`` decides every transition of this record and
``fleet.control.rollout.effects`` writes it (conditionally on its ETag, under the rollout
lease, ``rollouts/<model>.lease``); the doctor, the lazy loader and ``fleet rollout`` read it.
The stored JSON is a contract with every rollout run still going: the phases are stored as
their string values, which must never change.
"""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum
from typing import Any

from pydantic import BaseModel, ConfigDict

from fleet.types import ArmWindow


class Phase(StrEnum):
    """Where a rollout is. The values are stored: renaming one strands every stored rollout."""

    PREFLIGHT = "preflight"  # checksums, schema and offline metrics against the champion
    DEPLOY = "deploy"  # preflight passed: the canary is to be started (no traffic yet)
    SHADOW = "shadow"  # the canary answers a mirrored share of requests; callers never see it
    STEP = "step"  # the canary serves the policy's weight of ``step``, judged tick by tick
    BAKE = "bake"  # blue-green: green serves 100 % since the switch, blue ready to switch back
    APPROVAL = "approval"  # waiting for a person before the 100 % step or the switch (``manual_approval``)
    PROMOTE = "promote"  # every step passed: the canary is to become the stable
    PROMOTED = "promoted"  # terminal: the canary is the stable
    ROLLED_BACK = "rolled_back"  # terminal: traffic back on the champion, the canary rejected and stopped
    REJECTED = "rejected"  # terminal: preflight refused it; nothing was ever routed to it


TERMINAL = frozenset({Phase.PROMOTED, Phase.ROLLED_BACK, Phase.REJECTED})
SERVING = frozenset({Phase.STEP, Phase.BAKE})  # the new version serves callers, judged tick by tick
JUDGED = frozenset({Phase.SHADOW, Phase.STEP, Phase.BAKE})  # ... or a mirrored share of them


class StepReport(BaseModel):
    """One shadow phase or weight step: how it was judged, for the flow's report."""

    model_config = ConfigDict(extra="forbid")

    phase: str  # shadow | step | bake
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
    strategy: str = "canary"  # canary | blue-green (the policy's, when the rollout began)
    phase: Phase = Phase.PREFLIGHT
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
    replicas: int = 1  # the new version's replicas (blue-green: the stable's count when it began)
    switched_at: float | None = None  # blue-green: when 100 % went to green (the rollout clock)
    # deployed and ready, no traffic yet: a first step at 100 % (blue-green's switch) waits until
    # the stable's traffic before it is enough to judge the new version against (``waiting``)
    ready_at: float | None = None
    preflight: list[dict[str, str]] = []
    reason: str = ""
    breached: list[str] = []
    started_at: datetime
    updated_at: datetime

    @property
    def done(self) -> bool:
        return self.phase in TERMINAL

    @property
    def waiting(self) -> bool:
        """Ready, unrouted, and waiting for the stable's baseline before its first step (at 100 %)."""
        return self.phase == Phase.DEPLOY and self.ready_at is not None

    @property
    def shown(self) -> str:
        """The phase as the CLI shows it."""
        return "deploy (waiting for the stable's baseline)" if self.waiting else self.phase.value


def state_key(model: str) -> str:
    return f"rollouts/{model}.json"


def lease_key(model: str) -> str:
    """The lease every writer of the model's rollout (or experiment) holds: one at a time."""
    return f"rollouts/{model}.lease"


def arm_window(data: dict[str, Any]) -> ArmWindow:
    """A stored window (``baseline``, ``served``: ``dataclasses.asdict`` of an ``ArmWindow``)
    back as one; JSON gave its histograms back as lists."""
    histograms = ("latency_ms", "predictions", "tpot_ms", "output_tokens")
    return ArmWindow(**{**data, **{k: tuple(data[k]) for k in histograms if k in data}})
