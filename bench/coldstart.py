"""Lazy loading: where a cold start's time goes, and the memory scale-to-zero saves.

Part 1, a cold start of the demo model (``demo-classifier``'s policy, ``loading: lazy``)
through a real gateway, ``--runs`` times: the version is stopped, then one request is sent
and timed until it is answered (held → answered). Each phase comes from the replica's log
(``bentos/phases.py``'s marks, one per process: BentoML's server imports the service, then
its worker imports it again and loads the model) and from the clock around the request:

  to server import   request sent → the server process begins importing the service
                     (the gateway's hold, the runtime's checks, the process start, bentoml's CLI)
  server imports     bentoml, torch, numpy, the service module (server process)
  server verify      the model files' SHA-256 check at import (server process)
  to worker import   the server starts its worker process
  worker imports     the same imports, in the worker
  worker verify      the check again in the worker (another process: its memo is empty)
  worker setup       BentoML's own work in the worker until the service's ``__init__``
  model load         the weights into torch (``__init__``)
  warm-up            one inference before ready (torch's first call)
  ready → answered   /readyz seen by the runtime, the gateway's pools re-read, the request served

Beside it, in the same run: a bare ``bentoml serve`` of the same Bento timed to its first
answer (what BentoML itself costs, no gateway, no hold), and a warm request through the
gateway (what the request costs once the version runs).

Part 2: ``--versions`` lazy versions of the model (one artifact registered under each
version), of which ``--hot`` get traffic (the stable and a tenant's pin): the resident
memory (proportional set size of every replica's processes) with lazy loading, against the
same versions all loaded eagerly.

    .venv/bin/python bench/coldstart.py [--runs 10] [--versions 10] [--hot 2] [--root DIR] [--json FILE]

With 10 runs, "p99" is the slowest run.

Targets (issue 17): cold start (request held → answered) at most 3 s p50 on this machine;
memory with lazy loading at most 40 % of eager.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench._scrape import SCRAPE  # noqa: E402
from bench.generation import Bench, bench_policies, claim_root  # noqa: E402

MODEL, SOURCE = "cold-clf", "demo-classifier"
BODY = {"inputs": [{"name": "features", "shape": [1, 4], "datatype": "FP32", "data": [1, 0, 0, 0]}]}
PHASES = (
    "to server import",
    "server imports",
    "server verify",
    "to worker import",
    "worker imports",
    "worker verify",
    "worker setup",
    "model load",
    "warm-up",
    "ready → answered",
)


class ColdBench(Bench):
    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.env["FLEET_ACTOR"] = "bench-coldstart"
        self.keys: dict[str, str] = {}

    def setup(self, versions: int) -> list[str]:
        def lazy(spec: dict) -> None:
            spec.update(
                loading="lazy", idle_unload_s=3600, max_hold_ms=60_000, timeout_ms=65_000, cache={"enabled": False}
            )

        bench_policies(self.policies, SOURCE, {MODEL: lazy})
        from fleet.catalog.registry import Registry, VersionMetadata
        from fleet.runtime.cache import ArtifactCache

        os.environ["FLEET_ACTOR"] = self.env["FLEET_ACTOR"]
        registry = Registry(self.store())
        names = [f"1.{i}.0" for i in range(versions)]
        if "1.0.0" not in registry.versions(MODEL):
            print(f"training {MODEL}:1.0.0 ...", flush=True)
            self.fleet("models", "train", MODEL, "1.0.0", "--rows", "5000", "--epochs", "5")
        mv = registry.get(MODEL, "1.0.0")
        meta = VersionMetadata(**{k: getattr(mv, k) for k in VersionMetadata.model_fields})
        artifact = ArtifactCache(self.root / "cache").path(registry, MODEL, "1.0.0")
        for version in names[1:]:
            if version not in registry.versions(MODEL):
                registry.register(MODEL, version, artifact, meta)
        for version in names:  # a cold start serves a built Bento: package them all first
            self.fleet("package", MODEL, version)
        self.fleet("route", "set", MODEL, "--stable", "1.0.0", "-r", "bench/coldstart.py")
        from fleet.catalog.tenants import Tenants

        known = {t.name for t in Tenants(self.store()).list()}
        for tenant in ("apps", "pinned"):
            verb = (
                ("tenants", "rotate", tenant, "--grace", "0")
                if tenant in known
                else ("tenants", "create", tenant, "--model", MODEL)
            )
            self.keys[tenant] = self.fleet_json(*verb)["api_key"]  # type: ignore[index]
        self.fleet("route", "pin", MODEL, "pinned", names[1], "-r", "bench/coldstart.py")
        return names

    def runtime(self):  # noqa: ANN201 - a LocalRuntime over this folder, serving built Bentos
        from fleet.runtime.local import LocalRuntime

        rt = LocalRuntime(self.root / "run", env={"BENTOML_HOME": self.env["BENTOML_HOME"]})
        rt.bento_for = rt.serve_tag
        return rt

    def refresh_gateway(self) -> None:
        """Tell the gateway the runtime changed, and wait until its pools list no replica of the model."""
        import httpx

        httpx.post(
            f"{self.gateway_url}/admin/refresh",
            headers={"Authorization": f"Bearer {self.env['FLEET_ADMIN_TOKEN']}"},
            timeout=10,
        ).raise_for_status()
        running = {d.version for d in self.runtime().list() if d.model == MODEL}
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            text = httpx.get(f"{self.gateway_url}/metrics", timeout=10, headers=SCRAPE).text
            listed = {v for v in _versions_in_flight(text) if v not in running}
            if not listed:
                return
            time.sleep(0.05)
        raise RuntimeError(f"the gateway still lists stopped replicas of {MODEL} after 30 s")

    def infer(self, tenant: str = "apps", timeout: float = 90) -> float:
        import httpx

        started = time.monotonic()
        resp = httpx.post(
            f"{self.gateway_url}/v2/models/{MODEL}/infer",
            json=BODY,
            timeout=timeout,
            headers={"Authorization": f"Bearer {self.keys[tenant]}"},
        )
        if resp.status_code != 200:
            raise RuntimeError(f"{MODEL} answered {resp.status_code}: {resp.text[:300]}")
        return time.monotonic() - started


def _versions_in_flight(exposition: str) -> set[str]:
    """Versions of MODEL the gateway has a pool for (its ``fleet_version_in_flight`` samples)."""
    from prometheus_client.parser import text_string_to_metric_families

    return {
        s.labels["version"]
        for f in text_string_to_metric_families(exposition)
        for s in f.samples
        if s.name == "fleet_version_in_flight" and s.labels.get("model") == MODEL
    }


def marks(log: Path, offset: int) -> list[tuple[int, str, float]]:
    """(pid, phase, unix time) of the phase lines written past ``offset``, in order."""
    out = []
    with open(log, "rb") as f:
        f.seek(offset)
        for line in f.read().decode(errors="replace").splitlines():
            parts = line.split()
            if len(parts) == 4 and parts[0] == "fleet-phase":
                out.append((int(parts[1]), parts[2], float(parts[3])))
    return out


def phases(sent: float, answered: float, seen: list[tuple[int, str, float]]) -> dict[str, float]:
    """Seconds per phase from one start's marks: the first pid is the server, the next the worker."""
    pids = list(dict.fromkeys(pid for pid, _, _ in seen))
    if len(pids) < 2:
        raise RuntimeError(f"expected the marks of a server and a worker, got {seen}")
    server = {p: t for pid, p, t in seen if pid == pids[0]}
    worker = {p: t for pid, p, t in seen if pid == pids[1]}
    points = [
        sent,
        server["import"],
        server["imported"],
        server["verified"],
        worker["import"],
        worker["imported"],
        worker["verified"],
        worker["worker"],
        worker["loaded"],
        worker["warm"],
        answered,
    ]
    return {name: b - a for name, a, b in zip(PHASES, points[:-1], points[1:], strict=True)}


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def bare_start(bench: ColdBench) -> float:
    """``bentoml serve`` of the Bento alone: spawn → first answer, no gateway, no hold."""
    import httpx

    rt = bench.runtime()
    started = time.monotonic()
    deployment, _ = rt.activate(MODEL, "1.0.0")
    httpx.post(f"{deployment.endpoints[0]}/predict", json={"features": [[1, 0, 0, 0]]}, timeout=30).raise_for_status()
    took = time.monotonic() - started
    rt.undeploy(MODEL, "1.0.0")
    return took


def cold_starts(bench: ColdBench, runs: int) -> dict:
    rt = bench.runtime()
    log = bench.root / "run" / MODEL / "1.0.0" / "replica-0.log"
    rows, bare, warm = [], [], []
    for i in range(runs):
        rt.undeploy(MODEL, "1.0.0")
        bench.refresh_gateway()
        offset = log.stat().st_size if log.exists() else 0
        sent_wall = time.time()
        took = bench.infer()
        answered_wall = sent_wall + took
        row = phases(sent_wall, answered_wall, marks(log, offset))
        row["total"] = took
        rows.append(row)
        warm.append(min(bench.infer() for _ in range(5)))
        print(
            f"  run {i + 1}/{runs}: held → answered {took:.2f} s ("
            + ", ".join(f"{k} {v:.2f}" for k, v in row.items() if k != "total")
            + ")",
            flush=True,
        )
    rt.undeploy(MODEL, "1.0.0")
    bench.refresh_gateway()
    for _ in range(min(runs, 5)):
        bare.append(bare_start(bench))
    keys = [*PHASES, "total"]
    return {
        "phases": {
            k: {"p50": statistics.median(r[k] for r in rows), "p99": pct([r[k] for r in rows], 0.99)} for k in keys
        },
        "bare_bentoml_serve_s": {"p50": statistics.median(bare), "p99": pct(bare, 0.99), "runs": len(bare)},
        "warm_request_ms": {"p50": statistics.median(warm) * 1e3, "p99": pct(warm, 0.99) * 1e3},
        "runs": runs,
    }


def memory(bench: ColdBench, names: list[str], hot: int) -> dict:
    rt = bench.runtime()
    rt.stop_all()
    bench.refresh_gateway()
    for _ in range(3):  # traffic to the stable (tenant apps) and to the pinned version: 2 versions start
        bench.infer("apps")
        if hot > 1:
            bench.infer("pinned")
    lazy_loaded = rt.loaded()
    lazy_mib = sum(x.memory_mib for x in lazy_loaded)
    print(f"  lazy: {len(lazy_loaded)} of {len(names)} versions loaded, {lazy_mib:.0f} MiB", flush=True)
    rt.stop_all()
    bench.refresh_gateway()
    for version in names:  # eager: every version runs
        rt.deploy(MODEL, version)
    eager_loaded = rt.loaded()
    eager_mib = sum(x.memory_mib for x in eager_loaded)
    print(f"  eager: {len(eager_loaded)} of {len(names)} versions loaded, {eager_mib:.0f} MiB", flush=True)
    rt.stop_all()
    return {
        "versions": len(names),
        "hot": hot,
        "lazy_loaded": len(lazy_loaded),
        "lazy_mib": round(lazy_mib, 1),
        "eager_loaded": len(eager_loaded),
        "eager_mib": round(eager_mib, 1),
        "per_replica_mib": round(eager_mib / max(1, len(eager_loaded)), 1),
        "ratio": round(lazy_mib / eager_mib, 3) if eager_mib else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--versions", type=int, default=10)
    parser.add_argument("--hot", type=int, default=2, choices=(1, 2))
    parser.add_argument("--root", type=Path, help="fleet folder to (re)use; default: a new temporary one")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    root, _lock = claim_root(args.root, "coldstart")
    bench = ColdBench(root)
    bench.stop_replicas()  # what an interrupted run on this folder left
    try:
        names = bench.setup(args.versions)
        bench.start_gateway()
        print(f"cold starts of {MODEL}:1.0.0 through the gateway, {args.runs} runs:", flush=True)
        cold = cold_starts(bench, args.runs)
        print(
            f"memory, {args.versions} lazy versions of which {args.hot} get traffic, against all loaded eagerly:",
            flush=True,
        )
        mem = memory(bench, names, args.hot)
    finally:
        bench.stop()
    print()
    print(f"{'phase':<22}{'p50 s':>9}{'p99 s':>9}")
    for name, row in cold["phases"].items():
        print(f"{name:<22}{row['p50']:>9.3f}{row['p99']:>9.3f}")
    bare, warm = cold["bare_bentoml_serve_s"], cold["warm_request_ms"]
    print(f"{'reference: bare bentoml serve → first answer':<46} p50 {bare['p50']:.2f} s  p99 {bare['p99']:.2f} s")
    print(f"{'reference: warm request through the gateway':<46} p50 {warm['p50']:.1f} ms  p99 {warm['p99']:.1f} ms")
    total = cold["phases"]["total"]["p50"]
    print(f"cold start held → answered p50 {total:.2f} s (target ≤ 3 s: {'met' if total <= 3 else 'NOT met'})")
    print(
        f"memory: lazy {mem['lazy_mib']:.0f} MiB ({mem['lazy_loaded']} loaded) vs eager {mem['eager_mib']:.0f} MiB "
        f"({mem['eager_loaded']} loaded): {mem['ratio'] * 100:.0f} % (target ≤ 40 %: "
        f"{'met' if mem['ratio'] <= 0.4 else 'NOT met'})"
    )
    if args.json:
        args.json.write_text(json.dumps({"cold": cold, "memory": mem}, indent=2))


if __name__ == "__main__":
    main()
