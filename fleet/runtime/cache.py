"""Local artifact cache keyed by the artifact's SHA-256: each version is downloaded once.

``<root>/<artifact sha256>/`` holds the verified files. A version seen again, or another
version with identical files, is served from the cache without touching the store — but
never on trust: every use checks the entry against the manifest's SHA-256s and sizes (files
whose size, mtime and ctime are unchanged since this process last hashed them are not
hashed again). An entry that fails (a file missing, changed or added) is moved aside,
deleted and downloaded again, verified. Processes sharing a cache take the entry's ``flock``
(``<root>/.locks/<sha256>.lock``) for check and repair, so none removes an entry another is
filling or has just verified.

**A byte budget** (``max_bytes``; ``runtime.artifact_cache_mib`` in the policies): after an
entry is fetched, and when a use of one ends, the least recently used entries are removed
until the cache holds at most the budget. Never one in use: ``use`` holds a shared ``flock``
(``<sha256>.use``) while the caller reads the files, and eviction takes each entry's locks
without waiting, skipping any it cannot have. An entry larger than the whole budget is
served while in use and removed after. Recency is the entry folder's mtime, touched on
every use. ``prefetch`` caches a version's artifact ahead of its first use (a canary's, when
its rollout starts).

A local replica reads its weights from here (``bentos/weights.py``'s ``NodeCache``: the same
layout and the same locks, so an entry a replica serves is never evicted under it); in the
cluster each node has such a cache of its own, filled by the replicas from the store.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

from bentos.integrity import check_folder
from fleet.catalog.registry import ModelVersion, Registry
from fleet.errors import IntegrityError

log_ = logging.getLogger("fleet.runtime.cache")


class ArtifactCache:
    def __init__(self, root: str | Path, max_bytes: int | None = None) -> None:
        self.root = Path(root)
        self.max_bytes = max_bytes

    @contextmanager
    def use(
        self, registry: Registry, model: str, version: str, *, log: Callable[[str], None] = lambda _: None
    ) -> Iterator[Path]:
        """The verified artifact folder of ``model:version``, kept from eviction while the ``with`` lasts."""
        mv = registry.get(model, version)
        with self._in_use(mv.artifact_sha256):
            yield self._verified(registry, mv, log)
        self.evict()  # an entry over the whole budget goes once nobody uses it

    def path(
        self, registry: Registry, model: str, version: str, *, log: Callable[[str], None] = lambda _: None
    ) -> Path:
        """The verified artifact folder of ``model:version``, downloading it if not cached (or not
        intact). With a budget, prefer ``use``: another process may evict the entry once this returns."""
        mv = registry.get(model, version)
        with self._in_use(mv.artifact_sha256):
            return self._verified(registry, mv, log)

    def prefetch(
        self, registry: Registry, model: str, version: str, *, log: Callable[[str], None] = lambda _: None
    ) -> tuple[Path, int, float]:
        """Cache (and verify) the artifact ahead of its first use: (its folder, bytes, seconds taken)."""
        started = time.monotonic()
        with self.use(registry, model, version, log=log) as folder:
            size = _size(folder)
        return folder, size, time.monotonic() - started

    def _verified(self, registry: Registry, mv: ModelVersion, log: Callable[[str], None]) -> Path:
        target = self.root / mv.artifact_sha256
        fetched = False
        with self._locked(mv.artifact_sha256):
            fetched = self._fill(registry, mv, target, log)
        os.utime(target)  # recency, for eviction
        if fetched:
            self.evict(keep=mv.artifact_sha256)
        return target

    def _fill(self, registry: Registry, mv: ModelVersion, target: Path, log: Callable[[str], None]) -> bool:
        """Make ``target`` the verified artifact (under its lock); True if it was downloaded."""
        model, version = mv.model, mv.version
        if target.is_dir():
            problems = check_folder(target, manifest_listing(mv), exact=True)
            if not problems:
                return False
            log(
                f"cached artifact of {mv.ref} at {target} does not match its manifest ({'; '.join(problems)}): "
                "removing it and downloading it again"
            )
            _discard(target)
        registry.fetch(model, version, target)  # verified, then renamed into place
        if problems := check_folder(target, manifest_listing(mv), exact=True):  # what landed on disk (primes the memo)
            _discard(target)
            raise IntegrityError(
                f"artifact of {mv.ref} was verified in the store but differs once written to "
                f"{target}: {'; '.join(problems)}; expected the manifest's bytes (failing disk?)"
            )
        return True

    def entries(self) -> list[tuple[str, int, float]]:
        """(sha256, bytes, last used) of every entry, least recently used first."""
        found = []
        for entry in self.root.iterdir() if self.root.is_dir() else ():
            if entry.is_dir() and not entry.name.startswith("."):
                try:
                    found.append((entry.name, _size(entry), entry.stat().st_mtime))
                except OSError:
                    continue  # removed meanwhile
        return sorted(found, key=lambda e: (e[2], e[0]))

    def evict(self, keep: str | None = None) -> list[str]:
        """Remove least recently used entries until the cache is within ``max_bytes``; never
        ``keep``, one in use or one being filled. The sha256s removed."""
        if self.max_bytes is None:
            return []
        entries = self.entries()
        total = sum(size for _, size, _ in entries)
        removed = []
        for sha, size, _ in entries:
            if total <= self.max_bytes:
                break
            if sha == keep:
                continue
            with ExitStack() as held:
                if not (held.enter_context(self._try(sha, ".use")) and held.enter_context(self._try(sha, ".lock"))):
                    continue  # in use, or being checked or filled: not now
                _discard(self.root / sha)
            total -= size
            removed.append(sha)
            log_.info(
                "artifact cache: removed %s (%d bytes, least recently used) to stay within %d bytes",
                sha[:12],
                size,
                self.max_bytes,
            )
        return removed

    @contextmanager
    def _locked(self, sha256: str) -> Iterator[None]:
        locks = self.root / ".locks"
        locks.mkdir(parents=True, exist_ok=True)
        with open(locks / f"{sha256}.lock", "a") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)  # released when the file closes
            yield

    @contextmanager
    def _in_use(self, sha256: str) -> Iterator[None]:
        """A shared lock: eviction skips the entry while any holds it."""
        locks = self.root / ".locks"
        locks.mkdir(parents=True, exist_ok=True)
        with open(locks / f"{sha256}.use", "a") as handle:
            fcntl.flock(handle, fcntl.LOCK_SH)
            yield

    @contextmanager
    def _try(self, sha256: str, suffix: str) -> Iterator[bool]:
        """The entry's lock ``suffix`` exclusively if nobody holds it now (no waiting)."""
        with open(self.root / ".locks" / f"{sha256}{suffix}", "a") as handle:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                yield False
                return
            yield True


def _size(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def manifest_listing(mv: ModelVersion) -> dict[str, dict[str, object]]:
    """The manifest's files in the form ``bentos/integrity.py`` reads: path → {sha256, size}."""
    return {path: digest.model_dump() for path, digest in sorted(mv.files.items())}


def _discard(entry: Path) -> None:
    """Take ``entry`` out of the cache at once (a rename), then delete it."""
    aside = entry.with_name(f".discard-{entry.name}-{uuid.uuid4().hex[:8]}")
    os.replace(entry, aside)
    shutil.rmtree(aside, ignore_errors=True)
