"""The docs follow the code: every module, file, class, function and ``Class.attribute`` that
README.md and docs/architecture.md name in backticks exists, and the architecture note opens
with the tree and the layer rule that import-linter enforces."""

from __future__ import annotations

import ast
import re
import tomllib
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ("README.md", "docs/architecture.md", "bentos/README.md", "infra/README.md")
PACKAGES = ("fleet", "flows", "bentos", "infra")
# `fleet.rollout.*` and its like are Prefect event names, not modules
EVENTS = re.compile(r"^fleet\.(rollout|experiment|monitor|retrain|rollback|model)\.")
DOTTED = re.compile(r"^(?:fleet|flows|bentos|infra)(?:\.[A-Za-z_][A-Za-z0-9_]*)+(?:\(\))?$")
PATH = re.compile(r"^(?:fleet|flows|bentos|infra|tests|bench|policies)/[\w./-]*$")
MEMBER = re.compile(r"^([A-Z][A-Za-z0-9]+)\.([A-Za-z_][A-Za-z0-9_]*)(?:\(\))?$")


def cited(text: str) -> list[str]:
    """What a document names in backticks (``x`` and `x`), one entry per distinct name."""
    names = re.findall(r"``([^`\n]+)``|`([^`\n]+)`", text)
    return sorted({a or b for a, b in names})


@cache
def module_file(dotted: str) -> Path | None:
    path = ROOT / dotted.replace(".", "/")
    for candidate in (path.with_suffix(".py"), path / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


@cache
def definitions(path: Path) -> dict[str, set[str]]:
    """Top-level names a module defines or imports, each with the attributes its class defines."""
    tree = ast.parse(path.read_text())
    found: dict[str, set[str]] = {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            found[node.name] = _members(node)
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            found[node.name] = set()
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            found.update({t.id: set() for t in targets if isinstance(t, ast.Name)})
        elif isinstance(node, ast.ImportFrom | ast.Import):
            found.update({(a.asname or a.name).split(".")[0]: set() for a in node.names})
    return found


def _members(node: ast.ClassDef) -> set[str]:
    members = set()
    for item in ast.walk(node):
        if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
            members.add(item.name)
        elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
            members.add(item.target.id)
        elif isinstance(item, ast.Assign):
            members.update(t.id for t in item.targets if isinstance(t, ast.Name))
        elif isinstance(item, ast.Attribute) and isinstance(item.value, ast.Name) and item.value.id == "self":
            members.add(item.attr)
    return members


@cache
def classes() -> dict[str, set[str]]:
    """Every class in the product's packages, with its members (methods, fields, self.x)."""
    found: dict[str, set[str]] = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            for name, members in definitions(path).items():
                if name[:1].isupper() and members:
                    found.setdefault(name, set()).update(members)
    return found


def problem(name: str) -> str | None:
    """Why ``name`` names nothing in the code, or None if it does."""
    if PATH.match(name) and not (ROOT / name.rstrip("/")).exists():
        if name.endswith((".py", "/")) or not name.startswith(PACKAGES):
            return "no such file or folder"
        name = name.replace("/", ".")  # `fleet/analysis/canary` or `fleet/analysis/canary.judge`: a module
    elif PATH.match(name):
        return None
    if DOTTED.match(name) and not EVENTS.match(name):
        parts = name.removesuffix("()").split(".")
        for cut in range(len(parts), 0, -1):
            path = module_file(".".join(parts[:cut]))
            if path is None:
                continue
            rest = parts[cut:]
            if not rest:
                return None
            defined = definitions(path)
            if rest[0] not in defined:
                return f"{'.'.join(parts[:cut])} defines no {rest[0]}"
            if len(rest) > 1 and rest[1] not in defined[rest[0]] and rest[0][:1].isupper():
                return f"{rest[0]} has no {rest[1]}"
            return None
        return "no such module"
    if (member := MEMBER.match(name)) and member.group(1) in classes():
        owner, attr = member.groups()
        return None if attr in classes()[owner] else f"class {owner} has no {attr}"
    return None


@pytest.mark.parametrize("doc", DOCS)
def test_every_name_the_docs_cite_exists_in_the_code(doc: str) -> None:
    text = (ROOT / doc).read_text()
    broken = {name: why for name in cited(text) if (why := problem(name)) is not None}
    assert not broken, f"{doc} names what the code does not have: {broken}"


def test_the_checker_catches_a_stale_name() -> None:
    assert problem("fleet.gateway.sinks") is None and problem("fleet/runtime/base.py") is None
    assert problem("fleet.gateway.record") == "no such module" or "defines no" in str(problem("fleet.gateway.record"))
    assert problem("fleet/rollout.py") == "no such file or folder"
    assert problem("fleet.usage.meter.UsageMeter.served") is None
    assert problem("fleet.runtime.base.Runtime.deploy") is None
    assert problem("fleet.runtime.base.Runtime.start") == "Runtime has no start"
    assert problem("fleet.rollout.started") is None  # an event name, not a module


def test_the_architecture_note_opens_with_the_tree_and_the_layer_rule() -> None:
    text = (ROOT / "docs/architecture.md").read_text()
    opening = text[: text.index("\n## ", text.index("\n## ") + 1)]  # up to the second section
    layers = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"][0]["layers"]
    for layer in layers:
        for module in re.split(r"\s*[|:]\s*", layer):
            assert module.split(".")[-1] in opening, f"the opening does not show layer {module}"
    assert "lint-imports" in opening or "import-linter" in opening


def test_the_quick_start_sets_every_secret_the_program_requires() -> None:
    """The README's `pulumi up` steps set, with `--secret`, every key infra/config.py requires
    (the quick start once set three of four, and `pulumi preview` stopped on redisAuthToken)."""
    from infra.config import SECRETS

    text = (ROOT / "README.md").read_text()
    start = text.index("## Production infrastructure (Pulumi)")
    block = text[text.index("```sh", start) : text.index("```\n", text.index("```sh", start) + 5)]
    set_there = set(re.findall(r"pulumi config set --secret (\w+)", block))
    assert set_there == set(SECRETS), (sorted(set(SECRETS) - set_there), sorted(set_there - set(SECRETS)))
    words = ("no", "one", "two", "three", "four", "five", "six", "seven", "eight")
    assert f"the {words[len(SECRETS)]} `pulumi config set --secret` keys below" in text
