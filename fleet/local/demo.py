"""``fleet demo``: the whole loop, scripted, on the local fleet that ``fleet up`` runs.

1. a good version is trained and promoted through every canary step;
2. another good one is rolled out blue-green: started beside the stable, switched to in one
   route change, baked, kept;
3. a bad one (a fifth of its requests fail) is rolled back automatically;
4. drifted traffic with its true labels fed back → monitor sees drift → retrain → the new
   version is promoted;
5. a corrupted batch (a value a million times off in one row of six) → monitor raises an
   alert and retraining is blocked.

Every step runs as a Prefect flow run against fleet up's server, so each shows in the UI;
steady traffic flows through the gateway meanwhile. The rollout policy is scaled to
seconds so the scenario takes a few minutes. Ends with a table: what happened, whether it
was what was expected, how long it took, and the run in the UI.
"""

from __future__ import annotations

import os
import textwrap
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from fleet.errors import ConfigError

# The rollout policy in seconds: the demo has minutes, not hours.
DEMO_ROLLOUT = {
    "steps": [20, 50, 100],
    "analysis_window_s": 3,
    "min_samples": 50,
    "hold_deadline_s": 180,
    "rollback_window_s": 5,
    "shadow_percent": 0,
    "shadow_duration_s": 0,
    "gates": {"max_error_rate_increase": 0.03, "confidence": 0.95, "max_p99_ratio": 3.0, "max_prediction_psi": 0.2},
}
DRIFT = np.array([1.2, -0.8, 0.8, 0.8])


@dataclass
class StepResult:
    step: str
    expected: str
    outcome: str
    ok: bool
    seconds: float
    run_url: str = ""


def summary_table(results: list[StepResult]) -> tuple[list[str], list[list[str]]]:
    """Columns and rows of the table ``fleet demo`` ends with: ``table("fleet demo", *summary_table(r))``.

    The verdict (as expected, took) comes right after the step's name, headers are short, and
    what happened is cut at a word, not mid-word: six columns with a Prefect URL in them do not
    fit 80 columns, so at that width each step prints as a record and this order is how it reads.
    """
    columns = ["step", "as expected", "took", "expected", "what happened", "Prefect run"]
    rows = [
        [
            r.step,
            "yes" if r.ok else "NO",
            f"{r.seconds:.0f} s",
            r.expected,
            textwrap.shorten(r.outcome or "-", _OUTCOME_CHARS, placeholder=" …"),
            r.run_url or "-",
        ]
        for r in results
    ]
    return columns, rows


_OUTCOME_CHARS = 240  # a Prefect state message can run to pages; the UI link has the rest


@dataclass
class Traffic:
    """Background requests through the gateway (random, undrifted) while rollouts run."""

    url: str
    key: str
    rps: float = 40.0
    sent: int = 0
    failed: int = 0
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> Traffic:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        rng = np.random.default_rng(0)
        with httpx.Client(base_url=self.url, timeout=30, headers={"Authorization": f"Bearer {self.key}"}) as client:
            while not self._stop.is_set():
                body = {
                    "inputs": [
                        {
                            "name": "features",
                            "shape": [1, 4],
                            "datatype": "FP32",
                            "data": rng.normal(size=4).round(3).tolist(),
                        }
                    ]
                }
                try:
                    ok = (
                        client.post(
                            "/v2/models/demo-classifier/infer",
                            json=body,
                            headers={"X-Fleet-Routing-Key": f"demo-{self.sent}"},
                        ).status_code
                        == 200
                    )
                except httpx.HTTPError:
                    ok = False
                self.sent += 1
                self.failed += not ok
                self._stop.wait(1 / self.rps)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)


def local_fleet(model: str) -> tuple[str, str]:
    """(gateway URL, demo tenant key) of the fleet ``fleet up`` runs from this folder."""
    from fleet.catalog import gateway_directory
    from fleet.store import open_store

    key_file = Path(".fleet/demo-tenant.key")
    live = gateway_directory.live(open_store())
    if not live or not key_file.exists() or not os.environ.get("PREFECT_API_URL"):
        raise ConfigError(
            "no local fleet is running here; start it with `make up` (or `fleet up`) in this folder, "
            "then run `fleet demo` from the same folder in another terminal"
        )
    return live[-1].url, key_file.read_text().strip()


def send(
    url: str, key: str, rows: np.ndarray, *, label: Callable[[np.ndarray], int] | None, threads: int = 4
) -> dict[str, int]:
    """One request per row; with ``label``, feed each answer's true class back. Counts."""
    counts = {"sent": 0, "labelled": 0, "unknown": 0}
    lock = threading.Lock()

    def part(chunk: np.ndarray, worker: int) -> None:
        feedback = []
        with httpx.Client(base_url=url, timeout=30, headers={"Authorization": f"Bearer {key}"}) as client:
            for i, row in enumerate(chunk):
                body = {"inputs": [{"name": "features", "shape": [1, 4], "datatype": "FP32", "data": row.tolist()}]}
                r = client.post(
                    "/v2/models/demo-classifier/infer",
                    json=body,
                    headers={"X-Fleet-Routing-Key": f"batch-{worker}-{i}-{time.time_ns()}"},
                )
                if r.status_code == 200 and label is not None:
                    feedback.append({"request_id": r.headers["x-request-id"], "label": label(row)})
            accepted = unknown = 0  # the gateway knows what it sampled before its log is even written
            for start in range(0, len(feedback), 500):
                answer = client.post(
                    "/v1/feedback", json={"model": "demo-classifier", "feedback": feedback[start : start + 500]}
                )
                accepted += answer.json().get("accepted", 0)
                unknown += len(answer.json().get("unknown", []))
        with lock:
            counts["sent"] += len(chunk)
            counts["labelled"] += accepted
            counts["unknown"] += unknown

    workers = [threading.Thread(target=part, args=(c, i)) for i, c in enumerate(np.array_split(rows, threads))]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return counts


def true_class(row: np.ndarray) -> int:
    from bentos.tabular_mlp import data

    return int(data.rule(row[None, :].astype(np.float32))[0] > data.THRESHOLD)


def run(model: str, say: Callable[[str], None]) -> list[StepResult]:
    """The scenario; each step's result, in order."""
    from bentos.tabular_mlp.train import TrainConfig, train_and_register
    from fleet.catalog.registry import Registry
    from fleet.catalog.routes.store import Router
    from fleet.store import open_store
    from flows.monitor import monitor
    from flows.retrain import next_version
    from flows.rollout import canary_rollout

    url, key = local_fleet(model)
    store = open_store()
    registry, router = Registry(store), Router(store)
    results: list[StepResult] = []
    traffic = Traffic(url, key).start()
    ui = os.environ["PREFECT_API_URL"].removesuffix("/api")

    def step(name: str, expected: str, action: Callable[[], Any], judge: Callable[[Any], tuple[bool, str]]) -> None:
        say(f"{name} ...")
        started = time.monotonic()
        state = action()
        ok, outcome = judge(state)
        run_id = getattr(state, "state_details", None) and state.state_details.flow_run_id
        results.append(
            StepResult(
                name,
                expected,
                outcome,
                ok,
                time.monotonic() - started,
                f"{ui}/runs/flow-run/{run_id}" if run_id else "",
            )
        )
        say(f"{'ok' if ok else 'UNEXPECTED'}: {outcome}")

    def train_and_roll_out(version: str, config: TrainConfig, **policy: Any) -> Any:  # noqa: ANN401 - a Prefect State
        train_and_register(store, model, version, config, parent=router.get(model).stable)
        return canary_rollout(model, version, **{**DEMO_ROLLOUT, **policy}, return_state=True)

    def traffic_then_monitor(rows: np.ndarray, what: str, **monitor_args: Any) -> Any:  # noqa: ANN401
        started = time.time()
        counts = send(url, key, rows, label=true_class)
        say(
            f"  sent {counts['sent']} {what} requests, fed back {counts['labelled']} labels "
            f"({counts['unknown']} requests the inference log did not sample)"
        )
        hours = (time.time() - started) / 3600 + 1 / 60  # judge this traffic, not what came before
        return monitor(model, window_hours=hours, cooldown=False, return_state=True, **monitor_args)

    try:
        good = next_version(registry, model)
        step(
            f"roll out a good {good}",
            "promoted through every step",
            lambda: train_and_roll_out(good, TrainConfig(seed=11, epochs=15)),
            lambda s: (s.is_completed(), s.message),
        )
        green = next_version(registry, model)
        step(
            f"roll out a good {green} blue-green",
            "switched to at once, baked, kept",
            lambda: train_and_roll_out(green, TrainConfig(seed=13, epochs=15), strategy="blue-green", bake_s=15),
            lambda s: (s.is_completed() and "bake" in (s.message or ""), s.message),
        )
        bad = next_version(registry, model)
        step(
            f"roll out a bad {bad} (20 % of requests fail)",
            "rolled back on the error-rate gate",
            lambda: train_and_roll_out(bad, TrainConfig(seed=12, epochs=15, fault_error_rate=0.2)),
            lambda s: (s.is_failed() and "error_rate" in (s.message or ""), s.message),
        )
        drifted = (np.random.default_rng(7).normal(size=(3000, 4)) + DRIFT).astype(np.float32)
        step(
            "drift on good data → monitor → retrain → rollout",
            "drift found, a new version retrained and promoted",
            lambda: traffic_then_monitor(drifted, "drifted", retrain_overrides=DEMO_ROLLOUT),
            lambda s: (s.is_completed() and "promoted" in (s.message or ""), s.message),
        )
        corrupted = np.random.default_rng(8).normal(size=(3000, 4)).astype(np.float32)
        corrupted[::6, 0] = 1e6  # a client bug: one value in six a million times off
        versions = len(registry.versions(model))
        step(
            "a corrupted batch → monitor",
            "an alert, and no retraining",
            lambda: traffic_then_monitor(corrupted, "corrupted"),
            lambda s: (
                s.is_failed()
                and "retraining blocked" in (s.message or "")
                and len(registry.versions(model)) == versions,
                s.message,
            ),
        )
    finally:
        traffic.stop()
    say(f"background traffic: {traffic.sent} requests, {traffic.failed} failed")
    return results
