"""The Prometheus metrics source against a real Prometheus (Debian's package) scraping a real
gateway: both sources must tell canary analysis the same story about the same traffic."""

from __future__ import annotations

import shutil
import signal
import subprocess
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from fleet.analysis.sources.gateway import GatewayMetrics
from fleet.analysis.sources.prometheus import PrometheusMetrics
from tests.gateway_env import ADMIN_TOKEN, METRICS_TOKEN, MODEL, GatewayEnv, infer, wait_for
from tests.serving_env import free_port

PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"


@pytest.fixture
def prometheus_for(tmp_path: Path):
    """Start Prometheus scraping the given gateway every second; stopped by PID."""
    procs: list[subprocess.Popen[bytes]] = []

    def start(gateway_url: str) -> str:
        assert Path(PROMETHEUS).exists(), (
            "Prometheus is not installed; `make test` installs it (apt-get install prometheus)"
        )
        port = free_port()
        config = tmp_path / "prometheus.yml"
        config.write_text(f"""
global: {{scrape_interval: 1s, evaluation_interval: 1s}}
scrape_configs:
  - job_name: fleet-gateway
    authorization: {{type: Bearer, credentials: {METRICS_TOKEN}}}
    static_configs: [{{targets: ["{gateway_url.removeprefix("http://")}"]}}]
""")
        log = open(tmp_path / "prometheus.log", "wb")
        procs.append(
            subprocess.Popen(
                [
                    PROMETHEUS,
                    f"--config.file={config}",
                    f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                    f"--web.listen-address=127.0.0.1:{port}",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        )
        url = f"http://127.0.0.1:{port}"
        wait_for(lambda: _ready(url), timeout=30, what="Prometheus ready")
        return url

    yield start
    for proc in procs:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=20)


def _ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/-/ready", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def _scraped_after(prom: str, moment: float) -> bool:
    r = httpx.get(f"{prom}/api/v1/query", params={"query": "timestamp(up)"}, timeout=5).json()
    return bool(r["data"]["result"]) and float(r["data"]["result"][0]["value"][1]) > moment


def test_prometheus_and_the_gateway_agree_on_what_each_version_served(tmp_path: Path, prometheus_for) -> None:
    (tmp_path / "env").mkdir()
    e = GatewayEnv(tmp_path / "env")
    try:
        e.register("1.0.0", "1.1.0")
        e.stub("1.0.0", "--delay-ms", "5")
        e.stub("1.1.0", "--delay-ms", "20", "--fail-rate", "0.2")
        e.route(stable="1.0.0")
        e.route(canary="1.1.0", weight=50)
        key = e.tenant("apps")
        url, _ = e.gateway()
        prom = prometheus_for(url)
        rng = np.random.default_rng(3)
        with httpx.Client(base_url=url, timeout=30) as client:

            def send(n: int, prefix: str) -> None:
                for i in range(n):
                    body = {
                        "inputs": [
                            {
                                "name": "features",
                                "shape": [1, 4],
                                "datatype": "FP32",
                                "data": rng.normal(size=4).round(3).tolist(),
                            }
                        ]
                    }
                    assert infer(client, key, body, **{"X-Fleet-Routing-Key": f"{prefix}-{i}"}).status_code == 200

            send(20, "warm")  # Prometheus counts increases of series it has seen: create them first
            warm = time.time()
            wait_for(lambda: _scraped_after(prom, warm + 0.5), timeout=20, what="a scrape after the warm-up")
            start = time.time()
            send(300, "load")
            sent = time.time()
            # a window of >= 12 s: increase() scales what it saw by range / sampled span, which
            # errs by up to about two scrape intervals (1 s each here) over the range
            wait_for(
                lambda: _scraped_after(prom, max(sent + 0.5, start + 12)), timeout=30, what="a scrape after the load"
            )
        end = time.time()
        gateway = GatewayMetrics(e.store, ADMIN_TOKEN)
        prometheus = PrometheusMetrics(prom)
        for version in ("1.0.0", "1.1.0"):
            g = gateway.window(MODEL, version, start, end)
            p = prometheus.window(MODEL, version, start, end)
            print(
                f"{version}: gateway requests {g.requests} errors {g.errors}; prometheus requests {p.requests} errors {p.errors}"
            )
            assert g.requests > 50
            bias = 2 * 1.0 / (end - start)  # two scrape intervals over the range: increase()'s extrapolation
            for mine, theirs in (
                (p.requests, g.requests),
                (p.error_count, g.error_count),
                (sum(p.latency_ms), sum(g.latency_ms)),
                (sum(p.predictions), sum(g.predictions)),
            ):
                assert abs(mine - theirs) <= 5 + bias * theirs, (mine, theirs, round(bias, 3))
        slow = prometheus.window(MODEL, "1.1.0", start, end)
        assert slow.errors["5xx"] > 0  # the canary's injected 500s
        from fleet.analysis.histograms import histogram_quantile

        # the medians: 20 ms vs 5 ms upstream (a p99 of ~150 requests is one stall of a busy machine)
        fast_p50 = histogram_quantile(0.5, prometheus.window(MODEL, "1.0.0", start, end).latency_ms)
        assert histogram_quantile(0.5, slow.latency_ms) > fast_p50
    finally:
        e.stop()
