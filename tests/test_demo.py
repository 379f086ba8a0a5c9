"""What the flow commands refuse before starting anything. `fleet demo` needs the local fleet (the scenario
runs the flows the end-to-end tests cover; its last run is in the closing note of issue 6)."""

from __future__ import annotations

import subprocess
from pathlib import Path

from tests.quiet import assert_quiet
from tests.serving_env import FLEET


def test_demo_without_a_running_fleet_says_how_to_start_one(tmp_path: Path) -> None:
    out = subprocess.run(
        [FLEET, "demo"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "FLEET_STORE": f"file://{tmp_path / 'store'}"},
    )
    assert out.returncode == 1
    assert out.stderr.startswith("error: no local fleet is running here; start it with `make up`")
    assert "Traceback" not in out.stderr
    assert_quiet(out.stdout + out.stderr, "fleet demo")


def test_rollout_refuses_a_bad_policy_override_before_starting_anything(tmp_path: Path) -> None:
    out = subprocess.run(
        [FLEET, "rollout", "demo-classifier", "1.1.0", "--set", "steps=[50,10]"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env={
            "PATH": "/usr/bin:/bin",
            "HOME": str(tmp_path),
            "PREFECT_API_URL": "http://127.0.0.1:1/api",
            "FLEET_POLICIES": str(Path(__file__).resolve().parents[1] / "policies"),
        },
    )
    assert out.returncode == 1 and "steps: got [50, 10] — expected strictly increasing" in out.stderr
    assert_quiet(out.stdout + out.stderr, "fleet rollout")
