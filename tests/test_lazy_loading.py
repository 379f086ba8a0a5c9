"""Lazy loading on real processes: ``bentoml serve`` replicas started by the gateway for a
held request, stopped by ``fleet unload-idle``, and the memory budget's choice of what to stop.

One model trained here (``lazy-clf``, the demo family) registered as several versions with
the same weights, and an eager model beside it; every version a start needs is packaged
first (a cold start serves a built Bento, it never builds one). Every process is stopped by
PID at the end.
"""

from __future__ import annotations

import json
import math
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from fleet.catalog.registry import Registry, VersionMetadata
from fleet.runtime.local import LocalRuntime
from fleet.store import open_store
from tests.gateway_env import metric, wait_for
from tests.serving_env import ROOT, FleetEnv

LAZY, EAGER = "lazy-clf", "eager-clf"
BODY = {"inputs": [{"name": "features", "shape": [1, 4], "datatype": "FP32", "data": [1, 0, 0, 0]}]}
MAX_HOLD_MS = 30_000  # above a start on a busy machine: a held request is answered, not given up on
IDLE_S = 2


def write_policies(folder: Path, memory_gib: float = 1.0, budget_mib: float | None = None) -> Path:
    base = yaml.safe_load((ROOT / "policies" / "fleet.yaml").read_text())
    spec = dict(
        base["models"]["demo-classifier"],
        cache={"enabled": False},
        inference_log={"sample_rate": 0.0},
        timeout_ms=MAX_HOLD_MS + 5000,
    )
    lazy = dict(
        spec,
        loading="lazy",
        idle_unload_s=IDLE_S,
        max_hold_ms=MAX_HOLD_MS,
        resources=dict(spec["resources"], memory_gib=memory_gib),
    )
    doc = {"models": {LAZY: lazy, EAGER: spec}, "rollout": base["rollout"], "monitoring": base["monitoring"]}
    if budget_mib is not None:
        doc["runtime"] = {"memory_budget_mib": budget_mib}
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "fleet.yaml").write_text(yaml.safe_dump(doc))
    return folder


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    env = FleetEnv(tmp_path_factory.mktemp("lazy"))
    env.env["FLEET_POLICIES"] = str(write_policies(env.root / "policies"))
    try:
        env.fleet("models", "train", LAZY, "1.0.0", "--rows", "1000", "--epochs", "1")
        store = open_store(env.env["FLEET_STORE"])
        registry = Registry(store)
        first = registry.get(LAZY, "1.0.0")
        artifact = registry.fetch(LAZY, "1.0.0", env.root / "artifact")
        meta = VersionMetadata(**first.model_dump(include=set(VersionMetadata.model_fields)))
        for model, version in [(LAZY, "1.1.0"), (LAZY, "1.2.0"), (LAZY, "1.3.0"), (LAZY, "9.0.0"), (EAGER, "1.0.0")]:
            registry.register(model, version, artifact, meta)  # the same weights: versions differ only in name here
        for version in ("1.0.0", "1.1.0", "1.2.0", "1.3.0"):  # 9.0.0 is never packaged: it cannot start
            env.fleet("package", LAZY, version)
        env.fleet("route", "set", LAZY, "--stable", "1.0.0", "-r", "lazy stable")
        env.fleet("route", "set", EAGER, "--stable", "1.0.0", "-r", "eager stable")
        keys = {}
        for tenant in ("apps", "p2", "p3", "broken"):
            keys[tenant] = env.fleet_json("tenants", "create", tenant, "--model", LAZY, "--model", EAGER)["api_key"]
        for tenant, version in (("p2", "1.2.0"), ("p3", "1.3.0"), ("broken", "9.0.0")):
            env.fleet("route", "pin", LAZY, tenant, version, "-r", "test")
        env.fleet("deploy", EAGER, "1.0.0")
        yield {"env": env, "keys": keys, "url": env.start_gateway(), "runtime": LocalRuntime(env.root / "run")}
    finally:
        env.stop()


def infer(url: str, key: str, version: str | None = None, timeout: float = 60) -> httpx.Response:
    path = f"/v2/models/{LAZY}" + (f"/versions/{version}" if version else "") + "/infer"
    return httpx.post(url + path, json=BODY, headers={"Authorization": f"Bearer {key}"}, timeout=timeout)


def running(fleet: dict) -> set[str]:
    return {f"{d.model}:{d.version}" for d in fleet["runtime"].list()}


def unload_when_idle(fleet: dict, version: str) -> list[dict]:
    """Run ``fleet unload-idle`` until it stops ``version`` (idle once its gateway's last request is IDLE_S old)."""
    stopped: list[dict] = []

    def done() -> bool:
        stopped.extend(json.loads(fleet["env"].fleet("unload-idle", "--json")))
        return any(s["model"] == LAZY and s["version"] == version for s in stopped)

    wait_for(done, timeout=60, what=f"{LAZY}:{version} to be unloaded as idle")
    return stopped


def test_a_lazy_version_starts_on_its_first_request_and_is_unloaded_after_idle_then_started_again(fleet: dict) -> None:
    url, key = fleet["url"], fleet["keys"]["apps"]
    assert f"{LAZY}:1.0.0" not in running(fleet)  # routed, never started
    t0 = time.monotonic()
    first = infer(url, key)
    held_s = time.monotonic() - t0
    assert first.status_code == 200, first.text
    assert first.headers["X-Fleet-Model-Version"] == "1.0.0" and len(first.json()["outputs"][0]["data"]) == 2
    assert metric(url, "fleet_cold_starts_total", model=LAZY, version="1.0.0", outcome="started") == 1
    assert metric(url, "fleet_activation_hold_seconds_count", model=LAZY, version="1.0.0") == 1
    assert 0 < metric(url, "fleet_activation_hold_seconds_sum", model=LAZY, version="1.0.0") <= held_s
    assert metric(url, "fleet_requests_held", model=LAZY, version="1.0.0") == 0
    assert infer(url, key).status_code == 200  # warm now: not held
    assert metric(url, "fleet_activation_hold_seconds_count", model=LAZY, version="1.0.0") == 1
    # the replica the gateway started holds none of the gateway's secrets (it runs a team's model code)
    states = list((fleet["env"].root / "run" / LAZY / "1.0.0").glob("replica-*.json"))
    assert states
    for state in states:
        replica = json.loads(state.read_text())
        for pid in [replica["pid"], *replica["workers"]]:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            assert any(v.startswith(b"BENTOML_HOME=") for v in environ)  # its environment, read
            names = {v.split(b"=")[0] for v in environ}
            assert not names & {b"FLEET_ADMIN_TOKEN", b"FLEET_STORE", b"AWS_SECRET_ACCESS_KEY", b"AWS_SESSION_TOKEN"}
            assert not any(fleet["env"].env["FLEET_ADMIN_TOKEN"].encode() in v for v in environ)

    stopped = unload_when_idle(fleet, "1.0.0")
    assert all(s["model"] == LAZY for s in stopped)  # never the eager model's stable
    reason = next(s["reason"] for s in stopped if s["version"] == "1.0.0")
    assert reason.startswith("idle for") and f"idle_unload_s {IDLE_S}" in reason
    assert f"{LAZY}:1.0.0" not in running(fleet) and f"{EAGER}:1.0.0" in running(fleet)
    rows = {(r["model"], r["version"]): r for r in fleet["env"].fleet_json("status")}
    lazy, eager = rows[(LAZY, "1.0.0")], rows[(EAGER, "1.0.0")]
    assert (lazy["loading"], lazy["load_state"], eager["loading"], eager["load_state"]) == (
        "lazy",
        "unloaded",
        "eager",
        "loaded",
    )
    assert lazy["last_request_ago_s"] >= IDLE_S and rows[(LAZY, "1.3.0")]["last_request_at"] is None

    again = infer(url, key)
    assert again.status_code == 200, again.text
    assert metric(url, "fleet_cold_starts_total", model=LAZY, version="1.0.0", outcome="started") == 2
    assert metric(url, "fleet_activation_hold_seconds_count", model=LAZY, version="1.0.0") == 2


def test_twenty_concurrent_first_requests_start_the_version_once(fleet: dict) -> None:
    url, key = fleet["url"], fleet["keys"]["apps"]
    if f"{LAZY}:1.0.0" in running(fleet):
        infer(url, key)  # (the idle clock counts from a request this gateway made)
        unload_when_idle(fleet, "1.0.0")
    before = metric(url, "fleet_cold_starts_total", model=LAZY, version="1.0.0", outcome="started")
    held_before = metric(url, "fleet_activation_hold_seconds_count", model=LAZY, version="1.0.0")
    barrier = threading.Barrier(20)
    answers: list[int] = []

    def call() -> None:
        barrier.wait()
        answers.append(infer(url, key).status_code)

    threads = [threading.Thread(target=call) for _ in range(20)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert answers == [200] * 20
    assert metric(url, "fleet_cold_starts_total", model=LAZY, version="1.0.0", outcome="started") == before + 1
    assert metric(url, "fleet_activation_hold_seconds_count", model=LAZY, version="1.0.0") - held_before >= 1
    folder = fleet["env"].root / "run" / LAZY / "1.0.0"
    assert len(list(folder.glob("replica-*.json"))) == 1  # one replica: one start


def test_a_version_that_cannot_start_fails_its_held_requests_with_503_naming_the_cause(fleet: dict) -> None:
    url, key = fleet["url"], fleet["keys"]["broken"]
    t0 = time.monotonic()
    resp = infer(url, key)
    took = time.monotonic() - t0
    assert resp.status_code == 503, resp.text
    error = resp.json()["error"]
    assert f"{LAZY}:9.0.0 could not be started: its Bento is not built" in error
    log = (fleet["env"].root / "gateway.log").read_text()  # the operator's side: what to run
    assert f"Bento {LAZY}:9.0.0 is not built; expected `fleet package {LAZY} 9.0.0`" in log
    assert int(resp.headers["Retry-After"]) >= 1
    assert took < MAX_HOLD_MS / 1000  # the failure is said as soon as it is known, within the hold
    t0 = time.monotonic()
    again = infer(url, key)  # within the back-off: the same cause at once, no second start
    assert again.status_code == 503 and "could not be started" in again.json()["error"]
    assert time.monotonic() - t0 < 2.0
    assert metric(url, "fleet_cold_starts_total", model=LAZY, version="9.0.0", outcome="failed") == 1
    assert f"{LAZY}:9.0.0" not in running(fleet)


def test_the_memory_budget_stops_the_least_recently_used_idle_version_never_eager_or_canary(fleet: dict) -> None:
    env, runtime = fleet["env"], fleet["runtime"]
    for version in ("1.0.0", "1.2.0"):  # 1.0.0 turns ready first, 1.2.0 second
        env.fleet("deploy", LAZY, version)
    env.fleet("route", "set", LAZY, "--canary", "1.1.0", "--weight", "10", "-r", "mid-rollout")
    env.fleet("deploy", LAZY, "1.1.0")
    loaded = {f"{x.model}:{x.version}": x.memory_mib for x in runtime.loaded()}
    assert {f"{LAZY}:1.0.0", f"{LAZY}:1.1.0", f"{LAZY}:1.2.0", f"{EAGER}:1.0.0"} <= set(loaded)
    per_replica = max(loaded.values())
    used = sum(loaded.values())
    # room for what runs now and half a replica more: the next start must stop one version
    budget = used + per_replica / 2
    policies = write_policies(env.root / "policies-budget", memory_gib=math.ceil(per_replica) / 1024, budget_mib=budget)
    before, env.env["FLEET_POLICIES"] = env.env["FLEET_POLICIES"], str(policies)
    try:
        url = env.start_gateway()
    finally:
        env.env["FLEET_POLICIES"] = before
    keys = fleet["keys"]
    # 1.0.0 turned ready first but is asked now: 1.2.0 becomes the least recently used
    asked = time.time()
    assert infer(url, keys["apps"], "1.0.0").status_code == 200
    wait_for(lambda: (_last_request(env, "1.0.0") or 0) >= asked, timeout=30, what="this gateway's activity record")
    wait_for(
        lambda: _all_idle(env, policies), timeout=30, what=f"every lazy version idle past idle_unload_s ({IDLE_S} s)"
    )
    resp = infer(url, keys["p3"])  # pinned to 1.3.0, which runs nowhere
    assert resp.status_code == 200, resp.text
    assert resp.headers["X-Fleet-Model-Version"] == "1.3.0"
    now = running(fleet)
    assert f"{LAZY}:1.2.0" not in now  # the least recently used idle one
    assert {f"{LAZY}:1.0.0", f"{LAZY}:1.1.0", f"{LAZY}:1.3.0", f"{EAGER}:1.0.0"} <= now  # recent, canary, new, eager


def _all_idle(env: FleetEnv, policies: Path) -> bool:
    from fleet.catalog.policies.loader import load_policies
    from fleet.control.lazy import LoadController

    controller = LoadController(
        open_store(env.env["FLEET_STORE"]), load_policies(policies), LocalRuntime(env.root / "run")
    )
    return all(time.time() - c.last_used >= IDLE_S for c in controller.candidates() if c.model == LAZY)


def _last_request(env: FleetEnv, version: str) -> float | None:
    from fleet.logs.activity import last_requests

    return last_requests(open_store(env.env["FLEET_STORE"])).get((LAZY, version))


def test_a_replica_is_listed_only_once_ready_so_no_request_reaches_one_still_starting(tmp_path: Path) -> None:
    from fleet.runtime.base import DeployFailed

    runtime = LocalRuntime(
        tmp_path / "run", bento_for=lambda m, v: "no-such-bento:1.0.0", env={"BENTOML_HOME": str(tmp_path / "bentoml")}
    )
    errors: list[BaseException] = []
    starting = threading.Thread(target=lambda: _catch(errors, lambda: runtime.deploy(LAZY, "1.0.0")))
    starting.start()
    folder = tmp_path / "run" / LAZY / "1.0.0"
    wait_for(
        lambda: any(folder.glob("starting-*.json")) or not starting.is_alive(), timeout=60, what="the replica's start"
    )
    observed = any(folder.glob("starting-*.json"))
    seen_while_starting = runtime.list()
    starting.join(120)
    assert observed, "the start ended before it could be observed"  # bentoml takes a second to give up
    assert seen_while_starting == []  # a bentoml process was running, not yet ready: not listed
    assert len(errors) == 1 and isinstance(errors[0], DeployFailed)  # (it never gets ready: no such Bento)
    assert runtime.list() == [] and not list(folder.glob("*-*.json"))  # nothing left behind


def _catch(errors: list[BaseException], call) -> None:  # noqa: ANN001
    try:
        call()
    except BaseException as exc:  # noqa: BLE001 - the test reads it
        errors.append(exc)
