"""The ``fleet`` CLI as a user runs it: a subprocess, against a file:// and an S3 store."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.quiet import assert_quiet

FLEET = str(Path(sys.executable).with_name("fleet"))
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "demo-classifier"
POLICIES = Path(__file__).resolve().parents[1] / "policies"


def run(store_url: str, *args: str, ok: bool = True, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "FLEET_STORE": store_url, "FLEET_ACTOR": "cli-test", "COLUMNS": "200"}
    proc = subprocess.run([FLEET, *args], capture_output=True, text=True, env=env, timeout=60, cwd=cwd)
    assert_quiet(proc.stdout + proc.stderr, f"fleet {' '.join(args)}")
    if ok:
        assert proc.returncode == 0, proc.stderr
    return proc


def run_json(store_url: str, *args: str) -> object:
    return json.loads(run(store_url, *args, "--json").stdout)


def register(store_url: str, version: str) -> None:
    run(
        store_url,
        "models",
        "register",
        "demo-classifier",
        version,
        str(EXAMPLE / "artifact"),
        "--meta",
        str(EXAMPLE / "meta.yaml"),
    )


def test_a_new_user_registers_creates_a_tenant_sets_a_canary_and_reads_history(store_url: str, tmp_path: Path) -> None:
    register(store_url, "1.0.0")
    register(store_url, "1.1.0")
    versions = run_json(store_url, "models", "list")
    assert [(v["version"], v["state"]) for v in versions] == [("1.0.0", "registered"), ("1.1.0", "registered")]

    created = run_json(
        store_url, "tenants", "create", "acme", "--model", "demo-classifier", "--rps", "5", "--burst", "10"
    )
    key = created["api_key"]
    assert key.startswith("sfk_") and key not in json.dumps(run_json(store_url, "tenants", "list"))

    run(store_url, "route", "set", "demo-classifier", "--stable", "1.0.0", "--reason", "first rollout")
    route = run_json(
        store_url, "route", "set", "demo-classifier", "--canary", "1.1.0", "--weight", "25", "-r", "canary 25%"
    )
    assert route["canary"] == {"version": "1.1.0", "weight": 25.0} and route["revision"] == 2
    run(store_url, "route", "pin", "demo-classifier", "acme", "1.0.0", "-r", "acme stays")

    history = run_json(store_url, "route", "history", "demo-classifier")
    routes = [e for e in history if e["kind"] == "route"]
    assert [(e["revision"], e["who"], e["why"]) for e in routes] == [
        (1, "cli-test", "first rollout"),
        (2, "cli-test", "canary 25%"),
        (3, "cli-test", "acme stays"),
    ]
    states = [(e["version"], e["after"]) for e in history if e["kind"] == "state"]
    assert ("1.0.0", "stable") in states and ("1.1.0", "canary") in states

    text = run(store_url, "route", "history", "demo-classifier").stdout
    assert "canary=1.1.0@25%" in text and "acme stays" in text
    at = run_json(store_url, "route", "history", "demo-classifier", "--at", "2999-01-01T00:00:00Z")
    assert at["revision"] == 3 and at["pins"] == {"acme": "1.0.0"}

    shown = run_json(store_url, "models", "show", "demo-classifier", "1.1.0", "--verify")
    assert shown["state"] == "canary" and "config.json" in shown["files"]
    run(store_url, "models", "fetch", "demo-classifier", "1.0.0", str(tmp_path / "got"))
    assert (tmp_path / "got" / "config.json").read_bytes() == (EXAMPLE / "artifact" / "config.json").read_bytes()

    run(store_url, "tenants", "revoke", "acme")
    assert all(k["revoked_at"] for k in run_json(store_url, "tenants", "list")[0]["keys"])


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["models", "show", "demo-classifier", "9.9.9"], "demo-classifier:9.9.9 is not registered"),
        (
            [
                "models",
                "register",
                "demo-classifier",
                "1.0",
                str(EXAMPLE / "artifact"),
                "--meta",
                str(EXAMPLE / "meta.yaml"),
            ],
            "not a semantic version",
        ),
        (
            ["route", "set", "demo-classifier", "--canary", "1.0.0", "--weight", "5", "-r", "x"],
            "a canary needs a stable",
        ),
        (["route", "set", "nobody", "--stable", "1.0.0", "-r", "x"], "'nobody' has no registered versions"),
        (["tenants", "create", "acme", "--model", "demo-classifier:latest"], "not a semantic version"),
        (["route", "history", "demo-classifier", "--at", "yesterday"], "expected ISO 8601"),
        (["route", "set", "demo-classifier", "--no-canary", "--canary", "1.0.0", "-r", "x"], "cannot be combined"),
        (["route", "set", "demo-classifier", "-r", "x"], "nothing to change"),
        (["route", "unpin", "demo-classifier", "acme", "-r", "x"], "has no pin"),
        (["tenants", "revoke", "ghost"], "tenant 'ghost' does not exist"),
    ],
)
def test_errors_are_one_line_on_stderr_with_a_nonzero_exit(store_url: str, args: list[str], message: str) -> None:
    register(store_url, "1.0.0")
    proc = run(store_url, *args, ok=False)
    assert proc.returncode == 1
    assert proc.stderr.startswith("error: ") and message in proc.stderr
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr


def test_duplicate_registration_keeps_the_original(store_url: str) -> None:
    register(store_url, "1.0.0")
    before = run_json(store_url, "models", "show", "demo-classifier", "1.0.0")
    proc = run(
        store_url,
        "models",
        "register",
        "demo-classifier",
        "1.0.0",
        str(EXAMPLE / "artifact"),
        "--meta",
        str(EXAMPLE / "meta.yaml"),
        ok=False,
    )
    assert proc.returncode == 1 and "already registered" in proc.stderr
    assert run_json(store_url, "models", "show", "demo-classifier", "1.0.0") == before


def test_bad_metadata_file_names_the_key_and_value(tmp_path: Path) -> None:
    meta = tmp_path / "meta.yaml"
    meta.write_text("framework: torch\ninputs: [{name: x, datatype: FP33, shape: [-1, 4]}]\noutputs: []\n")
    proc = run(
        f"file://{tmp_path / 's'}",
        "models",
        "register",
        "m",
        "1.0.0",
        str(EXAMPLE / "artifact"),
        "--meta",
        str(meta),
        ok=False,
    )
    assert proc.returncode == 1
    assert "inputs[0].datatype: got 'FP33' — expected one of 'BOOL'" in proc.stderr
    assert "outputs: got [] — expected a non-empty list" in proc.stderr
    assert proc.stderr.count("\n") == 1  # several problems, still one line


def test_unknown_store_scheme_is_refused(tmp_path: Path) -> None:
    proc = run("gs://bucket/x", "models", "list", ok=False)
    assert proc.returncode == 1 and "expected file://" in proc.stderr and "s3://" in proc.stderr


def test_usage_errors_exit_2() -> None:
    proc = run("file:///tmp/unused", "route", "set", "demo-classifier", "--stable", "1.0.0", ok=False)
    assert proc.returncode == 2 and "--reason" in proc.stderr


def test_policies_check_passes_on_the_shipped_policies(tmp_path: Path) -> None:
    out = run(f"file://{tmp_path}", "policies", "check", str(POLICIES), "--json").stdout
    assert json.loads(out)["ok"] is True
    bad = tmp_path / "bad.yaml"
    bad.write_text("models:\n  demo:\n    family: x\n    batching: {max_batch_size: -1}\n")
    proc = run(f"file://{tmp_path}", "policies", "check", str(bad), ok=False)
    assert proc.returncode == 1 and "bad.yaml" in proc.stderr and "max_batch_size" in proc.stderr


def test_help_lists_every_command_group() -> None:
    out = run("file:///tmp/unused", "--help").stdout
    for group in ("models", "route", "tenants", "policies"):
        assert group in out


def test_a_tampered_artifact_is_refused_by_name(tmp_path: Path) -> None:
    url = f"file://{tmp_path / 'store'}"
    register(url, "1.0.0")
    (tmp_path / "store" / "models" / "demo-classifier" / "1.0.0" / "artifact" / "config.json").write_text("{}")
    for args in (
        ["models", "fetch", "demo-classifier", "1.0.0", str(tmp_path / "out")],
        ["models", "show", "demo-classifier", "1.0.0", "--verify"],
    ):
        proc = run(url, *args, ok=False)
        assert proc.returncode == 1 and "'config.json' of demo-classifier:1.0.0 fails its checksum" in proc.stderr
    assert not (tmp_path / "out").exists()


def test_promote_then_roll_back_moves_states_and_revoking_twice_is_refused(tmp_path: Path) -> None:
    url = f"file://{tmp_path / 'store'}"
    register(url, "1.0.0")
    register(url, "1.1.0")
    run(url, "route", "set", "demo-classifier", "--stable", "1.0.0", "-r", "first")
    run(url, "route", "set", "demo-classifier", "--canary", "1.1.0", "--weight", "50", "-r", "canary")
    run(url, "route", "set", "demo-classifier", "--stable", "1.1.0", "-r", "promote")
    states = {v["version"]: v["state"] for v in run_json(url, "models", "list")}
    assert states == {"1.0.0": "retired", "1.1.0": "stable"}
    run(url, "route", "set", "demo-classifier", "--stable", "1.0.0", "-r", "roll back")
    states = {v["version"]: v["state"] for v in run_json(url, "models", "list")}
    assert states == {"1.0.0": "stable", "1.1.0": "retired"}

    run(url, "tenants", "create", "acme", "--model", "demo-classifier")
    run(url, "tenants", "revoke", "acme")
    proc = run(url, "tenants", "revoke", "acme", ok=False)
    assert proc.returncode == 1 and "already revoked" in proc.stderr
