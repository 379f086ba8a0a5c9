"""Gateway processes in front of stub model services, for the data-plane tests.

A file store in a temp dir holds registered versions (a one-file artifact with the demo
schema: nothing to train), routes and tenants; ``tests/stub_model.py`` processes play the
model services (listed for the gateway through ``FLEET_RUNTIME=static``); the gateway is
``fleet gateway`` as a subprocess. Every process started is stopped by PID.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

from fleet.catalog.registry import Registry, TensorSpec, VersionMetadata
from fleet.catalog.routes.store import Router
from fleet.catalog.tenants import Quota, Tenants
from fleet.store import open_store
from tests.serving_env import FLEET, ROOT, free_port, wait_ready

MODEL = "stub-model"
ADMIN_TOKEN = "test-admin-token"
BODY = {"inputs": [{"name": "features", "shape": [1, 4], "datatype": "FP32", "data": [1.0, 0.0, 0.0, 0.0]}]}
PROFILE = {"features": {"income": {}, "debt_ratio": {}, "age": {}, "tenure": {}}}


def model_policy(**overrides: Any) -> dict[str, Any]:
    spec = {
        "family": "tabular-mlp",
        "size_class": "small",
        "params_millions": 0.01,
        "autoscaling": {"max_replicas": 1, "target_qps_per_replica": 100, "target_p99_ms": 100},
        "slo": {"p99_ms": 250, "error_rate": 0.01},
        "timeout_ms": 2000,
        "concurrency": 32,
        "inference_log": {"sample_rate": 0.0},
    }
    for key, value in overrides.items():
        spec[key] = {**spec[key], **value} if isinstance(value, dict) and isinstance(spec.get(key), dict) else value
    return spec


class GatewayEnv:
    def __init__(
        self, root: Path, store_url: str | None = None, *, limits: dict[str, float] | None = None, **policy: Any
    ) -> None:
        """``policy``: overrides of the model's policy; ``limits``: the policies' ``gateway:`` section."""
        self.root = root
        self.store_url = store_url or f"file://{root / 'store'}"
        self.store = open_store(self.store_url)
        self.endpoints_file = root / "endpoints.yaml"
        self.endpoints: dict[str, list[str]] = {}
        self.procs: list[subprocess.Popen[bytes]] = []
        base = yaml.safe_load((ROOT / "policies" / "fleet.yaml").read_text())
        (root / "policies").mkdir(exist_ok=True)
        doc = {"models": {MODEL: model_policy(**policy)}, "rollout": base["rollout"], "monitoring": base["monitoring"]}
        # the log staged every 2 s (production's default is 60 s): a test sees what it sent at once
        doc["gateway"] = {"inference_log_flush_s": 2, **(limits or {})}
        (root / "policies" / "fleet.yaml").write_text(yaml.safe_dump(doc))
        self.write_endpoints()

    # -- state in the store --------------------------------------------------------------
    def register(self, *versions: str) -> None:
        artifact = self.root / "artifact"
        artifact.mkdir(exist_ok=True)
        (artifact / "model.txt").write_text("stub weights\n")
        meta = VersionMetadata(
            framework="torch",
            baseline_profile=PROFILE,
            inputs=[TensorSpec(name="features", datatype="FP32", shape=[-1, 4])],
            outputs=[TensorSpec(name="probabilities", datatype="FP32", shape=[-1, 2])],
        )
        for version in versions:
            Registry(self.store).register(MODEL, version, artifact, meta)

    def route(self, **changes: Any) -> None:
        Router(self.store).set(MODEL, why="test", **changes)

    def tenant(self, name: str, rps: float | None = None, burst: int | None = None) -> str:
        quota = Quota(rps=rps, burst=burst or int(rps)) if rps else None
        return Tenants(self.store).create(name, {MODEL: ["*"]}, quota)[1]

    # -- processes -----------------------------------------------------------------------
    def write_endpoints(self) -> None:
        tmp = self.endpoints_file.with_suffix(".tmp")
        tmp.write_text(yaml.safe_dump(self.endpoints))
        tmp.replace(self.endpoints_file)  # the gateway never reads half a file

    def stub(self, version: str, *args: str) -> str:
        """Start a stub replica of ``version`` and list it; return its URL."""
        port = free_port()
        log = self.root / f"stub-{port}.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                [sys.executable, str(ROOT / "tests" / "stub_model.py"), "--port", str(port), *args],
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        self.procs.append(proc)
        url = f"http://127.0.0.1:{port}"
        wait_ready(f"{url}/readyz", proc, log)
        self.endpoints.setdefault(f"{MODEL}:{version}", []).append(url)
        self.write_endpoints()
        return url

    def one_version(self, **extra: str) -> tuple[str, str, str]:
        """Version 1.0.0 registered, served by one stub and routed as stable, tenant ``apps``
        and a gateway: (gateway URL, the tenant's key, the stub's URL)."""
        self.register("1.0.0")
        stub = self.stub("1.0.0")
        self.route(stable="1.0.0")
        key = self.tenant("apps")
        url, _ = self.gateway(**extra)
        return url, key, stub

    def env(self, **extra: str) -> dict[str, str]:
        return {
            **os.environ,
            "FLEET_STORE": self.store_url,
            "FLEET_RUNTIME": "static",
            "FLEET_STATIC_ENDPOINTS": str(self.endpoints_file),
            "FLEET_POLICIES": str(self.root / "policies"),
            "FLEET_ADMIN_TOKEN": ADMIN_TOKEN,
            "FLEET_ACTOR": "gateway-test",
            **extra,
        }

    def gateway(self, *args: str, **extra: str) -> tuple[str, subprocess.Popen[bytes]]:
        port = free_port()
        log = self.root / f"gateway-{port}.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                [FLEET, "gateway", "--port", str(port), *args],
                env=self.env(**extra),
                cwd=self.root,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        self.procs.append(proc)
        url = f"http://127.0.0.1:{port}"
        wait_ready(f"{url}/v2/health/ready", proc, log)
        return url, proc

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def admin(url: str) -> httpx.Client:
    return httpx.Client(base_url=url, headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}, timeout=10)


def infer(client: httpx.Client, key: str, body: dict | None = None, **headers: str) -> httpx.Response:
    return client.post(
        f"/v2/models/{MODEL}/infer", json=body or BODY, headers={"Authorization": f"Bearer {key}", **headers}
    )


def dropped(s: socket.socket, within_s: float = 1.0) -> bool:
    """Whether the server dropped the connection ``s``: what it had sent read, then a reset or
    the end within ``within_s`` (one still open keeps sending, or goes quiet: False)."""
    deadline = time.monotonic() + within_s
    try:
        while time.monotonic() < deadline:
            s.settimeout(max(deadline - time.monotonic(), 0.01))
            if not s.recv(1 << 20):
                return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        pass
    return False


def wait_for(condition, timeout: float = 10.0, what: str = "condition") -> None:  # noqa: ANN001
    """Poll ``condition()`` until true; fail with ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


METRICS_TOKEN = "test-metrics-token"  # the scrape token tests/conftest.py gives every gateway


def scrape(url: str, **params: str) -> str:
    """The gateway's ``/metrics``, scraped as Prometheus does: with the scrape token."""
    r = httpx.get(f"{url}/metrics", params=params, headers={"Authorization": f"Bearer {METRICS_TOKEN}"}, timeout=10)
    r.raise_for_status()
    return r.text


def metric(url: str, name: str, **labels: str) -> float:
    """Sum of the Prometheus samples called ``name`` whose labels include ``labels``."""
    from prometheus_client.parser import text_string_to_metric_families

    total = 0.0
    for family in text_string_to_metric_families(scrape(url)):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total
