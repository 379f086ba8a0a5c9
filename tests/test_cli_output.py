"""CLI output at 80 columns: tables keep names, versions, hashes and URLs whole, prose wraps
at spaces, and times read as UTC clock times, never as epoch seconds. Through ``table()``
into a rich Console of width 80, and through the real ``fleet`` against a file:// store."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path

import pytest
import yaml
from rich.cells import cell_len
from rich.console import Console

from fleet.cli import _output
from fleet.cli._output import table, when
from tests.quiet import assert_quiet

FLEET = str(Path(sys.executable).with_name("fleet"))
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "demo-classifier"

MODEL = "fraud-detector-eu-west"
VERSIONS = ("1.9.0", "1.10.0-rc.12")
SHA = "d8b26ac825633cd645187bd72da3590c54a6301124838dfc2f24a9d9c57b2d64"
ACTOR = "release-bot@payments-platform"
REASON = "canary at a quarter of traffic while the latency regression is investigated by the on-call team"
URL = "http://127.0.0.1:4200/runs/flow-run/0b1c2d3e-4f50-6172-8394-a5b6c7d8e9f0"
AT = datetime(2026, 12, 1, 14, 2, tzinfo=UTC)
EPOCH = re.compile(r"(?<![\w.])\d{9,}(?![\w.])")  # unix seconds: 9 digits or more


def render(monkeypatch: pytest.MonkeyPatch, title: str | None, columns: list[str], rows: list[list[object]]) -> str:
    """What ``table`` prints on an 80-column terminal, without styles."""
    console = Console(width=80, record=True, color_system=None, force_terminal=False, file=open(os.devnull, "w"))  # noqa: SIM115
    monkeypatch.setattr(_output, "console", console)
    table(title, columns, rows)
    return console.export_text(styles=False)


def tokens(text: str) -> set[str]:
    """Every run of text between spaces and table rules: a word split over two lines is in none."""
    return {t for line in text.splitlines() for t in re.split(r"[\s│┃]+", line) if t}


def whole_in(word: str, found: set[str]) -> bool:
    return any(word in t for t in found)  # "1.10.0-rc.12" is whole in "1.10.0-rc.12:"


def assert_readable(text: str, whole: list[str], prose: list[str] = ()) -> None:
    """No line wider than 80; each identifier whole on one line; each prose word whole."""
    too_wide = [line for line in text.splitlines() if cell_len(line) > 80]
    assert not too_wide, "\n".join(too_wide)
    found = tokens(text)
    for ident in whole:
        assert whole_in(ident, found), f"{ident!r} is split in:\n{text}"
    for sentence in prose:
        split = [w for w in sentence.split() if not whole_in(w, found)]
        assert not split, f"words {split} are split in:\n{text}"


# -- table() at 80 columns -----------------------------------------------------------------------


def test_a_history_with_long_names_and_a_long_reason_keeps_every_name_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    rows = [
        [when(AT), "route", f"r2: stable={VERSIONS[0]} canary={VERSIONS[1]}@25%", ACTOR, REASON],
        [when(AT), "state", f"{VERSIONS[1]}: registered → canary", ACTOR, "route r2: " + REASON],
    ]
    text = render(monkeypatch, f"history of {MODEL}", ["when", "kind", "change", "who", "why"], rows)
    assert_readable(text, [MODEL, VERSIONS[1], f"canary={VERSIONS[1]}@25%", ACTOR], [REASON])


def test_a_table_that_fits_stays_a_table_and_wraps_its_prose_at_spaces(monkeypatch: pytest.MonkeyPatch) -> None:
    rows = [[when(AT), "route", f"r2: stable={VERSIONS[0]} canary={VERSIONS[1]}@25%", "alice", REASON]]
    text = render(monkeypatch, None, ["when", "kind", "change", "who", "why"], rows)
    assert "┃ when" in text and "alice" in text
    assert_readable(text, [f"canary={VERSIONS[1]}@25%", "2026-12-01", "14:02:00"], [REASON])
    assert len(text.splitlines()) > 5, "the reason wraps over several lines rather than widening the table"


def test_a_models_list_too_wide_for_80_columns_prints_records_with_names_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    columns = ["model", "version", "state", "framework", "files", "created", "by"]
    rows = [[MODEL, v, "registered", "torch", 1, when(AT), ACTOR] for v in VERSIONS]
    text = render(monkeypatch, None, columns, rows)
    assert_readable(text, [MODEL, *VERSIONS, ACTOR, "registered", "framework"])
    assert f"created    {when(AT)}" in text.splitlines()  # a record: one field per line, the time whole


def test_a_sha256_and_a_url_are_never_split(monkeypatch: pytest.MonkeyPatch) -> None:
    text = render(
        monkeypatch, None, ["file", "bytes", "sha256", "source"], [["weights/model.safetensors", 1234, SHA, URL]]
    )
    assert_readable(text, [SHA, URL, "weights/model.safetensors"])


def test_only_a_word_wider_than_the_terminal_folds(monkeypatch: pytest.MonkeyPatch) -> None:
    huge = "x" * 150
    text = render(monkeypatch, None, ["name", "value"], [["long", huge], [MODEL, "short"]])
    assert_readable(text, [MODEL, "short"])
    assert "".join(line.strip() for line in text.splitlines() if "x" * 40 in line) == huge


def test_cells_and_titles_print_as_typed_not_as_markup(monkeypatch: pytest.MonkeyPatch) -> None:
    text = render(monkeypatch, "pins [tenant] → version", ["tenant", "why"], [["acme", "keep [bold] as typed"]])
    assert "pins [tenant] → version" in text and "keep [bold] as typed" in text


def test_a_table_without_title_or_rows_still_prints_its_header(monkeypatch: pytest.MonkeyPatch) -> None:
    assert "┃ tenant" in render(monkeypatch, None, ["tenant", "entitlements"], [])


def test_the_demo_summary_reads_at_80_columns(monkeypatch: pytest.MonkeyPatch) -> None:
    from fleet.local.demo import StepResult, summary_table

    outcome = (
        "roll back: error rate canary 12/300 = 4.00 %, stable 1/900 = 0.11 %: +3.89 pp vs allowed "
        "+3.00 pp, above the margin at 95 % (p=0.001)"
    )
    results = [
        StepResult(
            "roll out a good 1.1.0",
            "promoted through every step",
            "promoted through 20 %, 50 %, 100 %",
            True,
            63.2,
            URL,
        ),
        StepResult(
            "roll out a bad 1.2.0 (20 % of requests fail)",
            "rolled back on the error-rate gate",
            outcome * 3,
            True,
            41.0,
        ),
    ]
    text = render(monkeypatch, "fleet demo", *summary_table(results))
    assert_readable(text, [URL, "(p=0.001)", "error-rate"], [results[1].step, results[1].expected])
    assert "…" in text, "a long outcome is cut, at a word"


# -- times ---------------------------------------------------------------------------------------


def test_when_prints_utc_with_the_zone_named() -> None:
    paris = timezone(timedelta(hours=1))
    assert when(datetime(2026, 12, 1, 15, 2, 0, tzinfo=paris)) == "2026-12-01 14:02:00 UTC"
    assert when(datetime(2026, 12, 1, 14, 2, 0)) == "2026-12-01 14:02:00 UTC"  # naive: as the store writes it, UTC
    assert when(None) == ""


def test_clock_turns_epoch_seconds_into_the_same_format() -> None:
    from fleet.cli._output import clock

    assert clock(AT.timestamp() + 9.7) == "2026-12-01 14:02:09 UTC"
    assert clock(None) == ""


def test_a_holding_verdict_says_when_it_fails_as_a_clock_time() -> None:
    from fleet.analysis.canary import judge
    from fleet.catalog.policies.rollout import RolloutPolicy
    from fleet.types import ERROR_CLASSES, LATENCY_BUCKETS_MS, PREDICTION_BINS, ArmWindow

    start = AT.timestamp()
    gates = {"max_error_rate_increase": 0.005, "confidence": 0.95, "max_p99_ratio": 1.2, "max_prediction_psi": 0.2}
    policy = RolloutPolicy.model_validate(
        {"steps": [10, 100], "analysis_window_s": 10, "min_samples": 50, "hold_deadline_s": 129, "gates": gates}
    )

    def empty(version: str) -> ArmWindow:
        return ArmWindow(
            "demo",
            version,
            start,
            start + 60,
            0,
            dict.fromkeys(ERROR_CLASSES, 0),
            (0,) * (len(LATENCY_BUCKETS_MS) + 1),
            (0,) * PREDICTION_BINS,
        )

    v = judge(empty("1.0.0"), empty("1.1.0"), policy, step_started=start)
    assert v.outcome == "hold"
    assert "a failure from 2026-12-01 14:04:09 UTC on" in v.summary
    assert not EPOCH.search(v.summary), v.summary


# -- the real CLI --------------------------------------------------------------------------------


@pytest.fixture
def seeded(tmp_path: Path) -> tuple[str, str]:
    """A file store with two versions of a long-named model, a route with a long reason and a
    tenant entitled to both; returns the store URL and the tenant's key id."""
    from fleet.catalog.registry import Registry, VersionMetadata
    from fleet.catalog.routes.store import Router
    from fleet.catalog.tenants import Quota, Tenants
    from fleet.store import open_store

    url = f"file://{tmp_path / 'store'}"
    store = open_store(url)
    meta = VersionMetadata(**yaml.safe_load((EXAMPLE / "meta.yaml").read_text()))
    for version in VERSIONS:
        Registry(store).register(MODEL, version, EXAMPLE / "artifact", meta, who=ACTOR)
    router = Router(store)
    router.set(MODEL, stable=VERSIONS[0], why="first rollout after the quarterly retraining", who=ACTOR)
    router.set(MODEL, canary=VERSIONS[1], weight=25, why=REASON, who="alice")
    tenant, _ = Tenants(store).create(
        "acme-payments-europe", {MODEL: list(VERSIONS)}, Quota(rps=50, burst=100), who=ACTOR
    )
    return url, tenant.keys[0].id


def fleet(store_url: str, *args: str) -> str:
    env = {**os.environ, "FLEET_STORE": store_url, "COLUMNS": "80", "FLEET_ACTOR": "cli-test"}
    proc = subprocess.run([FLEET, *args], capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert_quiet(proc.stdout + proc.stderr, f"fleet {' '.join(args)}")
    return proc.stdout


def test_fleet_lists_read_at_80_columns_with_utc_times(seeded: tuple[str, str]) -> None:
    url, key_id = seeded
    models = fleet(url, "models", "list")
    assert_readable(models, [MODEL, *VERSIONS, ACTOR, "framework"])
    tenants = fleet(url, "tenants", "list")
    assert_readable(tenants, ["acme-payments-europe", key_id, "entitlements"])
    history = fleet(url, "route", "history", MODEL)
    assert_readable(history, [MODEL, *VERSIONS, f"canary={VERSIONS[1]}@25%", ACTOR], [REASON])
    for text in (models, tenants, history):
        assert re.search(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC", text), text
        assert not EPOCH.search(text), text


def test_fleet_models_show_keeps_the_sha256_whole(seeded: tuple[str, str]) -> None:
    url, _ = seeded
    shown = fleet(url, "models", "show", MODEL, VERSIONS[1])
    digest = re.search(r"\b[0-9a-f]{64}\b", shown)
    assert digest, shown
    assert_readable(shown, [digest.group(0), f"{MODEL}:{VERSIONS[1]}"])
