"""Canary rollouts of a generative model end to end: tiny-lm versions trained here, served by
``bentoml serve`` behind a real gateway, rolled out by the real Prefect flow under steady
``/v1/completions`` load.

A version whose first token is slow is rolled back on the time-to-first-token gate with no
caller failing; an int8 copy of the stable (``fleet models quantize``) is promoted through
every step. The policy is the model's own (``generative``), scaled to seconds.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import pytest

from fleet import records
from fleet.catalog.registry import Registry, State
from fleet.catalog.rollouts import RolloutState, state_key
from fleet.catalog.routes.store import Router
from tests.rollout_env import Load, serving_fleet
from tests.serving_env import ROOT, FleetEnv

MODEL = "demo-lm"
# The generative policy's gates, with its steps and windows scaled to seconds.
FAST = {
    "steps": [20, 50, 100],
    "analysis_window_s": 2,
    "min_samples": 40,
    "hold_deadline_s": 120,
    "rollback_window_s": 1,
    "shadow_percent": 0,
    "shadow_duration_s": 0,
    "offline_tolerance": 0.1,
    "gates": {
        "max_error_rate_increase": 0.03,
        "confidence": 0.95,
        "max_p99_ratio": 3.0,
        "max_tpot_p99_ratio": 3.0,
        "max_output_length_psi": 0.25,
    },
}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory, prefect_api: str) -> Iterator[dict]:
    with serving_fleet(FleetEnv(tmp_path_factory.mktemp("genrollout")), MODEL, ("--preset", "test")) as fleet:
        yield fleet


def load(fleet: dict, **kwargs) -> Load:  # noqa: ANN003
    return Load(fleet["url"], fleet["key"], model=MODEL, generative=True, **kwargs)


def run_rollout(version: str, **overrides):  # noqa: ANN003, ANN201 - a Prefect State
    from flows.rollout import canary_rollout

    return canary_rollout(MODEL, version, **{**FAST, **overrides}, return_state=True)


def stored(fleet: dict) -> RolloutState | None:
    return records.load_or_none(fleet["store"], state_key(MODEL), RolloutState)[0]


def served(fleet: dict, n: int = 20) -> set[str]:
    with httpx.Client(base_url=fleet["url"], timeout=30) as client:
        return {
            client.post(
                "/v1/completions",
                headers={"Authorization": f"Bearer {fleet['key']}"},
                json={"model": MODEL, "prompt": "reverse abc>", "max_tokens": 2},
            ).headers["x-fleet-model-version"]
            for _ in range(n)
        }


def _ttft_slo_ms() -> float:
    from fleet.catalog.policies.loader import load_policies

    return load_policies(ROOT / "policies").model(MODEL).slo.p99_ms


@pytest.mark.timeout(600)  # the module's fleet is built inside this first test's time, and a busy machine is slow
def test_a_version_with_a_slow_first_token_is_rolled_back_with_no_caller_failing(fleet: dict) -> None:
    stable = Router(fleet["store"]).get(MODEL).stable
    # Each of the canary's answers holds its first token 2.5x the model's TTFT SLO longer (the
    # fault delays that answer only, not the engine): judged at the shipped policy's ratio
    # (1.5x), its TTFT is past the limit whenever the stable's p99 is under 1.67 s (about 0.8 s
    # here with the machine busy, 0.07 s quiet), and at most 2.5 s plus the normal TTFT, inside
    # first_token_timeout_ms (5 s): nobody times out. Two more callers ask the stable by name,
    # for its share of the samples.
    slow_ms = 2.5 * _ttft_slo_ms()
    fleet["env"].fleet(
        "models", "train", MODEL, "2.0.0", "--preset", "test", "--seed", "21", "--fault-first-token-ms", f"{slow_ms:g}"
    )
    loads = [load(fleet, rps=20, threads=2), load(fleet, rps=20, threads=2, version=stable, seed=100)]
    for traffic in loads:
        traffic.start()
    try:
        # the gate, never the step's deadline, must roll it back: the deadline is far off
        state = run_rollout("2.0.0", hold_deadline_s=240, gates={**FAST["gates"], "max_p99_ratio": 1.5})
    finally:
        for traffic in loads:
            traffic.stop()
    split = loads[0]
    print(f"2.0.0 (slow first token): {'; '.join(t.report() for t in loads)}; flow: {state.message}")
    assert state.is_failed() and "gate latency_p99 breached" in state.message, state.message
    assert "latency_p99" in stored(fleet).breached and stored(fleet).phase == "rolled_back"
    table = Router(fleet["store"]).get(MODEL)
    assert table.stable == stable and table.canary is None
    assert Registry(fleet["store"]).states(MODEL)["2.0.0"] == State.REJECTED
    assert [t.failures for t in loads] == [[], []]
    assert split.by_version.get("2.0.0", 0) > 0  # the canary did answer callers, slowly
    assert served(fleet) == {stable}


def test_an_int8_version_is_rolled_out_and_promoted(fleet: dict) -> None:
    champion = Router(fleet["store"]).get(MODEL).stable
    fleet["env"].fleet("models", "quantize", MODEL, champion, "3.0.0")
    meta = Registry(fleet["store"]).get(MODEL, "3.0.0")
    assert meta.parent_version == champion
    traffic = load(fleet, rps=30, threads=6).start()
    try:
        state = run_rollout("3.0.0")
    finally:
        traffic.stop()
    print(f"3.0.0 (int8 of {champion}): {traffic.report()}; flow: {state.message}")
    assert state.is_completed(), state.message
    record = stored(fleet)
    assert record.phase == "promoted" and [r.weight for r in record.reports] == [20.0, 50.0, 100.0]
    gates = {g["gate"] for r in record.reports for g in r.gates}
    assert {"latency_p99", "tpot_p99", "output_length"} <= gates, gates  # the generation gates were judged
    assert "predictions" not in {g["gate"] for r in record.reports for g in r.gates if g["status"] != "pass"}
    assert Router(fleet["store"]).get(MODEL).stable == "3.0.0"
    states = Registry(fleet["store"]).states(MODEL)
    assert states["3.0.0"] == State.STABLE and states[champion] == State.RETIRED
    assert traffic.failures == [] and traffic.by_version.get("3.0.0", 0) > 0
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and served(fleet, 5) != {"3.0.0"}:
        time.sleep(0.2)
    assert served(fleet) == {"3.0.0"}
