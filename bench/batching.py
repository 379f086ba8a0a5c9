"""Adaptive batching on vs off: the same tabular-mlp version, the same requests, one run.

Builds two Bentos of one version (batching as in the policy, and no batching), serves each
with ``bentoml serve`` on 127.0.0.1, and sends a fixed number of one-row requests at
concurrency 1, 16 and 64 straight to the service with wrk (Debian's package: a C load
generator in its own process, so the client does not steal the server's CPU). Prints throughput, p50 and p99 side by
side, plus the mean batch size BentoML reports, which shows where the time goes.

    .venv/bin/python bench/batching.py [--requests 2000] [--workdir /tmp/fleet-bench]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench._scrape import SCRAPE  # noqa: E402
from bench._wrk import Result, load  # noqa: E402


def _bodies() -> list[str]:
    """One-row requests with varied features (the batcher must not see identical rows)."""
    rows = [[(i % 7) / 3 - 1, (i % 5) / 2 - 1, (i % 3) - 1, (i % 11) / 5 - 1] for i in range(64)]
    return [json.dumps({"features": [row]}) for row in rows]


def _load(url: str, concurrency: int, total: int) -> Result:
    return load(f"{url}/predict", _bodies(), concurrency=concurrency, requests=total)


def _mean_batch(url: str) -> float | None:
    import httpx

    text = httpx.get(f"{url}/metrics", timeout=5, headers=SCRAPE).text
    sums = [float(v) for v in re.findall(r"bentoml_service_adaptive_batch_size_sum\{[^}]*\} ([0-9.e+]+)", text)]
    counts = [float(v) for v in re.findall(r"bentoml_service_adaptive_batch_size_count\{[^}]*\} ([0-9.e+]+)", text)]
    return sum(sums) / sum(counts) if counts and sum(counts) else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--max-latency-ms", type=int, help="override the policy's batching.max_latency_ms")
    parser.add_argument("--max-batch-size", type=int, help="override the policy's batching.max_batch_size")
    args = parser.parse_args()
    work = args.workdir or Path(tempfile.mkdtemp(prefix="fleet-bench-"))
    os.environ["BENTOML_HOME"] = str(work / "bentoml")
    os.environ["FLEET_STORE"] = f"file://{work / 'store'}"

    from bentos.tabular_mlp.train import TrainConfig, train_and_register
    from fleet.catalog.policies.loader import load_policies
    from fleet.catalog.registry import Registry
    from fleet.runtime.bento import package
    from fleet.runtime.cache import ArtifactCache
    from fleet.runtime.local import LocalRuntime
    from fleet.store import open_store

    store = open_store()
    model, version = "demo-classifier", "1.0.0"
    spec = load_policies(ROOT / "policies").model(model)
    overrides = {
        k: v for k, v in (("max_latency_ms", args.max_latency_ms), ("max_batch_size", args.max_batch_size)) if v
    }
    if overrides:
        spec = spec.model_copy(update={"batching": spec.batching.model_copy(update=overrides)})
    if not Registry(store).versions(model):
        train_and_register(store, model, version, TrainConfig(rows=5000, epochs=5))
    cache = ArtifactCache(work / "cache")
    tags = {
        "batching": package(Registry(store), model, version, spec, cache, force=True).bento,
        "no batching": package(Registry(store), model, version, spec, cache, batchable=False).bento,
    }
    print(
        f"policy: max_batch_size={spec.batching.max_batch_size} max_latency_ms={spec.batching.max_latency_ms} "
        f"slo p99={spec.slo.p99_ms:g} ms; {args.requests} one-row requests per cell; {os.cpu_count()} cores"
    )
    results: dict[tuple[str, int], tuple[float, float, float, int, float | None]] = {}
    for name, tag in tags.items():
        runtime = LocalRuntime(work / "run" / name.replace(" ", "-"), bento_for=lambda m, v, t=tag: t)
        deployment = runtime.deploy(model, version)
        url = deployment.endpoints[0]
        try:
            _load(url, 8, 200)  # warm up
            for concurrency in (1, 16, 64):
                r = _load(url, concurrency, args.requests)
                results[name, concurrency] = (r.rps, r.p50_ms, r.p99_ms, r.errors, _mean_batch(url))
        finally:
            runtime.undeploy(model, version)
    print(
        f"{'concurrency':>11} | {'batching: req/s':>15} {'p50 ms':>7} {'p99 ms':>7} {'errors':>6} {'mean batch':>10} | "
        f"{'no batching: req/s':>18} {'p50 ms':>7} {'p99 ms':>7} {'errors':>6} | {'speed-up':>8}"
    )
    for concurrency in (1, 16, 64):
        b, n = results["batching", concurrency], results["no batching", concurrency]
        mean_batch = f"{b[4]:.1f}" if b[4] else "-"
        print(
            f"{concurrency:>11} | {b[0]:>15.0f} {b[1]:>7.1f} {b[2]:>7.1f} {b[3]:>6} {mean_batch:>10} | "
            f"{n[0]:>18.0f} {n[1]:>7.1f} {n[2]:>7.1f} {n[3]:>6} | {b[0] / n[0]:>7.2f}x"
        )
    print("mean batch: cumulative over the run so far, from BentoML's adaptive_batch_size histogram")
    _model_time(cache.path(Registry(store), model, version), results["no batching", 1][1])


def _model_time(artifact: Path, http_p50_ms: float) -> None:
    """Where the time goes: the model's own compute next to one HTTP round trip."""
    import numpy as np

    from bentos.tabular_mlp.model import Predictor

    predictor = Predictor(artifact, device="cpu")
    for rows in (1, 32):
        x = np.random.default_rng(0).normal(size=(rows, 4)).astype(np.float32)
        for _ in range(50):
            predictor.predict_proba(x)
        start = time.perf_counter()
        for _ in range(500):
            predictor.predict_proba(x)
        ms = (time.perf_counter() - start) / 500 * 1e3
        print(
            f"model compute, {rows:>2} row(s): {ms:.3f} ms per call = {ms / http_p50_ms:.1%} of one "
            f"unbatched request's p50 ({http_p50_ms:.1f} ms)"
        )


if __name__ == "__main__":
    main()
