"""The layer rule of docs/architecture.md, as ``make test`` enforces it: import-linter's
contracts in pyproject.toml hold for the tree, and break on an upward import or a circle."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINT = str(Path(sys.executable).with_name("lint-imports"))


def lint(root: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([LINT, "--no-cache"], cwd=root, capture_output=True, text=True, timeout=120)


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """A copy of the packages the contracts cover, to plant imports in."""
    for name in ("fleet", "flows"):
        shutil.copytree(ROOT / name, tmp_path / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    return tmp_path


def plant(tree: Path, module: str, line: str) -> None:
    path = tree / (module.replace(".", "/") + ".py")
    path.write_text(path.read_text() + f"\n{line}  # planted by the test\n")


def test_the_tree_keeps_every_contract() -> None:
    result = lint(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Contracts: 2 kept, 0 broken." in result.stdout


@pytest.mark.parametrize(
    ("module", "line", "says"),
    [
        (
            "fleet.catalog.registry",
            "from fleet.control import lazy",
            "fleet.catalog is not allowed to import fleet.control",
        ),
        ("fleet.records", "from fleet.catalog import tenants", "is not allowed to import fleet.catalog"),
        (
            "fleet.gateway.telemetry",
            "from fleet.control import doctor",
            "fleet.gateway is not allowed to import fleet.control",
        ),
        (
            "fleet.runtime.local",
            "from fleet.analysis import canary",
            "fleet.runtime is not allowed to import fleet.analysis",
        ),
        ("fleet.logs.inference", "from fleet.usage import meter", "fleet.logs is not allowed to import fleet.usage"),
        ("fleet.control.doctor", "import flows.rollout", "fleet.control is not allowed to import flows"),
    ],
    ids=[
        "catalog-imports-control",
        "kernel-imports-catalog",
        "gateway-imports-control",
        "runtime-imports-analysis",
        "logs-imports-usage",
        "control-imports-flows",
    ],
)
def test_an_upward_or_sideways_import_breaks_the_layers(tree: Path, module: str, line: str, says: str) -> None:
    plant(tree, module, line)
    result = lint(tree)
    assert result.returncode != 0 and says in result.stdout, result.stdout


def test_only_the_gateways_composition_root_may_wire_control(tree: Path) -> None:
    plant(tree, "fleet.gateway.app", "from fleet.control import lazy as _lazy")
    assert lint(tree).returncode == 0  # app.py is allowed: it wires the memory budget's room-maker
    plant(tree, "fleet.gateway.activate", "from fleet.control import lazy as _lazy")
    result = lint(tree)
    assert result.returncode != 0 and "fleet.gateway.activate -> fleet.control.lazy" in result.stdout


def test_an_import_circle_breaks_the_build(tree: Path) -> None:
    plant(tree, "fleet.planning.stack", "from fleet.planning import planner as _planner")
    result = lint(tree)
    assert result.returncode != 0 and "No cycles are allowed in fleet.planning" in result.stdout, result.stdout
