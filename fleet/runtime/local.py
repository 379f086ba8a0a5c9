"""LocalRuntime: model services as ``bentoml serve`` processes on 127.0.0.1.

Each replica is a process group of its own (BentoML forks workers) on a free port, with
its log and a state file under ``<run_dir>/<model>/<version>/``. ``deploy`` waits until
every replica answers ``/readyz`` or fails with the log's last lines. BentoML starts its
workers in sessions of their own, holding the server's socket: the state file records
them, and stopping a replica stops them too. A state file whose server is gone (a crash,
a reboot) is detected by ``list``, its surviving workers are stopped and it is removed.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

from fleet.errors import InvalidInput
from fleet.names import check_name, check_version
from fleet.processes import alive, parent_pid, stop_group, tail, tree
from fleet.runtime.base import DRAIN_S, DeployFailed, Loaded
from fleet.types import Deployment

READY_TIMEOUT_S = 120.0
# What a model replica never needs and must not hold: the gateway's, the store's and the
# cloud's secrets (a replica runs a team's model code, which reads its environment; a gateway
# that starts a cold version would otherwise hand it the admin token). Dropped by name, and
# any name that says it is a secret.
SECRET_ENV = frozenset(
    {"FLEET_ADMIN_TOKEN", "FLEET_REDIS_URL", "FLEET_STORE", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"}
)
SECRET_MARKS = ("TOKEN", "SECRET", "PASSWORD", "PASSWD", "CREDENTIAL", "API_KEY")


def replica_env(environ: dict[str, str]) -> dict[str, str]:
    """``environ`` without what a replica must not hold (``SECRET_ENV``, ``SECRET_MARKS``)."""
    return {k: v for k, v in environ.items() if k not in SECRET_ENV and not any(m in k.upper() for m in SECRET_MARKS)}


READY_POLL_S = 0.05  # a held request waits on this poll: at 0.2 s it cost a cold start 0.1 s on average
LOG_TAIL_LINES = 25
ORPHANED_DRAIN_S = 60.0  # a draining-* file this old outlived its unload (which waits DRAIN_S): stopped as an orphan
FOOTPRINT = "footprint.json"  # the memory a version's replica held when it last started (MiB)


@dataclass(frozen=True)
class _Replica:
    pid: int
    port: int
    url: str
    log: str
    bento: str
    workers: tuple[int, ...] = ()  # BentoML's workers live in sessions of their own

    def stop(self) -> None:
        stop_group(self.pid, also=tuple(w for w in self.workers if self._ours(w)))

    def _ours(self, worker: int) -> bool:
        """A recorded worker pid still names this replica's worker (pids get reused): it serves
        our Bento, and its parent is our server or no longer a BentoML server at all."""
        if not alive(worker, self.bento.encode()):
            return False
        parent = parent_pid(worker)
        return parent == self.pid or parent is None or not alive(parent, b"bentoml")

    @classmethod
    def read(cls, path: Path) -> _Replica | None:
        try:
            data = json.loads(path.read_text())
            return cls(**{**data, "workers": tuple(data.get("workers", ()))})
        except (OSError, ValueError, TypeError):
            return None


def _pss_mib(pids: list[int]) -> float:
    """The proportional set size of ``pids`` together (RSS where the kernel lacks smaps_rollup)."""
    total_kib = 0
    for pid in pids:
        for name, key in ((f"/proc/{pid}/smaps_rollup", "Pss:"), (f"/proc/{pid}/status", "VmRSS:")):
            try:
                with open(name) as f:
                    line = next((ln for ln in f if ln.startswith(key)), None)
            except OSError:
                continue
            if line is not None:
                total_kib += int(line.split()[1])
                break
    return total_kib / 1024


class LocalRuntime:
    """``fleet.runtime.base.Runtime`` on this machine: its versions share its memory (the
    policy's memory budget applies) and their Bentos are built here."""

    kind = "local"
    budgets_memory = True
    packages_here = True

    def __init__(
        self,
        run_dir: str | Path = ".fleet/run",
        *,
        bento_for: Callable[[str, str], str] | None = None,
        env: dict[str, str] | None = None,
        ready_timeout_s: float = READY_TIMEOUT_S,
    ) -> None:
        """``bento_for(model, version)`` returns the Bento tag to serve (packaging it if
        needed); by default the tag is ``<model>:<version>``."""
        self.run_dir = Path(run_dir).absolute()
        self.bento_for = bento_for or (lambda model, version: f"{model}:{version}")
        self.env = env or {}
        self.ready_timeout_s = ready_timeout_s

    def _dir(self, model: str, version: str) -> Path:
        return self.run_dir / check_name("model", model) / check_version(version)

    def _replicas(self, model: str, version: str) -> list[tuple[Path, _Replica]]:
        """Live replicas; state files of dead processes are removed on the way."""
        live = []
        for path in sorted(self._dir(model, version).glob("replica-*.json")):
            replica = _Replica.read(path)
            if replica is not None and alive(replica.pid, b"bentoml"):
                live.append((path, replica))
            else:
                if replica is not None:  # a crashed server's workers may still hold its port
                    replica.stop()
                path.unlink(missing_ok=True)
        return live

    @contextmanager
    def _locked(self, model: str, version: str) -> Iterator[Path]:
        """The version's lock (its folder): one start, stop or unload of a version at a time,
        across processes. Under it, ``starting-*`` files are orphans (their starter died)."""
        folder = self._dir(model, version)
        folder.mkdir(parents=True, exist_ok=True)
        with open(folder / ".version.lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
            self._clear_orphans(folder)
            yield folder

    @contextmanager
    def _budget_locked(self) -> Iterator[None]:
        """One budgeted start at a time on this machine: each sees what the last one holds."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        with open(self.run_dir / ".budget.lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            yield

    def _clear_orphans(self, folder: Path) -> None:
        """Stop what a starter or a drain that died left behind (called under the version's lock)."""
        now = time.time()
        for path in [*folder.glob("starting-*.json"), *folder.glob("draining-*.json")]:
            with contextlib.suppress(OSError):
                if path.name.startswith("draining-") and now - path.stat().st_mtime < ORPHANED_DRAIN_S:
                    continue  # an unload is waiting out its drain: it stops these itself
            replica = _Replica.read(path)
            if replica is not None:
                replica.stop()
            path.unlink(missing_ok=True)

    def deploy(self, model: str, version: str, replicas: int = 1) -> Deployment:
        if replicas < 1:
            raise InvalidInput(f"replicas must be >= 1, got {replicas}")
        with self._locked(model, version):
            running = self._replicas(model, version)
            for path, replica in running[replicas:]:
                replica.stop()
                path.unlink(missing_ok=True)
            running = running[:replicas]
            if len(running) < replicas:
                bento = self.bento_for(model, version)
                used = {int(p.stem.split("-")[1]) for p, _ in running}
                slots = [i for i in range(replicas * 2) if i not in used][: replicas - len(running)]
                started = [self._start(model, version, bento, slot) for slot in slots]
                try:
                    for _path, replica in started:
                        self._wait_ready(model, version, replica)
                except BaseException:
                    for path, replica in started:
                        replica.stop()
                        path.unlink(missing_ok=True)
                    raise
                running += [self._record_workers(path, replica) for path, replica in started]
            return Deployment(model, version, tuple(r.url for _, r in running))

    def _start(self, model: str, version: str, bento: str, slot: int) -> tuple[Path, _Replica]:
        """Spawn a replica; its state file is ``starting-<slot>.json`` (not listed, so no gateway
        sends it a request) until ``_record_workers`` renames it once it is ready."""
        folder = self._dir(model, version)
        folder.mkdir(parents=True, exist_ok=True)
        port = _free_port()
        log = folder / f"replica-{slot}.log"
        cmd = [sys.executable, "-m", "bentoml", "serve", bento, "--host", "127.0.0.1", "--port", str(port)]
        env = replica_env({**os.environ, "BENTOML_DO_NOT_TRACK": "true", **self.env})
        # the replica loads its weights from the fleet's artifact cache (bentos/weights.py); `bentoml
        # serve` runs the service from the Bento's own folder, so a relative path would miss it
        env["FLEET_CACHE_DIR"] = str(Path(env.get("FLEET_CACHE_DIR") or ".fleet/cache").resolve())
        with open(log, "ab") as out:
            proc = subprocess.Popen(
                cmd,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,  # its own group: stop reaches the workers too
            )
        replica = _Replica(pid=proc.pid, port=port, url=f"http://127.0.0.1:{port}", log=str(log), bento=bento)
        path = folder / f"starting-{slot}.json"
        path.write_text(json.dumps(replica.__dict__))
        return path, replica

    def _wait_ready(self, model: str, version: str, replica: _Replica) -> None:
        deadline = time.monotonic() + self.ready_timeout_s
        with httpx.Client(timeout=2.0) as client:
            while time.monotonic() < deadline:
                if not alive(replica.pid, b"bentoml"):
                    raise DeployFailed(
                        f"{model}:{version} exited while starting; last log lines of {replica.log}:\n"
                        + tail(replica.log, LOG_TAIL_LINES),
                        summary="its replica exited while starting",
                    )
                try:
                    if client.get(f"{replica.url}/readyz").status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                time.sleep(READY_POLL_S)
        raise DeployFailed(
            f"{model}:{version} was not ready after {self.ready_timeout_s:.0f} s; last log lines of "
            f"{replica.log}:\n" + tail(replica.log, LOG_TAIL_LINES),
            summary=f"its replica was not ready within {self.ready_timeout_s:.0f} s",
        )

    def _record_workers(self, path: Path, replica: _Replica) -> tuple[Path, _Replica]:
        """Once ready, note the server's worker processes (they outlive a crash of the server)
        and list the replica: ``starting-N.json`` becomes ``replica-N.json``."""
        workers = tuple(p for p in tree(replica.pid) if p != replica.pid)
        recorded = _Replica(**{**replica.__dict__, "workers": workers})
        listed = path.with_name(path.name.replace("starting-", "replica-", 1))
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({**recorded.__dict__, "workers": list(workers)}))
        os.replace(tmp, listed)
        path.unlink(missing_ok=True)
        return listed, recorded

    def release(self, model: str, version: str) -> None:
        """Nothing scales local replicas: the version keeps the count it was deployed at."""

    def undeploy(self, model: str, version: str, drain_s: float | None = None) -> None:
        """Stop every replica of the version, drained (``unload``): they leave the list first
        (under its lock: a start in progress finishes first), and stop ``DRAIN_S`` later, so
        a gateway that has not yet seen the route move away, or re-read this list (every
        second), still reaches them, and requests already sent finish. Retiring a previous
        stable or rolling a canary back is never a caller's 503."""
        self.unload([(model, version)], drain_s=drain_s)

    def unload(
        self,
        versions: list[tuple[str, str]],
        on_drain: Callable[[], object] = lambda: None,
        drain_s: float | None = None,
    ) -> None:
        """Lazy versions' idle stop (``fleet.control.lazy``), drained: each version's replicas leave
        the list (``draining-*``, under its lock, briefly), ``on_drain`` tells the gateways, and
        after ``drain_s`` (``DRAIN_S``) every one of them stops — one wait for all of them."""
        draining = []
        for model, version in versions:
            with self._locked(model, version):
                for path, replica in self._replicas(model, version):
                    aside = path.with_name(f"draining-{path.name}")
                    os.replace(path, aside)  # no longer listed; stopped below, or as an orphan if this process dies
                    os.utime(aside)  # the drain's start: an orphan is told by its age (ORPHANED_DRAIN_S)
                    draining.append((aside, replica))
        if not draining:
            return
        on_drain()
        time.sleep(DRAIN_S if drain_s is None else drain_s)
        for path, replica in draining:
            replica.stop()
            path.unlink(missing_ok=True)

    def serve_tag(self, model: str, version: str) -> str:
        """The Bento a lazy start serves: the one ``fleet package`` built, never a new build."""
        from fleet.runtime.bento import bento_version

        return f"{model}:{bento_version(version, False)}"

    def activate(
        self, model: str, version: str, before_start: Callable[[], None] | None = None
    ) -> tuple[Deployment, bool]:
        """One ready replica of a version that runs none (the running ones if it does), and
        whether this call started it.

        Under the version's lock, so concurrent activations start it once: the second finds the
        first's replica. ``before_start`` (making room under the memory budget) runs only when a
        replica is to be started, and then under the machine's budget lock too, taken first, so
        budgeted starts run one at a time and each sees what the one before holds. The replica's
        memory once ready is kept in ``footprint.json``: what the budget expects of its next start.
        """
        budget = self._budget_locked() if before_start is not None else contextlib.nullcontext()
        with budget, self._locked(model, version) as folder:
            running = self._replicas(model, version)
            if running:
                return Deployment(model, version, tuple(r.url for _, r in running)), False
            tag = self.serve_tag(model, version)
            self._check_built(model, version, tag)
            if before_start is not None:
                before_start()
            path, replica = self._start(model, version, tag, 0)
            try:
                self._wait_ready(model, version, replica)
            except BaseException:
                replica.stop()
                path.unlink(missing_ok=True)
                raise
            _, replica = self._record_workers(path, replica)
            memory = _pss_mib([replica.pid, *replica.workers])
            (folder / FOOTPRINT).write_text(json.dumps({"memory_mib": round(memory, 1), "at": time.time()}))
            return Deployment(model, version, (replica.url,)), True

    def _check_built(self, model: str, version: str, tag: str) -> None:
        """Refuse at once, saying what to do, to start a Bento that was never built (BentoML
        would take seconds to fail, with a message about importing modules)."""
        home = Path(self.env.get("BENTOML_HOME") or os.environ.get("BENTOML_HOME") or ".fleet/bentoml")
        name, _, tag_version = tag.partition(":")
        if not (home / "bentos" / name / tag_version / "bento.yaml").is_file():
            raise DeployFailed(
                f"Bento {tag} is not built; expected `fleet package {model} {version}` "
                "before its first request (a cold start serves a built Bento, it never builds one)",
                summary="its Bento is not built",
            )

    def footprint_mib(self, model: str, version: str) -> float | None:
        """The memory the version's replica held when it last started here, if it ever did."""
        try:
            return float(json.loads((self._dir(model, version) / FOOTPRINT).read_text())["memory_mib"])
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def loaded(self) -> list[Loaded]:
        """Every version with a live replica, with the memory its replicas hold now."""
        found = []
        for folder in sorted(p for p in self.run_dir.glob("*/*") if p.is_dir()):
            model, version = folder.parent.name, folder.name
            live = self._replicas(model, version)
            if not live:
                continue
            pids = [p for _, r in live for p in (r.pid, *r.workers)]
            ready_at = max(path.stat().st_mtime for path, _ in live)
            found.append(Loaded(model, version, len(live), _pss_mib(pids), ready_at))
        return found

    def list(self) -> list[Deployment]:
        found = []
        for folder in sorted(p for p in self.run_dir.glob("*/*") if p.is_dir()):
            model, version = folder.parent.name, folder.name
            urls = tuple(r.url for _, r in self._replicas(model, version))
            if urls:
                found.append(Deployment(model, version, urls))
        return found

    def health(self, model: str, version: str) -> dict[str, bool]:
        result = {}
        with httpx.Client(timeout=2.0) as client:
            for _, replica in self._replicas(model, version):
                try:
                    result[replica.url] = client.get(f"{replica.url}/readyz").status_code == 200
                except httpx.HTTPError:
                    result[replica.url] = False
        return result

    def stop_all(self) -> None:
        """Stop every replica under the run folder: listed, starting or draining."""
        for folder in sorted(p for p in self.run_dir.glob("*/*") if p.is_dir()):
            with self._locked(folder.parent.name, folder.name):
                for path in [*folder.glob("draining-*.json"), *folder.glob("replica-*.json")]:
                    replica = _Replica.read(path)
                    if replica is not None:
                        replica.stop()
                    path.unlink(missing_ok=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
