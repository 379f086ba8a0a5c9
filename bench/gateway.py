"""What the gateway costs: one fixed load against a Bento directly, through nginx, through the gateway.

Two upstreams: the demo model's Bento (``bentoml serve``) and a trivial echo (nginx
answering a fixed prediction), which exposes each proxy's own cost. Three ways in front
of each: direct, Debian's nginx as a keep-alive reverse proxy, and ``fleet gateway``
(tenant auth, routing, schema check, metrics, 20 % inference-log sampling as in the demo
policy; prediction cache off so every request reaches the upstream). wrk sends a fixed
number of one-row requests at concurrency 1, 16 and 64. Direct and nginx get the Bento's
body (``{"features": [[...]]}``); the gateway gets the OIP v2 body it translates to that.

    .venv/bin/python bench/gateway.py [--requests 3000] [--workdir DIR] [--baseline GIT-REF]

Each gateway cell also reports, for that cell alone, the mean time a request spent in the
gateway and the upstream call's part of it (from the gateway's own histograms, differenced
over the cell), and the gateway process's CPU time per request (/proc). ``--baseline REF``
runs one more gateway in front of the echo, from that commit's tree (``git archive``), so
today's code and REF's are measured in the same run, side by side.

Targets (issue 4): gateway p50 <= direct p50 + 1 ms; gateway throughput >= 0.9x nginx's.
Issue 13: in front of the echo at concurrency 16, >= 2.5x the baseline's throughput with
p99 under 20 ms. Needs Debian's nginx and wrk (apt-get install -y nginx-light wrk).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench._scrape import SCRAPE  # noqa: E402
from bench._wrk import Result, load  # noqa: E402

MODEL = "demo-classifier"
ECHO = "[[0.3,0.7]]"


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(url: str, timeout: float = 60) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{url} not ready after {timeout} s")


def _nginx(work: Path, name: str, server_block: str) -> tuple[subprocess.Popen[bytes], Path]:
    folder = work / f"nginx-{name}"
    folder.mkdir(parents=True, exist_ok=True)
    temps = " ".join(f"{k}_temp_path {folder / k};" for k in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))
    conf = folder / "nginx.conf"
    conf.write_text(f"""
worker_processes 1;
daemon off;
pid {folder / "nginx.pid"};
error_log {folder / "error.log"} warn;
events {{ worker_connections 4096; }}
http {{
  access_log off;
  {temps}
  {server_block}
}}
""")
    return subprocess.Popen([shutil.which("nginx") or "/usr/sbin/nginx", "-c", str(conf)], start_new_session=True), conf


def _bodies() -> tuple[list[str], list[str]]:
    rows = [[(i % 7) / 3 - 1, (i % 5) / 2 - 1, (i % 3) - 1, (i % 11) / 5 - 1] for i in range(64)]
    bento = [json.dumps({"features": [r]}) for r in rows]
    oip = [json.dumps({"inputs": [{"name": "features", "shape": [1, 4], "datatype": "FP32", "data": r}]}) for r in rows]
    return bento, oip


def _gateway_codes(url: str) -> dict[str, int]:
    """The gateway's answers by HTTP status, from its own counters."""
    import httpx

    codes: dict[str, int] = {}
    for code, value in re.findall(
        r'^fleet_requests_total\{[^}]*code="(\d+)"[^}]*\} ([0-9.e+-]+)$',
        httpx.get(f"{url}/metrics", timeout=5, headers=SCRAPE).text,
        re.M,
    ):
        codes[code] = codes.get(code, 0) + int(float(value))
    return codes


_SPLIT = (
    "fleet_request_duration_seconds_count",
    "fleet_request_duration_seconds_sum",
    "fleet_upstream_duration_seconds_count",
    "fleet_upstream_duration_seconds_sum",
)
_TICKS = os.sysconf("SC_CLK_TCK")


def _counters(url: str, pid: int) -> dict[str, float]:
    """The gateway's duration histograms' counts and sums, and its process's CPU seconds, now."""
    import httpx

    text = httpx.get(f"{url}/metrics", timeout=5, headers=SCRAPE).text
    found = {
        name: sum(float(v) for v in re.findall(rf"^{name}\{{[^}}]*\}} ([0-9.e+-]+)$", text, re.M)) for name in _SPLIT
    }
    with open(f"/proc/{pid}/stat") as f:  # noqa: PTH123
        fields = f.read().rsplit(")", 1)[1].split()
    found["cpu"] = (int(fields[11]) + int(fields[12])) / _TICKS
    return found


def _cell(before: dict[str, float], after: dict[str, float]) -> dict[str, float] | None:
    """One cell's mean ms in the gateway, the upstream's part, and CPU ms per request."""
    d = {k: after[k] - before[k] for k in after}
    n, up = d["fleet_request_duration_seconds_count"], d["fleet_upstream_duration_seconds_count"]
    if not n or not up:
        return None
    return {
        "total_ms": d["fleet_request_duration_seconds_sum"] / n * 1e3,
        "upstream_ms": d["fleet_upstream_duration_seconds_sum"] / up * 1e3,
        "cpu_ms": d["cpu"] / n * 1e3,
    }


def _baseline_tree(ref: str, into: Path) -> Path:
    """``ref``'s ``fleet`` package and policies, extracted from git (the working tree is not touched)."""
    into.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", ref, "fleet", "bentos", "policies"], capture_output=True, check=True
    )
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
    return into


def _bench_policies(source: Path, into: Path) -> Path:
    """``source``'s fleet policies with the demo model's cache off and no tenants, in ``into``."""
    import yaml

    policies = yaml.safe_load(source.read_text())
    policies["models"][MODEL]["cache"]["enabled"] = False  # every request must reach the upstream
    policies.pop("tenants", None)
    into.mkdir(parents=True, exist_ok=True)
    (into / "fleet.yaml").write_text(yaml.safe_dump(policies))
    return into


def _baseline_store(tree: Path, store: Path, into: Path) -> str:
    """A copy of ``store`` whose tenant is written by the baseline's own code (record formats change); its key."""
    shutil.rmtree(into, ignore_errors=True)
    shutil.copytree(store, into)
    shutil.rmtree(into / "tenants", ignore_errors=True)
    script = (
        "import sys; from fleet.store import open_store; from fleet.catalog.tenants import Tenants; "
        f"print(Tenants(open_store(sys.argv[1])).create('bench-baseline', {{'{MODEL}': ['*']}})[1])"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, f"file://{into}"],
        env={**os.environ, "PYTHONPATH": str(tree)},
        cwd=tree,
        capture_output=True,
        text=True,
        check=True,
    )
    return done.stdout.strip().splitlines()[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--baseline", default=None, help="also run a gateway from this git ref, in front of the echo")
    args = parser.parse_args()
    work = args.workdir or Path(tempfile.mkdtemp(prefix="fleet-bench-gw-"))
    os.environ["BENTOML_HOME"] = str(work / "bentoml")
    os.environ["FLEET_STORE"] = f"file://{work / 'store'}"

    import yaml

    from bentos.tabular_mlp.train import TrainConfig, train_and_register
    from fleet.catalog.policies.loader import load_policies
    from fleet.catalog.registry import Registry
    from fleet.catalog.routes.store import Router
    from fleet.catalog.tenants import Tenants
    from fleet.runtime.bento import package
    from fleet.runtime.cache import ArtifactCache
    from fleet.runtime.local import LocalRuntime
    from fleet.store import open_store

    store = open_store()
    spec = load_policies(_bench_policies(ROOT / "policies" / "fleet.yaml", work / "policies")).model(MODEL)
    if not Registry(store).versions(MODEL):
        train_and_register(store, MODEL, "1.0.0", TrainConfig(rows=5000, epochs=5))
        Router(store).set(MODEL, stable="1.0.0", why="bench")
    key = Tenants(store).create(f"bench-{os.getpid()}", {MODEL: ["*"]})[1]
    bento = package(Registry(store), MODEL, "1.0.0", spec, ArtifactCache(work / "cache")).bento
    runtime = LocalRuntime(work / "run", bento_for=lambda m, v: bento)
    procs: list[subprocess.Popen[bytes]] = []
    try:
        bento_url = runtime.deploy(MODEL, "1.0.0").endpoints[0]
        echo_port, nginx_bento_port, nginx_echo_port = _free_port(), _free_port(), _free_port()
        echo_proc, _ = _nginx(
            work,
            "echo",
            f"""server {{ listen 127.0.0.1:{echo_port};
            location / {{ default_type application/json; return 200 '{ECHO}'; }} }}""",
        )
        bento_host = bento_url.removeprefix("http://")
        proxy_proc, _ = _nginx(
            work,
            "proxy",
            f"""
  upstream bento {{ server {bento_host}; keepalive 128; }}
  upstream echo {{ server 127.0.0.1:{echo_port}; keepalive 128; }}
  server {{ listen 127.0.0.1:{nginx_bento_port};
    location / {{ proxy_pass http://bento; proxy_http_version 1.1; proxy_set_header Connection ""; }} }}
  server {{ listen 127.0.0.1:{nginx_echo_port};
    location / {{ proxy_pass http://echo; proxy_http_version 1.1; proxy_set_header Connection ""; }} }}""",
        )
        procs += [echo_proc, proxy_proc]
        echo_url = f"http://127.0.0.1:{echo_port}"
        endpoints = work / "endpoints.yaml"
        gateways, pids = {}, {}
        baseline = _baseline_tree(args.baseline, work / "baseline") if args.baseline else None
        baseline_key = _baseline_store(baseline, work / "store", work / "store-baseline") if baseline else None
        runs = [("bento", bento_url, None), ("echo", echo_url, None)] + (
            [("baseline", echo_url, baseline)] if baseline else []
        )
        for name, upstream, tree in runs:
            endpoints_file = endpoints.with_name(f"endpoints-{name}.yaml")
            endpoints_file.write_text(yaml.safe_dump({f"{MODEL}:1.0.0": [upstream]}))
            port = _free_port()
            env = {
                **os.environ,
                "FLEET_RUNTIME": "static",
                "FLEET_STATIC_ENDPOINTS": str(endpoints_file),
                "FLEET_POLICIES": str(work / "policies"),
            }
            if tree is not None:  # the baseline's fleet package first on the path, and its own policy schema
                env["PYTHONPATH"] = str(tree)
                env["FLEET_POLICIES"] = str(
                    _bench_policies(tree / "policies" / "fleet.yaml", work / "policies-baseline")
                )
                env["FLEET_STORE"] = f"file://{work / 'store-baseline'}"
            log = open(work / f"gateway-{name}.log", "wb")
            command = [sys.executable, "-c", "from fleet.cli import main; main()", "gateway", "--port", str(port)]
            procs.append(
                subprocess.Popen(
                    command, env=env, cwd=tree or ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
                )
            )
            gateways[name], pids[name] = f"http://127.0.0.1:{port}", procs[-1].pid
        for url in (
            f"{echo_url}/",
            f"http://127.0.0.1:{nginx_echo_port}/",
            *(f"{g}/v2/health/ready" for g in gateways.values()),
        ):
            _wait(url)
        bento_bodies, oip_bodies = _bodies()
        auth = {"Authorization": f"Bearer {key}"}
        targets = {
            "bento": [
                ("direct", f"{bento_url}/predict", bento_bodies, {}),
                ("nginx", f"http://127.0.0.1:{nginx_bento_port}/predict", bento_bodies, {}),
                ("gateway", f"{gateways['bento']}/v2/models/{MODEL}/infer", oip_bodies, auth),
            ],
            "echo": [
                ("direct", f"{echo_url}/predict", bento_bodies, {}),
                ("nginx", f"http://127.0.0.1:{nginx_echo_port}/predict", bento_bodies, {}),
                ("gateway", f"{gateways['echo']}/v2/models/{MODEL}/infer", oip_bodies, auth),
            ]
            + (
                [
                    (
                        "baseline",
                        f"{gateways['baseline']}/v2/models/{MODEL}/infer",
                        oip_bodies,
                        {"Authorization": f"Bearer {baseline_key}"},
                    )
                ]
                if baseline
                else []
            ),
        }
        results: dict[tuple[str, str, int], Result] = {}
        cells: dict[tuple[str, str, int], dict[str, float] | None] = {}
        for upstream, ways in targets.items():
            for _way, url, bodies, headers in ways:
                load(url, bodies, concurrency=8, requests=300, headers=headers)  # warm up
            # concurrency outside, the three ways inside: BentoML's batcher tunes its waits to
            # the load it saw, so each way must follow the same history (after a run at 64 it
            # waited ~10 ms per request at 1, which an earlier order blamed on the proxies)
            for concurrency in (1, 16, 64):
                for way, url, bodies, headers in ways:
                    gw = ("baseline" if way == "baseline" else upstream) if way in ("gateway", "baseline") else None
                    before = _counters(gateways[gw], pids[gw]) if gw else None
                    results[upstream, way, concurrency] = load(
                        url, bodies, concurrency=concurrency, requests=args.requests, headers=headers
                    )
                    if gw:
                        cells[upstream, way, concurrency] = _cell(before, _counters(gateways[gw], pids[gw]))  # type: ignore[arg-type]
        _report(
            results, args.requests, cells, {name: _gateway_codes(url) for name, url in gateways.items()}, args.baseline
        )
    finally:
        for proc in procs:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        for proc in procs:
            proc.wait(timeout=20)
        runtime.stop_all()


def _report(results: dict, requests: int, cells: dict, codes: dict, baseline: str | None) -> None:  # noqa: ANN001
    print(f"{requests} one-row requests per cell, wrk -t1, {os.cpu_count()} cores shared by load, proxy and upstream")
    print(
        f"{'upstream':>8} {'conc':>4} | {'direct rps':>10} {'p50':>6} {'p99':>6} {'err':>4} | {'nginx rps':>9} {'p50':>6} "
        f"{'p99':>6} {'err':>4} | {'gateway rps':>11} {'p50':>6} {'p99':>6} {'err':>4} | {'gw-direct p50':>13} "
        f"{'gw/nginx rps':>12}"
    )
    for upstream in ("bento", "echo"):
        for c in (1, 16, 64):
            d, n, g = (results[upstream, w, c] for w in ("direct", "nginx", "gateway"))
            print(
                f"{upstream:>8} {c:>4} | {d.rps:>10.0f} {d.p50_ms:>6.2f} {d.p99_ms:>6.1f} {d.errors:>4} | {n.rps:>9.0f} "
                f"{n.p50_ms:>6.2f} {n.p99_ms:>6.1f} {n.errors:>4} | {g.rps:>11.0f} {g.p50_ms:>6.2f} {g.p99_ms:>6.1f} {g.errors:>4} | "
                f"{g.p50_ms - d.p50_ms:>+10.2f} ms {g.rps / n.rps:>11.2f}x"
            )
    print()
    print(
        "per gateway cell (that cell alone): mean ms in the gateway, the upstream call's part, gateway CPU per request"
    )
    for (upstream, way, c), cell in sorted(cells.items()):
        if cell:
            print(
                f"{upstream:>8} {way:>8} {c:>4} | in gateway {cell['total_ms']:6.2f} ms, upstream {cell['upstream_ms']:6.2f} ms,"
                f" own {cell['total_ms'] - cell['upstream_ms']:6.2f} ms | CPU {cell['cpu_ms']:.3f} ms/request"
            )
    if baseline:
        print()
        for c in (1, 16, 64):
            now, then = results["echo", "gateway", c], results["echo", "baseline", c]
            cpu_now, cpu_then = cells.get(("echo", "gateway", c)), cells.get(("echo", "baseline", c))
            cpu = (
                f", CPU/request {cpu_then['cpu_ms']:.3f} -> {cpu_now['cpu_ms']:.3f} ms" if cpu_now and cpu_then else ""
            )
            print(
                f"echo, concurrency {c}: this tree {now.rps:.0f} req/s against {baseline}'s {then.rps:.0f}: "
                f"{now.rps / then.rps:.2f}x (p99 {then.p99_ms:.1f} -> {now.p99_ms:.1f} ms){cpu}"
            )
    for name, by_code in codes.items():
        print(f"gateway answers in front of {name}, by status: {dict(sorted(by_code.items()))}")
    print("p50/p99 in ms; err: non-2xx answers and socket errors")


if __name__ == "__main__":
    main()
