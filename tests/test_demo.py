"""`fleet demo` needs the local fleet: without one it says how to start it (the scenario itself
runs the flows the end-to-end tests cover; its last run is in the closing note of issue 6)."""

from __future__ import annotations

import subprocess
from pathlib import Path

from tests.serving_env import FLEET


def test_demo_without_a_running_fleet_says_how_to_start_one(tmp_path: Path) -> None:
    out = subprocess.run([FLEET, "demo"], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                         env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "FLEET_STORE": f"file://{tmp_path / 'store'}"})  # fmt: skip
    assert out.returncode == 1
    assert out.stderr.startswith("error: no local fleet is running here; start it with `make up`")
    assert "Traceback" not in out.stderr
