"""The test doubles the suite shares: a clock, a runtime with the whole runtime contract, and a
store that can be taken down.

Fakes stand in only for what cannot run in a unit test (time, the processes a runtime
starts, a store outage); stores are otherwise real (``fleet.store.MemoryStore`` is the
in-memory backend, and the file and S3 backends run for real elsewhere).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from fleet.errors import StoreUnavailable
from fleet.runtime.base import DeployFailed, Loaded
from fleet.store import MemoryStore
from fleet.types import Deployment

T0 = 1_000_000.0  # a fixed start, far from 0, so "since the epoch" bugs show


class Clock:
    """A clock tests move by hand: ``clock()`` reads it, ``clock.now = ...`` or ``advance`` moves it."""

    def __init__(self, now: float = T0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> float:
        self.now += seconds
        return self.now


class FakeRuntime:
    """``fleet.runtime.base.Runtime`` without processes: versions "run" once deployed or activated.

    - ``running``: (model, version) → replicas; ``log``: "deploy m:v", "undeploy m:v", ... in order.
    - ``fail``: a message every deploy and activate then fails with (``DeployFailed``).
    - ``before_undeploy(model, version)``: called first by ``undeploy`` (a test asserts there
      that nothing routes to the version any more); ``while_deploying()``: what happens
      elsewhere while a deploy runs.
    - ``gate``: an event ``activate`` waits on (10 s at most) before it starts a version, so a
      test can hold a cold start; ``calls`` counts activations.
    - ``footprints``: (model, version) → MiB that ``footprint_mib`` reports.
    """

    kind = "fake"
    budgets_memory = False
    packages_here = False

    def __init__(
        self,
        running: dict[tuple[str, str], int] | None = None,
        *,
        clock: Callable[[], float] = lambda: T0,
        memory_mib: float = 0.0,
    ) -> None:
        self.running: dict[tuple[str, str], int] = dict(running or {})
        self.ready_at: dict[tuple[str, str], float] = {key: clock() for key in self.running}
        self.clock, self.memory_mib = clock, memory_mib
        self.log: list[str] = []
        self.fail: str | None = None
        self.fail_summary = "its replica exited while starting"
        self.before_undeploy: Callable[[str, str], object] = lambda model, version: None
        self.while_deploying: Callable[[], object] = lambda: None
        self.gate: threading.Event | None = None
        self.calls = 0
        self.footprints: dict[tuple[str, str], float] = {}

    def url(self, model: str, version: str, replica: int = 0) -> str:
        return f"http://fake/{model}/{version}/{replica}"

    def _deployment(self, model: str, version: str) -> Deployment:
        n = self.running.get((model, version), 0)
        return Deployment(model, version, tuple(self.url(model, version, i) for i in range(n)))

    def _start(self, model: str, version: str, replicas: int) -> None:
        if self.fail is not None:
            raise DeployFailed(self.fail, summary=self.fail_summary)
        self.running[model, version] = replicas
        self.ready_at[model, version] = self.clock()

    # -- Runtime ---------------------------------------------------------------------------
    def deploy(self, model: str, version: str, replicas: int = 1) -> Deployment:
        self.while_deploying()
        self._start(model, version, replicas)
        self.log.append(f"deploy {model}:{version}")
        return self._deployment(model, version)

    def release(self, model: str, version: str) -> None:
        self.log.append(f"release {model}:{version}")

    def undeploy(self, model: str, version: str) -> None:
        self.before_undeploy(model, version)
        self.running.pop((model, version), None)
        self.log.append(f"undeploy {model}:{version}")

    def list(self) -> list[Deployment]:
        return [self._deployment(m, v) for m, v in sorted(self.running)]

    def health(self, model: str, version: str) -> dict[str, bool]:
        return dict.fromkeys(self._deployment(model, version).endpoints, True)

    # -- ScalesToZero ----------------------------------------------------------------------
    def activate(
        self, model: str, version: str, before_start: Callable[[], None] | None = None
    ) -> tuple[Deployment, bool]:
        self.calls += 1
        if (model, version) in self.running:
            return self._deployment(model, version), False
        if before_start is not None:
            before_start()
        if self.gate is not None:
            self.gate.wait(10)
        self._start(model, version, 1)
        self.log.append(f"activate {model}:{version}")
        return self._deployment(model, version), True

    def unload(self, versions: list[tuple[str, str]], on_drain: Callable[[], object] = lambda: None) -> None:
        for key in versions:
            self.running.pop(key, None)
            self.log.append(f"unload {key[0]}:{key[1]}")
        on_drain()

    def loaded(self) -> list[Loaded]:
        return [
            Loaded(m, v, n, self.memory_mib * n, self.ready_at.get((m, v), self.clock()))
            for (m, v), n in sorted(self.running.items())
        ]

    def footprint_mib(self, model: str, version: str) -> float | None:
        return self.footprints.get((model, version))


class DownStore(MemoryStore):
    """The in-memory store whose writes (puts and deletes) fail as unreachable (``StoreUnavailable``, not a
    refusal) while ``down`` is set; ``refused`` counts them. Reads still work."""

    def __init__(self, *, down: bool = False) -> None:
        super().__init__()
        self.down = threading.Event()
        if down:
            self.down.set()
        self.refused = 0

    def put(self, key: str, data: bytes, **kwargs) -> str:  # noqa: ANN003
        if self.down.is_set():
            self.refused += 1
            raise StoreUnavailable("store unreachable (test)")
        return super().put(key, data, **kwargs)

    def delete(self, key: str) -> None:
        if self.down.is_set():
            self.refused += 1
            raise StoreUnavailable("store unreachable (test)")
        super().delete(key)
