"""The runtime the CLI and the flows use: ``open_runtime()`` whose local kind packages a
version (``fleet.runtime.bento.package``) the first time it is deployed."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from fleet.types import Runtime


def packaged_runtime(policies_path: str | Path | None = None, log: Callable[[str], None] = lambda _: None) -> Runtime:
    from fleet.registry import Registry
    from fleet.runtime import open_runtime
    from fleet.runtime.bento import bentoml_home, package
    from fleet.runtime.cache import ArtifactCache
    from fleet.spec import load_policies
    from fleet.store import open_store

    bentoml_home()  # the served Bentos live in the same BentoML home as the built ones
    path = Path(policies_path or os.environ.get("FLEET_POLICIES") or "policies")

    def bento_for(model: str, version: str) -> str:
        spec = load_policies(path).model(model)
        cache = ArtifactCache(os.environ.get("FLEET_CACHE_DIR", ".fleet/cache"))
        return package(Registry(open_store()), model, version, spec, cache, log=log).bento

    return open_runtime(bento_for=bento_for)
