"""Packaging as the CLI and the flows use it, and the runtime that packages on first deploy.

``package_version`` is ``fleet.runtime.bento.package`` with this environment's policies,
store and artifact cache (``FLEET_CACHE_DIR``, default ``.fleet/cache``: the folder a local
replica reads its weights from; ``cache_weights=False`` for an image built for the cluster,
whose replicas fetch their own); ``record_image``
records a version's image digest in that store (``fleet.runtime.images``); ``packaged_runtime``
is ``open_runtime()`` whose local kind calls it the first time a version is deployed.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fleet.runtime.base import Runtime


def artifact_cache(max_mib: float | None = None) -> Any:  # noqa: ANN401 - a fleet.runtime.cache.ArtifactCache
    """The artifact cache at ``FLEET_CACHE_DIR``, within ``max_mib`` (the policies' ``runtime.artifact_cache_mib``)."""
    from fleet.runtime.cache import ArtifactCache

    return ArtifactCache(
        os.environ.get("FLEET_CACHE_DIR", ".fleet/cache"), None if max_mib is None else int(max_mib * 1024 * 1024)
    )


def policies_path(path: str | Path | None = None) -> Path:
    return Path(path or os.environ.get("FLEET_POLICIES") or "policies")


def package_version(
    model: str,
    version: str,
    *,
    policies: str | Path | None = None,
    quantize: bool = False,
    force: bool = False,
    cache_weights: bool = True,
    log: Callable[[str], None] = lambda _: None,
) -> Any:  # noqa: ANN401 - a fleet.runtime.bento.Packaged
    from fleet.catalog.policies.loader import load_policies
    from fleet.catalog.registry import Registry
    from fleet.runtime.bento import package
    from fleet.store import open_store

    loaded = load_policies(policies_path(policies))
    cache = artifact_cache(loaded.runtime.artifact_cache_mib) if cache_weights else None
    return package(
        Registry(open_store()), model, version, loaded.model(model), cache, quantize=quantize, force=force, log=log
    )


def record_image(model: str, version: str, digest: str, *, bento: str, repository: str | None = None) -> Any:  # noqa: ANN401
    """Record the image digest of ``model:version`` in this environment's store; (before, after) ImageRecords."""
    from fleet.catalog.registry import Registry
    from fleet.runtime.images import record
    from fleet.store import open_store

    store = open_store()
    return record(store, Registry(store).get(model, version), digest, bento, repository=repository)


def packaged_runtime(policies: str | Path | None = None, log: Callable[[str], None] = lambda _: None) -> Runtime:
    from fleet.runtime import open_runtime
    from fleet.runtime.bento import bentoml_home

    bentoml_home()  # the served Bentos live in the same BentoML home as the built ones
    return open_runtime(
        bento_for=lambda model, version: package_version(model, version, policies=policies, log=log).bento
    )
