"""Local artifact cache keyed by the artifact's SHA-256: each version is downloaded once.

``<root>/<artifact sha256>/`` holds the verified files. A version seen again, or another
version with identical files, is served from the cache without touching the store — but
never on trust: every use checks the entry against the manifest's SHA-256s and sizes (files
whose size, mtime and ctime are unchanged since this process last hashed them are not
hashed again). An entry that fails (a file missing, changed or added) is moved aside,
deleted and downloaded again, verified. Processes sharing a cache take the entry's ``flock``
(``<root>/.locks/<sha256>.lock``) for check and repair, so none removes an entry another is
filling or has just verified.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from bentos.integrity import check_folder
from fleet.errors import IntegrityError
from fleet.registry import ModelVersion, Registry


class ArtifactCache:
    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)

    def path(self, registry: Registry, model: str, version: str, *, log: Callable[[str], None] = lambda _: None) -> Path:
        """The verified artifact folder of ``model:version``, downloading it if not cached (or not intact)."""
        mv = registry.get(model, version)
        target = self.root / mv.artifact_sha256
        with self._locked(mv.artifact_sha256):
            if target.is_dir():
                problems = check_folder(target, manifest_listing(mv), exact=True)
                if not problems:
                    return target
                log(f"cached artifact of {mv.ref} at {target} does not match its manifest ({'; '.join(problems)}): "
                    "removing it and downloading it again")  # fmt: skip
                _discard(target)
            registry.fetch(model, version, target)  # verified, then renamed into place
            if problems := check_folder(target, manifest_listing(mv), exact=True):  # what landed on disk (primes the memo)
                _discard(target)
                raise IntegrityError(f"artifact of {mv.ref} was verified in the store but differs once written to "
                                     f"{target}: {'; '.join(problems)}; expected the manifest's bytes (failing disk?)")  # fmt: skip
        return target

    @contextmanager
    def _locked(self, sha256: str) -> Iterator[None]:
        locks = self.root / ".locks"
        locks.mkdir(parents=True, exist_ok=True)
        with open(locks / f"{sha256}.lock", "a") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)  # released when the file closes
            yield


def manifest_listing(mv: ModelVersion) -> dict[str, dict[str, object]]:
    """The manifest's files in the form ``bentos/integrity.py`` reads: path → {sha256, size}."""
    return {path: digest.model_dump() for path, digest in sorted(mv.files.items())}


def _discard(entry: Path) -> None:
    """Take ``entry`` out of the cache at once (a rename), then delete it."""
    aside = entry.with_name(f".discard-{entry.name}-{uuid.uuid4().hex[:8]}")
    os.replace(entry, aside)
    shutil.rmtree(aside, ignore_errors=True)
