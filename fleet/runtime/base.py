"""The runtime contract: what every runtime (``local``, ``static``, ``kubernetes``) implements.

A runtime runs model versions and says where they answer. Every runtime implements every
method below; what one cannot do it refuses with ``DeployFailed`` naming why (the static
runtime starts nothing), so callers never probe for a capability. What differs between
runtimes and changes what a caller does is declared, not detected:

- ``budgets_memory``: its versions share this machine's memory, so the policy's
  ``runtime.memory_budget_mib`` applies to starts (the local runtime only);
- ``packages_here``: it builds a version's Bento on this machine before running it, so a
  rollout prefetches the canary's artifact while preflight runs (the local runtime only).

**Scale to zero** (``ScalesToZero``, part of every runtime): ``activate`` starts one replica
of a version that runs none, for a request the gateway holds (``fleet.gateway.activate``);
``unload`` stops idle lazy versions (``fleet.control.lazy``); ``loaded`` says what runs with
when it turned ready and what memory it holds; ``footprint_mib`` what a version's replica
held when it last started here.

**The drain contract.** ``unload`` takes a version's replicas out of what ``list`` returns
first, calls ``on_drain`` (which tells the gateways, at once), and stops them ``DRAIN_S``
later: a request already on its way to a replica is answered, never cut off.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from fleet.errors import FleetError
from fleet.types import Deployment

# Replicas leave the gateways' list this long before they stop (the push reaches them at once;
# their poll within 1.25 s).
DRAIN_S = 2.5


class DeployFailed(FleetError):
    """A version that could not start. The message is for operators (log lines, paths, what to
    run); ``summary`` says why in words fit for a tenant whose request waited on the start."""

    status = 503

    def __init__(self, message: str, summary: str = "the runtime failed to start it") -> None:
        super().__init__(message)
        self.summary = summary


@dataclass(frozen=True)
class Loaded:
    """A version running here: its replicas, the memory they hold and when they turned ready."""

    model: str
    version: str
    replicas: int
    memory_mib: float  # 0.0 where the runtime does not measure it
    ready_at: float  # unix seconds, the most recent replica's


class ScalesToZero(Protocol):
    """Starting a version on a request and stopping it when idle (lazy loading)."""

    def activate(
        self, model: str, version: str, before_start: Callable[[], None] | None = None
    ) -> tuple[Deployment, bool]:
        """One ready replica of a version that runs none (the running ones if it does), and
        whether this call started it; ``before_start`` runs only when a replica is to start.
        Raises ``DeployFailed`` if it cannot be started."""
        ...

    def unload(self, versions: list[tuple[str, str]], on_drain: Callable[[], object] = lambda: None) -> None:
        """Stop the versions' replicas, drained (see the module's drain contract)."""
        ...

    def loaded(self) -> list[Loaded]:
        """Every version this runtime runs and may stop, with when it turned ready."""
        ...

    def footprint_mib(self, model: str, version: str) -> float | None:
        """The memory a replica of the version held when it last started here; None if unknown."""
        ...


class Runtime(ScalesToZero, Protocol):
    """Where model services run: local processes, services run by others, or Kubernetes."""

    kind: str  # "local" | "static" | "kubernetes" (FLEET_RUNTIME)
    budgets_memory: bool
    packages_here: bool

    def deploy(self, model: str, version: str, replicas: int = 1) -> Deployment:
        """Run ``replicas`` ready replicas of the version (idempotent); return their endpoints."""
        ...

    def undeploy(self, model: str, version: str) -> None:
        """Stop every replica of the version; stopping what is not running is not an error."""
        ...

    def release(self, model: str, version: str) -> None:
        """Hand the version's count back to its autoscaler: a floor ``deploy(replicas=N)``
        raised (blue-green holds blue at its count, and starts green there) goes back to the
        version's own minimum, and load decides from there. A runtime that nothing scales keeps
        the replicas it runs (taking them away under load would be the opposite of a release)."""
        ...

    def list(self) -> list[Deployment]:
        """Every deployment with at least one live replica."""
        ...

    def health(self, model: str, version: str) -> dict[str, bool]:
        """Endpoint → whether it answers its readiness check now."""
        ...
