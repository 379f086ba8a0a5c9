"""A small real fleet for end-to-end tests: a file store and run folder in a temp dir, driven
through the ``fleet`` CLI as a user would. Every process it starts is stopped by PID at the end.

The BentoML home is the test process's (tests/conftest.py sets one per process): BentoML reads
it once, at import, and flows called in-process build Bentos there, so every fleet of the
process shares it — as two stores on one machine may (``fleet package`` rebuilds a Bento that
was built from another artifact). The commands whose imports dominate their cost (training,
packaging, deploying: torch and BentoML) run in this process, through the same CLI; the rest
run as the user runs them, as a ``fleet`` process."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from tests.quiet import assert_quiet

ROOT = Path(__file__).resolve().parents[1]
FLEET = str(Path(sys.executable).with_name("fleet"))
# `fleet <group>` commands run in this process: each would import torch or BentoML afresh
IN_PROCESS = frozenset({"models", "package", "deploy"})
_IN_PROCESS = threading.Lock()  # one at a time: they set the environment and the working folder


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class FleetEnv:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.env = {
            **os.environ,
            "FLEET_STORE": f"file://{root / 'store'}",
            "BENTOML_HOME": os.environ["BENTOML_HOME"],
            "FLEET_RUN_DIR": str(root / "run"),
            "FLEET_CACHE_DIR": str(root / "cache"),
            "FLEET_POLICIES": str(ROOT / "policies"),
            "FLEET_ACTOR": "e2e",
            "FLEET_ADMIN_TOKEN": "e2e-admin-token",
            "COLUMNS": "200",
        }
        self.procs: list[subprocess.Popen[bytes]] = []

    def fleet(self, *args: str, timeout: float = 300) -> str:
        if args and args[0] in IN_PROCESS:
            return self._in_process(args)
        proc = subprocess.run(
            [FLEET, *args], env=self.env, capture_output=True, text=True, timeout=timeout, cwd=self.root
        )
        assert proc.returncode == 0, f"fleet {' '.join(args)} failed: {proc.stderr}"
        assert_quiet(proc.stdout + proc.stderr, f"fleet {' '.join(args)}")
        return proc.stdout

    def _in_process(self, args: tuple[str, ...]) -> str:
        """``fleet *args`` through the CLI's own entry point, in this process, with this fleet's
        environment and folder (both restored after)."""
        import logging

        from typer.testing import CliRunner

        from fleet.cli import _keep_libraries_quiet, app, hoist_global_options

        changed = {k: v for k, v in self.env.items() if os.environ.get(k) != v}
        store_log = logging.getLogger("fleet.store")
        with _IN_PROCESS, _working_folder(self.root):
            muted = store_log.disabled  # the CLI mutes the store's logger for its own output
            try:
                hoisted = hoist_global_options(list(args))
                _keep_libraries_quiet(hoisted)  # as main() does: whether torch was imported before is not the test's
                result = CliRunner().invoke(app, hoisted, env=changed)
            finally:
                store_log.disabled = muted
        detail = result.stderr or result.output
        if result.exception is not None and not isinstance(result.exception, SystemExit):
            detail += f"\n{type(result.exception).__name__}: {result.exception}"
        assert result.exit_code == 0, f"fleet {' '.join(args)} failed: {detail}"
        assert_quiet(result.stdout + result.stderr, f"fleet {' '.join(args)}")
        return result.stdout

    def fleet_json(self, *args: str) -> object:
        return json.loads(self.fleet(*args, "--json"))

    def start_gateway(self) -> str:
        port = free_port()
        log = open(self.root / "gateway.log", "ab")
        proc = subprocess.Popen(
            [FLEET, "gateway", "--port", str(port)], env=self.env, stdout=log, stderr=subprocess.STDOUT, cwd=self.root
        )
        self.procs.append(proc)
        url = f"http://127.0.0.1:{port}"
        wait_ready(f"{url}/v2/health/ready", proc, self.root / "gateway.log")
        return url

    def stop(self) -> None:
        from fleet.runtime.local import LocalRuntime

        for proc in self.procs:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        LocalRuntime(self.root / "run").stop_all()


@contextmanager
def _working_folder(path: Path) -> Iterator[None]:
    before = os.getcwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(before)


def wait_ready(url: str, proc: subprocess.Popen[bytes], log: Path, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"process exited with {proc.returncode}: {log.read_text()[-3000:]}")
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"{url} not ready after {timeout} s: {log.read_text()[-3000:]}")
