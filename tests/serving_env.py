"""A small real fleet for end-to-end tests: a file store, BentoML home and run folder in a
temp dir, driven through the ``fleet`` CLI as a user would. Every process it starts is
stopped by PID at the end."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
FLEET = str(Path(sys.executable).with_name("fleet"))


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
            "BENTOML_HOME": str(root / "bentoml"),
            "FLEET_RUN_DIR": str(root / "run"),
            "FLEET_CACHE_DIR": str(root / "cache"),
            "FLEET_POLICIES": str(ROOT / "policies"),
            "FLEET_ACTOR": "e2e",
            "FLEET_ADMIN_TOKEN": "e2e-admin-token",
            "COLUMNS": "200",
        }
        self.procs: list[subprocess.Popen[bytes]] = []

    def fleet(self, *args: str, timeout: float = 300) -> str:
        proc = subprocess.run(
            [FLEET, *args], env=self.env, capture_output=True, text=True, timeout=timeout, cwd=self.root
        )
        assert proc.returncode == 0, f"fleet {' '.join(args)} failed: {proc.stderr}"
        return proc.stdout

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
