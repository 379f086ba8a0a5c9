"""README's "Walkthroughs", run as written: one real ``fleet up`` (as tests/test_up.py starts it)
for the module, and per walkthrough the blocks README.md marks ``<!-- walkthrough: NAME -->``
run in the folder where ``fleet up`` runs, as a user would from a second terminal.

A walkthrough's ``sh`` blocks become one bash script (``set -euo pipefail``) and its ``python``
blocks run in their place, with the venv's python and the script's exported variables. The
README assumes fleet up's default ports; the blocks are rewritten to this module's. The CLI
finds the fleet's admin token and Prefect server in ``./.fleet`` by itself, so none of that is
in the environment the blocks get. Every process is stopped at the end, by the marker in its
environment.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.quiet import assert_quiet
from tests.rollout_env import Load
from tests.serving_env import ROOT, free_port
from tests.test_up import kill_marked, processes_with, start_up

README = ROOT / "README.md"
BLOCK = re.compile(r"^<!-- walkthrough: ([\w-]+) -->\n```(sh|python)\n(.*?)^```$", re.M | re.S)
DEFAULT_PORTS = {"gateway": 8000, "grpc": 8001, "prefect": 4200}
# what the CLI would otherwise take from this test process instead of ./.fleet
NOT_PASSED = ("PREFECT_API_URL", "PREFECT_HOME", "FLEET_ADMIN_TOKEN", "FLEET_STORE", "FLEET_REDIS_URL")


def blocks(name: str) -> list[tuple[str, str]]:
    """(language, code) of each block README.md marks for walkthrough ``name``, in order."""
    found = [(lang, code) for who, lang, code in BLOCK.findall(README.read_text()) if who == name]
    assert found, f"README.md has no block marked <!-- walkthrough: {name} -->"
    return found


def script(name: str, ports: dict[str, int]) -> str:
    """The walkthrough as one bash script, on this module's ports."""
    parts = ["set -euo pipefail"]
    for i, (lang, code) in enumerate(blocks(name)):
        for what, default in DEFAULT_PORTS.items():
            code = code.replace(f"127.0.0.1:{default}", f"127.0.0.1:{ports[what]}")
        if lang == "sh":
            parts.append(code)
        else:
            end = f"WALKTHROUGH_PY_{i}"
            parts.append(f"{shlex.quote(sys.executable)} - <<'{end}'\n{code}{end}")
    return "\n".join(parts) + "\n"


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    folder = tmp_path_factory.mktemp("walkthroughs")
    shutil.copy(ROOT / "Pulumi.dev.yaml", folder)  # the folder stands in for the checkout: `fleet plan --stack dev`
    marker = uuid.uuid4().hex
    env = {k: v for k, v in os.environ.items() if k not in NOT_PASSED}
    env.update(
        FLEET_POLICIES=str(ROOT / "policies"),
        FLEET_TEST_MARKER=marker,
        PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '/usr/bin:/bin')}",
    )
    ports = {what: free_port() for what in DEFAULT_PORTS}
    proc = None
    try:
        proc, key = start_up(folder, env, ports["gateway"], ports["prefect"], "--grpc-port", str(ports["grpc"]))
        yield {"folder": folder, "env": env, "ports": ports, "demo_key": key, "ran": {}}
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0
        deadline = time.monotonic() + 15
        while processes_with(marker) and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
        kill_marked(marker)


def walk(fleet: dict, name: str) -> str:
    """Run walkthrough ``name`` once (later calls answer what it printed); its output, checked."""
    if name not in fleet["ran"]:
        code = script(name, fleet["ports"])
        started = time.monotonic()
        done = subprocess.run(
            ["bash", "-c", code],
            cwd=fleet["folder"],
            env=fleet["env"],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=480,
        )
        print(f"--- walkthrough {name} ({time.monotonic() - started:.0f} s):\n{done.stdout}")
        assert done.returncode == 0, f"walkthrough {name} exited {done.returncode}:\n{code}\n--- output:\n{done.stdout}"
        assert_quiet(done.stdout, f"walkthrough {name}")
        fleet["ran"][name] = done.stdout
    return fleet["ran"][name]


def prefect(fleet: dict) -> httpx.Client:
    return httpx.Client(base_url=f"http://127.0.0.1:{fleet['ports']['prefect']}/api", timeout=10)


def test_infra_engineer_plans_then_puts_a_first_model_live(fleet: dict) -> None:
    out = walk(fleet, "infra-engineer")
    assert "whole stack:" in out and "GPU ceiling" in out  # fleet plan
    assert "demo-classifier" in out and "heartbeat" in out  # fleet status: the model and the gateway
    assert "registered demo-lm:1.0.0" in out and "demo-lm:1.0.0 ready at" in out
    # the curl answer: a generation by the version just routed
    assert re.search(r'\{"model_name":"demo-lm","model_version":"1.0.0","text_output":"[^"]*","finish_reason"', out), (
        out
    )


def test_ml_engineer_rolls_out_blue_green_watches_and_rolls_back(fleet: dict) -> None:
    from fleet.catalog.routes.store import Router
    from fleet.store import open_store

    url = f"http://127.0.0.1:{fleet['ports']['gateway']}"
    load = Load(url, fleet["demo_key"], rps=20).start()  # the live traffic the gates judge
    try:
        deadline = time.monotonic() + 60
        while load.ok < 20 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert load.ok >= 20, load.report()
        out = walk(fleet, "ml-engineer")
    finally:
        load.stop()
    print(load.report())
    assert "promoted demo-classifier:1.1.0; 1.0.0 stays ready" in out, out
    assert "blue-green 1.0.0→1.1.0: promoted" in out, out  # fleet top: the rollout and its verdict
    assert re.search(r"^demo-classif\S*\s+1\.1\.0\s+\d", out, re.M), out  # ... and 1.1.0's row, with traffic
    assert "demo-classifier: traffic moved to 1.0.0" in out, out
    assert not load.failures, load.report()
    store = open_store(f"file://{fleet['folder'] / '.fleet' / 'store'}")
    assert Router(store).get("demo-classifier").stable == "1.0.0"

    # the runs behind both commands, in the Prefect server the printed link points at
    link = re.search(rf"http://127\.0\.0\.1:{fleet['ports']['prefect']}/runs/flow-run/([0-9a-f-]{{36}})", out)
    assert link, out
    with prefect(fleet) as api:
        run = api.get(f"/flow_runs/{link.group(1)}").json()
        assert run["name"] == "rollout demo-classifier 1.1.0"
        assert api.get(f"/deployments/{run['deployment_id']}").json()["name"] == "rollout"
        rollbacks = api.post(
            "/flow_runs/filter", json={"flow_runs": {"name": {"any_": ["rollback demo-classifier"]}}}
        ).json()
        assert [r["state_type"] for r in rollbacks] == ["COMPLETED"]


def test_application_team_calls_with_curl_triton_and_openai(fleet: dict) -> None:
    walk(fleet, "infra-engineer")  # demo-lm live: the infra walkthrough's first model
    out = walk(fleet, "application-team")
    assert re.search(r'"model_name":"demo-classifier","model_version":"[\d.]+".*"name":"probabilities"', out), out
    triton = re.search(r"^triton: \[\[([\d.]+), ([\d.]+)\], \[([\d.]+), ([\d.]+)\]\]$", out, re.M)
    assert triton, out
    rows = [float(v) for v in triton.groups()]
    assert abs(rows[0] + rows[1] - 1) < 0.01 and abs(rows[2] + rows[3] - 1) < 0.01
    assert re.search(r"^openai: (['\"]).*\1 \d+ tokens$", out, re.M), out  # the text's repr, its usage
