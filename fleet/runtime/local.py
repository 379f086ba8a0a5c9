"""LocalRuntime: model services as ``bentoml serve`` processes on 127.0.0.1.

Each replica is a process group of its own (BentoML forks workers) on a free port, with
its log and a state file under ``<run_dir>/<model>/<version>/``. ``deploy`` waits until
every replica answers ``/readyz`` or fails with the log's last lines. BentoML starts its
workers in sessions of their own, holding the server's socket: the state file records
them, and stopping a replica stops them too. A state file whose server is gone (a crash,
a reboot) is detected by ``list``, its surviving workers are stopped and it is removed.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx

from fleet.errors import FleetError, InvalidInput
from fleet.names import check_name, check_version
from fleet.processes import alive, parent_pid, stop_group, tail, tree
from fleet.types import Deployment

READY_TIMEOUT_S = 120.0
LOG_TAIL_LINES = 25


class DeployFailed(FleetError):
    status = 503


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


class LocalRuntime:
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

    def deploy(self, model: str, version: str, replicas: int = 1) -> Deployment:
        if replicas < 1:
            raise InvalidInput(f"replicas must be >= 1, got {replicas}")
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
                for path, replica in started:
                    self._wait_ready(model, version, replica)
            except BaseException:
                for path, replica in started:
                    replica.stop()
                    path.unlink(missing_ok=True)
                raise
            started = [(path, self._record_workers(path, replica)) for path, replica in started]
            running += started
        return Deployment(model, version, tuple(r.url for _, r in running))

    def _start(self, model: str, version: str, bento: str, slot: int) -> tuple[Path, _Replica]:
        folder = self._dir(model, version)
        folder.mkdir(parents=True, exist_ok=True)
        port = _free_port()
        log = folder / f"replica-{slot}.log"
        cmd = [sys.executable, "-m", "bentoml", "serve", bento, "--host", "127.0.0.1", "--port", str(port)]
        env = {**os.environ, "BENTOML_DO_NOT_TRACK": "true", **self.env}
        with open(log, "ab") as out:
            proc = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=env, start_new_session=True,  # its own group: stop reaches the workers too
            )  # fmt: skip
        replica = _Replica(pid=proc.pid, port=port, url=f"http://127.0.0.1:{port}", log=str(log), bento=bento)
        path = folder / f"replica-{slot}.json"
        path.write_text(json.dumps(replica.__dict__))
        return path, replica

    def _wait_ready(self, model: str, version: str, replica: _Replica) -> None:
        deadline = time.monotonic() + self.ready_timeout_s
        with httpx.Client(timeout=2.0) as client:
            while time.monotonic() < deadline:
                if not alive(replica.pid, b"bentoml"):
                    raise DeployFailed(
                        f"{model}:{version} exited while starting; last log lines of {replica.log}:\n"
                        + tail(replica.log, LOG_TAIL_LINES)
                    )
                try:
                    if client.get(f"{replica.url}/readyz").status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                time.sleep(0.2)
        raise DeployFailed(
            f"{model}:{version} was not ready after {self.ready_timeout_s:.0f} s; last log lines of "
            f"{replica.log}:\n" + tail(replica.log, LOG_TAIL_LINES)
        )

    def _record_workers(self, path: Path, replica: _Replica) -> _Replica:
        """Once ready, note the server's worker processes: they outlive a crash of the server."""
        workers = tuple(p for p in tree(replica.pid) if p != replica.pid)
        recorded = _Replica(**{**replica.__dict__, "workers": workers})
        path.write_text(json.dumps({**recorded.__dict__, "workers": list(workers)}))
        return recorded

    def undeploy(self, model: str, version: str) -> None:
        for path, replica in self._replicas(model, version):
            replica.stop()
            path.unlink(missing_ok=True)

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
        for d in self.list():
            self.undeploy(d.model, d.version)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
