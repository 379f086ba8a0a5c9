"""The control plane at fleet size: what a gateway's view of routes and tenants costs in store
requests, start-up time and propagation, beside the gateway before the change journal.

For each tenants × models cell a store is filled (routes and manifests of ``models`` models,
``tenants`` tenants), then served through a store that sleeps ``--latency-ms`` per request
(S3 in-region is ~10-30 ms for a small GET) and counts requests as S3 bills them (a listing:
one request per 1,000 keys). Measured, for this commit's ``FleetView`` and for the reference
(``FleetView`` as of ``--reference``, loaded from git into this process):

- requests per steady poll (nothing changed) and cold start (first poll, ready to serve);
- propagation of a route change (write → the view's snapshot has it), p50/p99 over
  ``--changes`` changes at random moments, with the poll only, with an admin push, and with
  the change bus (a real redis-server when one is on PATH);
- projected S3 requests and USD a month, per gateway process and for 40 (20 pods × 2).

The reference's figures at large cells are projected from its measured request counts (its
poll takes minutes there); those cells are marked ``~``.

    .venv/bin/python bench/scale.py [--latency-ms 10] [--tenants 10,1000,10000] [--models 5,500]
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fleet import audit, changes, records  # noqa: E402
from fleet.catalog.registry import Registry  # noqa: E402
from fleet.catalog.routes.table import Canary, RouteTable  # noqa: E402
from fleet.catalog.tenants import Tenants  # noqa: E402
from fleet.gateway import sync as sync_module  # noqa: E402
from fleet.gateway.view import POLL_S, FleetView  # noqa: E402
from fleet.store import MemoryStore  # noqa: E402
from fleet.types import Deployment  # noqa: E402

GET_USD, LIST_PUT_USD = 0.0004 / 1000, 0.005 / 1000  # S3 Standard, us-east-1
MONTH_S = 30 * 86400
REFERENCE = "6774c4d"  # the gateway before the change journal (issue 29)


class Slow:
    """The store, sleeping ``latency_s`` per request and counting requests as S3 bills them."""

    def __init__(self, store: MemoryStore, latency_s: float) -> None:
        self.store, self.url, self.latency_s = store, store.url, latency_s
        self.counts = {"GET": 0, "LIST": 0, "PUT": 0}
        self._lock = threading.Lock()

    def _pay(self, kind: str, n: int = 1) -> None:
        with self._lock:
            self.counts[kind] += n
        if self.latency_s:
            time.sleep(self.latency_s * n)

    def get(self, key: str):  # noqa: ANN201
        self._pay("GET")
        return self.store.get(key)

    def get_if_changed(self, key: str, etag: str | None):  # noqa: ANN201
        self._pay("GET")
        return self.store.get_if_changed(key, etag)

    def put(self, key: str, data: bytes, **kw: Any) -> str:
        self._pay("PUT")
        return self.store.put(key, data, **kw)

    def list(self, prefix: str = ""):  # noqa: ANN201
        keys = list(self.store.list(prefix))
        self._pay("LIST", max(1, -(-len(keys) // 1000)))
        return iter(keys)

    def scan(self, prefix: str = ""):  # noqa: ANN201
        found = list(self.store.scan(prefix))
        self._pay("LIST", max(1, -(-len(found) // 1000)))
        return iter(found)

    def delete(self, key: str) -> None:
        self._pay("PUT")
        self.store.delete(key)

    def reset(self) -> dict[str, int]:
        with self._lock:
            counts, self.counts = self.counts, {"GET": 0, "LIST": 0, "PUT": 0}
        return counts


class _Runtime:
    kind, budgets_memory, packages_here = "bench", False, False

    def __init__(self, models: int) -> None:
        self.deployments = [Deployment(f"m{i}", "1.0.0", ("http://127.0.0.1:9",)) for i in range(models)]

    def list(self) -> list[Deployment]:
        return self.deployments


def fill(tenants: int, models: int) -> MemoryStore:
    store = MemoryStore()
    art = Path(tempfile.mkdtemp(prefix="fleet-scale-"))
    (art / "w").write_text("w")
    from tests.test_registry import META  # the same version metadata the tests register

    reg = Registry(store)
    now = audit.now()
    for i in range(models):
        for v in ("1.0.0", "1.1.0"):
            reg.register(f"m{i}", v, art, META)
        table = RouteTable(model=f"m{i}", stable="1.0.0", canary=Canary(version="1.1.0", weight=1))
        store.put(f"routes/m{i}.json", records.dump(table))
    shutil.rmtree(art)
    proto, _ = Tenants(MemoryStore()).create("proto", {"*": ["*"]})
    for i in range(tenants):
        t = proto.model_copy(update={"name": f"t{i}", "created_at": now})
        store.put(f"tenants/t{i}.json", records.dump(t))
    changes.note(store, "tenants/t0.json", store.get("tenants/t0.json").etag)  # the journal exists
    return store


def reference_module(rev: str, path: str, name: str, swap: dict[str, str] | None = None) -> Any:
    """The module at ``path`` as of ``rev``, loaded from git beside this commit's (None without
    git); ``swap`` rewrites its imports (to load a reference module's own references)."""
    root = Path(__file__).resolve().parents[1]
    try:
        source = subprocess.run(
            ["git", "show", f"{rev}:{path}"], cwd=root, capture_output=True, check=True, text=True
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    for old, new in (swap or {}).items():
        source = source.replace(old, new)
    spec = importlib.util.spec_from_loader(name, loader=None)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    sys.modules[name] = module  # dataclasses look their module up
    exec(compile(source, f"{rev}:{path}", "exec"), module.__dict__)  # noqa: S102
    return module


def reference_view(rev: str) -> type | None:
    module = reference_module(rev, "fleet/gateway/view.py", "reference_view")
    return None if module is None else module.FleetView


def _held(build: Any) -> tuple[Any, int]:
    """What ``build()`` returns and the bytes it allocated and still holds (tracemalloc)."""
    import gc
    import tracemalloc

    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    made = build()
    gc.collect()
    held = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    return made, held


def telemetry_rows(tenants: int, versions: int, rev: str) -> list[str]:
    """/metrics bytes with ``tenants`` tenants served by one version (and the usage
    collector), and memory held by ``versions`` versions asked once each; this commit's
    telemetry beside the reference's, each with the ``*_created`` samples it had."""
    import prometheus_client

    from fleet.gateway import telemetry as this_telemetry
    from fleet.usage import meter as this_meter

    ref_stats = reference_module(rev, "fleet/gateway/stats.py", "reference_stats")
    ref_tel = reference_module(
        rev,
        "fleet/gateway/telemetry.py",
        "reference_telemetry",
        {"from fleet.gateway.stats import": "from reference_stats import"},
    )
    ref_meter = reference_module(rev, "fleet/usage/meter.py", "reference_meter")
    rows = []
    for label, tel_mod, meter_mod, created in (
        ("this", this_telemetry, this_meter, False),
        ("reference", ref_tel, ref_meter, True),
    ):
        if tel_mod is None or (label == "reference" and ref_stats is None):
            continue
        (prometheus_client.enable_created_metrics if created else prometheus_client.disable_created_metrics)()

        def serve(tel_mod=tel_mod, meter_mod=meter_mod):  # noqa: ANN001, ANN202
            t = tel_mod.Telemetry(lambda: iter(()))
            usage = meter_mod.UsageMeter(MemoryStore(), "gw-bench", lambda m: None)
            t.registry.register(usage.collector())
            for i in range(tenants):
                t.finished("demo", "1.0.0", f"tenant-{i:05d}", 200, 4.0)
                usage.served(f"tenant-{i:05d}", "demo", "1.0.0", 1, 0.004)
            return t

        t, held = _held(serve)
        size = len(t.exposition())

        def versions_once(tel_mod=tel_mod):  # noqa: ANN001, ANN202
            t = tel_mod.Telemetry(lambda: iter(()))
            import numpy as np

            for v in range(versions):
                t.answered("demo", f"1.{v}.0", 3.0, np.array([0.5]))
            return t

        _, vheld = _held(versions_once)
        rows.append(
            f"| {label} | {size / 1e6:.2f} MB ({size / tenants:.0f} B per tenant) | {held / 2**20:.1f} MiB "
            f"| {vheld / 2**20:.1f} MiB ({vheld / versions / 1024:.0f} KiB per version) |"
        )
    prometheus_client.disable_created_metrics()
    return rows


def _change(store: MemoryStore, model: str, weight: float) -> None:
    records.update(
        store,
        f"routes/{model}.json",
        RouteTable,
        lambda t: t.model_copy(update={"canary": Canary(version="1.1.0", weight=weight)}),  # type: ignore[union-attr]
    )


def propagation(view: Any, slow: Slow, store: MemoryStore, models: int, n: int, how: str) -> list[float]:
    """Seconds from a route write (through the slow store) to the view's snapshot showing it."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    stop = asyncio.Event()

    async def serve() -> None:  # the gateway's loop: the view's refresher (and the bus subscription)
        tasks = [asyncio.create_task(view.run(lambda s: None))]
        if how == "bus":
            from fleet.gateway import bus

            tasks.append(asyncio.create_task(bus.subscribe(os.environ["FLEET_REDIS_URL"], view.nudge, view.on_bus)))
        await stop.wait()
        for task in tasks:
            task.cancel()
        _, stuck = await asyncio.wait(tasks, timeout=10)
        for task in stuck:
            print(f"  ({how}: {task.get_coro()} did not stop)", file=sys.stderr)

    served = asyncio.run_coroutine_threadsafe(serve(), loop)
    deadline = time.monotonic() + 10
    while how == "bus" and not view.bus_up and time.monotonic() < deadline:
        time.sleep(0.01)
    times = []
    rng = random.Random(7)
    for _ in range(n):
        time.sleep(rng.uniform(0, 0.3))
        model = f"m{rng.randrange(models)}"
        weight = float((view.snapshot.routes[model].canary.weight + 1) % 90 + 2)  # never the weight it has
        _change(slow, model, weight)  # type: ignore[arg-type]
        start = time.perf_counter()  # from the moment the writer's call returned
        if how == "push":
            loop.call_soon_threadsafe(view.wake)
        while view.snapshot.routes[model].canary.weight != weight:
            time.sleep(0.0005)
        times.append(time.perf_counter() - start)
    loop.call_soon_threadsafe(stop.set)
    try:
        served.result(timeout=30)
    except TimeoutError:
        print(f"  (the {how} run's tasks did not stop within 30 s)", file=sys.stderr)
    loop.call_soon_threadsafe(loop.stop)
    thread.join()
    loop.close()
    return times


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def usd_month(per_s: dict[str, float]) -> float:
    return MONTH_S * (per_s.get("GET", 0) * GET_USD + (per_s.get("LIST", 0) + per_s.get("PUT", 0)) * LIST_PUT_USD)


def cell(tenants: int, models: int, latency_s: float, n: int, ref: type | None, bus: bool) -> list[str]:
    store = fill(tenants, models)
    slow = Slow(store, latency_s)
    rows = []
    view = FleetView(slow, _Runtime(models))  # type: ignore[arg-type]
    slow.reset()
    start = time.perf_counter()
    view.refresh(True)
    cold_s, cold = time.perf_counter() - start, slow.reset()
    polls = 20
    start = time.perf_counter()
    for _ in range(polls):
        view.sync.poll()
    poll_s, steady = (time.perf_counter() - start) / polls, {k: v / polls for k, v in slow.reset().items()}
    prop = {how: propagation(view, slow, store, models, n, how) for how in ("poll", "push") + (("bus",) if bus else ())}
    # a gateway polls every POLL_S without the bus, BUS_POLL_S with it, and compares listings every RESYNC_S
    lists = (tenants // 1000 + 1) + (models // 1000 + 1)
    per_s = {"GET": 1 / max(POLL_S, poll_s), "LIST": lists / sync_module.RESYNC_S}
    per_s_bus = {"GET": 1 / 2.0, "LIST": lists / sync_module.RESYNC_S}
    fmt = " / ".join(f"{1e3 * _pct(prop[h], 0.5):.0f}/{1e3 * _pct(prop[h], 0.99):.0f}" for h in prop)
    rows.append(
        f"| {tenants:,} × {models} | this | {steady['GET']:.0f} GET + {steady['LIST']:.0f} LIST | "
        f"{cold['GET']:,} GET + {cold['LIST']} LIST, {cold_s:.2f} s | {fmt} | "
        f"{usd_month(per_s):.2f} ({usd_month(per_s_bus):.2f} with bus) | {40 * usd_month(per_s):,.0f} ({40 * usd_month(per_s_bus):,.0f}) |"
    )
    if ref is not None:
        old = ref(store, _Runtime(models))
        counting = Slow(store, 0.0)
        old.store = counting
        old.registry.store = counting
        old.refresh(True)
        cold_ref = counting.reset()
        old._poll()
        steady_ref = counting.reset()
        cost = latency_s * (steady_ref["GET"] + steady_ref["LIST"])
        projected = cost > 2.0
        if projected:
            poll_ref = cost  # measured counts × the latency: its poll would take this long
            prop_ref = f"~{1e3 * (POLL_S + poll_ref) / 2 + 1e3 * poll_ref:.0f}/~{1e3 * (POLL_S + 2 * poll_ref):.0f}"
        else:
            old.store = slow
            old.registry.store = slow
            times = propagation(old, slow, store, models, n, "poll")
            prop_ref = f"{1e3 * _pct(times, 0.5):.0f}/{1e3 * _pct(times, 0.99):.0f}"
            poll_ref = cost
        per_s_ref = {k: v / (POLL_S + poll_ref) for k, v in steady_ref.items()}
        mark = "~" if projected else ""
        rows.append(
            f"| | reference | {steady_ref['GET']:,} GET + {steady_ref['LIST']} LIST | "
            f"{cold_ref['GET']:,} GET + {cold_ref['LIST']} LIST, {mark}{latency_s * (cold_ref['GET'] + cold_ref['LIST']):.2f} s | "
            f"{prop_ref} (poll only) | {usd_month(per_s_ref):.2f} | {40 * usd_month(per_s_ref):,.0f} |"
        )
    return rows


def write_rows(latency_s: float, creates: int) -> list[str]:
    """What the journal costs a writer: tenants created by 1 and by 8 writers at once on the
    latency store, with the journal entry (this commit) and without (the reference: the
    record alone)."""
    import concurrent.futures

    rows = []
    for label, journal in (("this", True), ("reference", False)):
        for writers in (1, 8):
            slow = Slow(MemoryStore(), latency_s)
            tenants = Tenants(slow)  # type: ignore[arg-type]
            real = changes.note
            if not journal:
                changes.note = lambda store, key, etag: None  # type: ignore[assignment]
            try:
                start = time.perf_counter()
                with concurrent.futures.ThreadPoolExecutor(writers) as pool:
                    list(pool.map(lambda i: tenants.create(f"t{i}", {"*": ["*"]}), range(creates)))
                seconds = time.perf_counter() - start
            finally:
                changes.note = real  # type: ignore[assignment]
            counts = slow.reset()
            per = sum(counts.values()) / creates
            rows.append(
                f"| {label} | {writers} | {creates / seconds:.0f} creates/s ({creates:,} in {seconds:.1f} s) "
                f"| {per:.1f} ({counts['GET'] / creates:.1f} GET, {counts['PUT'] / creates:.1f} PUT) |"
            )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--latency-ms", type=float, default=10.0)
    parser.add_argument("--tenants", default="10,1000,10000")
    parser.add_argument("--models", default="5,500")
    parser.add_argument("--changes", type=int, default=40, help="route changes timed per cell and way")
    parser.add_argument("--reference", default=REFERENCE, help="git revision of the reference gateway")
    parser.add_argument("--metrics-tenants", type=int, default=10_000, help="tenants in the /metrics measurement")
    parser.add_argument("--versions", type=int, default=500, help="versions in the windowed-stats measurement")
    parser.add_argument("--creates", type=int, default=400, help="tenants created in the writers' measurement")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    ref = reference_view(args.reference)
    redis_proc = None
    if exe := shutil.which("redis-server"):
        from tests.serving_env import free_port

        port = free_port()
        redis_proc = subprocess.Popen(
            [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
            stdout=subprocess.DEVNULL,
        )
        os.environ["FLEET_REDIS_URL"] = f"redis://127.0.0.1:{port}/0"
        import redis

        for _ in range(200):
            try:
                redis.Redis.from_url(os.environ["FLEET_REDIS_URL"]).ping()
                break
            except redis.ConnectionError:
                time.sleep(0.02)
    print(f"/metrics and memory of one gateway process; reference: telemetry at {args.reference}")
    print(
        f"| gateway | /metrics, {args.metrics_tenants:,} tenants on one version | held by their series | {args.versions} versions asked once |"
    )
    print("|---|---|---|---|")
    for row in telemetry_rows(args.metrics_tenants, args.versions, args.reference):
        print(row, flush=True)
    print()
    print(f"tenant creates, store latency {args.latency_ms:g} ms per request (no bus)")
    print("| writer | writers at once | throughput | store requests per create |")
    print("|---|---|---|---|")
    bus_url = os.environ.pop("FLEET_REDIS_URL", None)  # the writers' cost in the store alone
    for row in write_rows(args.latency_ms / 1e3, args.creates):
        print(row, flush=True)
    if bus_url:
        os.environ["FLEET_REDIS_URL"] = bus_url
    print()
    print(f"store latency {args.latency_ms:g} ms per request; reference: FleetView at {args.reference}")
    ways = "poll / push" + (" / bus" if redis_proc else "")
    print(
        f"| tenants × models | gateway | steady poll | cold start | propagation p50/p99 ms ({ways}) "
        "| the view's S3 $/month, 1 process | 40 processes |"
    )
    print("|---|---|---|---|---|---|---|")
    try:
        for t in (int(x) for x in args.tenants.split(",")):
            for m in (int(x) for x in args.models.split(",")):
                for row in cell(t, m, args.latency_ms / 1e3, args.changes, ref, redis_proc is not None):
                    print(row, flush=True)
    finally:
        if redis_proc is not None:
            redis_proc.kill()
            redis_proc.wait()


if __name__ == "__main__":
    main()
