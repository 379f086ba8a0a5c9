"""Gateway workers: N gateway processes answering on one port (``fleet gateway --workers N``).

Python runs one request at a time per process, so one gateway uses one core. With workers
the parent (``supervise``) binds N listening sockets to the same address with
``SO_REUSEPORT`` — the kernel spreads connections over them — and one private socket per
worker on a port of its own, then starts N ``fleet gateway`` processes, each handed its two
sockets (inherited file descriptors; a real TCP socket object, so ``TCP_NODELAY`` is set on
its connections — uvicorn's ``--fd`` builds a Unix one and skips it, which cost 44 ms per
request). The parent holds the sockets for as long as it runs: a worker that dies is
started again on the same sockets, and connections that arrived meanwhile wait in its
socket's backlog instead of being refused.

Each worker is a gateway in its own right — its own id, its own record in ``gateways/``
announcing its *private* URL — so what the control plane already does for several
gateways holds for workers too:

- a route push (``gateways.notify``) reaches every worker, not whichever one the kernel
  picked; canary analysis sums every worker's windowed stats;
- quotas: through Redis (``FLEET_REDIS_URL``) one budget for all; without it, or while
  Redis is down, each worker enforces its share (``quota / live gateways``);
- a version's admission slots and wait queue are divided between the workers, so the
  model sees its policy's ``concurrency``, not N times it;
- ``/metrics`` answers for the whole gateway: the worker that gets the scrape adds its
  siblings' series to its own, each labelled ``worker`` (``merge_expositions``), so one
  scrape target per pod sees all the traffic (503 if a sibling does not answer: a gap in
  the graphs rather than series that vanish); ``/metrics?worker=1`` shows one worker's own.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from urllib.parse import urlsplit

import httpx

from fleet.errors import ConfigError, FleetError

SIBLINGS_ENV = "FLEET_GATEWAY_SIBLINGS"  # private base URLs of every worker, comma-separated
WORKER_ENV = "FLEET_GATEWAY_WORKER"  # "i/N" in a worker
READY_TIMEOUT_S = 60.0
RESTART_BACKOFF_S = (0.5, 1.0, 2.0, 5.0)
STEADY_S = 30.0  # a worker up this long has recovered: its next crash starts the back-off over
MAX_QUICK_CRASHES = 5  # crashes in a row, each within STEADY_S of its start: give up (exit 1)
STOP_GRACE_S = 15.0
MAX_WORKERS = 64


class WorkersFailed(FleetError):
    status = 503


def listening_socket(host: str, port: int, reuse_port: bool) -> socket.socket:
    """A bound, listening TCP socket (IPv6 for an address with a colon)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ConfigError(
            f"cannot listen on {host}:{port} ({exc.strerror}); free the port or pass another --port"
        ) from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def from_fd(fd: int) -> socket.socket:
    """The socket a worker inherited (its family and type read from the descriptor)."""
    return socket.socket(fileno=fd)


def with_port(url: str, port: int) -> str:
    """``url`` (scheme://host[:port]) on another port."""
    parts = urlsplit(url)
    host = parts.hostname or "127.0.0.1"
    return f"{parts.scheme}://{f'[{host}]' if ':' in host else host}:{port}"


class Supervisor:
    """Start N workers on shared sockets, restart one that dies, stop them all on the way out."""

    def __init__(
        self,
        n: int,
        host: str,
        port: int,
        worker_cmd: Callable[..., list[str]],
        env: dict[str, str],
        log: Callable[[str], None],
        admin_port: int | None = None,
    ) -> None:
        if not 2 <= n <= MAX_WORKERS:
            raise ConfigError(f"--workers {n}; expected 1 (one process) to {MAX_WORKERS}")
        self.n, self.host, self.port, self.worker_cmd, self.log = n, host, port, worker_cmd, log
        self.shared = [listening_socket(host, port, reuse_port=True) for _ in range(n)]
        self.private = [listening_socket(host, 0, reuse_port=False) for _ in range(n)]
        # the admin port (fleet.gateway.listeners), shared like the public one
        self.admin = [listening_socket(host, admin_port, reuse_port=True) for _ in range(n)] if admin_port else []
        self.port = self.shared[0].getsockname()[1]  # the one bound, when 0 was asked for
        shown = "127.0.0.1" if host in ("0.0.0.0", "::", "") else f"[{host}]" if ":" in host else host
        self.private_urls = [f"http://{shown}:{s.getsockname()[1]}" for s in self.private]
        self.env = {**env, SIBLINGS_ENV: ",".join(self.private_urls), "FLEET_GATEWAY_WORKERS": str(n)}
        self.procs: list[subprocess.Popen[bytes] | None] = [None] * n
        self.restarts = [0] * n  # quick crashes in a row, per worker
        self.started_at = [0.0] * n
        self._stopping = False

    def start(self, i: int) -> None:
        fds = [self.shared[i].fileno(), self.private[i].fileno(), *([self.admin[i].fileno()] if self.admin else [])]
        cmd = self.worker_cmd(i, *fds)
        self.started_at[i] = time.monotonic()
        self.procs[i] = subprocess.Popen(
            cmd,
            env={**self.env, WORKER_ENV: f"{i}/{self.n}"},
            stdin=subprocess.DEVNULL,
            pass_fds=tuple(fds),
            start_new_session=True,
        )

    def start_all(self) -> None:
        for i in range(self.n):
            self.start(i)

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> None:
        """Until every worker answers ``/v2/health/ready`` with 200 on its private port."""
        deadline = time.monotonic() + timeout_s
        pending = set(range(self.n))
        with httpx.Client(timeout=2.0) as client:
            while pending:
                for i in list(pending):
                    proc = self.procs[i]
                    if proc is not None and proc.poll() is not None:
                        raise WorkersFailed(
                            f"gateway worker {i} exited with {proc.returncode} while starting; its messages are above"
                        )
                    with contextlib.suppress(httpx.HTTPError):
                        if client.get(f"{self.private_urls[i]}/v2/health/ready").status_code == 200:
                            pending.discard(i)
                if pending and time.monotonic() > deadline:
                    raise WorkersFailed(f"gateway workers {sorted(pending)} were not ready after {timeout_s:.0f} s")
                if pending:
                    time.sleep(0.1)

    def watch(self) -> None:
        """Until stopped (SIGTERM, Ctrl-C): a worker that exits is started again, after a pause
        that grows while it keeps failing. A worker that keeps failing at once
        (``MAX_QUICK_CRASHES``) is not a worker any more: ``WorkersFailed``, so the process
        exits and whatever runs it (Kubernetes) starts the whole gateway again, rather than
        its socket holding 1/N of new connections with nobody to answer them."""
        while not self._stopping:
            time.sleep(0.2)
            for i, proc in enumerate(self.procs):
                if self._stopping or proc is None or proc.poll() is None:
                    continue
                if time.monotonic() - self.started_at[i] >= STEADY_S:
                    self.restarts[i] = 0
                if self.restarts[i] >= MAX_QUICK_CRASHES:
                    raise WorkersFailed(
                        f"gateway worker {i} exited {MAX_QUICK_CRASHES} times in a row within "
                        f"{STEADY_S:g} s of starting (last: {proc.returncode}); stopping the gateway"
                    )
                pause = RESTART_BACKOFF_S[min(self.restarts[i], len(RESTART_BACKOFF_S) - 1)]
                self.log(
                    f"gateway worker {i} (pid {proc.pid}) exited with {proc.returncode}; starting it again "
                    f"in {pause:g} s"
                )
                self.restarts[i] += 1
                time.sleep(pause)
                if not self._stopping:
                    self.start(i)

    def stop(self) -> None:
        self._stopping = True
        for proc in self.procs:
            if proc is not None and proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        for proc in self.procs:
            if proc is None:
                continue
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        for sock in self.shared + self.private + self.admin:
            sock.close()


def worker_argv(argv: Iterable[str], i: int, shared_fd: int, private_fd: int, *admin_fd: int) -> list[str]:
    """The parent's own ``fleet gateway`` command line, run as worker ``i`` on its sockets."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        if arg in ("--workers",):
            skip = True
            continue
        if arg.startswith("--workers="):
            continue
        out.append(arg)
    fds = ",".join(str(fd) for fd in (shared_fd, private_fd, *admin_fd))
    return [sys.executable, "-m", "fleet", *out, "--worker-fds", fds]


def siblings() -> list[tuple[int, str]]:
    """(index, private base URL) of every worker of this gateway, this one included."""
    raw = os.environ.get(SIBLINGS_ENV, "")
    return list(enumerate(u for u in raw.split(",") if u))


def my_index() -> int | None:
    """This worker's index (``FLEET_GATEWAY_WORKER`` = ``i/N``), None outside workers."""
    raw = os.environ.get(WORKER_ENV, "")
    index, _, _ = raw.partition("/")
    return int(index) if index.isdigit() else None


def merge_expositions(texts: Iterable[tuple[int, str]]) -> bytes:
    """Prometheus text expositions of several workers as one, each sample labelled with its
    ``worker``. Not summed: a worker that restarts starts its counters at zero, which a sum
    would show as a drop of the whole gateway's; per worker, Prometheus sees one series
    reset, which ``rate()`` handles. Queries add the workers up (``sum by (model)``) — and
    take the largest for a value every worker sees whole (replica-seconds, prices)."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.metrics_core import Metric
    from prometheus_client.parser import text_string_to_metric_families

    families: dict[str, Metric] = {}
    for worker, text in texts:
        for fam in text_string_to_metric_families(text):
            merged = families.get(fam.name)
            if merged is None:
                merged = families[fam.name] = Metric(fam.name, fam.documentation, fam.type, fam.unit)
            for sample in fam.samples:
                merged.add_sample(
                    sample.name,
                    {**sample.labels, "worker": str(worker)},
                    sample.value,
                    sample.timestamp,
                    sample.exemplar,
                )

    class _Merged:
        def collect(self):  # noqa: ANN202
            yield from families.values()

    registry = CollectorRegistry()
    registry.register(_Merged())  # type: ignore[arg-type]
    return generate_latest(registry)
