"""A new user's first commands print the fleet's own lines only (issue 32): what libraries print
(torchao's "Failed to load …so", torch's deprecations, Python warnings) is kept off the
terminal unless ``-v`` asks for it; a version the registry would refuse at the end of the
training is refused before it; training shows its steps as it goes."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from tests.quiet import assert_quiet, noise

ROOT = Path(__file__).resolve().parents[1]


def fleet(tmp: Path, *args: str, extra_path: Path | None = None) -> tuple[subprocess.CompletedProcess[str], float]:
    """``python -m fleet *args`` as a user runs it, in ``tmp``; (the process, seconds it took)."""
    env = {
        **os.environ,
        "FLEET_STORE": f"file://{tmp / 'store'}",
        "FLEET_POLICIES": str(ROOT / "policies"),
        "FLEET_ACTOR": "quiet-test",
        "COLUMNS": "200",
    }
    if extra_path is not None:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(extra_path), env.get("PYTHONPATH")) if p)
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "fleet", *args], env=env, cwd=tmp, capture_output=True, text=True, timeout=300
    )
    return proc, time.monotonic() - started


def test_training_prints_only_the_fleets_lines_and_a_registered_version_is_refused_before_any_work(
    tmp_path: Path,
) -> None:
    # tiny-lm imports transformers, which imports torchao: its C extensions and torch's pytree
    # deprecations print on import here when nothing keeps them
    trained, took = fleet(tmp_path, "models", "train", "demo-lm", "1.0.0", "--preset", "test", "--steps", "40")
    assert trained.returncode == 0, trained.stderr
    assert_quiet(trained.stdout + trained.stderr, "fleet models train")
    assert "registered demo-lm:1.0.0" in trained.stdout
    assert "training demo-lm:1.0.0: 1/40 steps" in trained.stderr and "40/40 steps" in trained.stderr

    again, refused_in = fleet(tmp_path, "models", "train", "demo-lm", "1.0.0", "--preset", "test", "--steps", "40")
    assert again.returncode == 1 and again.stdout == ""
    assert again.stderr == (
        "error: demo-lm:1.0.0 is already registered (versions are immutable); expected a new version, "
        "e.g. 1.0.1 (see `fleet models list demo-lm`)\n"
    )
    # refused before the trainer ran (no step, no line of it) and before torch was imported
    assert refused_in < took / 2, (refused_in, took)

    for args in (("quantize", "demo-lm", "1.0.0", "1.0.0"), ("distill", "demo-lm", "1.0.0", "1.0.0")):
        proc, _ = (
            fleet(tmp_path, "models", *args, "--preset", "student-test")
            if args[0] == "distill"
            else fleet(tmp_path, "models", *args)
        )
        assert proc.returncode == 1 and "steps" not in proc.stderr, proc.stderr
        assert "demo-lm:1.0.0 is already registered (versions are immutable); expected a new version" in proc.stderr
        assert_quiet(proc.stdout + proc.stderr, f"fleet models {args[0]}")

    missing, _ = fleet(tmp_path, "models", "train", "demo-lm", "1.1.0", "--parent", "0.9.0")
    assert missing.returncode == 1 and "demo-lm:0.9.0 is not registered (registered: 1.0.0)" in missing.stderr


NOISY_LIBRARY = '''
import logging, sys, warnings

_said = []


def _noise(event, args):
    """A library as torchao is: a warning and a "Failed to load" log line, on its import by the trainer."""
    if event == "import" and args[0] == "bentos.tabular_mlp.data" and not _said:
        _said.append(True)
        warnings.warn_explicit("noisylib's old API is deprecated", FutureWarning, "/opt/noisylib/api.py", 7)
        logging.getLogger("noisylib").warning("Failed to load /opt/noisylib/_C.so: undefined symbol")


sys.addaudithook(_noise)
'''


def test_what_libraries_print_is_kept_off_the_terminal_unless_verbose(tmp_path: Path) -> None:
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    (hooks / "sitecustomize.py").write_text(NOISY_LIBRARY)
    train = ("models", "train", "demo-classifier")
    small = ("--rows", "500", "--epochs", "2")

    quiet, _ = fleet(tmp_path, *train, "1.0.0", *small, extra_path=hooks)
    assert quiet.returncode == 0, quiet.stderr
    assert_quiet(quiet.stdout + quiet.stderr)
    assert "noisylib" not in quiet.stderr
    assert quiet.stderr.splitlines() == [
        "training demo-classifier:1.0.0: 1/2 epochs",
        "training demo-classifier:1.0.0: 2/2 epochs",
    ]

    for verbose in (("-v", *train, "1.0.1", *small), (*train, "1.0.2", *small, "--verbose")):
        shown, _ = fleet(tmp_path, *verbose, extra_path=hooks)
        assert shown.returncode == 0, shown.stderr
        said = noise(shown.stderr)
        assert any("FutureWarning: noisylib's old API is deprecated" in line for line in said), shown.stderr
        assert "Failed to load /opt/noisylib/_C.so: undefined symbol" in said, shown.stderr


def test_the_check_catches_what_libraries_print_and_passes_the_fleets_lines() -> None:
    seen_here = [  # what `fleet models train demo-lm` printed before the CLI kept them
        "Failed to load /x/site-packages/torchao/_C_mxfp8.cpython-310-x86_64-linux-gnu.so: Could not load this library",
        "W1207 14:25:36.047000 5344 torch/utils/_pytree.py:630] <enum 'KernelPreference'> is an Enum subclass",
        "/x/site-packages/transformers/utils/generic.py:441: FutureWarning: `_register_pytree_node` is deprecated.",
        "WARNING:bentoml:a library's line in basicConfig's format",
        "[transformers] Some weights were not initialized",
        "Traceback (most recent call last):",
    ]
    assert noise("\n".join(seen_here)) == seen_here
    ours = [
        "registered demo-lm:1.0.0: exact_match=0.1562, holdout_examples=64",
        "training demo-lm:1.0.0: 201/300 steps, about 2 s left",
        "step 100/300  loss 2.2449  lr 4.15e-03  2s",
        "error: demo-lm:1.0.0 is already registered (versions are immutable); expected a new version, e.g. 1.0.1",
        "verifying and caching the artifact of demo-lm:1.3.0 in .fleet/cache",
    ]
    assert noise("\n".join(ours)) == []


def test_libraries_with_their_own_console_handler_are_kept_whatever_imports_them_first() -> None:
    """transformers asks whether torch is there (a spec found, no import) before torch is
    imported: torch's handler is still taken over when the import comes."""
    script = """
import logging, sys, warnings
from fleet.cli import quiet
quiet.install()
import transformers, torch
logging.getLogger("torch.utils._pytree").warning("a torch deprecation")
transformers.utils.logging.get_logger("transformers.x").warning("a transformers warning")
warnings.warn("a library's warning", FutureWarning)
logging.getLogger("fleet.x").warning("the fleet's own warning")
print("\\n".join(quiet.captured()))
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == "the fleet's own warning\n"
    assert "a torch deprecation" in proc.stdout and "[transformers] a transformers warning" in proc.stdout
    assert "FutureWarning: a library's warning" in proc.stdout


def test_verbose_is_a_global_flag_taken_after_the_subcommand_too() -> None:
    from fleet.cli import hoist_global_options

    assert hoist_global_options(["models", "list", "-v", "--store", "s3://b/p"]) == [
        "-v",
        "--store",
        "s3://b/p",
        "models",
        "list",
    ]
    assert hoist_global_options(["route", "set", "m", "--", "-v"]) == ["route", "set", "m", "--", "-v"]
