"""fleet.analysis.ab: the always-valid interval and the decision, over seeded simulations; and an
experiment on the running fleet, whose winner is the arm with the planted better outcome."""

from __future__ import annotations

import threading
import time
import xml.etree.ElementTree as ET
from collections.abc import Iterator

import httpx
import numpy as np
import pytest

from fleet.analysis.ab import (
    MAX_TICKS_KEPT,
    MIN_PER_ARM,
    arm_stats,
    check_min_effect,
    decide,
    duration_of,
    effect_svg,
    interval,
    split_of,
    thinned,
)
from fleet.catalog.experiments import Tick
from tests.rollout_env import MODEL, serving_fleet
from tests.serving_env import ROOT, FleetEnv


def looks(
    rng: np.random.Generator,
    p_a: float,
    p_b: float,
    min_effect: float,
    alpha: float = 0.05,
    per_tick: int = 20,
    ticks: int = 150,
):  # noqa: ANN201
    """An experiment looked at after every tick of ``per_tick`` outcomes per arm: the first
    decision and when (or ('running', ticks))."""
    a = rng.random(per_tick * ticks) < p_a
    b = rng.random(per_tick * ticks) < p_b
    for t in range(1, ticks + 1):
        n = t * per_tick
        sa, sb = arm_stats("A", a[:n]), arm_stats("B", b[:n])
        decision = decide(sa, sb, interval(sa, sb, alpha, min_effect, 1.0), min_effect, False, "clicked")
        if decision.status != "running":
            return decision, n
    return decide(sa, sb, None, min_effect, False, "clicked"), per_tick * ticks


def test_with_no_effect_a_winner_is_declared_in_at_most_alpha_of_experiments_looked_at_every_tick() -> None:
    rng, runs = np.random.default_rng(18), 400
    winners = sum(looks(rng, 0.2, 0.2, min_effect=0.005)[0].status == "winner" for _ in range(runs))
    assert winners / runs <= 0.05, winners


def test_a_planted_effect_is_found_and_the_better_arm_wins() -> None:
    rng = np.random.default_rng(7)
    found = [looks(rng, 0.20, 0.25, min_effect=0.01, ticks=400) for _ in range(50)]
    assert sum(d.winner == "B" for d, _ in found) >= 45
    assert all(d.winner != "A" for d, _ in found)
    # outcomes per arm: a fixed-horizon test with 80 % power at +5 pp needs ~1,090, fixed in advance
    assert np.median([n for d, n in found if d.winner == "B"]) < 3000


def test_no_effect_ends_as_no_difference_once_the_interval_fits_inside_the_minimum_effect() -> None:
    rng = np.random.default_rng(3)
    found = [looks(rng, 0.5, 0.5, min_effect=0.1) for _ in range(40)]
    assert sum(d.status == "no_difference" for d, _ in found) >= 36
    decision, _ = found[0]
    assert "no difference of 0.1 or more" in decision.summary


def test_rare_events_do_not_make_the_interval_a_point() -> None:
    """Both arms near 1 (A 99.9 %, B 98.1 %: B worse by 1.9 pp): a sample variance of ~0 must
    not let 'no difference' within 1 pp be declared at a few dozen outcomes."""
    rng = np.random.default_rng(5)
    wrong = sum(looks(rng, 0.999, 0.981, min_effect=0.01, ticks=100)[0].status == "no_difference" for _ in range(300))
    assert wrong / 300 <= 0.05, wrong


def test_the_interval_waits_for_enough_outcomes_and_says_so() -> None:
    few = arm_stats("1.0.0", np.ones(MIN_PER_ARM - 1))
    many = arm_stats("1.1.0", np.zeros(100))
    assert interval(few, many, 0.05, 0.01, 1.0) is None
    assert "waiting: 30 outcomes per arm" in decide(few, many, None, 0.01, False, "clicked").summary
    assert decide(few, many, None, 0.01, True, "clicked").status == "out_of_time"
    # all outcomes equal so far: the interval is not a point
    same = interval(arm_stats("a", np.zeros(50)), arm_stats("b", np.zeros(50)), 0.05, 0.01, 1.0)
    assert same is not None and same.hi > same.lo


def test_split_and_duration_are_checked() -> None:
    assert split_of("90/10") == (90.0, 10.0)
    for bad in ("50", "60/60", "0/100", "a/b", "50/50/0"):
        with pytest.raises(ValueError, match="two positive percentages that add up to 100"):
            split_of(bad)
    assert duration_of("7d") == 7 * 86400 and duration_of("90") == 90 and duration_of("30m") == 1800
    for bad in ("0s", "-1h", "soon", "inf"):
        with pytest.raises(ValueError, match="positive number with d, h, m or s"):
            duration_of(bad)


def test_a_min_effect_too_small_to_measure_or_past_the_range_is_refused_saying_what_was_expected() -> None:
    a, b = arm_stats("1.0.0", np.r_[np.zeros(40), np.ones(40)]), arm_stats("1.1.0", np.r_[np.zeros(30), np.ones(50)])
    with pytest.raises(ZeroDivisionError):  # what a run given one used to end in, at its first decision
        interval(a, b, 0.05, 1e-300, 1.0)
    for bad in (1e-300, 9e-7, 1.0, 2.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match=r"for accuracy \(its range is 1\); expected at least 1e-06 .* below 1"):
            check_min_effect(bad, 1.0, "accuracy")
    for good in (1e-6, 0.01, 0.99):
        check_min_effect(good, 1.0, "accuracy")
        assert interval(a, b, 0.05, good, 1.0) is not None
    with pytest.raises(ValueError, match=r"revenue \(its range is 500\); expected at least 0.0005"):
        check_min_effect(1e-4, 500.0, "revenue")
    from typer.testing import CliRunner

    from fleet.cli import app

    refused = CliRunner().invoke(app, ["experiment", "start", MODEL, "--arms", "1.0.0,1.1.0", "--min-effect", "1e-300"])
    said = f"{refused.output}{refused.stderr or ''}{refused.exception or ''}"
    assert refused.exit_code != 0 and "expected at least 1e-06" in said, said


def test_the_history_for_the_plot_is_bounded_and_the_plot_is_svg() -> None:
    ticks = [
        Tick(at=float(i), n=(i, i), mean=(0.2, 0.3), diff=0.1, lo=0.1 - 1 / (i + 1), hi=0.1 + 1 / (i + 1))
        for i in range(MAX_TICKS_KEPT + 1)
    ]
    kept = thinned(ticks)
    assert len(kept) < len(ticks) and kept[-1] == ticks[-1]
    svg = effect_svg(kept, ("1.0.0", "1.1.0"), "clicked", 0.01)
    root = ET.fromstring(svg)
    assert root.tag.endswith("svg") and any(e.tag.endswith("polygon") for e in root.iter())
    assert b"no interval yet" in effect_svg([], ("1.0.0", "1.1.0"), "clicked", 0.01)


def test_a_guardrail_stops_an_experiment_whose_b_fails_more_and_a_stop_request_is_heeded() -> None:
    """``Experiment.look`` on counters alone (no outcomes yet): B erring at 20 % against
    A's 0 % is harm shown, and the experiment stops saying which guardrail; a stop request
    ends a healthy one at its next look."""
    from datetime import UTC, datetime

    from fleet.analysis.sources import MemoryMetrics
    from fleet.catalog.experiments import ExperimentState, stop_key
    from fleet.catalog.policies.loader import load_policies
    from fleet.control.experiment.effects import Experiment
    from fleet.store import MemoryStore

    def run(b_errors: float, stop: bool = False) -> ExperimentState:
        metrics, store = MemoryMetrics(), MemoryStore()
        ab = Experiment(store, None, metrics, load_policies(ROOT / "policies"), who="test")  # type: ignore[arg-type]
        start = 1_000_000.0
        state = ExperimentState(
            model=MODEL,
            arms=("1.0.0", "1.1.0"),
            split=(50, 50),
            metric="clicked",
            min_effect=0.01,
            alpha=0.05,
            max_duration_s=3600,
            run_id="r",
            started_at=datetime.fromtimestamp(start, UTC),
            ticked_at=start,
        )
        if stop:
            store.put(stop_key(MODEL), b"someone (enough)")
        for second in range(60):
            at = start + second
            metrics.answered(MODEL, "1.0.0", at=at, latency_ms=10, scores=[0.5], count=20)
            failed = round(20 * b_errors)
            metrics.answered(MODEL, "1.1.0", at=at, latency_ms=10, scores=[0.5], count=20 - failed)
            if failed:
                metrics.failed(MODEL, "1.1.0", at=at, count=failed)
            if (second + 1) % 5 == 0:
                state, skipped = ab.look(state, now=at + 1.0)
                assert skipped is None
                if state.status != "running":
                    break
        return state

    harmed = run(0.2)
    assert harmed.status == "stopped" and harmed.summary.startswith("guardrail error_rate"), harmed.summary
    healthy = run(0.0)
    assert healthy.status == "running" and healthy.served["b"]["requests"] == 60 * 20
    stopped = run(0.0, stop=True)
    assert stopped.status == "stopped" and "stopped by someone (enough)" in stopped.summary


# -- on the running fleet ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory, prefect_api: str) -> Iterator[dict]:
    env = FleetEnv(tmp_path_factory.mktemp("experiment"))
    with serving_fleet(env, training=("--rows", "2000", "--epochs", "2")) as fleet:
        env.fleet("models", "train", MODEL, "1.1.0", "--rows", "2000", "--epochs", "2", "--seed", "3")
        yield fleet


class Users:
    """Callers with routing keys (user ids); each answer's ``clicked`` is drawn with the
    probability planted for the version that answered, and sent back as feedback."""

    def __init__(self, fleet: dict, clicked: dict[str, float], seed: int) -> None:
        self.fleet, self.clicked, self.rng = fleet, clicked, np.random.default_rng(seed)
        self.stop, self.events = threading.Event(), []  # (time, user, version answered)
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(2)]

    def __enter__(self) -> Users:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=30)

    def _run(self, worker: int) -> None:
        auth = {"Authorization": f"Bearer {self.fleet['key']}"}
        body = {"inputs": [{"name": "features", "shape": [1, 4], "datatype": "FP32", "data": [1, 0, 0, 0]}]}
        with httpx.Client(base_url=self.fleet["url"], timeout=10) as client:
            i = 0
            while not self.stop.is_set():
                user = f"user-{worker}-{i % 200}"
                i += 1
                r = client.post(f"/v2/models/{MODEL}/infer", headers={**auth, "X-Fleet-Routing-Key": user}, json=body)
                if r.status_code != 200:
                    continue
                version = r.headers["x-fleet-model-version"]
                self.events.append((time.time(), user, version))
                click = float(self.rng.random() < self.clicked[version])
                client.post(
                    "/v1/feedback",
                    headers=auth,
                    json={
                        "model": MODEL,
                        "feedback": [{"request_id": r.headers["x-request-id"], "outcomes": {"clicked": click}}],
                    },
                )


def run_experiment(**params):  # noqa: ANN003, ANN201 - a Prefect State
    from flows.experiment import experiment

    return experiment(MODEL, ["1.0.0", "1.1.0"], **{"metric": "clicked", "tick_s": 1.0, **params}, return_state=True)


def test_an_experiment_with_a_planted_effect_ends_with_that_arm_winning(fleet: dict) -> None:
    from fleet.catalog.routes.store import Router
    from fleet.control.experiment.effects import load

    with Users(fleet, {"1.0.0": 0.2, "1.1.0": 0.8}, seed=1) as users:
        state = run_experiment(min_effect=0.1, max_duration="180s")
    assert state.is_completed(), state.message
    stored = load(fleet["store"], MODEL)
    assert (stored.status, stored.winner) == ("winner", "1.1.0"), stored.summary
    assert stored.ticks[-1].lo > 0 and all(n >= 30 for n in stored.ticks[-1].n)
    # the split served from B's first answer to the decision (a strong effect can be decided
    # within a second or two of the start, so no fixed margin fits inside that window)
    began = min(at for at, _, version in users.events if version == "1.1.0")
    ended = stored.ticks[-1].at
    arms: dict[str, set[str]] = {}
    for at, user, version in users.events:
        if began <= at <= ended:
            arms.setdefault(user, set()).add(version)
    assert all(len(v) == 1 for v in arms.values()), arms  # a user stays in one arm
    assert set().union(*arms.values()) == {"1.0.0", "1.1.0"}
    assert Router(fleet["store"]).get(MODEL).canary is None  # traffic is back on the stable alone


def test_an_experiment_with_no_planted_effect_ends_with_no_difference_or_out_of_time(fleet: dict) -> None:
    from fleet.control.experiment.effects import load

    # With no effect the interval wrongly excludes zero in at most alpha of experiments (the
    # product's promise, checked over seeded runs above); at the default 0.05 this one run would
    # fail about once in every few dozen (it did in a suite run: +0.17 at n=182/166, lower bound
    # +0.0025). At 0.001 the same promise bounds that to one run in a thousand.
    with Users(fleet, {"1.0.0": 0.5, "1.1.0": 0.5}, seed=2):
        state = run_experiment(min_effect=0.35, max_duration="60s", alpha=0.001)
    assert state.is_completed(), state.message
    stored = load(fleet["store"], MODEL)
    assert stored.status in ("no_difference", "out_of_time") and stored.winner is None, stored.summary
