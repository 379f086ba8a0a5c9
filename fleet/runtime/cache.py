"""Local artifact cache keyed by the artifact's SHA-256: each version is downloaded once.

``<root>/<artifact sha256>/`` holds the verified files. A version seen again, or another
version with identical files, is served from the cache without touching the store.
"""

from __future__ import annotations

from pathlib import Path

from fleet.errors import InvalidInput
from fleet.registry import Registry


class ArtifactCache:
    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)

    def path(self, registry: Registry, model: str, version: str) -> Path:
        """The verified artifact folder of ``model:version``, downloading it if not cached."""
        mv = registry.get(model, version)
        target = self.root / mv.artifact_sha256
        if not target.is_dir():
            try:
                registry.fetch(model, version, target)  # verified, then renamed into place
            except (InvalidInput, OSError):
                if not target.is_dir():  # not another process filling the same entry
                    raise
        return target
