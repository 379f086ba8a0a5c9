"""``fleet up`` as a user runs it: a subprocess that answers a prediction, survives a crash
of its predecessor, and stops cleanly on SIGINT with no process left behind."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx

from tests.serving_env import ROOT, free_port

FLEET = str(Path(sys.executable).with_name("fleet"))
BODY = {"inputs": [{"name": "features", "shape": [1, 4], "datatype": "FP32", "data": [1.0, 0.0, 0.0, 0.0]}]}


def processes_with(marker: str) -> list[int]:
    """PIDs of every process whose environment carries ``marker`` (all our descendants)."""
    found = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if marker.encode() in environ.read_bytes():
                found.append(int(environ.parent.name))
        except OSError:
            continue
    return [p for p in found if p != os.getpid()]


def kill_marked(marker: str) -> None:
    """Whatever a failed test left running, by PID."""
    for pid in processes_with(marker):
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


def start_up(
    cwd: Path, env: dict[str, str], port: int, prefect_port: int, *args: str
) -> tuple[subprocess.Popen[bytes], str]:
    out = cwd / f"up-{time.monotonic_ns()}.out"
    with open(out, "wb") as stdout:
        proc = subprocess.Popen(
            [FLEET, "up", "--port", str(port), "--prefect-port", str(prefect_port), *(args or ("--grpc-port", "0"))],
            cwd=cwd,
            env=env,
            stdout=stdout,
            stderr=subprocess.STDOUT,
        )
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        text = out.read_text()
        if match := re.search(r"Authorization: Bearer (sfk_\S+?)'", text):
            return proc, match.group(1)
        assert proc.poll() is None, f"fleet up exited with {proc.returncode}:\n{text}"
        time.sleep(0.5)
    proc.kill()
    raise AssertionError(f"fleet up did not come up:\n{out.read_text()}")


def predict(port: int, key: str) -> httpx.Response:
    return httpx.post(
        f"http://127.0.0.1:{port}/v2/models/demo-classifier/infer",
        json=BODY,
        headers={"Authorization": f"Bearer {key}"},
        timeout=30,
    )


def test_fleet_up_serves_recovers_from_a_crash_and_stops_cleanly_on_sigint(tmp_path: Path) -> None:
    marker = f"FLEET_TEST_MARKER={uuid.uuid4().hex}"
    env = {**os.environ, "FLEET_POLICIES": str(ROOT / "policies"), marker.split("=")[0]: marker.split("=")[1]}
    port, prefect_port = free_port(), free_port()
    try:
        first, key = start_up(tmp_path, env, port, prefect_port)
        r = predict(port, key)
        assert r.status_code == 200 and r.headers["x-fleet-model-version"] == "1.0.0"
        assert httpx.get(f"http://127.0.0.1:{prefect_port}/api/health", timeout=5).status_code == 200
        deadline = time.monotonic() + 60  # fleet up serves the flows: their deployments show in the UI
        names: set[str] = set()
        while time.monotonic() < deadline and not {"rollout", "rollback"} <= names:
            found = httpx.post(f"http://127.0.0.1:{prefect_port}/api/deployments/filter", json={}, timeout=5).json()
            names = {d["name"] for d in found}
            time.sleep(0.5)
        assert {"rollout", "rollback"} <= names

        first.send_signal(signal.SIGKILL)  # a crash: its children live on in their own sessions
        first.wait(timeout=10)
        assert processes_with(marker), "the crash should have left services running"

        second, key2 = start_up(tmp_path, env, port, prefect_port)
        assert key2 == key  # the demo key survives restarts
        assert predict(port, key).status_code == 200
        second.send_signal(signal.SIGINT)
        assert second.wait(timeout=60) == 0
        deadline = time.monotonic() + 15
        while processes_with(marker) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert processes_with(marker) == []
    finally:
        kill_marked(marker)


def test_fleet_up_with_two_gateways_shares_quotas_through_its_redis_and_stops_it(tmp_path: Path) -> None:
    marker = f"FLEET_TEST_MARKER={uuid.uuid4().hex}"
    env = {**os.environ, "FLEET_POLICIES": str(ROOT / "policies"), marker.split("=")[0]: marker.split("=")[1]}
    port, redis_port, grpc_port = free_port(), free_port(), free_port()
    try:
        proc, key = start_up(
            tmp_path,
            env,
            port,
            free_port(),
            "--no-prefect",
            "--gateways",
            "2",
            "--redis-port",
            str(redis_port),
            "--grpc-port",
            str(grpc_port),
        )
        assert predict(port, key).status_code == 200
        ready = f"http://127.0.0.1:{port}/v2/health/ready"
        health = httpx.get(ready, timeout=5).json()
        assert health["workers"] == 2
        assert health["quotas"] == {
            "backend": "redis",
            "shared": True,
            "share_divisor": 1,
        }  # where it lives: admins only
        admin = {"Authorization": f"Bearer {(tmp_path / '.fleet' / 'admin-token').read_text().strip()}"}
        assert httpx.get(ready, timeout=5, headers=admin).json()["quotas"]["url"] == f"redis://127.0.0.1:{redis_port}/0"
        records = list((tmp_path / ".fleet" / "store" / "gateways").glob("*.json"))
        assert len(records) == 2  # each gateway process announced itself
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0
        deadline = time.monotonic() + 15
        while processes_with(marker) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert processes_with(marker) == [], "gateways, model services and Redis all stop with fleet up"
    finally:
        kill_marked(marker)
