"""Fair queuing, the shared quota's cost, and gateway workers: three measurements in one run.

    .venv/bin/python bench/fairness.py [--seconds 10] [--baseline f926d6f] [--workdir DIR]

1. Fair queuing under a flood. One stub replica (``tests/stub_model.py --delay-ms 20``)
   behind a model policy of ``concurrency: 8``, ``max_queue: 64``: the version saturates at
   about 8 / 20 ms = 400 req/s. Tenant B sends a steady open loop of 40 req/s (one request
   every 25 ms, each on its own task, its latency taken from the time it was due to be
   sent); tenant A floods with an open loop at 10x its fair share (half of 400 req/s: 2,000
   req/s, each request on its own task whatever the answers). Each client is
   a process of its own (this script, ``--client``), so neither shares a core's event loop
   with the other or with the gateway. Three cells, ``--seconds`` each after 1 s of warm-up:
   (i) B alone on this tree; (ii) A + B on the ``--baseline`` tree (before fair queuing:
   one priority-only FIFO line for everyone); (iii) A + B on this tree (deficit round robin
   between tenants; a full queue sheds the newest request of the tenant with the most
   waiting). Reported: B's p50/p99 (its 200 answers) and its non-200 answers, A's answers/s
   and sheds (503), and each client's achieved rate and CPU.
   Target: (iii) B p99 <= 1.5x (i) B p99.

2. The quota check's cost, Redis vs in-process. A stub with ``--delay-ms 0``, a tenant whose
   quota never refuses (rps 1e6, burst 1e6); one gateway with ``FLEET_REDIS_URL`` (a
   redis-server started here) and one without, loaded in turn by wrk at concurrency 1 and 16
   for ``--seconds`` each. Reported: p50/p99 and req/s, the p50 Redis adds, and CPU per
   request of the gateway (and of redis-server) from /proc.
   Target: Redis adds <= 0.5 ms to p50 at concurrency 1.

3. Workers. ``--workers 1`` against ``--workers 2`` (both with ``FLEET_REDIS_URL``) in front
   of an nginx answering a fixed prediction (as bench/gateway.py's echo), wrk at concurrency
   32 for ``--seconds``, a never-refusing quota. Then, with 2 workers, a tenant of quota
   rps=200, burst=20 under wrk at concurrency 32 for ``--seconds``: its 200 and 429 answers
   (the gateway's own ``fleet_requests_total``, every worker added up by ``/metrics`` on the
   shared port) and admitted / (200 x seconds + 20).
   Targets: 2 workers >= 1.7x the throughput of 1; admitted within 5 % of the quota.

Every process started here is stopped by PID at the end. Needs wrk, redis-server and
nginx (apt-get install -y wrk redis-server nginx-light). The figures depend on the cores
there are: load generators, gateways, stubs and Redis share them (the count is printed).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
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

MODEL = "demo-classifier"  # bench.gateway's model: its baseline helpers entitle tenants to it
BODY = {"inputs": [{"name": "features", "shape": [1, 4], "datatype": "FP32", "data": [1.0, 0.0, 0.0, 0.0]}]}
STEADY_RPS = 40.0
FLOOD_RPS = 10 * (8 / 0.020) / 2  # 10x A's fair share: half of what the version answers (8 slots of 20 ms)
WARMUP_S = 1.0
NEVER = 1_000_000  # a quota that never refuses: rps and burst
EXACT_RPS, EXACT_BURST = 200.0, 20


# -- the load clients (run as child processes: this script with --client) ---------------------
def _percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in 0..100); NaN of nothing."""
    if not values:
        return float("nan")
    import math

    ordered = sorted(values)
    return ordered[min(len(ordered), max(1, math.ceil(q / 100 * len(ordered)))) - 1]


class _Http:
    """A minimal HTTP/1.1 keep-alive client on asyncio streams: one POST at a time per
    connection, idle connections kept for reuse. httpx's pool (httpcore 1.0) spent about 20 ms of
    CPU per request with 80 connections busy here, so the flood never reached the gateway;
    this costs about 0.1 ms."""

    def __init__(self, url: str, key: str) -> None:
        from urllib.parse import urlsplit

        parts = urlsplit(url)
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or 80
        body = json.dumps(BODY).encode()
        self.request = (
            f"POST {parts.path} HTTP/1.1\r\nHost: {parts.netloc}\r\nAuthorization: Bearer {key}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        ).encode() + body
        self.idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
        self.connections = 0
        self.stale = 0  # kept connections found closed by the server, the request sent again

    async def post(self) -> int:
        """One request; its status, or 0 if the connection failed. A kept connection that the
        server closed while it was idle (its keep-alive timeout) is retried once on a new one,
        as HTTP clients do, and counted in ``stale``."""
        import socket

        while True:
            reused = bool(self.idle)
            if reused:
                reader, writer = self.idle.pop()
            else:
                try:
                    reader, writer = await asyncio.open_connection(self.host, self.port)
                except OSError:
                    return 0
                writer.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                self.connections += 1
            try:
                writer.write(self.request)
                raw = await reader.readuntil(b"\r\n\r\n")
            except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError) as exc:
                writer.close()
                if reused and (not isinstance(exc, asyncio.IncompleteReadError) or not exc.partial):
                    self.stale += 1
                    continue  # nothing came back on a kept connection: try a new one
                return 0
            break
        try:
            head = raw.decode("latin-1").lower().split("\r\n")
            status = int(head[0].split()[1])
            fields = dict(line.split(":", 1) for line in head[1:] if ":" in line)
            if fields.get("transfer-encoding", "").strip() == "chunked":
                while size := int((await reader.readuntil(b"\r\n")).split(b";")[0], 16):
                    await reader.readexactly(size + 2)
                await reader.readuntil(b"\r\n")
            else:
                await reader.readexactly(int(fields.get("content-length", "0")))
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError, IndexError):
            writer.close()
            return 0
        if fields.get("connection", "").strip() == "close":
            writer.close()
        else:
            self.idle.append((reader, writer))
        return status

    def close(self) -> None:
        for _, writer in self.idle:
            writer.close()


async def _cpu_between(start: float, end: float, out: dict) -> None:
    """This process's CPU share (of one core) between two of the loop's times, into ``out``."""
    loop = asyncio.get_running_loop()
    await asyncio.sleep(max(0.0, start - loop.time()))
    t = os.times()
    await asyncio.sleep(max(0.0, end - loop.time()))
    u = os.times()
    out["cpu"] = (u.user + u.system - t.user - t.system) / (end - start)


async def _open_loop(url: str, key: str, rate: float, start_at: float, seconds: float) -> dict:
    """One request every 1/rate s, each on its own task (a slow answer delays no later request);
    latency from the time each was due. Requests due in the warm-up are sent, not kept."""
    loop = asyncio.get_running_loop()
    kept: list[tuple[float, int]] = []
    lag = 0.0
    client = _Http(url, key)
    await asyncio.sleep(max(0.0, start_at - time.time()))
    t0 = loop.time()
    n = int((WARMUP_S + seconds) * rate)
    usage: dict[str, float] = {}
    meter = asyncio.create_task(_cpu_between(t0 + WARMUP_S, t0 + WARMUP_S + seconds, usage))

    async def one(due: float, keep: bool) -> None:
        code = await client.post()
        if keep:
            kept.append((loop.time() - due, code))

    tasks = []
    for i in range(n):
        due = t0 + i / rate
        await asyncio.sleep(max(0.0, due - loop.time()))
        lag = max(lag, loop.time() - due)
        tasks.append(asyncio.create_task(one(due, i / rate >= WARMUP_S)))
    await asyncio.gather(*tasks, meter)
    client.close()
    codes: dict[str, int] = {}
    for _, code in kept:
        codes[str(code)] = codes.get(str(code), 0) + 1
    ok = [s * 1e3 for s, code in kept if code == 200]
    return {
        "sent": len(kept),
        "seconds": seconds,
        "codes": codes,
        "p50_ms": _percentile(ok, 50),
        "p99_ms": _percentile(ok, 99),
        "mean_ms": sum(ok) / len(ok) if ok else float("nan"),
        "max_ms": max(ok, default=float("nan")),
        "max_send_lag_ms": lag * 1e3,
        "connections": client.connections,
        "stale": client.stale,
        **usage,
    }


def _client_main(args: argparse.Namespace) -> None:
    kind, url, key, amount = args.client
    assert kind == "open", kind
    out = asyncio.run(_open_loop(url, key, float(amount), args.start_at, args.seconds))
    args.out.write_text(json.dumps(out))


# -- processes ------------------------------------------------------------------------------
class Procs:
    """Every process this run starts, each in a session of its own, stopped by PID."""

    def __init__(self, work: Path) -> None:
        self.work, self.procs = work, []
        self.worker_pids: set[int] = set()  # gateway workers a supervisor started (they stop with it)

    def start(self, name: str, cmd: list[str], **kw) -> subprocess.Popen[bytes]:  # noqa: ANN003
        log = open(self.work / f"{name}.log", "wb")  # noqa: SIM115 - closed with the process
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, **kw)
        log.close()
        self.procs.append(proc)
        return proc

    def stop(self, proc: subprocess.Popen[bytes]) -> None:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=25)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()

    def stop_all(self) -> None:
        for proc in reversed(self.procs):
            self.stop(proc)
        for pid in self.worker_pids:  # a worker its supervisor failed to stop
            with contextlib.suppress(OSError):
                if "fleet" in Path(f"/proc/{pid}/cmdline").read_text():
                    os.kill(pid, signal.SIGKILL)


def _cpu_s(pid: int) -> float:
    from bench.gateway import _TICKS

    with open(f"/proc/{pid}/stat") as f:  # noqa: PTH123
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICKS


def _box_ticks() -> tuple[int, int]:
    """The machine's (busy, total) CPU ticks so far, every core (/proc/stat)."""
    with open("/proc/stat") as f:  # noqa: PTH123
        ticks = [int(x) for x in f.readline().split()[1:]]
    return sum(ticks) - ticks[3] - ticks[4], sum(ticks)


def _seed_store(path: Path, tenants: dict[str, object]) -> tuple[object, dict[str, str]]:
    """A file store with version 1.0.0 of the model (a stub artifact, the demo's schema),
    routed as stable, and ``tenants`` (name -> Quota or None) with their keys."""
    from fleet.catalog.registry import Registry, TensorSpec, VersionMetadata
    from fleet.catalog.routes.store import Router
    from fleet.catalog.tenants import Tenants
    from fleet.store import open_store

    store = open_store(f"file://{path}")
    artifact = path.parent / "artifact"
    artifact.mkdir(parents=True, exist_ok=True)
    (artifact / "model.txt").write_text("stub weights\n")
    profile = {"features": {f: {} for f in ("income", "debt_ratio", "age", "tenure")}}
    meta = VersionMetadata(
        framework="torch",
        baseline_profile=profile,
        inputs=[TensorSpec(name="features", datatype="FP32", shape=[-1, 4])],
        outputs=[TensorSpec(name="probabilities", datatype="FP32", shape=[-1, 2])],
    )
    Registry(store).register(MODEL, "1.0.0", artifact, meta)
    Router(store).set(MODEL, stable="1.0.0", why="bench")
    keys = {name: Tenants(store).create(name, {MODEL: ["*"]}, quota, weight=1.0)[1] for name, quota in tenants.items()}
    return store, keys


def _policies(source: Path, into: Path, **model: object) -> Path:
    """``source``'s policies (bench.gateway's: cache off, no tenants) with the model's policy
    changed by ``model`` and no inference-log sampling."""
    import yaml

    from bench.gateway import _bench_policies

    folder = _bench_policies(source, into)
    doc = yaml.safe_load((folder / "fleet.yaml").read_text())
    doc["models"][MODEL].update(model)
    doc["models"][MODEL]["inference_log"] = {"sample_rate": 0.0}
    (folder / "fleet.yaml").write_text(yaml.safe_dump(doc))
    return folder


def _endpoints(path: Path, url: str) -> Path:
    import yaml

    path.write_text(yaml.safe_dump({f"{MODEL}:1.0.0": [url]}))
    return path


def _stub(procs: Procs, delay_ms: float) -> str:
    from bench.gateway import _free_port, _wait

    port = _free_port()
    procs.start(
        f"stub-{port}",
        [sys.executable, str(ROOT / "tests" / "stub_model.py"), "--port", str(port), "--delay-ms", str(delay_ms)],
    )
    _wait(f"http://127.0.0.1:{port}/readyz")
    return f"http://127.0.0.1:{port}"


def _gateway(
    procs: Procs,
    name: str,
    store: Path,
    policies: Path,
    endpoints: Path,
    *,
    tree: Path | None = None,
    redis_url: str | None = None,
    workers: int = 1,
) -> tuple[str, subprocess.Popen[bytes]]:
    """``fleet gateway`` (this tree's, or ``tree``'s) on a free port; wait until it is ready
    (with workers: every worker's record under the store's ``gateways/``)."""
    from bench.gateway import _free_port, _wait

    port = _free_port()
    env = {
        **os.environ,
        "FLEET_STORE": f"file://{store}",
        "FLEET_RUNTIME": "static",
        "FLEET_STATIC_ENDPOINTS": str(endpoints),
        "FLEET_POLICIES": str(policies),
    }
    for var in ("FLEET_REDIS_URL", "FLEET_GATEWAY_WORKERS", "FLEET_ADMIN_TOKEN", "PYTHONPATH"):
        env.pop(var, None)
    if redis_url:
        env["FLEET_REDIS_URL"] = redis_url
    if tree is not None:
        env["PYTHONPATH"] = str(tree)
    cmd = [sys.executable, "-m", "fleet", "gateway", "--port", str(port)] + (
        ["--workers", str(workers)] if workers > 1 else []
    )
    proc = procs.start(f"gateway-{name}", cmd, env=env, cwd=tree or ROOT)
    url = f"http://127.0.0.1:{port}"
    _wait(f"{url}/v2/health/ready", timeout=90)
    if workers > 1:
        from fleet.catalog.gateway_directory import live
        from fleet.store import open_store

        deadline = time.monotonic() + 60
        while len(found := live(open_store(f"file://{store}"))) < workers:
            if time.monotonic() > deadline:
                raise RuntimeError(f"gateway {name}: {len(found)} of {workers} workers announced after 60 s")
            time.sleep(0.1)
        procs.worker_pids |= {r.pid for r in found}
    return url, proc


def _redis(procs: Procs, work: Path) -> tuple[str, subprocess.Popen[bytes]]:
    import redis

    from bench.gateway import _free_port

    port = _free_port()
    exe = shutil.which("redis-server")
    if exe is None:
        raise SystemExit("redis-server is not installed; install it with: apt-get install -y redis-server")
    proc = procs.start(
        "redis",
        [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", str(work)],
    )
    url = f"redis://127.0.0.1:{port}/0"
    client, deadline = redis.Redis.from_url(url, socket_timeout=1), time.monotonic() + 10
    while True:
        try:
            client.ping()
            return url, proc
        except redis.ConnectionError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"redis-server did not start; see {work / 'redis.log'}") from None
            time.sleep(0.02)


def _tenant_codes(url: str, tenant: str) -> dict[str, int]:
    """A tenant's answers by HTTP status, from the gateway's ``fleet_requests_total`` (all workers)."""
    import httpx

    codes: dict[str, int] = {}
    for labels, value in re.findall(
        r"^fleet_requests_total\{([^}]*)\} ([0-9.e+-]+)$",
        httpx.get(f"{url}/metrics", timeout=10, headers=SCRAPE).text,
        re.M,
    ):
        found = dict(re.findall(r'(\w+)="([^"]*)"', labels))
        if found.get("tenant") == tenant:
            codes[found["code"]] = codes.get(found["code"], 0) + int(float(value))
    return codes


# -- part 1 ---------------------------------------------------------------------------------
def _tenant_time(url: str, tenant: str) -> tuple[float, float]:
    """A tenant's (answers, seconds) in the gateway's ``fleet_request_duration_seconds``."""
    import httpx

    text = httpx.get(f"{url}/metrics", timeout=10, headers=SCRAPE).text
    out = []
    for part in ("count", "sum"):
        out.append(
            sum(
                float(v)
                for labels, v in re.findall(
                    rf"^fleet_request_duration_seconds_{part}\{{([^}}]*)\}} ([0-9.e+-]+)$", text, re.M
                )
                if f'tenant="{tenant}"' in labels
            )
        )
    return out[0], out[1]


def _clients(
    gateway: str, pid: int, keys: dict[str, str], tenant_b: str, seconds: float, work: Path, cell: str, flood: bool
) -> dict[str, dict]:
    """B's open loop (and A's flood) as processes of their own, started together; their
    reports, the gateway's CPU over the measured window and B's mean time in the gateway."""
    url = f"{gateway}/v2/models/{MODEL}/infer"
    start_at = time.time() + 1.0  # after both clients have started
    runs = {"B": ("open", keys["B"], str(STEADY_RPS))} | ({"A": ("open", keys["A"], str(FLOOD_RPS))} if flood else {})
    procs = {}
    for who, (kind, key, amount) in runs.items():
        out = work / f"client-{cell}-{who}.json"
        cmd = [
            sys.executable,
            __file__,
            "--client",
            kind,
            url,
            key,
            amount,
            "--start-at",
            repr(start_at),
            "--seconds",
            repr(seconds),
            "--out",
            str(out),
        ]
        procs[who] = (subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT), out)
    time.sleep(max(0.0, start_at + WARMUP_S - time.time()))
    cpu, b_time, box = _cpu_s(pid), _tenant_time(gateway, tenant_b), _box_ticks()
    time.sleep(max(0.0, start_at + WARMUP_S + seconds - time.time()))
    box_after = _box_ticks()
    window = {
        "gateway_cpu": (_cpu_s(pid) - cpu) / seconds,
        "box_busy": (box_after[0] - box[0]) / max(1, box_after[1] - box[1]),
    }
    b_after = _tenant_time(gateway, tenant_b)
    n = b_after[0] - b_time[0]
    window["b_in_gateway_ms"] = (b_after[1] - b_time[1]) / n * 1e3 if n else float("nan")
    results: dict[str, dict] = {"window": window}
    for who, (proc, out) in procs.items():
        try:
            text, _ = proc.communicate(timeout=seconds + 120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise
        if proc.returncode != 0:
            raise RuntimeError(f"client {who} of cell {cell} failed: {text.decode()[-2000:]}")
        results[who] = json.loads(out.read_text())
    return results


def part1(procs: Procs, work: Path, seconds: float, baseline_ref: str) -> dict:
    from bench.gateway import _baseline_store, _baseline_tree

    policy = {"concurrency": 8, "max_queue": 64, "timeout_ms": 5000}
    stub = _stub(procs, 20)
    endpoints = _endpoints(work / "endpoints-fair.yaml", stub)
    _, keys = _seed_store(work / "store-fair", {"flood-a": None, "steady-b": None})
    keys = {"A": keys["flood-a"], "B": keys["steady-b"]}
    policies = _policies(ROOT / "policies" / "fleet.yaml", work / "policies-fair", **policy)
    tree = _baseline_tree(baseline_ref, work / "baseline")
    # the baseline's tenants are written by its own code; bench-baseline is A, steady-b is B
    base_keys = {"A": _baseline_store(tree, work / "store-fair", work / "store-fair-baseline")}
    script = (
        "import sys; from fleet.store import open_store; from fleet.catalog.tenants import Tenants; "
        f"print(Tenants(open_store(sys.argv[1])).create('steady-b', {{'{MODEL}': ['*']}})[1])"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, f"file://{work / 'store-fair-baseline'}"],
        cwd=tree,
        check=True,
        env={**os.environ, "PYTHONPATH": str(tree)},
        capture_output=True,
        text=True,
    )
    base_keys["B"] = done.stdout.strip().splitlines()[-1]
    base_policies = _policies(tree / "policies" / "fleet.yaml", work / "policies-fair-baseline", **policy)
    now_url, now_proc = _gateway(procs, "fair", work / "store-fair", policies, endpoints)
    base_url, base_proc = _gateway(
        procs, "fair-baseline", work / "store-fair-baseline", base_policies, endpoints, tree=tree
    )
    cells = {}
    for cell, url, proc, cell_keys, flood in (
        ("alone", now_url, now_proc, keys, False),
        ("baseline", base_url, base_proc, base_keys, True),
        ("fair", now_url, now_proc, keys, True),
    ):
        cells[cell] = _clients(url, proc.pid, cell_keys, "steady-b", seconds, work, cell, flood)
        time.sleep(0.5)  # the queue drains before the next cell
    for p in (now_proc, base_proc):
        procs.stop(p)
    return cells


def report1(cells: dict, seconds: float, baseline_ref: str) -> None:
    print(
        f"1. fair queuing under a flood: stub replica 20 ms, concurrency 8, max_queue 64 (~400 req/s); "
        f"B open loop {STEADY_RPS:g} req/s, A open loop {FLOOD_RPS:g} req/s (10x its fair share); {seconds:g} s per cell after "
        f"{WARMUP_S:g} s warm-up"
    )
    print(
        f"{'cell':<28} | {'B sent/s':>8} {'B p50':>7} {'B p99':>7} {'B max':>7} {'B 5xx':>5} {'B 429':>5} {'B other':>7} {'B mean':>6} {'B gw':>6} | "
        f"{'A sent/s':>8} {'A 200/s':>7} {'A 503/s':>7} {'A other':>7} | {'gw CPU':>6} {'cli CPU A/B':>11} {'box busy':>8}"
    )
    names = {
        "alone": "(i) B alone, this tree",
        "baseline": f"(ii) A+B, {baseline_ref} (FIFO)",
        "fair": "(iii) A+B, this tree (fair)",
    }
    for cell, name in names.items():
        c = cells[cell]
        b, a = c["B"], c.get("A")
        bc = b["codes"]
        b5 = sum(n for code, n in bc.items() if code.startswith("5"))
        b429 = bc.get("429", 0)
        b_other = sum(n for code, n in bc.items() if code not in ("200", "429") and not code.startswith("5"))
        if a:
            ac = a["codes"]
            a_other = sum(n for code, n in ac.items() if code not in ("200", "503"))
            a_cols = f"{a['sent'] / seconds:>8.0f} {ac.get('200', 0) / seconds:>7.0f} {ac.get('503', 0) / seconds:>7.0f} {a_other:>7}"
            cli = f"{a['cpu'] * 100:>4.0f}%/{b['cpu'] * 100:.0f}%"
        else:
            a_cols = f"{'-':>8} {'-':>7} {'-':>7} {'-':>7}"
            cli = f"{'-':>4}/{b['cpu'] * 100:.0f}%"
        w = c["window"]
        print(
            f"{name:<28} | {b['sent'] / seconds:>8.1f} {b['p50_ms']:>7.1f} {b['p99_ms']:>7.1f} {b['max_ms']:>7.1f} {b5:>5} "
            f"{b429:>5} {b_other:>7} {b['mean_ms']:>6.1f} {w['b_in_gateway_ms']:>6.1f} | {a_cols} | {w['gateway_cpu'] * 100:>5.0f}% {cli:>11} {w['box_busy'] * 100:>7.0f}%"
        )
    alone, fair, base = (cells[c]["B"]["p99_ms"] for c in ("alone", "fair", "baseline"))
    ratio = fair / alone
    print(
        f"   B p99 with the flood, fair queuing: {fair:.1f} ms = {ratio:.2f}x B alone ({alone:.1f} ms); "
        f"target <= 1.5x: {'MET' if ratio <= 1.5 else 'NOT MET'} (baseline FIFO: {base:.1f} ms = {base / alone:.2f}x)"
    )
    lags = {c: cells[c]["B"]["max_send_lag_ms"] for c in names}
    print(
        "   B client's worst lag behind its schedule (ms): "
        + ", ".join(f"{c} {v:.1f}" for c, v in lags.items())
        + "; requests sent again after a kept connection was found closed (B/A): "
        + ", ".join(f"{c} {cells[c]['B']['stale']}/{cells[c]['A']['stale'] if 'A' in cells[c] else '-'}" for c in names)
    )
    print(
        "   B p50/p99/max: ms over its 200 answers, from when each was due; B mean, B gw: its mean ms at the client and in the gateway (the gateway's "
        "histogram; from when the gateway read it); A n/s: answers in the window / s; CPU: % of one core over the window; box busy: % of all the machine's cores busy then (anything running)"
    )


# -- part 2 ---------------------------------------------------------------------------------
def part2(procs: Procs, work: Path, seconds: float, redis_url: str, redis_proc: subprocess.Popen[bytes]) -> dict:
    import httpx

    from bench._wrk import load_for
    from bench.gateway import _cell, _counters
    from fleet.catalog.tenants import Quota

    stub = _stub(procs, 0)
    endpoints = _endpoints(work / "endpoints-quota.yaml", stub)
    policies = _policies(ROOT / "policies" / "fleet.yaml", work / "policies-open", concurrency=64, max_queue=256)
    gws, keys = {}, {}
    for name, url in (("in-process", None), ("redis", redis_url)):  # a store each: neither counts the other as a sharer
        store = work / f"store-quota-{name}"
        keys[name] = _seed_store(store, {"unbounded": Quota(rps=NEVER, burst=NEVER, concurrency=None)})[1]["unbounded"]
        gws[name] = _gateway(procs, f"quota-{name}", store, policies, endpoints, redis_url=url)
    health = {name: httpx.get(f"{url}/v2/health/ready", timeout=5).json() for name, (url, _) in gws.items()}
    headers = {name: {"Authorization": f"Bearer {key}"} for name, key in keys.items()}
    body = [json.dumps(BODY)]
    for name, (url, _) in gws.items():
        load_for(f"{url}/v2/models/{MODEL}/infer", body, concurrency=8, seconds=WARMUP_S, headers=headers[name])
    out: dict = {"health": health}
    for concurrency in (1, 16):
        for name, (url, proc) in gws.items():
            before, redis_cpu = _counters(url, proc.pid), _cpu_s(redis_proc.pid)
            result = load_for(
                f"{url}/v2/models/{MODEL}/infer", body, concurrency=concurrency, seconds=seconds, headers=headers[name]
            )
            cell = _cell(before, _counters(url, proc.pid))
            redis_ms = (_cpu_s(redis_proc.pid) - redis_cpu) / max(1, result.requests) * 1e3
            out[name, concurrency] = (result, cell, redis_ms)
    out["codes"] = {name: _tenant_codes(url, "unbounded") for name, (url, _) in gws.items()}
    for _, proc in gws.values():
        procs.stop(proc)
    return out


def report2(out: dict, seconds: float) -> None:
    print(f"2. the quota check's cost: stub replica 0 ms, a quota that never refuses, wrk for {seconds:g} s per cell")
    for name, h in out["health"].items():
        quota = h.get("quota", h.get("quotas"))
        print(f"   {name} gateway's health says quota: {json.dumps(quota) if quota is not None else '(not shown)'}")
    print(
        f"{'conc':>4} {'quotas':>10} | {'req/s':>7} {'p50':>6} {'p99':>6} {'err':>4} | {'gw CPU/req':>10} "
        f"{'redis CPU/req':>13} {'own ms':>7}"
    )
    for concurrency in (1, 16):
        for name in ("in-process", "redis"):
            r, cell, redis_ms = out[name, concurrency]
            own = f"{cell['total_ms'] - cell['upstream_ms']:>7.3f}" if cell else f"{'-':>7}"
            cpu = f"{cell['cpu_ms']:>7.3f} ms" if cell else f"{'-':>10}"
            print(
                f"{concurrency:>4} {name:>10} | {r.rps:>7.0f} {r.p50_ms:>6.2f} {r.p99_ms:>6.2f} {r.errors:>4} | {cpu} "
                f"{redis_ms if name == 'redis' else 0:>10.3f} ms {own}"
            )
        local, shared = out["in-process", concurrency][0], out["redis", concurrency][0]
        added = shared.p50_ms - local.p50_ms
        target = f"; target <= 0.5 ms: {'MET' if added <= 0.5 else 'NOT MET'}" if concurrency == 1 else ""
        print(
            f"   concurrency {concurrency}: Redis adds {added:+.3f} ms to p50, {shared.p99_ms - local.p99_ms:+.3f} ms to p99, "
            f"{shared.rps / local.rps:.2f}x the req/s{target}"
        )
    print(f"   answers by status: {out['codes']}")
    print(
        "   p50/p99 in ms (wrk); CPU/req: that process's CPU over the cell / answers; own ms: mean time in the gateway "
        "less the upstream call (its histograms)"
    )


# -- part 3 ---------------------------------------------------------------------------------
def part3(procs: Procs, work: Path, seconds: float, redis_url: str) -> dict:
    from bench._wrk import load_for
    from bench.gateway import ECHO, _free_port, _nginx, _wait
    from fleet.catalog.tenants import Quota

    echo_port = _free_port()
    echo_proc, _ = _nginx(
        work,
        "echo",
        f"""server {{ listen 127.0.0.1:{echo_port};
            location / {{ default_type application/json; return 200 '{ECHO}'; }} }}""",
    )
    procs.procs.append(echo_proc)
    echo = f"http://127.0.0.1:{echo_port}"
    _wait(f"{echo}/")
    endpoints = _endpoints(work / "endpoints-echo.yaml", echo)
    policies = _policies(ROOT / "policies" / "fleet.yaml", work / "policies-echo", concurrency=64, max_queue=256)
    tenants = {
        "unbounded": Quota(rps=NEVER, burst=NEVER, concurrency=None),
        "exact": Quota(rps=EXACT_RPS, burst=EXACT_BURST, concurrency=None),
    }
    body = [json.dumps(BODY)]
    out: dict = {}
    for workers in (1, 2):
        store = work / f"store-workers-{workers}"
        _, keys = _seed_store(store, tenants)
        url, proc = _gateway(
            procs, f"workers-{workers}", store, policies, endpoints, redis_url=redis_url, workers=workers
        )
        infer = f"{url}/v2/models/{MODEL}/infer"
        unbounded = {"Authorization": f"Bearer {keys['unbounded']}"}
        load_for(infer, body, concurrency=32, seconds=WARMUP_S, headers=unbounded)
        out[workers] = load_for(infer, body, concurrency=32, seconds=seconds, headers=unbounded)
        out["codes", workers] = _tenant_codes(url, "unbounded")
        if workers == 2:
            before = _tenant_codes(url, "exact")
            result = load_for(
                infer, body, concurrency=32, seconds=seconds, headers={"Authorization": f"Bearer {keys['exact']}"}
            )
            time.sleep(0.3)  # the last answers are counted
            after = _tenant_codes(url, "exact")
            out["exact"] = (result, {code: after.get(code, 0) - before.get(code, 0) for code in after})
        procs.stop(proc)
    return out


def report3(out: dict, seconds: float) -> None:
    print(
        f"3. workers: nginx echo as the replica, both gateways with FLEET_REDIS_URL, wrk at concurrency 32 for {seconds:g} s"
    )
    for workers in (1, 2):
        r = out[workers]
        print(
            f"   --workers {workers}: {r.rps:>7.0f} req/s, p50 {r.p50_ms:.2f} ms, p99 {r.p99_ms:.2f} ms, errors {r.errors}; "
            f"answers by status {out['codes', workers]}"
        )
    ratio = out[2].rps / out[1].rps
    print(f"   2 workers / 1: {ratio:.2f}x the throughput; target >= 1.7x: {'MET' if ratio >= 1.7 else 'NOT MET'}")
    result, codes = out["exact"]
    admitted, refused = codes.get("200", 0), codes.get("429", 0)
    others = {c: n for c, n in codes.items() if c not in ("200", "429") and n}
    quota = EXACT_RPS * result.seconds + EXACT_BURST
    print(
        f"   quota rps={EXACT_RPS:g} burst={EXACT_BURST}, --workers 2, wrk at concurrency 32 for {result.seconds:.2f} s: "
        f"{admitted} admitted (200), {refused} refused (429){f', other {others}' if others else ''}; "
        f"wrk saw {result.requests} answers, {result.non_2xx} non-2xx"
    )
    print(
        f"   admitted / (rps x {result.seconds:.2f} s + burst) = {admitted} / {quota:.0f} = {admitted / quota:.3f}; "
        f"target within 5 %: {'MET' if abs(admitted / quota - 1) <= 0.05 else 'NOT MET'}"
    )


def _log_findings(work: Path) -> None:
    """Tracebacks and errors in the servers' logs, for the reader to look at."""
    for log in sorted(work.glob("*.log")):
        text = log.read_text(errors="replace")
        hits = [ln for ln in text.splitlines() if re.search(r"Traceback|ERROR|Error:|exited with", ln)]
        if hits:
            print(f"   {log.name}: {len(hits)} suspicious lines, first: {hits[0][:200]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=10.0, help="measured seconds per cell (after 1 s of warm-up)")
    parser.add_argument("--baseline", default="f926d6f", help="the git ref before fair queuing, for cell (ii)")
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--parts", default="123", help="which parts to run (default all: 123)")
    parser.add_argument("--client", nargs=4, metavar=("KIND", "URL", "KEY", "AMOUNT"), help=argparse.SUPPRESS)
    parser.add_argument("--start-at", type=float, default=0.0, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.client:
        _client_main(args)
        return
    for tool in ("wrk", "redis-server", "nginx"):
        if shutil.which(tool) is None and not Path(f"/usr/sbin/{tool}").exists():
            raise SystemExit(f"{tool} is not installed (apt-get install -y wrk redis-server nginx-light)")
    work = args.workdir or Path(tempfile.mkdtemp(prefix="fleet-bench-fair-"))
    work.mkdir(parents=True, exist_ok=True)
    procs = Procs(work)
    started = time.monotonic()
    load_before = Path("/proc/loadavg").read_text().split()[0]
    try:
        fair = part1(procs, work, args.seconds, args.baseline) if "1" in args.parts else None
        if "2" in args.parts or "3" in args.parts:
            redis_url, redis_proc = _redis(procs, work)
        quota = part2(procs, work, args.seconds, redis_url, redis_proc) if "2" in args.parts else None
        workers = part3(procs, work, args.seconds, redis_url) if "3" in args.parts else None
    finally:
        procs.stop_all()
    print(
        f"{os.cpu_count()} cores shared by the clients, gateways, stubs, nginx and Redis (and whatever else runs: load "
        f"average {load_before} before this run); work folder {work}; {time.monotonic() - started:.0f} s in all"
    )
    for part, report in ((fair, report1), (quota, report2), (workers, report3)):
        if part is not None:
            print()
            report(part, args.seconds, *((args.baseline,) if report is report1 else ()))
    print()
    print("server logs:")
    _log_findings(work)


if __name__ == "__main__":
    main()
