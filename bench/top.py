"""What ``fleet top`` costs the gateway it watches: CPU at one refresh a second.

    .venv/bin/python bench/top.py [--seconds 30] [--rps 50] [--models 20] [--tenants 200]

1. End to end. A ``fleet gateway`` process in front of one stub replica
   (``tests/stub_model.py``) serving ``--models`` models of two versions each (stable and a
   30 % canary), ``--tenants`` tenants; a client process (this script, ``--client``) sends
   ``--rps`` requests a second, open loop (at most 32 in flight: a client that falls behind
   skips rather than piles up), to random models as random tenants. The gateway's
   CPU seconds (user + system, its process and its children, from /proc via psutil) are
   taken over ``--seconds`` in five cells: no viewer, one live ``fleet top`` (a real one, in
   a pseudo-terminal, refreshing every second; a cell starts once every viewer has drawn
   twice), none, ``--viewers`` of them, none. Reported per cell: CPU % of one core, the
   requests a second the gateway answered (its ``fleet_requests_total``) and CPU ms per
   request; and the spread between the cells with no viewer, the noise floor a viewer's
   cost has to rise above.

2. At fleet size, in process. A gateway's ``Telemetry`` holding 500 models × 2 versions
   with traffic in every second of the window and 10,000 tenants (two status codes each);
   ``TopStats`` answers ``--repeat`` times with the cache out of the way, its counters read
   each time (as every ``COUNTERS_S``) and reused (as in between). Reported: CPU ms per
   answer and the event loop's part of it, the answer's size, and what parsing and merging
   40 such answers (40 gateways) costs the viewer (``fleet.cli.top_merge.merge``).

The figures depend on the machine (printed: cores, load); the client and the viewers share
the cores with the gateway, so cell 1 measures the gateway's own CPU time, not wall time.
Every process started here is stopped by PID at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import pty
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402
import orjson  # noqa: E402
import psutil  # noqa: E402
import yaml  # noqa: E402

MAX_IN_FLIGHT = 32  # the client's requests waiting for answers at most
BODY = {"inputs": [{"name": "features", "shape": [1, 4], "datatype": "FP32", "data": [1.0, 0.0, 0.0, 0.0]}]}


# -- 1. end to end ----------------------------------------------------------------------------


def client(url: str, keys: list[str], models: list[str], rps: float, seconds: float) -> None:
    """An open loop of ``rps`` requests a second for ``seconds``: each on its own task."""

    async def run() -> None:
        sent, failed = 0, 0
        async with httpx.AsyncClient(base_url=url, timeout=10, limits=httpx.Limits(max_connections=64)) as c:

            async def one() -> None:
                nonlocal failed
                key, model = random.choice(keys), random.choice(models)
                try:
                    r = await c.post(f"/v2/models/{model}/infer", json=BODY, headers={"Authorization": f"Bearer {key}"})
                    failed += r.status_code != 200
                except httpx.HTTPError:
                    failed += 1

            start, tasks, skipped = time.monotonic(), set(), 0
            while (now := time.monotonic()) - start < seconds:
                due = start + (sent + skipped) / rps
                if due > now:
                    await asyncio.sleep(due - now)
                if len(tasks) >= MAX_IN_FLIGHT:  # behind (a busy machine): skip, never pile up
                    skipped += 1
                    continue
                task = asyncio.create_task(one())
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                sent += 1
            await asyncio.gather(*tasks)
        print(f"client: {sent} sent, {failed} not 200, {skipped} skipped", file=sys.stderr)

    asyncio.run(run())


def cpu_seconds(proc: psutil.Process) -> float:
    total = 0.0
    for p in [proc, *proc.children(recursive=True)]:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


class Viewer:
    """A live ``fleet top`` in a pseudo-terminal (80x24), its screen read and dropped."""

    def __init__(self, env: dict[str, str], cwd: Path) -> None:
        master, slave = pty.openpty()
        os.set_blocking(master, True)
        env = {**env, "TERM": "xterm-256color", "COLUMNS": "80", "LINES": "24"}
        self.proc = subprocess.Popen(
            [str(Path(sys.executable).with_name("fleet")), "top", "--interval", "1"],
            stdin=slave,
            stdout=slave,
            stderr=slave,
            env=env,
            cwd=cwd,
            start_new_session=True,
        )
        os.close(slave)
        self.master, self.bytes = master, 0
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self) -> None:
        while True:
            try:
                data = os.read(self.master, 65536)
            except OSError:
                return
            if not data:
                return
            self.bytes += len(data)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        os.close(self.master)


def serving(e: object, n_models: int, n_tenants: int) -> tuple[list[str], list[str]]:
    """``n_models`` models of two versions (a 30 % canary) on one stub replica, ``n_tenants``
    tenants entitled to all: (models, keys)."""
    from fleet.catalog.registry import Registry, VersionMetadata
    from fleet.catalog.routes.store import Router
    from fleet.catalog.tenants import Tenants
    from tests.gateway_env import MODEL, model_policy

    models = [MODEL] + [f"bench-{i:03d}" for i in range(1, n_models)]
    policies = e.root / "policies" / "fleet.yaml"  # type: ignore[attr-defined]
    doc = yaml.safe_load(policies.read_text())
    doc["models"] = {m: model_policy() for m in models}
    policies.write_text(yaml.safe_dump(doc))
    e.register("1.0.0", "1.1.0")  # type: ignore[attr-defined]
    registry = Registry(e.store)  # type: ignore[attr-defined]
    stored = registry.get(MODEL, "1.0.0")
    meta = VersionMetadata(**stored.model_dump(include=set(VersionMetadata.model_fields)))
    replica = e.stub("1.0.0")  # type: ignore[attr-defined]
    router = Router(e.store)  # type: ignore[attr-defined]
    for m in models:
        for v in ("1.0.0", "1.1.0"):
            if m != MODEL:
                registry.register(m, v, e.root / "artifact", meta)  # type: ignore[attr-defined]
            e.endpoints[f"{m}:{v}"] = [replica]  # type: ignore[attr-defined]
        router.set(m, stable="1.0.0", why="bench")
        router.set(m, canary="1.1.0", weight=30, why="bench")
    e.write_endpoints()  # type: ignore[attr-defined]
    tenants = Tenants(e.store)  # type: ignore[attr-defined]
    keys = [tenants.create(f"t{i:04d}", {m: ["*"] for m in models}, None)[1] for i in range(n_tenants)]
    return models, keys


def end_to_end(args: argparse.Namespace, work: Path) -> list[tuple[str, float, float, float]]:
    from tests.gateway_env import GatewayEnv, metric

    e = GatewayEnv(work)
    viewers: list[Viewer] = []
    load: subprocess.Popen[bytes] | None = None
    try:
        models, keys = serving(e, args.models, args.tenants)
        url, gateway = e.gateway()
        keys_file = work / "keys.txt"
        keys_file.write_text("\n".join(keys))
        load = subprocess.Popen(  # until stopped at the end
            [sys.executable, __file__, "--client", url, str(keys_file), ",".join(models), str(args.rps), "1e9"]
        )
        proc = psutil.Process(gateway.pid)
        time.sleep(5)  # the load at its rate, the gateway warm
        cells = []

        def cell(name: str, n_viewers: int) -> None:
            while len(viewers) < n_viewers:
                viewers.append(Viewer(e.env(), e.root))
            while len(viewers) > n_viewers:
                viewers.pop().stop()
            for v in viewers:  # each one drawing, and drawn again since: refreshing
                seen = v.bytes
                deadline = time.monotonic() + 60
                while v.bytes <= seen or v.bytes < 2000:
                    assert time.monotonic() < deadline and v.proc.poll() is None, "a viewer did not start"
                    time.sleep(0.2)
            time.sleep(1)
            n0, c0, t0 = metric(url, "fleet_requests_total"), cpu_seconds(proc), time.monotonic()
            drawn = [v.bytes for v in viewers]
            time.sleep(args.seconds)
            n1, c1, t1 = metric(url, "fleet_requests_total"), cpu_seconds(proc), time.monotonic()
            alive = all(v.proc.poll() is None and v.bytes > b for v, b in zip(viewers, drawn, strict=True))
            assert alive, "a viewer stopped drawing"
            cells.append((name, 100 * (c1 - c0) / (t1 - t0), (n1 - n0) / (t1 - t0), 1000 * (c1 - c0) / max(n1 - n0, 1)))
            print(f"{name}: gateway {cells[-1][1]:.1f} % of a core at {cells[-1][2]:.0f} req/s", file=sys.stderr)

        cell("no viewer", 0)
        cell("1 fleet top", 1)
        cell("no viewer", 0)
        cell(f"{args.viewers} fleet top", args.viewers)
        cell("no viewer", 0)
        return cells
    finally:
        for v in viewers:
            v.stop()
        if load is not None and load.poll() is None:
            load.terminate()
            load.wait(timeout=10)
        e.stop()


# -- 2. at fleet size, in process -----------------------------------------------------------


def fleet_size(repeat: int, n_models: int = 500, n_tenants: int = 10_000) -> dict[str, float]:
    from fleet.cli.top_merge import Gateway, merge
    from fleet.gateway.telemetry import Telemetry
    from fleet.gateway.top import TopStats

    clock = [1_000_000.0]
    telemetry = Telemetry(lambda: iter(()))
    telemetry.stats._clock = lambda: clock[0]
    models = [f"model-{i:03d}" for i in range(n_models)]
    for second in range(10):
        clock[0] = 1_000_000.0 + second
        for m in models:
            for v in ("1.0.0", "1.1.0"):
                for ms in (3.0, 8.0, 40.0):
                    telemetry.stats.answered(m, v, ms, None)
    for t in range(n_tenants):
        m = models[t % n_models]
        telemetry.finished(m, "1.0.0", f"tenant-{t:05d}", 200, 1.0)
        telemetry.finished(m, "none", f"tenant-{t:05d}", 429 if t % 7 == 0 else 200, 1.0)
    routes = {
        m: SimpleNamespace(
            revision=1,
            stable="1.0.0",
            canary=SimpleNamespace(version="1.1.0", weight=30.0),
            shadow=None,
            pins={},
            referenced_versions=lambda: {"1.0.0", "1.1.0"},
        )
        for m in models
    }
    endpoints = {(m, v): ("http://10.0.0.1:3000", "http://10.0.0.2:3000") for m in models for v in ("1.0.0", "1.1.0")}
    view = SimpleNamespace(snapshot=SimpleNamespace(routes=routes, endpoints=endpoints), stale=False)
    top = TopStats(view, telemetry, SimpleNamespace(pools=lambda: {}), "gw", clock=lambda: clock[0])  # type: ignore[arg-type]

    async def answers(read_counters: bool) -> tuple[float, dict]:
        answer: dict = {}
        p0 = time.process_time()  # the whole process: the loop and the thread the sums run in
        for _ in range(repeat):
            top._cache.clear()
            if read_counters:
                top._read_at = -float("inf")  # as if the last reading were COUNTERS_S old
            answer = await top.answer(10, 20)
        return (time.process_time() - p0) / repeat, answer

    read_s, answer = asyncio.run(answers(True))
    reused_s, _ = asyncio.run(answers(False))
    p0 = time.process_time()  # the loop's own part: the copies made before the thread is handed the work
    for _ in range(repeat):
        _ = (
            [kv for kv in telemetry.stats._series.items()],
            list(telemetry._finished),
            list(telemetry._finished.values()),
        )
    loop_s = (time.process_time() - p0) / repeat
    raw = orjson.dumps(answer)
    parsed = orjson.loads(raw)
    p0 = time.process_time()
    answers40 = [(Gateway(f"gw-{i}", ""), orjson.loads(raw)) for i in range(40)]
    parse_s = time.process_time() - p0
    merge(answers40, at=0.0, window_s=10)
    merge_s = time.process_time() - p0 - parse_s
    assert len(parsed["models"]) == n_models
    return {
        "gateway: CPU ms per answer, counters read (at most every 2 s)": 1000 * read_s,
        "gateway: CPU ms per answer, counters reused": 1000 * reused_s,
        "gateway: of which on the event loop (copies), ms": 1000 * loop_s,
        "gateway: CPU % of a core at 1 refresh/s (any number of viewers)": 100 * (read_s + reused_s) / 2,
        "answer size, KiB": len(raw) / 1024,
        "viewer: parse 40 answers, ms": 1000 * parse_s,
        "viewer: merge 40 answers, ms": 1000 * merge_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--rps", type=float, default=50.0)
    parser.add_argument("--models", type=int, default=20)
    parser.add_argument("--tenants", type=int, default=200)
    parser.add_argument("--viewers", type=int, default=10)
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--client", nargs=5, metavar=("URL", "KEYS", "MODELS", "RPS", "SECONDS"))
    args = parser.parse_args()
    if args.client:
        url, keys, models, rps, seconds = args.client
        client(url, Path(keys).read_text().split(), models.split(","), float(rps), float(seconds))
        return
    from tests.gateway_env import METRICS_TOKEN

    os.environ["FLEET_METRICS_TOKEN"] = METRICS_TOKEN  # the token tests.gateway_env scrapes with
    print(f"{os.cpu_count()} cores, load {os.getloadavg()[0]:.2f}", file=sys.stderr)
    sizes = {
        "500 × 10,000": fleet_size(args.repeat),
        f"{args.models} × {args.tenants}": fleet_size(args.repeat, args.models, args.tenants),
    }
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        cells = end_to_end(args, Path(tmp))
    idle = [c for c in cells if c[0] == "no viewer"]
    print(
        f"\n## fleet top: the gateway's CPU, about {args.rps:g} req/s over {args.models} models × 2 versions, "
        f"{args.tenants} tenants, {args.seconds:g} s a cell ({os.cpu_count()} cores, load {os.getloadavg()[0]:.1f})\n"
    )
    print("| cell | gateway CPU, % of a core | req/s | CPU ms per request |")
    print("|---|---|---|---|")
    for name, pct, rate, per_request in cells:
        print(f"| {name} | {pct:.1f} | {rate:.0f} | {per_request:.3f} |")
    mean = sum(c[1] for c in idle) / len(idle)
    spread = max(c[1] for c in idle) - min(c[1] for c in idle)
    print(f"\nno viewer: {mean:.1f} % on average, {spread:.1f} points between its cells (the noise floor)")
    print("\n## one /admin/top answer, in process: models (× 2 versions) × tenants\n")
    names = list(sizes)
    print(f"| measure | {' | '.join(names)} |")
    print("|---" * (len(names) + 1) + "|")
    for measure in sizes[names[0]]:
        print(f"| {measure} | {' | '.join(f'{sizes[n][measure]:.1f}' for n in names)} |")


if __name__ == "__main__":
    main()
