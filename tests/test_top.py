"""``fleet top``: the merge of the gateways' answers (pure), the gateway's ``/admin/top``, and the
live view driven through textual's pilot and the CLI against a real gateway.

The gateway (``fleet gateway``, a subprocess) serves a tabular model with a canary and a
generative one, in front of one stub replica process (``tests/stub_model.py`` answers both
protocols); a rollout record is in the store and a tenant under a 1 request/s quota is
refused. Every process is started once for the module and stopped by PID at its end.
"""

from __future__ import annotations

import asyncio
import json
import math
import subprocess
import time
from datetime import UTC, datetime
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
import yaml

from fleet import records
from fleet.catalog import gateway_directory
from fleet.catalog.registry import Registry, VersionMetadata
from fleet.catalog.rollouts import Phase, RolloutState, StepReport
from fleet.catalog.routes.store import Router
from fleet.catalog.tenants import Quota, Tenants
from fleet.cli.top_merge import Gateway, merge
from fleet.cli.top_read import FleetReader
from fleet.cli.top_text import COLUMNS, cells, num, sort_rows
from fleet.gateway.stats import HORIZON_S
from fleet.gateway.telemetry import Telemetry
from fleet.gateway.top import TopStats
from fleet.types import N_LATENCY
from tests.gateway_env import ADMIN_TOKEN, BODY, FLEET, MODEL, GatewayEnv, model_policy

LM = "stub-lm"
META = set(VersionMetadata.model_fields)
TENSOR_REQUESTS, GENERATIONS = 40, 6


# -- the merge, pure ----------------------------------------------------------------------


def answer(gateway: str, versions: dict[str, dict], *, span: float = 10.0, **tenants: Any) -> dict:  # noqa: ANN401
    return {
        "gateway": gateway,
        "start": 100.0,
        "end": 110.0,
        "since": 0.0,
        "counters_span_s": span,
        "stale": False,
        "models": {
            "m": {"revision": 3, "stable": "1", "canary": ["2", 25.0], "shadow": None, "pins": 0, "versions": versions}
        },
        "tenants": {"active": 2, "requests": 0, "refused": 0, "top": [], "top_refused": [], **tenants},
    }


def hist(**buckets: int) -> list[int]:
    """A latency histogram with counts at bucket indexes: ``hist(b3=5)``."""
    counts = [0] * N_LATENCY
    for k, v in buckets.items():
        counts[int(k[1:])] = v
    return counts


def test_two_gateways_are_summed_with_shares_rates_and_quantiles_from_the_summed_histograms() -> None:
    a = answer(
        "a",
        {
            "1": {"requests": 60, "errors": {"5xx": 3}, "latency_ms": hist(b3=60)[:4], "replicas": 2, "in_flight": 1},
            "2": {"requests": 20, "errors": {"timeout": 1}, "latency_ms": hist(b5=20), "replicas": 1, "shed": 2},
        },
    )
    b = answer(
        "b",
        {
            "1": {"requests": 60, "errors": {}, "latency_ms": hist(b9=60), "replicas": 2, "queue": 4},
            "2": {"requests": 20, "errors": {}, "latency_ms": hist(b5=20), "replicas": 1},
        },
    )
    top = merge([(Gateway("a", "http://a"), a), (Gateway("b", "http://b"), b)], at=111.0, window_s=10)
    one, two = top.rows
    assert (one.version, one.requests, one.rps, one.errors) == ("1", 120, 12.0, {"5xx": 3})
    assert one.error_rate == pytest.approx(3 / 120)
    assert one.share == pytest.approx(0.75) and two.share == pytest.approx(0.25)
    # half the requests in the (3, 5] bucket, half in (30, 50]: the median at 5, p99 near 50
    assert one.p50_ms == pytest.approx(5.0) and one.p99_ms == pytest.approx(30 + 20 * 58.8 / 60)
    assert two.p50_ms == pytest.approx(8.75)  # the middle of (7.5, 10]
    assert (one.replicas, one.in_flight, one.queue) == (2, 1, 4)  # replicas: the same deployments, not summed
    assert (two.shed, two.role, one.role) == (2, "canary 25%", "stable 75%")
    assert one.by_gateway == {"a": 60, "b": 60}
    assert top.models["m"].revisions == [3, 3] and top.models["m"].requests == 160


def test_a_generative_version_has_ttft_quantiles_time_per_token_and_tokens_a_second() -> None:
    v = {"requests": 10, "errors": {}, "latency_ms": hist(b11=10), "tpot_ms": hist(b5=9), "completion_tokens": 400}
    w = {**v, "completion_tokens": 200}
    top = merge(
        [(Gateway("a", ""), answer("a", {"1": v}, span=20.0)), (Gateway("b", ""), answer("b", {"1": w}, span=10.0))],
        at=0.0,
        window_s=10,
    )
    (row,) = top.rows
    assert row.generative and row.tokens_per_s == pytest.approx(400 / 20 + 200 / 10)  # each over its own span
    assert 75 < row.p50_ms < 100 and row.tpot_p50_ms == pytest.approx(8.75)
    assert cells(row)[6] == "40"  # the tok/s column; a tensor version leaves it blank


def test_tenants_are_summed_across_gateways_counted_once_each_and_unread_gateways_are_named() -> None:
    a = answer(
        "a",
        {},
        active=3,
        refused=5,
        top=[{"tenant": "acme", "requests": 50, "refused": 5}, {"tenant": "globex", "requests": 30, "refused": 0}],
        top_refused=[{"tenant": "acme", "refused": 5, "requests": 50}],
    )
    b = answer("b", {}, active=2, top=[{"tenant": "globex", "requests": 40, "refused": 0}])
    down = Gateway("c", "http://c", ok=False, error="unreachable")
    top = merge([(Gateway("a", ""), a), (Gateway("b", ""), b), (down, None)], at=0.0, window_s=10, tenants=1)
    assert [(t.tenant, t.requests) for t in top.tenants] == [("globex", 70)]  # acme's 50 once, not twice
    assert [(t.tenant, t.refused) for t in top.tenants_refused] == [("acme", 5)]
    assert (top.refused, top.refused_per_s, top.tenants_active) == (5, 0.5, 3)
    assert [g.id for g in top.gateways if not g.ok] == ["c"]


def test_a_gateway_younger_than_the_window_is_rated_over_its_life_and_json_has_no_nan() -> None:
    young = answer("a", {"1": {"requests": 10, "errors": {}, "latency_ms": []}}) | {"since": 108.0}
    top = merge([(Gateway("a", ""), young)], at=0.0, window_s=10)
    assert top.rows[0].rps == pytest.approx(5.0) and top.rows[0].p50_ms is None
    json.dumps(top.to_json(), allow_nan=False)


def test_numbers_fit_their_columns_and_a_row_fits_80_columns() -> None:
    assert [num(v) for v in (None, 0, 0.5, 12.345, 842.1, 1234.5, 12345, 1.2e6)] == [
        "-",
        "0",
        "0.50",
        "12.35",
        "842.1",
        "1234",
        "12345",
        "1.20M",
    ]
    assert sum(w for _, w in COLUMNS) + len(COLUMNS) - 1 <= 78


# -- the gateway's side, in process --------------------------------------------------------


def test_the_top_answer_holds_what_the_windowed_stats_hold_and_counters_over_the_span_said() -> None:
    """The one-pass sum over every model equals ``/admin/stats``'s per model (the slot layout is
    shared), and counters are differenced against a sample at least the window old."""
    clock = [1000.0]
    telemetry = Telemetry(lambda: iter(()))
    telemetry.stats._clock = lambda: clock[0]
    table = SimpleNamespace(
        revision=4, stable="1", canary=None, shadow=None, pins={}, referenced_versions=lambda: {"1"}
    )
    view = SimpleNamespace(
        snapshot=SimpleNamespace(routes={"m": table}, endpoints={("m", "1"): ("http://r1", "http://r2")}), stale=False
    )
    upstreams = SimpleNamespace(pools=lambda: {})
    top = TopStats(view, telemetry, upstreams, "gw", clock=lambda: clock[0], monotonic=lambda: clock[0])  # type: ignore[arg-type]
    for i in range(30):
        clock[0] = 1000.0 + i / 3
        telemetry.stats.answered("m", "1", 3.0 + i, None)
        telemetry.stats.failed("m", "2", "timeout")
        telemetry.finished("m", "1", "acme", 200, 1.0)
        telemetry.finished("m", "none", "tiny", 429, 1.0)
    first = asyncio.run(top.answer(10, 5))
    expected = telemetry.stats.window("m", 10)[2]
    for version in ("1", "2"):
        got = first["models"]["m"]["versions"][version]
        assert got["requests"] == expected[version]["requests"] > 0
        assert got.get("errors", {}) == {c: n for c, n in expected[version]["errors"].items() if n}  # zeros left out
        padded = got["latency_ms"] + [0] * (N_LATENCY - len(got["latency_ms"]))
        assert padded == expected[version]["latency_ms"]
    assert first["models"]["m"]["versions"]["1"]["replicas"] == 2 and first["models"]["m"]["revision"] == 4
    assert first["counters_span_s"] == pytest.approx(29 / 3, abs=1e-3)  # the first look: since it started
    assert first["tenants"]["top"] == [
        {"tenant": "acme", "requests": 30, "refused": 0},
        {"tenant": "tiny", "requests": 30, "refused": 30},  # refused requests are traffic too
    ]
    assert first["tenants"]["top_refused"] == [{"tenant": "tiny", "refused": 30, "requests": 30}]
    assert first["models"]["m"]["refused"] == 30
    clock[0] += 12  # later looks: what changed since a sample at least the window old
    telemetry.finished("m", "1", "acme", 200, 1.0)
    later = asyncio.run(top.answer(10, 5))
    assert later["counters_span_s"] == pytest.approx(12) and later["tenants"]["top"][0]["requests"] == 1
    assert later["tenants"]["refused"] == 0 and later["models"]["m"]["versions"]["1"]["requests"] == 0
    assert HORIZON_S >= 60


# -- against a running gateway ---------------------------------------------------------------


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    e = GatewayEnv(tmp_path_factory.mktemp("top"))
    try:
        policies = e.root / "policies" / "fleet.yaml"
        doc = yaml.safe_load(policies.read_text())
        doc["models"][LM] = model_policy(
            generative=True, family="tiny-lm", timeout_ms=5000, generation={"max_tokens": 32, "default_max_tokens": 8}
        )
        policies.write_text(yaml.safe_dump(doc))
        e.register("1.0.0", "1.1.0")
        registry = Registry(e.store)
        tensor = registry.get(MODEL, "1.0.0")
        registry.register(LM, "1.0.0", e.root / "artifact", VersionMetadata(**tensor.model_dump(include=META)))
        replica = e.stub("1.0.0")  # the stub answers tensors and generations: one process for both models
        e.endpoints[f"{MODEL}:1.1.0"] = [replica]
        e.endpoints[f"{LM}:1.0.0"] = [replica]
        e.write_endpoints()
        e.route(stable="1.0.0")
        e.route(canary="1.1.0", weight=30)
        Router(e.store).set(LM, stable="1.0.0", why="test")
        tenants = Tenants(e.store)
        key = tenants.create("apps", {MODEL: ["*"], LM: ["*"]}, None)[1]
        tiny = tenants.create("tiny", {MODEL: ["*"]}, Quota(rps=0.01, burst=1))[1]
        now = datetime.now(UTC)
        rollout = RolloutState(
            model=MODEL,
            version="1.1.0",
            champion="1.0.0",
            run_id="run-1",
            phase=Phase.STEP,
            step=1,
            weight=30,
            reports=[
                StepReport(
                    phase="step",
                    weight=30,
                    started=time.time(),
                    summary="holding: 12 of 200 canary requests",
                    gates=[{"gate": "samples", "status": "pending", "observed": "12", "allowed": "200"}],
                    canary_requests=12,
                    stable_requests=28,
                    ticks=3,
                )
            ],
            started_at=now,
            updated_at=now,
        )
        e.store.put("rollouts/stub-model.json", records.dump(rollout))
        url, _ = e.gateway()
        with httpx.Client(base_url=url, timeout=10) as client:
            for _ in range(TENSOR_REQUESTS):
                r = client.post(f"/v2/models/{MODEL}/infer", json=BODY, headers={"Authorization": f"Bearer {key}"})
                assert r.status_code == 200, r.text
            for _ in range(GENERATIONS):
                r = client.post(
                    "/v1/completions",
                    json={"model": LM, "prompt": "abcdef", "max_tokens": 8},
                    headers={"Authorization": f"Bearer {key}"},
                )
                assert r.status_code == 200, r.text
            codes = [
                client.post(f"/v2/models/{MODEL}/infer", json=BODY, headers={"Authorization": f"Bearer {tiny}"})
                for _ in range(3)
            ]
            assert [c.status_code for c in codes].count(429) == 2
        gateway_id = gateway_directory.live(e.store)[0].id
        yield SimpleNamespace(env=e, url=url, gateway=gateway_id)
    finally:
        e.stop()


def test_admin_top_answers_every_model_with_the_scoped_stats_credential(fleet) -> None:  # noqa: ANN001
    auth = {"Authorization": gateway_directory.credential(ADMIN_TOKEN, "stats", fleet.gateway)}
    r = httpx.get(f"{fleet.url}/admin/top", params={"window_s": 60, "tenants": 5}, headers=auth)
    assert r.status_code == 200, r.text
    body = r.json()
    tensor, lm = body["models"][MODEL], body["models"][LM]
    assert tensor["canary"] == ["1.1.0", 30.0] and tensor["revision"] >= 2
    served = tensor["versions"]["1.0.0"]["requests"] + tensor["versions"]["1.1.0"]["requests"]
    assert served == TENSOR_REQUESTS + 1 and tensor["refused"] == 2  # tiny had one before its quota ran out
    gen = lm["versions"]["1.0.0"]
    assert gen["requests"] == GENERATIONS and gen["completion_tokens"] == 8 * GENERATIONS and gen["tpot_ms"]
    assert gen["replicas"] == 1 and "in_flight" not in gen and "queue" not in gen  # zeros are left out
    top = body["tenants"]
    assert top["top"][0] == {"tenant": "apps", "requests": TENSOR_REQUESTS + GENERATIONS, "refused": 0}
    assert top["top_refused"] == [{"tenant": "tiny", "refused": 2, "requests": 3}]
    only = httpx.get(f"{fleet.url}/admin/top", params={"match": "lm"}, headers=auth).json()
    assert list(only["models"]) == [LM]  # the viewer's filter: the other models left out at the source
    bad = httpx.get(f"{fleet.url}/admin/top", params={"window_s": 61}, headers=auth)
    assert bad.status_code == 400 and "from 1 to 60" in bad.text
    assert httpx.get(f"{fleet.url}/admin/top", params={"window_s": "²"}, headers=auth).status_code == 400
    for hostile in ({"window_s": "9" * 5000}, {"tenants": "9" * 5000}, {"tenants": 51}, {"match": "m" * 129}):
        r = httpx.get(f"{fleet.url}/admin/top", params=hostile, headers=auth)  # refused, never a 500
        assert r.status_code == 400, (list(hostile), r.status_code, r.text[:200])
    assert httpx.get(f"{fleet.url}/admin/top").status_code == 401
    other = gateway_directory.credential(ADMIN_TOKEN, "refresh", fleet.gateway)  # another purpose's
    assert httpx.get(f"{fleet.url}/admin/top", headers={"Authorization": other}).status_code == 401


def rows(app) -> list[tuple[str, str, str]]:  # noqa: ANN001
    from textual.widgets import DataTable

    table = app.query_one(DataTable)
    return [tuple(str(c) for c in table.get_row_at(i)[:3]) for i in range(table.row_count)]


def shown(app, selector: str) -> str:  # noqa: ANN001
    from textual.widgets import Static

    return str(app.query_one(selector, Static).content)


def test_the_live_view_shows_sorts_filters_and_opens_a_version(fleet) -> None:  # noqa: ANN001
    from fleet.cli.top_view import Detail, TopApp

    async def scenario() -> None:
        app = TopApp(FleetReader(fleet.env.store, ADMIN_TOKEN, window_s=60), interval=0.5)
        async with app.run_test(size=(80, 30)) as pilot:

            async def until(condition, what: str) -> None:  # noqa: ANN001
                deadline = time.monotonic() + 10
                while not condition():
                    assert time.monotonic() < deadline, f"timed out waiting for {what}"
                    await pilot.pause(0.05)

            await until(lambda: app.refreshes >= 1 and rows(app), "the first refresh")
            assert [r[:2] for r in rows(app)] == [(LM, "1.0.0"), (MODEL, "1.0.0"), (MODEL, "1.1.0")]
            assert all(float(r[2]) > 0 for r in rows(app))  # requests/s of every version
            assert "1/1 gateways" in shown(app, "#head") and "sort model" in shown(app, "#head")
            progress = shown(app, "#progress")
            assert "stub-model canary 1.0.0→1.1.0: step 2, weight 30%, 12/28 req" in progress
            assert "holding: 12 of 200" in progress
            assert "tiny 2" in shown(app, "#tenants") and "apps" in shown(app, "#tenants")
            from textual.widgets import DataTable

            table = app.query_one(DataTable)
            assert table.virtual_size.width <= 80 and table.max_scroll_x == 0  # 80 columns, nothing cut

            await pilot.press("s")  # model → rps: the busiest version first
            by_rps = sort_rows(app.top.rows, "rps")
            assert [r[:2] for r in rows(app)] == [(r.model, r.version) for r in by_rps]
            assert rows(app)[0][:2] == (MODEL, "1.0.0") and "sort rps" in shown(app, "#head")

            await pilot.press("f", *"lm", "enter")  # only the models whose name holds "lm"
            assert [r[:2] for r in rows(app)] == [(LM, "1.0.0")]
            await pilot.press("enter")  # the version's detail
            await until(lambda: isinstance(app.screen, Detail), "the detail screen")
            detail = str(app.screen.query_one("#detail").content)
            assert f"{LM} 1.0.0  stable 100%" in detail and "time to first token p50" in detail
            assert f"requests by gateway:\n  {fleet.gateway} {GENERATIONS}" in detail
            await pilot.press("escape")
            await until(lambda: not isinstance(app.screen, Detail), "back to the table")

            await pilot.press("f", *["backspace"] * 2, "enter")  # an empty filter: every model again
            await until(lambda: len(rows(app)) == 3, "every model again")
            await pilot.press("q")

    asyncio.run(scenario())


def fleet_top(fleet, *args: str, **env: str) -> subprocess.CompletedProcess[str]:  # noqa: ANN001
    return subprocess.run(
        [FLEET, "top", *args],
        env={**fleet.env.env(), "COLUMNS": "80", **env},
        capture_output=True,
        text=True,
        timeout=60,
        cwd=fleet.env.root,
    )


def test_once_prints_one_plain_table_within_80_columns_and_json_the_merged_snapshot(fleet) -> None:  # noqa: ANN001
    once = fleet_top(fleet, "--once", "--window", "60", "--sort", "rps")
    assert once.returncode == 0, once.stderr
    lines = once.stdout.splitlines()
    assert max(len(line) for line in lines) <= 80 and "\x1b" not in once.stdout  # plain: no escapes
    table = [line.split() for line in lines if line.startswith("stub-") and "→" not in line]
    assert [t[:2] for t in table][0] == [MODEL, "1.0.0"] and len(table) == 3
    assert any("canary 1.0.0→1.1.0" in line for line in lines)
    assert any(line.startswith("quota refusals") and "tiny 2" in line for line in lines)

    as_json = fleet_top(fleet, "--json", "--window", "60", "--model", "lm")
    assert as_json.returncode == 0, as_json.stderr
    top = json.loads(as_json.stdout)
    (row,) = top["rows"]
    assert (row["model"], row["requests"], row["generative"]) == (LM, GENERATIONS, True)
    assert row["tokens_per_s"] > 0 and not math.isnan(row["p50_ms"])
    assert top["gateways"][0]["ok"] and top["progress"][0]["kind"] == "rollout"


def test_errors_say_what_is_wrong_and_what_to_do(fleet, tmp_path: Path) -> None:  # noqa: ANN001
    no_token = fleet_top(fleet, "--once", FLEET_ADMIN_TOKEN="")
    assert no_token.returncode == 1 and "set FLEET_ADMIN_TOKEN" in no_token.stderr
    empty = fleet_top(fleet, "--once", FLEET_STORE=f"file://{tmp_path / 'empty'}")
    assert empty.returncode == 1 and "start one with `fleet up` or `fleet gateway`" in empty.stderr
    wrong = fleet_top(fleet, "--once", FLEET_ADMIN_TOKEN="not-the-token")
    assert wrong.returncode == 1 and "refused the admin token" in wrong.stderr
