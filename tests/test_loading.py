"""Lazy loading's decisions (pure) and the gateway's activation against a runtime double.

The real-process tests (``bentoml serve`` behind a gateway) are in ``test_lazy_loading.py``;
here: which versions may be stopped and in what order, and how held requests behave when a
start is slow, fails or is asked for twenty times at once.
"""

from __future__ import annotations

import asyncio
import threading
import time
from datetime import UTC, datetime
from pathlib import Path

import pytest

from fleet.catalog.policies.loader import load_policies
from fleet.catalog.policies.models import ModelSpec
from fleet.catalog.rollouts import RolloutState
from fleet.catalog.routes.table import Canary, RouteTable, Shadow
from fleet.control.lazy import BUSY_WITHIN_S, Candidate, NoRoom, idle_unloads, make_room, protections
from fleet.gateway.activate import Activator, StartFailed, Starting
from fleet.gateway.telemetry import Telemetry
from fleet.gateway.upstream import NoReplica, Upstreams
from tests.fakes import FakeRuntime
from tests.serving_env import ROOT

NOW = 1_800_000_000.0


def lazy(
    version: str,
    idle_s: float,
    memory: float = 100.0,
    protected: str = "",
    idle_after: float | None = 60.0,
    model: str = "m",
) -> Candidate:
    return Candidate(model, version, idle_after, NOW - idle_s, memory, protected)


def eager(version: str, memory: float = 100.0, model: str = "e") -> Candidate:
    return Candidate(model, version, None, NOW - 10_000, memory)


# -- idle unload ------------------------------------------------------------------------------


def test_only_lazy_unprotected_versions_idle_past_their_time_are_unloaded() -> None:
    running = [lazy("1.0.0", 61), lazy("1.1.0", 59), lazy("1.2.0", 3600, protected="canary"), eager("1.0.0")]
    out = idle_unloads(running, NOW)
    assert [(u.model, u.version) for u in out] == [("m", "1.0.0")]
    assert "idle for 61 s (idle_unload_s 60)" in out[0].reason


# -- the memory budget ----------------------------------------------------------------------------


def test_the_budget_stops_the_least_recently_used_idle_version_first_and_only_as_many_as_needed() -> None:
    running = [
        eager("1.0.0", 300),
        lazy("1.0.0", 40),
        lazy("1.1.0", 500),
        lazy("1.2.0", 100),
        lazy("1.3.0", 900, protected="canary"),
    ]
    # used 700; +100 needs 800 within 750: one of 100 MiB frees enough; the oldest unprotected is 1.1.0
    out = make_room(running, 100, 750, NOW, "m:2.0.0")
    assert [u.version for u in out] == ["1.1.0"] and "least recently used" in out[0].reason
    out = make_room(running, 250, 750, NOW, "m:2.0.0")  # needs two: 1.1.0 then 1.2.0, never the canary or eager
    assert [u.version for u in out] == ["1.1.0", "1.2.0"]
    assert make_room(running, 50, 750, NOW, "m:2.0.0") == []  # fits: nothing stops
    assert make_room(running, 10_000, None, NOW, "m:2.0.0") == []  # no budget


def test_a_start_the_budget_cannot_hold_is_refused_naming_what_holds_it_and_stops_nothing() -> None:
    running = [eager("1.0.0", 600), lazy("1.0.0", BUSY_WITHIN_S / 2, 100), lazy("1.1.0", 900, 100, protected="canary")]
    with pytest.raises(NoRoom) as info:
        make_room(running, 200, 800, NOW, "m:2.0.0")
    text = str(info.value)
    assert "m:2.0.0 needs about 200 MiB" in text and "memory_budget_mib is 800" in text
    assert (
        "e:1.0.0 600 MiB (eager)" in text and "m:1.1.0 100 MiB (canary)" in text and "m:1.0.0 100 MiB (in use)" in text
    )
    assert "e:1.0.0" not in info.value.summary and "memory budget" in info.value.summary  # what a tenant is told


def test_a_version_asked_within_its_idle_time_is_in_use_even_below_busy_within() -> None:
    # idle_unload_s 2: a version idle 3 s may already be unloaded for idleness, so it may make room too
    running = [lazy("1.0.0", 3, 100, idle_after=2.0)]
    assert [u.version for u in make_room(running, 100, 150, NOW, "m:2.0.0")] == ["1.0.0"]
    running = [lazy("1.0.0", 1, 100, idle_after=2.0)]
    with pytest.raises(NoRoom):
        make_room(running, 100, 150, NOW, "m:2.0.0")


def _state(phase: str, version: str, champion: str, updated: float) -> RolloutState:
    at = datetime.fromtimestamp(updated, UTC)
    return RolloutState(
        model="demo-classifier",
        version=version,
        champion=champion,
        run_id="r",
        phase=phase,
        started_at=at,
        updated_at=at,
    )


def test_protections_cover_canary_shadow_running_rollouts_and_the_rollback_window() -> None:
    policies = load_policies(ROOT / "policies")
    window = policies.rollout_for("demo-classifier").rollback_window_s
    tables = {
        "demo-classifier": RouteTable(
            model="demo-classifier",
            stable="1.0.0",
            canary=Canary(version="1.1.0", weight=10),
            shadow=Shadow(version="1.2.0", percent=5),
        )
    }
    out = protections(tables, {}, policies, NOW)
    assert out == {("demo-classifier", "1.1.0"): "canary", ("demo-classifier", "1.2.0"): "shadow"}
    running = {"demo-classifier": _state("step", "2.0.0", "1.0.0", NOW)}
    out = protections({}, running, policies, NOW)
    assert out[("demo-classifier", "2.0.0")].startswith("rollout step") and ("demo-classifier", "1.0.0") in out
    promoted = {"demo-classifier": _state("promoted", "2.0.0", "1.0.0", NOW - window / 2)}
    assert protections({}, promoted, policies, NOW)[("demo-classifier", "1.0.0")].startswith("rollback window")
    assert protections({}, promoted, policies, NOW + window) == {}


# -- activation at the gateway (a runtime double: the real one is in test_lazy_loading) --------


def slow_runtime(fail: str | None = None) -> FakeRuntime:
    """``activate`` blocks until ``gate`` is set, counting calls; then the version runs."""
    runtime = FakeRuntime()
    runtime.gate, runtime.fail = threading.Event(), fail
    return runtime


def _activator(runtime: object, make_room=None, **policy: object) -> tuple[Activator, Upstreams, Telemetry]:  # noqa: ANN001
    spec = {
        "family": "tabular-mlp",
        "size_class": "small",
        "params_millions": 0.01,
        "loading": "lazy",
        "autoscaling": {"max_replicas": 1, "target_qps_per_replica": 10, "target_p99_ms": 100},
        "slo": {"p99_ms": 100, "error_rate": 0.01},
        **policy,
    }
    specs = {"m": ModelSpec.model_validate(spec), "e": ModelSpec.model_validate({**spec, "loading": "eager"})}
    upstreams = Upstreams()
    telemetry = Telemetry(lambda: iter(()), lambda: iter(()), lambda: iter(()), lambda: iter(()))
    act: Activator

    def read_runtime() -> None:  # the gateway's view re-reads the runtime, then syncs its pools
        upstreams.sync({k: d for k, d in (((m, v), ("http://127.0.0.1:9",)) for m, v in runtime.running)}, {})  # type: ignore[attr-defined]
        asyncio.get_running_loop().call_soon(act.synced)

    act = Activator(runtime, upstreams, specs.__getitem__, telemetry, read_runtime, make_room)
    upstreams.activator = act
    return act, upstreams, telemetry


def _value(telemetry: Telemetry, name: str, **labels: str) -> float:
    return telemetry.registry.get_sample_value(name, labels) or 0.0


def test_twenty_concurrent_first_requests_start_the_version_once_and_all_are_served() -> None:
    runtime = slow_runtime()
    act, upstreams, telemetry = _activator(runtime)

    async def scenario() -> list[object]:
        deadline = time.monotonic() + 10
        held = [asyncio.create_task(upstreams.ready("m", "1.0.0", deadline)) for _ in range(20)]
        while _value(telemetry, "fleet_requests_held", model="m", version="1.0.0") < 20:
            assert time.monotonic() < deadline, "the 20 requests were never all held"
            await asyncio.sleep(0.01)
        runtime.gate.set()
        return await asyncio.gather(*held)

    pools = asyncio.run(scenario())
    assert runtime.calls == 1 and all(p is pools[0] and p.replicas for p in pools)
    assert _value(telemetry, "fleet_cold_starts_total", model="m", version="1.0.0", outcome="started") == 1
    assert _value(telemetry, "fleet_activation_hold_seconds_count", model="m", version="1.0.0") == 20
    assert _value(telemetry, "fleet_requests_held", model="m", version="1.0.0") == 0


def test_past_max_hold_ms_the_request_gets_503_with_retry_after_and_the_start_goes_on() -> None:
    runtime = slow_runtime()
    act, upstreams, telemetry = _activator(runtime, max_hold_ms=200)

    async def scenario() -> tuple[Starting, float, object]:
        t0 = time.monotonic()
        with pytest.raises(Starting) as info:
            await upstreams.ready("m", "1.0.0", t0 + 10)
        waited = time.monotonic() - t0
        runtime.gate.set()
        pool = await upstreams.ready("m", "1.0.0", time.monotonic() + 10)  # the same start, not a second
        return info.value, waited, pool

    exc, waited, pool = asyncio.run(scenario())
    assert exc.status == 503 and exc.retry_after_s >= 1 and "m:1.0.0 is starting" in str(exc)
    assert 0.2 <= waited < 1.0  # the policy's bound, not the request's 10 s
    assert runtime.calls == 1 and pool.replicas  # type: ignore[attr-defined]


def test_the_hold_is_bounded_per_version_and_per_tenant_and_a_request_past_it_gets_503_at_once() -> None:
    runtime = slow_runtime()
    act, upstreams, telemetry = _activator(runtime, max_held=3, max_held_per_tenant=2)

    async def scenario() -> tuple[list[Starting], list[object]]:
        deadline = time.monotonic() + 10
        held = [asyncio.create_task(upstreams.ready("m", "1.0.0", deadline, t)) for t in ("a", "a", "b")]
        while _value(telemetry, "fleet_requests_held", model="m", version="1.0.0") < 3:
            assert time.monotonic() < deadline, "the 3 requests were never all held"
            await asyncio.sleep(0.01)
        refused = []
        for tenant in ("a", "c"):  # a: its own two held already; c: the version holds its three
            t0 = time.monotonic()
            with pytest.raises(Starting) as info:
                await upstreams.ready("m", "1.0.0", deadline, tenant)
            assert time.monotonic() - t0 < 0.5  # at once, not after a hold
            refused.append(info.value)
        runtime.gate.set()
        return refused, await asyncio.gather(*held)

    refused, pools = asyncio.run(scenario())
    assert "already holds 2 requests of your tenant (its policy's max_held_per_tenant)" in str(refused[0])
    assert "already holds 3 requests (its policy's max_held)" in str(refused[1])
    assert all(e.status == 503 and e.retry_after_s >= 1 for e in refused)
    assert all(p.replicas for p in pools) and runtime.calls == 1  # type: ignore[attr-defined]
    assert act._held == {}  # nothing left counted once they are served


def test_the_request_deadline_bounds_the_hold_too() -> None:
    runtime = slow_runtime()
    act, upstreams, _ = _activator(runtime, max_hold_ms=10_000)

    async def scenario() -> float:
        t0 = time.monotonic()
        with pytest.raises(Starting):
            await upstreams.ready("m", "1.0.0", t0 + 0.2)
        runtime.gate.set()
        return time.monotonic() - t0

    assert asyncio.run(scenario()) < 1.0


def test_a_start_that_fails_answers_every_held_request_with_its_cause_then_backs_off() -> None:
    runtime = slow_runtime(
        fail="m:1.0.0 exited while starting; last log lines of /x/replica-0.log:\nTraceback ...\n"
        "bentoml.exceptions.NotFound: Bento 'm:1.0.0' is not found"
    )
    act, upstreams, telemetry = _activator(runtime)

    async def scenario() -> list[BaseException]:
        deadline = time.monotonic() + 10
        held = [asyncio.create_task(upstreams.ready("m", "1.0.0", deadline)) for _ in range(3)]
        await asyncio.sleep(0.05)
        runtime.gate.set()
        errors = await asyncio.gather(*held, return_exceptions=True)
        try:  # within the back-off: the same answer at once, no second start
            await upstreams.ready("m", "1.0.0", deadline)
        except StartFailed as exc:
            errors.append(exc)
        return errors

    errors = asyncio.run(scenario())
    assert len(errors) == 4 and all(isinstance(e, StartFailed) and e.status == 503 for e in errors)
    text = str(errors[0])
    assert "m:1.0.0 could not be started: its replica exited while starting" in text
    assert "/x/replica-0.log" not in text and "Traceback" not in text  # the gist for the tenant; the log keeps the rest
    assert runtime.calls == 1 and errors[3].retry_after_s > 0  # type: ignore[attr-defined]
    assert _value(telemetry, "fleet_cold_starts_total", model="m", version="1.0.0", outcome="failed") == 1


def test_an_eager_model_without_replicas_is_not_held() -> None:
    act, upstreams, _ = _activator(slow_runtime())
    with pytest.raises(NoReplica) as info:
        asyncio.run(upstreams.ready("e", "1.0.0", time.monotonic() + 1))
    assert not isinstance(info.value, (Starting, StartFailed)) and "expected it to be deployed" in str(info.value)


def test_a_runtime_that_cannot_start_says_so(tmp_path: Path) -> None:
    from fleet.runtime.static import StaticRuntime

    (tmp_path / "endpoints.yaml").write_text("{}")
    act, upstreams, _ = _activator(StaticRuntime(tmp_path / "endpoints.yaml"))
    with pytest.raises(StartFailed) as info:
        asyncio.run(upstreams.ready("m", "1.0.0", time.monotonic() + 1))
    assert "cannot start one (FLEET_RUNTIME=static)" in str(info.value) and info.value.retry_after_s > 0


# -- the policy ---------------------------------------------------------------------------------


def test_policy_keys_parse_and_idle_unload_s_needs_lazy(tmp_path) -> None:  # noqa: ANN001
    import yaml

    from fleet.errors import ConfigError

    base = yaml.safe_load((ROOT / "policies" / "fleet.yaml").read_text())
    base["models"]["demo-classifier"].update(loading="lazy", idle_unload_s=30, max_hold_ms=4000)
    base["runtime"] = {"memory_budget_mib": 2048}
    (tmp_path / "fleet.yaml").write_text(yaml.safe_dump(base))
    policies = load_policies(tmp_path / "fleet.yaml")
    spec = policies.model("demo-classifier")
    assert (spec.loading, spec.idle_unload_s, spec.max_hold_ms, policies.runtime.memory_budget_mib) == (
        "lazy",
        30,
        4000,
        2048,
    )
    base["models"]["demo-classifier"]["loading"] = "eager"
    base["runtime"] = {"memory_budget_mib": -1}
    (tmp_path / "fleet.yaml").write_text(yaml.safe_dump(base))
    with pytest.raises(ConfigError) as info:
        load_policies(tmp_path / "fleet.yaml")
    text = str(info.value)
    assert "models.demo-classifier.loading" in text and "lazy when idle_unload_s is set" in text
    assert "runtime.memory_budget_mib: got -1" in text


def test_a_start_the_memory_budget_refuses_tells_the_tenant_no_other_models_name() -> None:
    runtime = slow_runtime()
    runtime.gate.set()

    def full(model: str, version: str) -> None:
        make_room([eager("1.0.0", 900, model="secret-model")], 200, 1000, NOW, f"{model}:{version}")

    act, upstreams, _ = _activator(runtime, make_room=full)
    with pytest.raises(StartFailed) as info:
        asyncio.run(upstreams.ready("m", "1.0.0", time.monotonic() + 5))
    text = str(info.value)
    assert "m:1.0.0 could not be started: the runtime's memory budget cannot hold it now" in text
    assert "secret-model" not in text and runtime.running == {}


def test_an_unexpected_error_in_a_start_is_a_503_with_a_back_off_not_a_500() -> None:
    class Broken(FakeRuntime):
        def activate(self, model: str, version: str, before_start=None):  # noqa: ANN001, ANN201
            self.calls += 1
            raise PermissionError("[Errno 13] Permission denied: '/srv/fleet/run/m/1.0.0/.version.lock'")

    runtime = Broken()
    act, upstreams, _ = _activator(runtime)

    async def scenario() -> list[BaseException]:
        out = []
        for _ in range(2):
            try:
                await upstreams.ready("m", "1.0.0", time.monotonic() + 5)
            except BaseException as exc:  # noqa: BLE001 - the assertions say which
                out.append(exc)
        return out

    errors = asyncio.run(scenario())
    assert all(isinstance(e, StartFailed) for e in errors) and runtime.calls == 1  # the second is the back-off's
    assert "the runtime failed to start it" in str(errors[0]) and "/srv" not in str(errors[0])
