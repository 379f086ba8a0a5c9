"""A real fleet for the rollout flows: a stable Bento, a gateway, steady generated load.

Used by the end-to-end flow tests; every process is stopped by PID at the end.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import httpx
import numpy as np

from tests.serving_env import FleetEnv

MODEL = "demo-classifier"
# Small, fast steps for tests: every knob the policy has, scaled to seconds.
FAST = {
    "steps": [20, 50, 100],
    "analysis_window_s": 2,
    "min_samples": 40,
    "hold_deadline_s": 90,
    "rollback_window_s": 1,
    "shadow_percent": 0,
    "shadow_duration_s": 0,
    "gates": {"max_error_rate_increase": 0.03, "confidence": 0.95, "max_p99_ratio": 3.0, "max_prediction_psi": 0.2},
}


@dataclass
class Load:
    """Requests at a steady rate through the gateway, from a few threads; counts what callers saw.

    ``version``: ask for that version by name instead of letting the split choose. ``seed``
    offsets each thread's inputs, so two loads at once do not answer each other from the cache.
    ``model``: a generative model is asked for completions (``/v1/completions``, a
    ``reverse <word>>`` prompt, ``max_tokens`` of them) instead of tensors.
    """

    url: str
    key: str
    rps: float
    threads: int = 4
    version: str | None = None
    seed: int = 0
    model: str = MODEL
    generative: bool = False
    max_tokens: int = 6
    ok: int = 0
    failures: list[str] = field(default_factory=list)
    by_version: dict[str, int] = field(default_factory=dict)
    _stop: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _workers: list[threading.Thread] = field(default_factory=list)

    def start(self) -> Load:
        self._workers = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(self.threads)]
        for w in self._workers:
            w.start()
        return self

    def _run(self, worker: int) -> None:
        rng = np.random.default_rng(self.seed + worker)
        path = f"/v2/models/{self.model}" + (f"/versions/{self.version}" if self.version else "") + "/infer"
        if self.generative:
            path = "/v1/completions"
        with httpx.Client(base_url=self.url, timeout=30) as client:
            i = 0
            while not self._stop.is_set():
                started = time.monotonic()
                if self.generative:
                    word = "".join(rng.choice(list("abcdefghijklmnopqrstuvwxyz"), size=int(rng.integers(3, 5))))
                    body = {
                        "model": self.model + (f":{self.version}" if self.version else ""),
                        "prompt": f"reverse {word}>",
                        "max_tokens": self.max_tokens,
                    }
                else:
                    data = rng.normal(size=4).round(3).tolist()
                    body = {"inputs": [{"name": "features", "shape": [1, 4], "datatype": "FP32", "data": data}]}
                try:
                    r = client.post(
                        path,
                        json=body,
                        headers={"Authorization": f"Bearer {self.key}", "X-Fleet-Routing-Key": f"user-{worker}-{i}"},
                    )
                    outcome = None if r.status_code == 200 else f"{r.status_code} {r.text[:120]}"
                    version = r.headers.get("x-fleet-model-version", "none")
                except httpx.HTTPError as exc:
                    outcome, version = f"{type(exc).__name__}", "none"
                with self._lock:
                    if outcome is None:
                        self.ok += 1
                        self.by_version[version] = self.by_version.get(version, 0) + 1
                    else:
                        self.failures.append(outcome)
                i += 1
                pause = self.threads / self.rps - (time.monotonic() - started)
                if pause > 0:
                    self._stop.wait(pause)

    def stop(self) -> Load:
        self._stop.set()
        for w in self._workers:
            w.join(timeout=30)
        return self

    def report(self) -> str:
        return f"{self.ok + len(self.failures)} requests, {len(self.failures)} caller-visible failures, by version {self.by_version}"


class Watch(threading.Thread):
    """For the blue-green tests and bench/bluegreen.py: every 20 ms the route revision each
    gateway serves, every 0.25 s blue's ready replicas."""

    def __init__(self, fleet: dict, blue: str) -> None:
        super().__init__(daemon=True)
        self.urls, self.blue = fleet["urls"], blue
        from fleet.runtime.local import LocalRuntime

        self.runtime = LocalRuntime(fleet["env"].root / "run")
        self.revisions: dict[str, list[tuple[float, int]]] = {u: [] for u in self.urls}
        self.blue_ready: list[tuple[float, int]] = []
        self.stop = threading.Event()

    def run(self) -> None:
        headers = {"Authorization": "Bearer e2e-admin-token"}
        last_health = 0.0
        with httpx.Client(timeout=5, headers=headers) as client:
            while not self.stop.wait(0.02):
                for url in self.urls:
                    answer = client.get(f"{url}/admin/stats/{MODEL}", params={"window_s": 1})
                    self.revisions[url].append((time.time(), answer.json()["revision"]))
                if time.monotonic() - last_health >= 0.25:
                    last_health = time.monotonic()
                    health = self.runtime.health(MODEL, self.blue)
                    self.blue_ready.append((time.time(), sum(health.values())))

    def seen_at(self, url: str, revision: int) -> float:
        """When ``url`` first served ``revision`` or later."""
        return next(t for t, r in self.revisions[url] if r >= revision)


def rollout_watched(fleet: dict, version: str, policy: dict, rps: float = 60.0) -> tuple[object, list[Load], Watch]:
    """``canary_rollout`` of ``version`` with ``policy``, under ``rps`` of ``Load`` split over the
    fleet's gateways (``fleet["urls"]``) and a ``Watch`` of the stable: (the Prefect state,
    the loads, the watch)."""
    from fleet.catalog.routes.store import Router
    from flows.rollout import canary_rollout

    watch = Watch(fleet, Router(fleet["store"]).get(MODEL).stable)
    urls = fleet["urls"]
    loads = [Load(url, fleet["key"], rps=rps / len(urls), seed=100 * i) for i, url in enumerate(urls)]
    watch.start()
    for load in loads:
        load.start()
    try:
        state = canary_rollout(MODEL, version, **policy, return_state=True)
    finally:
        for load in loads:
            load.stop()
        watch.stop.set()
        watch.join(timeout=30)
    return state, loads, watch


def route_changes(fleet: dict) -> list[tuple[int, float, str]]:
    """(revision, written at, reason) of every route change, oldest first."""
    from fleet.catalog.routes.store import Router

    events = Router(fleet["store"]).history(MODEL)
    return [(e.after["revision"], e.at.timestamp(), e.why) for e in events if e.kind == "route" and e.after]


@contextlib.contextmanager
def environment(env: FleetEnv) -> Iterator[None]:
    """This process sees the fleet's environment (flows called in-process read it)."""
    keys = [k for k in env.env if k.startswith(("FLEET_", "BENTOML_", "AWS_", "PREFECT_"))]
    saved = {k: os.environ.get(k) for k in keys}
    os.environ.update({k: env.env[k] for k in keys})
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def serving_fleet(
    env: FleetEnv, model: str = MODEL, training: tuple[str, ...] = ("--rows", "20000", "--epochs", "15")
) -> Iterator[dict]:
    """Version 1.0.0 of ``model`` trained (with ``training``'s options), stable and served, a
    tenant, a gateway; this process in its environment."""
    from fleet.store import open_store

    try:
        env.fleet("models", "train", model, "1.0.0", *training)
        env.fleet("route", "set", model, "--stable", "1.0.0", "-r", "first")
        key = env.fleet_json("tenants", "create", "apps", "--model", model)["api_key"]
        env.fleet("deploy", model, "1.0.0")
        url = env.start_gateway()
        with environment(env):
            yield {"env": env, "url": url, "key": key, "store": open_store()}
    finally:
        env.stop()
