"""``fleet models``: register, list, show and fetch model versions."""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated

import typer
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn

from fleet.catalog.registry import VersionMetadata
from fleet.cli._output import JsonFlag, console, emit_json, err_console, registry, table, when
from fleet.cli.doctor import skipped
from fleet.cli.progress import Steps, counting
from fleet.errors import InvalidInput
from fleet.validation import load_yaml_file

app = typer.Typer(help="Register and inspect model versions.", no_args_is_help=True)


@contextmanager
def _bytes_progress(verb: str, what: str, total: int, json: bool) -> Iterator[Callable[[str, int], None]]:
    """A bar of bytes moved on a terminal's stderr (none with --json or without a terminal):
    the ``progress(relative_path, bytes)`` callback of the registry's upload and download."""
    with Progress(
        TextColumn(f"{verb} {{task.description}}"),
        BarColumn(),
        DownloadColumn(),
        console=err_console,
        transient=True,
        disable=json or not err_console.is_terminal,
    ) as progress:
        task = progress.add_task(what, total=total)
        yield lambda _rel, size: progress.advance(task, size)


@app.command()
def register(
    model: Annotated[str, typer.Argument(help="Model name, e.g. demo-classifier.")],
    version: Annotated[str, typer.Argument(help="Semantic version, e.g. 1.0.0.")],
    artifact_dir: Annotated[Path, typer.Argument(help="Folder holding the model's files.")],
    meta: Annotated[
        Path,
        typer.Option(
            "--meta",
            "-m",
            help="YAML/JSON file: framework, inputs, outputs (name, datatype, shape), "
            "hyperparameters, training_data {uri, sha256}, metrics, parent_version.",
        ),
    ],
    json: JsonFlag = False,
) -> None:
    """Register a new immutable version: checksums every file, then commits the manifest."""
    metadata = load_yaml_file(meta, VersionMetadata)
    total = sum(p.stat().st_size for p in artifact_dir.rglob("*") if p.is_file()) if artifact_dir.is_dir() else 0
    with _bytes_progress("uploading", f"{model}:{version}", total, json) as advance:
        mv = registry().register(model, version, artifact_dir, metadata, progress=advance)
    if json:
        emit_json(mv)
    else:
        console.print(f"registered [bold]{mv.ref}[/] ({len(mv.files)} files, state {mv.state})")


@app.command("list")
def list_(
    model: Annotated[str | None, typer.Argument(help="Only this model.")] = None,
    json: JsonFlag = False,
) -> None:
    """List registered versions with their state."""
    versions, bad = registry().scan(model)
    skipped(bad)
    if json:
        emit_json(versions)
        return
    table(
        None,
        ["model", "version", "state", "framework", "files", "created", "by"],
        [[v.model, v.version, v.state, v.framework, len(v.files), when(v.created_at), v.created_by] for v in versions],
    )


@app.command()
def show(
    model: str,
    version: str,
    verify: Annotated[bool, typer.Option("--verify", help="Check every stored file's SHA-256.")] = False,
    json: JsonFlag = False,
) -> None:
    """Show one version's manifest."""
    reg = registry()
    mv = reg.verify(model, version) if verify else reg.get(model, version)
    if json:
        emit_json(mv)
        return
    console.print(f"[bold]{mv.ref}[/]  state {mv.state}  framework {mv.framework}")
    console.print(f"created {when(mv.created_at)} by {mv.created_by}; parent {mv.parent_version or '-'}")
    for role, specs in (("input", mv.inputs), ("output", mv.outputs)):
        for s in specs:
            console.print(f"  {role:6} {s.name}: {s.datatype} {s.shape}")
    if mv.metrics:
        console.print("metrics: " + ", ".join(f"{k}={v:g}" for k, v in mv.metrics.items()))
    table(None, ["file", "bytes", "sha256"], [[f, d.size, d.sha256] for f, d in sorted(mv.files.items())])
    if verify:
        console.print("[green]every file matches its checksum[/]")


@app.command()
def fetch(
    model: str,
    version: str,
    dest: Annotated[Path, typer.Argument(help="New folder to download into.")],
    json: JsonFlag = False,
) -> None:
    """Download a version's artifact, verifying every checksum before it lands."""
    reg = registry()
    mv = reg.get(model, version)
    try:
        with _bytes_progress("downloading", mv.ref, sum(d.size for d in mv.files.values()), json) as advance:
            path = reg.fetch(model, version, dest, progress=advance)
    except OSError as exc:  # name the folder asked for, not the temporary one beside it
        raise InvalidInput(
            f"cannot download {model}:{version} into {dest}: {exc.strerror or exc}; nothing was left there"
        ) from None
    if json:
        emit_json(
            {
                "model": model,
                "version": version,
                "path": str(path),
                "files": len(mv.files),
                "artifact_sha256": mv.artifact_sha256,
            }
        )
    else:
        console.print(f"fetched {model}:{version} into {path} ({len(mv.files)} files, checksums verified)")


def _trainer(model: str, policies: Path, new: tuple[str, str | None] | None = None):  # noqa: ANN202
    """MODEL's family (from the policies) and the family's ``train`` module. With ``new``
    (VERSION, PARENT), once the registry would take VERSION derived from PARENT: what it would
    refuse at the end of the work (a version registered already, a parent that is not) is
    refused before torch is even imported."""
    from fleet.catalog.policies.loader import load_policies
    from fleet.runtime.bento import family_module

    family_name = load_policies(policies).model(model).family
    if new is not None:
        registry().check_new(model, new[0], parent=new[1])
    return family_name, importlib.import_module(f"{family_module(family_name).__name__}.train")


def _callbacks(function: object, shown: Steps) -> dict[str, object]:
    """The progress (and log, where the family's trainer takes one) callbacks for ``function``."""
    taken = inspect.signature(function).parameters  # type: ignore[arg-type]
    return {k: v for k, v in (("progress", shown.advance), ("log", shown.log)) if k in taken}


_TRAIN_OPTIONS = (
    "seed",
    "rows",
    "epochs",
    "steps",
    "label_threshold",
    "fault_error_rate",
    "fault_latency_ms",
    "fault_first_token_ms",
    "fault_token_ms",
)


@app.command()
def train(
    model: str,
    version: str,
    seed: Annotated[int | None, typer.Option(help="Seed for data, initialisation and shuffling (default 7).")] = None,
    preset: Annotated[
        str | None, typer.Option(help="A family's named settings (tiny-lm: demo, the default, or test: seconds).")
    ] = None,
    rows: Annotated[
        int | None, typer.Option(min=100, help="tabular-mlp: generated training rows (default 20000).")
    ] = None,
    epochs: Annotated[
        int | None, typer.Option(min=1, help="tabular-mlp: passes over the training rows (default 25).")
    ] = None,
    steps: Annotated[
        int | None, typer.Option(min=1, help="tiny-lm: optimizer steps (the preset's by default).")
    ] = None,
    parent: Annotated[str | None, typer.Option(help="Version this one derives from.")] = None,
    label_threshold: Annotated[
        float | None,
        typer.Option(
            help="tabular-mlp: label by rule > this (0.25 is the true rule; other values make a model that predicts a shifted distribution)."
        ),
    ] = None,
    fault_error_rate: Annotated[
        float | None,
        typer.Option(min=0, max=1, help="Rehearsal: this share of the version's requests fail with HTTP 500."),
    ] = None,
    fault_latency_ms: Annotated[
        float | None, typer.Option(min=0, help="Rehearsal: every answer of the version waits this much longer.")
    ] = None,
    fault_first_token_ms: Annotated[
        float | None,
        typer.Option(
            min=0, help="Rehearsal (tiny-lm): the version's first token of every answer waits this much longer."
        ),
    ] = None,
    fault_token_ms: Annotated[
        float | None, typer.Option(min=0, help="Rehearsal (tiny-lm): every later token waits this much longer.")
    ] = None,
    policies: Annotated[
        Path,
        typer.Option("--policies", envvar="FLEET_POLICIES", help="Policy folder or file (names the model's family)."),
    ] = Path("policies"),
    json: JsonFlag = False,
) -> None:
    """Train a version of MODEL's family on generated data and register it.

    Options apply to the families they name; one that does not apply to MODEL's family is
    refused. The --fault-* options build a deliberately bad version, to rehearse a rollback.
    """
    import dataclasses

    family_name, trainer = _trainer(model, policies, (version, parent))
    given = {
        k: v
        for k, v in {  # the options' names are _TRAIN_OPTIONS
            "seed": seed,
            "rows": rows,
            "epochs": epochs,
            "steps": steps,
            "label_threshold": label_threshold,
            "fault_error_rate": fault_error_rate,
            "fault_latency_ms": fault_latency_ms,
            "fault_first_token_ms": fault_first_token_ms,
            "fault_token_ms": fault_token_ms,
        }.items()
        if v is not None
    }
    known = {f.name for f in dataclasses.fields(trainer.TrainConfig)}
    if unknown := sorted(set(given) - known):
        shown = ", ".join("--" + k.replace("_", "-") for k in unknown)
        options = ", ".join("--" + k.replace("_", "-") for k in _TRAIN_OPTIONS if k in known)
        raise InvalidInput(
            f"{shown} does not apply to {model}'s family {family_name}; expected its options: {options}"
            + (", --preset" if getattr(trainer, "PRESETS", None) else "")
            + " (see `fleet models train --help`)"
        )
    presets = getattr(trainer, "PRESETS", None)
    if preset is not None and (presets is None or preset not in presets):
        offered = ", ".join(presets) if presets else "none"
        raise InvalidInput(f"preset {preset!r} is not one of {family_name}'s: {offered}")
    base = presets[preset or "demo"] if presets else trainer.TrainConfig()
    config = dataclasses.replace(base, **given)
    with counting(f"training {model}:{version}", getattr(trainer, "PROGRESS_UNIT", "steps")) as shown:
        fit = trainer.train_and_register
        mv = fit(registry().store, model, version, config, parent=parent, **_callbacks(fit, shown))
    if json:
        emit_json(mv)
    else:
        console.print(f"registered [bold]{mv.ref}[/]: " + ", ".join(f"{k}={v:.4g}" for k, v in mv.metrics.items()))


@app.command()
def quantize(
    model: str,
    parent: Annotated[str, typer.Argument(help="The full-precision version to quantize.")],
    version: Annotated[str, typer.Argument(help="The new, quantized version.")],
    method: Annotated[
        str, typer.Option(help="int8-weight-only (torchao): weights in int8, computed in float.")
    ] = "int8-weight-only",
    policies: Annotated[
        Path,
        typer.Option("--policies", envvar="FLEET_POLICIES", help="Policy folder or file (names the model's family)."),
    ] = Path("policies"),
    json: JsonFlag = False,
) -> None:
    """Register VERSION of MODEL: PARENT's weights quantized when they load, with its lineage.

    Its exact match and weight memory are measured on the parent's holdout and stored in its
    manifest beside the parent's; it rolls out like any version (fleet rollout start), so
    canary analysis judges it on live traffic too.
    """
    family_name, trainer = _trainer(model, policies)
    if not hasattr(trainer, "quantize_and_register"):
        raise InvalidInput(
            f"{model}'s family {family_name} has no weight quantization here; expected a generative "
            "family (tiny-lm) — a tabular-mlp version is quantized when packaged (fleet package --int8)"
        )
    if method not in trainer.QUANT_METHODS:
        raise InvalidInput(f"method {method!r} is not one of {', '.join(trainer.QUANT_METHODS)}")
    registry().check_new(model, version, parent=parent)  # refused now, not after the work
    with err_console.status(f"quantizing {model}:{parent} into {model}:{version} ..."):
        mv = trainer.quantize_and_register(
            registry().store, model, parent, version, method, log=lambda line: err_console.print(f"[dim]{line}[/]")
        )
    if json:
        emit_json(mv)
    else:
        console.print(
            f"registered [bold]{mv.ref}[/] ({method} of {model}:{parent}): "
            + ", ".join(f"{k}={v:.4g}" for k, v in mv.metrics.items())
        )


@app.command()
def distill(
    model: str,
    teacher: Annotated[str, typer.Argument(help="The version to learn from (its verified artifact).")],
    version: Annotated[str, typer.Argument(help="The new version (the student).")],
    preset: Annotated[
        str, typer.Option(help="The student's size (tiny-lm: student, or student-test: seconds).")
    ] = "student",
    steps: Annotated[int | None, typer.Option(min=1, help="Optimizer steps (the preset's by default).")] = None,
    policies: Annotated[
        Path,
        typer.Option("--policies", envvar="FLEET_POLICIES", help="Policy folder or file (names the model's family)."),
    ] = Path("policies"),
    json: JsonFlag = False,
) -> None:
    """Distil TEACHER into a smaller VERSION of MODEL and register it with its lineage.

    The student learns the teacher's answers to the training prompts and is judged on the
    true answers; its manifest names the teacher as parent and both exact matches. It rolls
    out like any version (fleet rollout start).
    """
    import dataclasses

    family_name, trainer = _trainer(model, policies)
    if not hasattr(trainer, "distill_and_register"):
        raise InvalidInput(
            f"{model}'s family {family_name} has no distillation; expected a generative family (tiny-lm)"
        )
    if preset not in trainer.PRESETS:
        raise InvalidInput(f"preset {preset!r} is not one of {family_name}'s: {', '.join(trainer.PRESETS)}")
    config = trainer.PRESETS[preset]
    if steps is not None:
        config = dataclasses.replace(config, steps=steps)
    registry().check_new(model, version, parent=teacher)  # refused now, not after the training
    with counting(f"distilling {model}:{teacher} into {model}:{version}", trainer.PROGRESS_UNIT) as shown:
        distil = trainer.distill_and_register
        mv = distil(registry().store, model, teacher, version, config, **_callbacks(distil, shown))
    if json:
        emit_json(mv)
    else:
        console.print(
            f"registered [bold]{mv.ref}[/] (distilled from {model}:{teacher}): "
            + ", ".join(f"{k}={v:.4g}" for k, v in mv.metrics.items())
        )
