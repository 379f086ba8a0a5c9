"""The CLI as the README promises it to an operator: one-line errors, clean help, global
options anywhere, a gateway that says where it listens and logs what it served."""

from __future__ import annotations

import json
import re
import signal
import subprocess
from pathlib import Path

import httpx
import pytest
import typer.main

from fleet.cli import app, hoist_global_options
from tests.gateway_env import BODY, MODEL, GatewayEnv, wait_for
from tests.quiet import assert_quiet
from tests.serving_env import FLEET, free_port, wait_ready


def run(env: GatewayEnv, *args: str) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        [FLEET, *args], env=env.env(COLUMNS="80"), cwd=env.root, capture_output=True, text=True, timeout=60
    )
    assert_quiet(proc.stdout + proc.stderr, f"fleet {' '.join(args)}")
    return proc


def _commands(cmd, path):  # noqa: ANN001, ANN202
    if hasattr(cmd, "commands"):
        for name, sub in cmd.commands.items():
            yield from _commands(sub, [*path, name])
    else:
        yield path, cmd


def test_every_option_is_described_and_help_shows_no_type_boxes(tmp_path: Path) -> None:
    for path, cmd in _commands(typer.main.get_command(app), ["fleet"]):
        for param in cmd.params:
            if param.param_type_name == "option":
                assert param.help, f"{' '.join(path)} {param.opts[0]} has no help"
    env = GatewayEnv(tmp_path)
    for args in (["--help"], ["route", "set", "--help"], ["tenants", "rotate", "--help"], ["gateway", "--help"]):
        out = run(env, *args)
        assert out.returncode == 0, out.stderr
        assert "<bool>" not in out.stdout and "╭" not in out.stdout, out.stdout
        assert max(len(line) for line in out.stdout.splitlines()) <= 80


def test_usage_mistakes_are_one_line_with_exit_2(tmp_path: Path) -> None:
    env = GatewayEnv(tmp_path)
    for args, says in (
        (["route", "set", "m"], "Missing option '--reason'"),
        (["models", "list", "--bogus"], "No such option: --bogus"),
        (["route", "set", "m", "-r", "x", "--weight", "200"], "--weight"),
        (["nosuch"], "No such command 'nosuch'"),
        (["models", "list", "--store"], "--store needs a value"),
    ):
        out = run(env, *args)
        assert out.returncode == 2, (args, out.stderr)
        assert out.stderr.count("\n") == 1 and out.stderr.startswith("error: ") and says in out.stderr, out.stderr


def test_global_options_are_taken_after_the_subcommand(tmp_path: Path) -> None:
    assert hoist_global_options(["models", "list", "--store", "s3://b/p", "--json"]) == [
        "--store",
        "s3://b/p",
        "models",
        "list",
        "--json",
    ]
    assert hoist_global_options(["route", "set", "m", "--store=file:///x", "--", "--store"]) == [
        "--store=file:///x",
        "route",
        "set",
        "m",
        "--",
        "--store",
    ]
    env = GatewayEnv(tmp_path)
    env.register("1.0.0")
    other = f"file://{tmp_path / 'elsewhere'}"
    here = run(env, "models", "list", "--json")
    there = run(env, "models", "list", "--json", "--store", other)
    assert [v["version"] for v in json.loads(here.stdout)] == ["1.0.0"]
    assert json.loads(there.stdout) == [], there.stderr


def test_route_changes_say_when_nothing_changed_and_at_takes_seconds(tmp_path: Path) -> None:
    env = GatewayEnv(tmp_path)
    env.register("1.0.0", "1.1.0")
    env.route(stable="1.0.0")
    first = run(env, "route", "set", MODEL, "--canary", "1.1.0", "--weight", "10", "-r", "canary", "--json")
    assert json.loads(first.stdout)["revision"] == 2
    again = run(env, "route", "set", MODEL, "--weight", "10", "-r", "again", "--json")
    assert again.returncode == 0 and json.loads(again.stdout)["revision"] == 2
    assert "nothing changed" in again.stderr
    replaced = run(env, "route", "set", MODEL, "--canary", "1.0.0-rc.1", "-r", "swap")
    assert replaced.returncode != 0
    at = run(env, "route", "history", MODEL, "--at", "23:59:59", "--json")
    assert at.returncode == 0, at.stderr
    bad = run(env, "route", "history", MODEL, "--at", "25:00:00")
    assert bad.returncode == 1 and "HH:MM:SS" in bad.stderr


def test_fleet_gateway_prints_its_addresses_and_an_access_log(tmp_path: Path) -> None:
    env = GatewayEnv(tmp_path)
    env.register("1.0.0")
    env.stub("1.0.0")
    env.route(stable="1.0.0")
    key = env.tenant("apps")
    port = free_port()
    out_file = tmp_path / "gateway.out"
    with open(out_file, "wb") as out:
        proc = subprocess.Popen(
            [FLEET, "gateway", "--port", str(port), "--access-log"],
            env=env.env(),
            cwd=env.root,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        url = f"http://127.0.0.1:{port}"
        wait_ready(f"{url}/v2/health/ready", proc, out_file)
        wait_for(lambda: "listening on" in out_file.read_text(), what="the start-up lines")
        with httpx.Client(base_url=url, timeout=10) as c:
            r = c.post(
                f"/v2/models/{MODEL}/infer",
                json=BODY,
                headers={"Authorization": f"Bearer {key}", "x-request-id": "req-42"},
            )
            assert r.status_code == 200, r.text
            c.get("/v2/models/%0Aforged%20line/ready")  # a tenant cannot break the log's lines
        wait_for(lambda: "id=req-42" in out_file.read_text(), what="the access-log line")
        text = out_file.read_text()
        assert f"listening on http://127.0.0.1:{port}" in text and f"{url}/metrics" in text
        line = next(ln for ln in text.splitlines() if "id=req-42" in ln)
        assert re.search(rf"POST /v2/models/{MODEL}/infer 200 [\d.]+ms tenant=apps model={MODEL} version=1.0.0", line)
        assert not any(ln.startswith("forged") for ln in text.splitlines())
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        env.stop()


@pytest.mark.parametrize(
    "args",
    [
        ["tenants", "create", "x", "--model", "m", "--rps", "inf", "--burst", "5"],
        ["tenants", "create", "x", "--model", "m", "--rps", "nan", "--burst", "5"],
        ["tenants", "create", "x", "--model", "m:"],
        ["tenants", "create", "x", "--model", "m", "--weight", "inf"],
        ["tenants", "create", "x", "--model", "m", "--weight", "nan"],
        ["tenants", "create", "x", "--model", "m", "--weight", "0"],
        ["tenants", "create", "x", "--model", "m", "--weight", "1e12"],
        ["tenants", "create", "x", "--model", "m", "--rps", "1", "--burst", "1", "--concurrency", "0"],
        ["tenants", "create", "x", "--model", "m", "--concurrency", "4"],
    ],
)
def test_values_that_cannot_be_stored_are_refused_and_nothing_is_written(tmp_path: Path, args: list[str]) -> None:
    env = GatewayEnv(tmp_path)
    env.register("1.0.0")
    out = run(env, *args)
    assert out.returncode in (1, 2) and out.stderr.startswith("error: ") and out.stderr.count("\n") == 1, out.stderr
    assert list(env.store.list("tenants/")) == []


def test_tenants_limits_changes_a_quota_and_weight_and_refuses_what_cannot_be_stored(tmp_path: Path) -> None:
    from fleet.catalog.tenants import Tenants

    env = GatewayEnv(tmp_path)
    env.register("1.0.0")
    env.tenant("acme", rps=5, burst=5)
    before = env.store.get("tenants/acme.json").data
    for args, says in [
        (["--weight", "inf"], "weight inf is not valid"),
        (["--weight", "-1"], "weight -1 is not valid"),
        (["--rps", "2"], "needs both --rps and --burst"),
        ([], "nothing to change"),
        (["--rps", "1", "--burst", "1", "--no-quota"], "contradict"),
        (["--rps", "1", "--burst", "1", "--concurrency", "0"], "concurrency 0 is not valid"),
    ]:
        out = run(env, "tenants", "limits", "acme", *args)
        assert out.returncode == 1 and says in out.stderr and out.stderr.count("\n") == 1, (args, out.stderr)
    assert env.store.get("tenants/acme.json").data == before  # nothing refused was written
    out = run(env, "tenants", "limits", "nobody", "--weight", "2")
    assert out.returncode == 1 and "nobody" in out.stderr
    out = run(
        env,
        "tenants",
        "limits",
        "acme",
        "--rps",
        "50",
        "--burst",
        "100",
        "--concurrency",
        "8",
        "--weight",
        "3",
        "--json",
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["quota"] == {"rps": 50.0, "burst": 100, "concurrency": 8}
    tenant = Tenants(env.store).get("acme")
    assert tenant.weight == 3.0 and tenant.quota.concurrency == 8
    assert run(env, "tenants", "limits", "acme", "--no-quota").returncode == 0
    assert Tenants(env.store).get("acme").quota is None and Tenants(env.store).get("acme").weight == 3.0
