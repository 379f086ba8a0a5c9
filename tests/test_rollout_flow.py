"""Canary rollouts end to end: real Bentos, a real gateway, a real Prefect API, steady load.

Each test trains its own candidate, rolls it out with the policy scaled to seconds
(``FAST``) and reports how many failures the callers saw. Assertions on the stable are
relative: a promotion changes it for the tests after.

The rollout lease under a deploy longer than its TTL is proved on the real flow and
Prefect API too, with the fleet behind it faked (``test_a_second_rollout_...``): the
deploy blocks until the test lets it go.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import httpx
import pytest

from fleet import records
from fleet.catalog.registry import Registry, State
from fleet.catalog.rollouts import RolloutState, lease_key, state_key
from fleet.catalog.routes.store import Router
from fleet.leases import LeaseRecord
from fleet.types import ArmWindow
from tests.fakes import FakeRuntime
from tests.quiet import assert_quiet
from tests.rollout_env import FAST, MODEL, Load, serving_fleet
from tests.serving_env import FLEET, ROOT, FleetEnv


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory, prefect_api: str) -> Iterator[dict]:
    env = FleetEnv(tmp_path_factory.mktemp("rollout"))
    with serving_fleet(env) as fleet:
        yield fleet


def train(fleet: dict, version: str, *extra: str) -> None:
    fleet["env"].fleet("models", "train", MODEL, version, "--rows", "20000", "--epochs", "15", *extra)


def stored(fleet: dict) -> RolloutState | None:
    return records.load_or_none(fleet["store"], state_key(MODEL), RolloutState)[0]


def served(fleet: dict, n: int = 30) -> set[str]:
    with httpx.Client(base_url=fleet["url"], timeout=10) as client:
        return {
            client.post(
                f"/v2/models/{MODEL}/infer",
                headers={"Authorization": f"Bearer {fleet['key']}", "X-Fleet-Routing-Key": f"probe-{i}"},
                json={"inputs": [{"name": "features", "shape": [1, 4], "datatype": "FP32", "data": [1, 0, 0, 0]}]},
            ).headers["x-fleet-model-version"]
            for i in range(n)
        }


def run_rollout(version: str, **overrides):  # noqa: ANN003, ANN201 - a Prefect State
    from flows.rollout import canary_rollout

    return canary_rollout(MODEL, version, **{**FAST, **overrides}, return_state=True)


def _slo_p99_ms() -> float:
    from fleet.catalog.policies.loader import load_policies

    return load_policies(ROOT / "policies").model(MODEL).slo.p99_ms


def _stable_p99_ms(fleet: dict, stable: str, since: float) -> float:
    """The stable's upstream p99 since ``since``, as the latency gate reads it."""
    from fleet.analysis.histograms import histogram_quantile
    from fleet.analysis.sources import open_metrics

    window = open_metrics(store=fleet["store"]).window(MODEL, stable, since, time.time())
    return histogram_quantile(0.99, window.latency_ms)


@pytest.mark.parametrize(
    ("version", "fault", "gate"),
    [
        ("2.0.1", ["--fault-error-rate", "0.1"], "error_rate"),
        # Every answer waits 4x the model's p99 SLO (250 ms): whenever the stable meets its SLO,
        # this version is at least 4x slower than it, past FAST's 3x however busy the machine
        # is. A fixed 25 ms was not: beside two CPU-bound processes the stable's own p99 rose
        # to 61-114 ms and the 25 ms drowned in it (the gate then rightly promoted the version).
        ("2.0.2", None, "latency_p99"),
        ("2.0.3", ["--label-threshold", "2.5"], "predictions"),
    ],
    ids=["fails-10pct", "3x-slower", "shifted-predictions"],
)
def test_a_bad_version_is_rolled_back_automatically(
    fleet: dict, version: str, fault: list[str] | None, gate: str
) -> None:
    stable, slo = Router(fleet["store"]).get(MODEL).stable, _slo_p99_ms()
    slow = fault is None
    train(fleet, version, *(["--fault-latency-ms", f"{4 * slo:g}"] if slow else fault))
    started = time.time()
    if slow:
        # The fault is a sleep inside the batched call and BentoML runs one batch at a time: a
        # second request waiting behind it past the batching budget would be shed (HTTP 503)
        # and fail the version on errors before its latency could be judged. So one caller
        # goes through the split; three more ask the stable by name, for its 299 requests.
        loads = [
            Load(fleet["url"], fleet["key"], rps=60, threads=1),
            Load(fleet["url"], fleet["key"], rps=45, threads=3, version=stable, seed=100),
        ]
    else:
        loads = [Load(fleet["url"], fleet["key"], rps=60)]
    for load in loads:
        load.start()
    try:
        # the slow case: one caller gathers the canary's requests at ~1 a second. The shifted
        # case: the sequential PSI test's time to decide grows as the model trained here lands
        # nearer the limit (its alpha is spent over ever more looks); beside two CPU-bound
        # processes one run was still undecided after 90 s at 50 % with ~1,400 rows an arm.
        # The hold deadline is a test speed, not what is tested: the predictions gate must decide
        state = run_rollout(version, **({"hold_deadline_s": 240} if slow or gate == "predictions" else {}))
    finally:
        for load in loads:
            load.stop()
    premise = f"stable p99 {_stable_p99_ms(fleet, stable, started):.0f} ms during the rollout, SLO {slo:g} ms"
    print(f"{version} ({gate}): {'; '.join(load.report() for load in loads)}; {premise}; flow: {state.message}")
    assert state.is_failed() and gate in state.message and "rolled back" in state.message, premise
    table = Router(fleet["store"]).get(MODEL)
    assert table.stable == stable and table.canary is None
    assert Registry(fleet["store"]).states(MODEL)[version] == State.REJECTED
    assert stored(fleet).phase == "rolled_back" and gate in stored(fleet).breached
    assert served(fleet) == {stable}
    assert sum(len(load.failures) for load in loads) <= 1, [load.failures for load in loads]  # retried on stable


class TinyTimeouts(threading.Thread):
    """A tenant entitled to every version asking ``version`` by name with timeouts it cannot
    meet (0.01 ms) or barely can (the policy's minimum, 50 ms), ten a second: before the
    hardening each expiry counted as the canary's failure and rolled a good canary back."""

    def __init__(self, fleet: dict, version: str) -> None:
        super().__init__(daemon=True)
        self.url, self.key, self.version = fleet["url"], fleet["key"], version
        self.codes: dict[str, list[int]] = {"0.01": [], "50": []}
        self.blamed: list[str] = []  # 504s that said the version failed
        self.stop = threading.Event()

    def run(self) -> None:
        body = {"inputs": [{"name": "features", "shape": [1, 4], "datatype": "FP32", "data": [0.5, 0, 0, 0]}]}
        with httpx.Client(base_url=self.url, timeout=10) as client:
            while not self.stop.wait(0.1):
                for asked, codes in self.codes.items():
                    r = client.post(
                        f"/v2/models/{MODEL}/versions/{self.version}/infer",
                        json=body,
                        headers={"Authorization": f"Bearer {self.key}", "X-Fleet-Timeout-Ms": asked},
                    )
                    codes.append(r.status_code)
                    if r.status_code == 504 and "not counted against the version" not in r.text:
                        self.blamed.append(r.text)


def test_a_good_version_is_promoted_through_every_step(fleet: dict) -> None:
    train(fleet, "1.1.0", "--seed", "11")
    champion = Router(fleet["store"]).get(MODEL).stable
    load = Load(fleet["url"], fleet["key"], rps=60).start()
    attack = TinyTimeouts(fleet, "1.1.0")
    attack.start()
    try:
        state = run_rollout("1.1.0")
    finally:
        load.stop()
        attack.stop.set()
        attack.join(timeout=30)
    tiny = {asked: dict(collections.Counter(codes)) for asked, codes in attack.codes.items()}
    print(f"1.1.0: {load.report()}; flow: {state.message}; tiny timeouts: {tiny}")
    assert state.is_completed(), state.message
    # refused before any model was asked (404 while 1.1.0 was not yet routed), never the canary's failure
    assert set(attack.codes["0.01"]) <= {400, 404} and 400 in attack.codes["0.01"]
    assert set(attack.codes["50"]) <= {200, 404, 504} and 200 in attack.codes["50"] and not attack.blamed
    record = stored(fleet)
    assert record.phase == "promoted" and [r.weight for r in record.reports] == [20.0, 50.0, 100.0]
    assert all(r.outcome == "advance" for r in record.reports)
    assert Router(fleet["store"]).get(MODEL).stable == "1.1.0"
    states = Registry(fleet["store"]).states(MODEL)
    assert states["1.1.0"] == State.STABLE and states[champion] == State.RETIRED
    assert load.failures == [] and load.by_version.get("1.1.0", 0) > 0
    assert served(fleet) == {"1.1.0"}
    deadline = time.monotonic() + 30  # the previous stable is undeployed after the 1 s rollback window
    while time.monotonic() < deadline and any(d.version == champion for d in _runtime(fleet).list()):
        time.sleep(0.2)
    assert not any(d.version == champion for d in _runtime(fleet).list())
    from prefect.client.orchestration import get_client

    async def artifacts() -> list:
        async with get_client() as client:
            return await client.read_latest_artifacts()

    keys = {a.key for a in asyncio.run(artifacts())}
    assert {f"rollout-{MODEL}", f"rollout-{MODEL}-summary"} <= keys


def _runtime(fleet: dict):  # noqa: ANN202
    from fleet.runtime.local import LocalRuntime

    return LocalRuntime(fleet["env"].root / "run")


def test_a_low_traffic_canary_holds_instead_of_failing(fleet: dict) -> None:
    train(fleet, "1.2.0", "--seed", "12")
    load = Load(fleet["url"], fleet["key"], rps=2, threads=1).start()
    result: dict = {}
    runner = threading.Thread(target=lambda: result.update(state=run_rollout("1.2.0")))
    runner.start()
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            record = stored(fleet)
            if record and record.version == "1.2.0" and record.reports and record.reports[-1].ticks >= 3:
                break
            time.sleep(0.5)
        record = stored(fleet)
        assert record.phase == "step" and record.weight == 20.0 and record.reports[-1].summary.startswith("hold")
        assert Router(fleet["store"]).get(MODEL).canary.version == "1.2.0"  # holding, not failed
        load.rps = 60  # traffic comes back: the same step now has the data to pass
    finally:
        runner.join(timeout=240)
        load.stop()
    print(f"1.2.0: {load.report()}; flow: {result['state'].message}")
    assert result["state"].is_completed(), result["state"].message
    assert load.failures == []


def test_a_flow_killed_mid_rollout_and_run_again_ends_consistent(fleet: dict) -> None:
    train(fleet, "1.3.0", "--seed", "13")
    load = Load(fleet["url"], fleet["key"], rps=60).start()
    code = f"from flows.rollout import canary_rollout; canary_rollout({MODEL!r}, '1.3.0', **{FAST!r})"
    child = subprocess.Popen(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env=os.environ.copy(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            record = stored(fleet)
            if record and record.version == "1.3.0" and record.phase == "step" and record.weight == 50:
                break
            assert child.poll() is None, "the rollout ended before it could be killed"
            time.sleep(0.2)
        child.send_signal(signal.SIGKILL)  # mid-rollout, canary at 50 %
        child.wait(timeout=10)
        table = Router(fleet["store"]).get(MODEL)
        assert table.canary.version == "1.3.0" and any(d.version == "1.3.0" for d in _runtime(fleet).list())
        state = run_rollout("1.3.0")  # the lease holder is dead: this run takes over and resumes
    finally:
        load.stop()
        if child.poll() is None:
            child.kill()
    print(f"1.3.0: {load.report()}; flow: {state.message}")
    assert state.is_completed(), state.message
    assert stored(fleet).phase == "promoted" and Router(fleet["store"]).get(MODEL).stable == "1.3.0"
    assert load.failures == []


def _canary_keys(fleet: dict, n: int = 5) -> list[str]:
    """Routing keys the current split sends to the canary."""
    from fleet.catalog.routes.table import choose_version

    table = Router(fleet["store"]).get(MODEL)
    keys = (f"probe-{i}" for i in range(10_000))
    return [k for k in keys if choose_version(table, None, k).reason == "canary"][:n]


def test_a_concurrent_rollout_is_refused_and_a_rollback_reaches_the_gateway_within_a_second(fleet: dict) -> None:
    from flows.rollback import rollback

    train(fleet, "2.1.0", "--seed", "21")
    train(fleet, "2.2.0", "--seed", "22")
    stable = Router(fleet["store"]).get(MODEL).stable
    load = Load(fleet["url"], fleet["key"], rps=30).start()
    result: dict = {}
    # min_samples out of reach: the first rollout holds at 20 % until it is rolled back
    runner = threading.Thread(
        target=lambda: result.update(state=run_rollout("2.1.0", min_samples=10**6, hold_deadline_s=600))
    )
    runner.start()
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not (
            stored(fleet) and stored(fleet).version == "2.1.0" and stored(fleet).phase == "step"
        ):
            time.sleep(0.2)
        second = run_rollout("2.2.0")
        assert second.is_failed() and "the rollout of demo-classifier is in progress" in second.message
        keys = _canary_keys(fleet)
        first_stable: list[float] = []

        def watch() -> None:  # when does the gateway first answer the canary's keys from stable?
            with httpx.Client(base_url=fleet["url"], timeout=10) as client:
                while not first_stable:
                    versions = {
                        client.post(
                            f"/v2/models/{MODEL}/infer",
                            json={
                                "inputs": [
                                    {"name": "features", "shape": [1, 4], "datatype": "FP32", "data": [1, 0, 0, 0]}
                                ]
                            },
                            headers={"Authorization": f"Bearer {fleet['key']}", "X-Fleet-Routing-Key": k},
                        ).headers["x-fleet-model-version"]
                        for k in keys
                    }
                    if versions == {stable}:
                        first_stable.append(time.time())

        watcher = threading.Thread(target=watch)
        watcher.start()
        called = time.time()
        rollback(MODEL, reason="stop the canary")
        returned = time.time()
        watcher.join(timeout=10)
        written = Router(fleet["store"]).get(MODEL).updated_at.timestamp()
    finally:
        runner.join(timeout=60)
        load.stop()
    seen = first_stable[0] - written
    print(
        f"rollback: flow run took {returned - called:.2f} s; the gateway served stable {seen * 1000:.0f} ms after "
        f"the route write; {load.report()}"
    )
    assert seen < 1.0
    assert result["state"].is_failed() and "route changed outside the rollout" in result["state"].message
    assert load.failures == []


def test_deployments_and_the_cli_start_and_follow_the_flows(fleet: dict) -> None:
    env = fleet["env"]
    train(fleet, "1.4.0", "--seed", "14")
    log = open(env.root / "flows-serve.log", "wb")
    server = subprocess.Popen(
        [FLEET, "flows", "serve"],
        env={**env.env, **os.environ},
        cwd=env.root,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    load = Load(fleet["url"], fleet["key"], rps=60).start()
    try:
        from prefect.client.orchestration import get_client

        async def names() -> set[str]:
            async with get_client() as client:
                return {d.name for d in await client.read_deployments()}

        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not {"rollout", "rollback"} <= asyncio.run(names()):
            assert server.poll() is None, (env.root / "flows-serve.log").read_text()
            time.sleep(0.5)
        # the previous stable kept warm, as the shipped policy does (600 s): the rollback is a
        # route change. A cold one (rollback_window_s: 0) would start a replica on these two
        # cores beside the one serving 60 req/s, whose batch queue then sheds (503) past 250 ms
        # The hold deadline is a test speed, not what is tested here (the CLI and deployments):
        # beside CI's other workers one run's canary still had early slow answers in its p99 tail
        # at 90 s into the 50 % step (16/1,995 above 3x the stable's p99, bound 1.5 % vs 1 %)
        warm = {**FAST, "rollback_window_s": 600, "hold_deadline_s": 240}
        sets = [a for k, v in warm.items() if k != "gates" for a in ("--set", f"{k}={v}")]
        sets += [a for k, v in FAST["gates"].items() for a in ("--set", f"gates.{k}={v}")]
        out = subprocess.run(
            [FLEET, "rollout", MODEL, "1.4.0", *sets],
            env={**env.env, **os.environ},
            cwd=env.root,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert out.returncode == 0, out.stderr + (env.root / "flows-serve.log").read_text()[-3000:]
        assert_quiet(out.stdout + out.stderr, "fleet rollout")
        assert "/runs/flow-run/" in out.stderr and "step 50%" in out.stderr and "promoted" in out.stdout
        # it returned at the promotion, not after the 600 s the run keeps the previous stable warm
        assert "stays ready for an instant rollback for 600 s" in out.stdout, out.stdout
        back = subprocess.run(
            [FLEET, "rollback", MODEL, "--reason", "rehearsal", "--json"],
            env={**env.env, **os.environ},
            cwd=env.root,
            capture_output=True,
            text=True,
            timeout=180,
        )
        assert back.returncode == 0, back.stderr
        assert_quiet(back.stdout + back.stderr, "fleet rollback")
        assert Router(fleet["store"]).get(MODEL).stable != "1.4.0"  # back on the previous stable
    finally:
        load.stop()
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
    assert load.failures == []


class SteadyMetrics:
    """Every version healthy and alike: 1,000 answered requests in any window."""

    def __init__(self) -> None:
        from fleet.analysis.sources import MemoryMetrics

        self._one = MemoryMetrics()
        for version in ("1.0.0", "1.1.0", "1.2.0"):
            self._one.answered(MODEL, version, at=0.0, latency_ms=10, scores=[0.3, 0.8], count=1000)

    def window(self, model: str, version: str, start: float, end: float) -> ArmWindow:
        return dataclasses.replace(self._one.window(model, version, 0.0, 1.0), start=start, end=end)


def test_a_second_rollout_while_the_first_deploys_past_the_lease_ttl_is_refused(
    prefect_api: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import flows.rollout
    from fleet.catalog.policies.loader import load_policies
    from fleet.store import MemoryStore
    from flows._context import FleetContext
    from tests.test_rollout import meta

    store, runtime, ttl = MemoryStore(), FakeRuntime({(MODEL, "1.0.0"): 1}), timedelta(seconds=2)
    deploying, proceed = threading.Event(), threading.Event()

    def blocked() -> None:  # a deploy blocks until the test lets it finish, however long that takes
        deploying.set()
        assert proceed.wait(timeout=120), "the test never let the deploy finish"

    runtime.while_deploying = blocked
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "w").write_text("w")
    for version in ("1.0.0", "1.1.0", "1.2.0"):
        Registry(store).register(MODEL, version, tmp_path / "a", meta())
    Router(store).set(MODEL, stable="1.0.0", why="first")
    context = FleetContext(store, load_policies(ROOT / "policies"), runtime, SteadyMetrics())
    monkeypatch.setattr(flows.rollout, "fleet_context", lambda: context)
    monkeypatch.setattr(flows.rollout, "LEASE_TTL", ttl)
    policy = {**FAST, "analysis_window_s": 0.2, "rollback_window_s": 0}
    first: dict = {}
    runner = threading.Thread(
        target=lambda: first.update(state=flows.rollout.canary_rollout(MODEL, "1.1.0", **policy, return_state=True))
    )
    runner.start()
    try:
        assert deploying.wait(timeout=120), "the first rollout never began its deploy"
        deadline = time.monotonic() + 30
        while True:  # the deploy goes on past twice the TTL: the lease must have been renewed meanwhile
            lease = records.load(store, lease_key(MODEL), LeaseRecord)[0]
            if lease.renewed_at - lease.acquired_at > 2 * ttl:
                break
            assert time.monotonic() < deadline, f"the lease was not renewed while deploying: {lease}"
            time.sleep(0.05)
        second = flows.rollout.canary_rollout(MODEL, "1.2.0", **policy, return_state=True)
        assert second.is_failed() and "the rollout of demo-classifier is in progress" in second.message
        assert stored({"store": store}).version == "1.1.0" and Router(store).get(MODEL).canary is None
    finally:
        proceed.set()
        runner.join(timeout=120)
    state = first["state"]
    assert state.is_completed(), state.message
    record = stored({"store": store})
    assert (record.version, record.phase, record.run_id) == ("1.1.0", "promoted", str(state.state_details.flow_run_id))
    assert [r.weight for r in record.reports] == [20.0, 50.0, 100.0]
    table = Router(store).get(MODEL)
    assert (table.stable, table.canary, table.revision) == ("1.1.0", None, 5)  # first, 20 %, 50 %, 100 %, promoted
    assert Registry(store).states(MODEL)["1.2.0"] == State.REGISTERED  # the second touched nothing
    assert runtime.log == [f"deploy {MODEL}:1.1.0", f"undeploy {MODEL}:1.0.0"]
    assert not records.exists(store, lease_key(MODEL))
