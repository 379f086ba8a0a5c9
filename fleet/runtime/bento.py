"""Packaging: one Bento per model version, holding code only — never the weights.

``package`` builds a Bento of the model's family (``bentos/<family>/``) with the policy's
resources, traffic and batching written into ``fleet_build.json``, with the artifact's SHA-256,
its key prefix in the store and the manifest's file listing. The weights stay out of the Bento
and so out of every image built from it (llm-70b's 130 GiB could not be pushed to ECR, whose
layers stop at 52,000 MiB): a replica takes them at start from the node's cache, fetching them
from the store if they are not there, verified file by file against the listing before it
loads anything (``bentos/weights.py``, ``fetch.py``, ``integrity.py``, copied into every
Bento). With a ``cache``, ``package`` also verifies and caches the artifact in this machine's
artifact cache, the folder a local replica (``fleet up``) reads through the same code.
Packages are pinned to what this environment runs and never locked against an index, so a
build reaches no registry and changes nothing in the project's venv. BentoML keeps its stores
under ``$BENTOML_HOME`` (default ``./.fleet/bentoml``).
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import version as installed
from pathlib import Path

from bentos import integrity, weights
from fleet.catalog.policies.models import ModelSpec
from fleet.catalog.registry import ModelVersion, Registry
from fleet.errors import FleetError, InvalidInput
from fleet.runtime.cache import ArtifactCache, manifest_listing

DEFAULT_HOME = ".fleet/bentoml"
# BentoML pins itself. Local version labels (+cpu) are dropped so a GPU image gets the
# CUDA build of the same release. A family's ``PACKAGES`` are pinned the same way; its
# ``GPU_PACKAGES`` (pinned in the family, e.g. vLLM, whose wheel is CUDA-only and never in
# the lock) go only into the Bentos of models whose policy asks for a GPU.
# boto3: a replica fetches its weights from S3 at start (bentos/fetch.py).
PINNED = ("torch", "numpy", "boto3")
# Shipped in every Bento beside the family's files (from bentos/): the check at load, the marks
# of a start's phases, the node cache and the fetch that fill a replica's model folder.
SHARED_FILES = ("integrity.py", "phases.py", "weights.py", "fetch.py")
WEIGHTS_LABEL = ("weights", "fetched-at-start")  # a Bento without it holds a model: rebuilt
# On Bentos whose service checks its model files at load; one built before that is rebuilt.
INTEGRITY_LABEL = ("integrity", "sha256-at-load")
BUILD_LABEL = "build-sha256"  # of fleet_build.json and the service files: a changed policy or service rebuilds it


class PackagingError(FleetError):
    status = 500


@dataclass(frozen=True)
class Packaged:
    bento: str  # tag, e.g. demo-classifier:1.0.0
    model_tag: str
    artifact_sha256: str
    built: bool  # False: the Bento already existed


def bentoml_home() -> Path:
    """Set ``BENTOML_HOME`` (before bentoml is imported) and return it.

    BentoML reads the variable once, at import. Once it is imported, its home is the truth:
    the variable is set back to it, so the ``bentoml serve`` processes started from here
    look for Bentos where this process builds them.
    """
    if "bentoml" in sys.modules:
        from bentoml._internal.configuration.containers import BentoMLContainer

        os.environ["BENTOML_HOME"] = str(BentoMLContainer.bentoml_home.get())
    home = Path(os.environ.setdefault("BENTOML_HOME", str(Path(DEFAULT_HOME).absolute())))
    os.environ.setdefault("BENTOML_DO_NOT_TRACK", "true")
    return home


def bento_version(version: str, quantize: bool) -> str:
    """BentoML tags allow [a-z0-9_.-]: semver build metadata (+x) becomes _x."""
    tag = version.lower().replace("+", "_") + ("-int8" if quantize else "")
    if not re.fullmatch(r"[a-z0-9]([a-z0-9_.-]*[a-z0-9])?", tag):
        raise InvalidInput(f"version {version!r} cannot be a BentoML tag; expected letters, digits, '.', '-', '_'")
    return tag


def family_module(family: str):  # noqa: ANN201 - a module
    try:
        return importlib.import_module(f"bentos.{family.replace('-', '_')}")
    except ModuleNotFoundError:
        raise InvalidInput(f"model family {family!r} has no folder bentos/{family.replace('-', '_')}/") from None


def package(
    registry: Registry,
    model: str,
    version: str,
    spec: ModelSpec,
    cache: ArtifactCache | None,
    *,
    quantize: bool = False,
    batchable: bool = True,
    force: bool = False,
    log: Callable[[str], None] = lambda _: None,
) -> Packaged:
    """Build (or find) the Bento of ``model:version``; ``log`` gets progress lines.

    ``cache``: also verify and cache the artifact there, for a replica on this machine
    (``None`` for an image built for the cluster, whose replicas fetch their own).

    ``batchable=False`` builds a variant without adaptive batching (tag suffix
    ``-nobatch``), for comparing the two in ``bench/batching.py``.
    """
    if quantize and spec.resources.gpu > 0:
        raise InvalidInput(f"{model} asks for a GPU; int8 dynamic quantization is for CPU-class models")
    bentoml_home()
    import bentoml

    mv = registry.get(model, version)
    build = _build_config(mv, spec, quantize, batchable)
    # what the service reads at import (resources, traffic, batching, generation) and the code it
    # runs: a Bento built from another policy or another service is not this one, even from the
    # same artifact (a fleet upgrade's service reaches a version at its next package or deploy)
    family = family_module(spec.family)
    build_sha = _build_sha(
        build,
        [Path(family.__file__).with_name(n) for n in family.BENTO_FILES]
        + [Path(integrity.__file__).with_name(n) for n in SHARED_FILES],
    )
    tag_version = bento_version(version, quantize) + ("" if batchable else "-nobatch")
    bento_tag = f"{model}:{tag_version}"
    model_tag = f"{model}:{bento_version(version, False)}"
    bentoml_home()  # bentoml is imported now: keep the variable on its home
    if _exists(bentoml.bentos.get, bento_tag):
        held_labels = bentoml.bentos.get(bento_tag).info.labels
        built_from = held_labels.get("artifact-sha256")
        checks = held_labels.get(INTEGRITY_LABEL[0]) == INTEGRITY_LABEL[1] and (
            held_labels.get(WEIGHTS_LABEL[0]) == WEIGHTS_LABEL[1]
        )
        same_policy = held_labels.get(BUILD_LABEL) == build_sha
        if not force and built_from == mv.artifact_sha256 and checks and same_policy:
            log(f"Bento {bento_tag} already built")
            _cache_artifact(cache, registry, mv, log)
            return Packaged(bento_tag, model_tag, mv.artifact_sha256, built=False)
        if built_from != mv.artifact_sha256:
            log(
                f"Bento {bento_tag} was built from artifact {str(built_from)[:12]}, not {mv.artifact_sha256[:12]} "
                f"(another store using this BentoML home?): rebuilding it from the registry"
            )
        elif not checks:
            log(f"Bento {bento_tag} predates the check of its model files at load or holds its weights: rebuilding it")
        elif not same_policy:
            log(
                f"Bento {bento_tag} was built from another policy or service code (its fleet_build.json or "
                "service files differ): rebuilding it"
            )
        bentoml.bentos.delete(bento_tag)

    _cache_artifact(cache, registry, mv, log)
    labels = {"model": model, "version": version, "artifact-sha256": mv.artifact_sha256}

    shared = Path(integrity.__file__).parent
    with tempfile.TemporaryDirectory(prefix="fleet-bento-") as ctx:
        for name in family.BENTO_FILES:
            shutil.copy(Path(family.__file__).with_name(name), Path(ctx) / name)
        for name in SHARED_FILES:
            shutil.copy(shared / name, Path(ctx) / name)
        (Path(ctx) / "fleet_build.json").write_text(json.dumps(build, indent=2))
        log(f"building Bento {bento_tag}")
        _forget_bento_modules()
        cwd = os.getcwd()  # a build that fails inside its context may leave the process there, and it is deleted next
        building = os.environ.get(weights.BUILDING)
        os.environ[weights.BUILDING] = "1"  # the service's import at build fetches and checks no weights
        try:
            bento = bentoml.bentos.build(
                family.SERVICE,
                name=model,
                version=tag_version,
                labels={
                    **labels,
                    "quantize": "int8" if quantize else "none",
                    INTEGRITY_LABEL[0]: INTEGRITY_LABEL[1],
                    WEIGHTS_LABEL[0]: WEIGHTS_LABEL[1],
                    BUILD_LABEL: build_sha,
                },
                include=[*family.BENTO_FILES, *SHARED_FILES, "fleet_build.json"],
                python={"packages": python_packages(family, spec), "lock_packages": False},
                build_ctx=ctx,
            )
        except Exception as exc:  # BentoML raises many kinds; say which build failed
            raise PackagingError(f"bentoml build of {bento_tag} failed: {type(exc).__name__}: {exc}") from exc
        finally:
            os.chdir(cwd)
            _forget_bento_modules()
            if building is None:
                os.environ.pop(weights.BUILDING, None)
            else:
                os.environ[weights.BUILDING] = building
    log(f"built Bento {bento.tag}")
    return Packaged(str(bento.tag), model_tag, mv.artifact_sha256, built=True)


def _build_sha(build: dict, files: list[Path]) -> str:
    """SHA-256 over the build config and the service files a Bento ships (names and bytes)."""
    digest = hashlib.sha256(json.dumps(build, sort_keys=True).encode())
    for path in files:
        digest.update(f"\0{path.name}\0".encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def _forget_bento_modules() -> None:
    """Drop the top-level modules an earlier build imported from its build context.

    ``bentoml.bentos.build`` imports the service from the context's root (``service``,
    ``engine``, ``model``, ...) and keeps it in ``sys.modules``: a later build in this process
    of another family would be handed the first family's ``service`` ("module 'service' has
    no attribute 'TabularClassifier'"). Only modules loaded from a ``fleet-bento-`` context are
    dropped."""
    for name, module in list(sys.modules.items()):
        where = getattr(module, "__file__", None) or ""
        if "." not in name and f"{os.sep}fleet-bento-" in where:
            del sys.modules[name]


def python_packages(family: object, spec: ModelSpec) -> list[str]:
    """What the Bento's image installs: torch, numpy and the family's ``PACKAGES`` at the
    versions this environment runs, and for a model whose policy asks for a GPU
    (``resources.gpu > 0``) the family's ``GPU_PACKAGES`` as the family pins them."""
    packages = [f"{p}=={installed(p).split('+')[0]}" for p in (*PINNED, *getattr(family, "PACKAGES", ()))]
    if spec.resources.gpu > 0:
        packages += list(getattr(family, "GPU_PACKAGES", ()))
    return packages


def _cache_artifact(
    cache: ArtifactCache | None, registry: Registry, mv: ModelVersion, log: Callable[[str], None]
) -> None:
    """Verify and cache ``mv``'s artifact in ``cache`` (the folder a local replica reads), if given."""
    if cache is not None:
        log(f"verifying and caching the artifact of {mv.ref} in {cache.root}")
        cache.prefetch(registry, mv.model, mv.version, log=log)


def _build_config(mv: ModelVersion, spec: ModelSpec, quantize: bool, batchable: bool) -> dict:
    resources: dict[str, object] = {"cpu": str(spec.resources.cpu), "memory": f"{spec.resources.memory_gib}Gi"}
    accelerator: dict[str, object] = {}
    if spec.resources.gpu > 0:
        resources["gpu"] = spec.resources.gpu
        # per GPU; the service gives vLLM this share of the GPU's memory (gpu_memory_utilization)
        accelerator = {"accelerator": {"gpus": spec.resources.gpu, "gpu_memory_gib": spec.resources.gpu_memory_gib}}
    return {
        "model": mv.model,
        "version": mv.version,
        "service_name": mv.model,
        "artifact_sha256": mv.artifact_sha256,
        # where a replica fetches the files from, under FLEET_STORE (fleet.catalog.registry's layout)
        "artifact_prefix": f"models/{mv.model}/{mv.version}/artifact/",
        "files": manifest_listing(mv),  # what the service checks its model folder against before loading
        "quantize": quantize,
        "resources": resources,
        "traffic": {"timeout": spec.timeout_ms / 1000, "concurrency": spec.concurrency},
        "batching": {**spec.batching.model_dump(), "batchable": batchable},
        "generation": spec.generation.model_dump() if spec.generation is not None else {},
        **accelerator,
    }


def _exists(get: Callable[[str], object], tag: str) -> bool:
    import bentoml

    try:
        # exactly this tag: BentoML's get takes a version prefix too (1.2.0 finds 1.2.0-int8)
        return str(getattr(get(tag), "tag", tag)) == tag
    except bentoml.exceptions.NotFound:
        return False
