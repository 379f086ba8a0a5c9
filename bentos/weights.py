"""Where a replica's model files come from: a node-local cache, filled from the store at start.

Images hold code only. ``model_dir(BUILD)`` (called by every family's service at import,
before it reports ready) returns the folder of the version's verified files:

* ``FLEET_MODEL_DIR`` set: that folder, as given (the service still checks it against the
  manifest before loading);
* else the entry ``<FLEET_CACHE_DIR>/<artifact sha256>/`` of the cache shared by the replicas
  on the node (a hostPath in the cluster; the fleet's own ``.fleet/cache`` locally, which
  ``fleet package`` fills through ``fleet.runtime.cache.ArtifactCache`` — same layout, same
  locks), fetched from ``FLEET_STORE`` (``fetch.py``) if it is not there yet.

Concurrency: ``<root>/.locks/<sha>.lock`` (exclusive) is held while an entry is checked or
filled, so of two replicas starting one version on a node one downloads and the other waits,
then uses what the first verified. ``<sha>.use`` (shared) is held by every process serving
the entry for as long as it lives; eviction takes both without waiting and skips any entry
it cannot have. Files land in ``<root>/.fetch-<sha>/`` (resumable: ``fetch.py``) and the folder
is renamed to ``<sha>`` only once every file matched its SHA-256.

Budget: ``FLEET_CACHE_MAX_BYTES``. Before a fetch, least recently used entries not in use
are removed until the new one fits; an entry's recency is its folder's mtime, touched at
every use. A fetch that cannot make room (everything else in use) goes ahead and says so.

A verified entry's files' stat signatures are kept in ``.locks/<sha>.verified.json``, so the
next process (BentoML's worker after its server, a second replica) checks an unchanged file
without hashing it again: any write to a file moves its ctime, which cannot be set back.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import IO, Any

try:  # in the repo, a package; in a Bento, files at its root
    from .fetch import CHUNK_BYTES, CONCURRENCY, FetchError, Source, fetch_files, open_source
    from .integrity import check_folder, remember
except ImportError:
    from fetch import CHUNK_BYTES, CONCURRENCY, FetchError, Source, fetch_files, open_source  # type: ignore[no-redef]
    from integrity import check_folder, remember  # type: ignore[no-redef]

STAGING = ".fetch-"
BUILDING = "FLEET_BENTO_BUILD"  # set by fleet.runtime.bento while bentoml build imports a service
_HELD: list[IO[str]] = []  # the ``.use`` locks this process keeps while it serves


def _stderr(line: str) -> None:
    print(f"fleet-weights {line}", file=sys.stderr, flush=True)


class NodeCache:
    """``<root>/<artifact sha256>/``: verified artifacts shared by the processes on a machine."""

    def __init__(
        self,
        root: str | os.PathLike[str],
        max_bytes: int | None = None,
        *,
        chunk_bytes: int = CHUNK_BYTES,
        concurrency: int = CONCURRENCY,
        log: Callable[[str], None] = _stderr,
    ) -> None:
        self.root = Path(root)
        self.max_bytes, self.chunk_bytes, self.concurrency, self.log = max_bytes, chunk_bytes, concurrency, log

    # -- using an entry --------------------------------------------------------------
    def hold(self, sha256: str) -> None:
        """Keep ``sha256`` from eviction until this process exits (a serving replica)."""
        handle = open(self._lockfile(sha256, ".use"), "a")  # noqa: SIM115 - held for the process's life
        fcntl.flock(handle, fcntl.LOCK_SH)
        _HELD.append(handle)

    @contextmanager
    def using(self, sha256: str) -> Iterator[None]:
        """Keep ``sha256`` from eviction while the ``with`` lasts."""
        with open(self._lockfile(sha256, ".use"), "a") as handle:
            fcntl.flock(handle, fcntl.LOCK_SH)
            yield

    def ensure(
        self, sha256: str, listing: Mapping[str, Mapping[str, Any]], source: Source | None, prefix: str, *, what: str
    ) -> Path:
        """The verified folder of the artifact ``sha256`` whose files ``listing`` names, fetched
        from ``source`` (keys ``prefix`` + path) if it is not here or not intact.

        Hold the entry (``hold``/``using``) first: between this call and the caller's use,
        another process's eviction must not take it."""
        target = self.root / sha256
        with self._exclusive(sha256):
            if target.is_dir():
                self._recall(sha256, target)
                problems = check_folder(target, listing, exact=True)
                if not problems:
                    os.utime(target)  # recency, for eviction
                    self._record(sha256, target, listing)
                    self.log(f"{what}: artifact {sha256[:12]} is in the node cache {self.root}")
                    return target
                if source is None:  # nothing to repair it from here: say what differs
                    raise FetchError(
                        f"{what}: the cached artifact at {target} does not match its manifest, refusing to load it: "
                        f"{'; '.join(problems)}; expected the registered files (`fleet package` caches them again)"
                    )
                self.log(
                    f"{what}: cached artifact at {target} differs from its manifest ({'; '.join(problems)}); fetching it again"
                )
                _discard(target)
            if source is None:
                raise FetchError(
                    f"{what}: artifact {sha256} is not in the cache {self.root} and no store was given to fetch it "
                    "from; expected FLEET_STORE (in the cluster) or `fleet package` to have cached it (locally)"
                )
            need = sum(int(d["size"]) for d in listing.values())
            self.evict(keep=sha256, need=need)
            staging = self.root / f"{STAGING}{sha256}"
            self.log(f"{what}: fetching {len(listing)} files, {need / 2**20:.1f} MiB, from {source.url} into {target}")
            fetch_files(
                source,
                prefix,
                listing,
                staging,
                what=what,
                chunk_bytes=self.chunk_bytes,
                concurrency=self.concurrency,
                log=self.log,
            )
            if extra := _unlisted(staging, listing):  # debris of another run in a reused staging folder
                _discard(staging)
                raise FetchError(f"{what}: the fetch left files the manifest does not list: {', '.join(extra)}")
            os.replace(staging, target)
            self._record(sha256, target, listing)  # every file was hashed by the fetch, just now
            self._recall(sha256, target)  # so the service's own check of the folder hashes nothing again
        self.evict(keep=sha256)
        return target

    # -- the budget ------------------------------------------------------------------
    def entries(self) -> list[tuple[str, Path, int, float]]:
        """(sha256, folder, bytes, last used) of every entry and staging folder, least recently used first."""
        found = []
        for entry in self.root.iterdir() if self.root.is_dir() else ():
            sha = entry.name[len(STAGING) :] if entry.name.startswith(STAGING) else entry.name
            if entry.is_dir() and not sha.startswith("."):
                try:
                    found.append((sha, entry, _size(entry), entry.stat().st_mtime))
                except OSError:
                    continue  # removed meanwhile
        return sorted(found, key=lambda e: (e[3], e[0]))

    def evict(self, keep: str | None = None, need: int = 0) -> list[str]:
        """Remove least recently used entries until ``need`` more bytes fit in ``max_bytes``;
        never ``keep`` nor one in use or being filled. The sha256s removed."""
        if self.max_bytes is None:
            return []
        entries = self.entries()
        total = sum(size for sha, _, size, _ in entries if sha != keep) + need
        removed = []
        for sha, folder, size, _ in entries:
            if total <= self.max_bytes:
                break
            if sha == keep:
                continue
            with ExitStack() as held:
                if not (held.enter_context(self._try(sha, ".use")) and held.enter_context(self._try(sha, ".lock"))):
                    continue  # in use, or being checked or filled: not now
                _discard(folder)
                self._lockfile(sha, ".verified.json").unlink(missing_ok=True)
            total -= size
            removed.append(sha)
            self.log(f"removed {sha[:12]} from the node cache ({size / 2**20:.1f} MiB, least recently used)")
        if total > self.max_bytes:
            self.log(
                f"the node cache {self.root} holds {total / 2**20:.1f} MiB with what is in use, over its budget of "
                f"{self.max_bytes / 2**20:.1f} MiB (FLEET_CACHE_MAX_BYTES)"
            )
        return removed

    # -- locks and records -----------------------------------------------------------
    def _lockfile(self, sha256: str, suffix: str) -> Path:
        locks = self.root / ".locks"
        locks.mkdir(parents=True, exist_ok=True)
        return locks / f"{sha256}{suffix}"

    @contextmanager
    def _exclusive(self, sha256: str) -> Iterator[None]:
        with open(self._lockfile(sha256, ".lock"), "a") as handle:
            started = time.monotonic()
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                self.log(f"artifact {sha256[:12]} is being fetched or checked by another process on this node: waiting")
                fcntl.flock(handle, fcntl.LOCK_EX)
                self.log(f"artifact {sha256[:12]}: waited {time.monotonic() - started:.1f} s")
            yield

    @contextmanager
    def _try(self, sha256: str, suffix: str) -> Iterator[bool]:
        with open(self._lockfile(sha256, suffix), "a") as handle:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                yield False
                return
            yield True

    def _record(self, sha256: str, target: Path, listing: Mapping[str, Mapping[str, Any]]) -> None:
        """Note each verified file's stat signature (``check_folder`` just hashed them all)."""
        signatures = {}
        for rel in listing:
            st = target.joinpath(*rel.split("/")).stat()
            signatures[rel] = [_signature(st), listing[rel]["sha256"], int(listing[rel]["size"])]
        tmp = self._lockfile(sha256, f".verified.{uuid.uuid4().hex[:8]}")
        tmp.write_text(json.dumps(signatures))
        os.replace(tmp, self._lockfile(sha256, ".verified.json"))

    def _recall(self, sha256: str, target: Path) -> None:
        """Tell the integrity check what an earlier process verified (files unchanged since)."""
        try:
            signatures = json.loads(self._lockfile(sha256, ".verified.json").read_text())
        except (OSError, ValueError):
            return
        for rel, (signature, digest, size) in signatures.items():
            remember(target.joinpath(*rel.split("/")), tuple(signature), (digest, size))


def model_dir(build: Mapping[str, Any], environ: Mapping[str, str] = os.environ) -> str | None:
    """The folder the service loads its model from (see the module's docstring); this process
    holds the entry against eviction until it exits. None while ``bentoml build`` imports the
    service (``fleet package`` sets ``FLEET_BENTO_BUILD``): a build needs no weights."""
    if environ.get(BUILDING):
        return None
    given = environ.get("FLEET_MODEL_DIR")
    if given:
        return given
    sha, what = build["artifact_sha256"], f"{build['model']}:{build['version']}"
    budget = environ.get("FLEET_CACHE_MAX_BYTES")
    cache = NodeCache(
        environ.get("FLEET_CACHE_DIR") or ".fleet/cache",
        int(budget) if budget else None,
        chunk_bytes=int(environ.get("FLEET_FETCH_CHUNK_BYTES") or CHUNK_BYTES),
        concurrency=int(environ.get("FLEET_FETCH_CONCURRENCY") or CONCURRENCY),
    )
    store = environ.get("FLEET_STORE")
    cache.hold(sha)
    prefix = build.get("artifact_prefix") or f"models/{build['model']}/{build['version']}/artifact/"
    return str(cache.ensure(sha, build["files"], open_source(store) if store else None, prefix, what=what))


def _unlisted(folder: Path, listing: Mapping[str, Any]) -> list[str]:
    return sorted(
        rel for p in folder.rglob("*") if p.is_file() and (rel := p.relative_to(folder).as_posix()) not in listing
    )


def _signature(st: os.stat_result) -> list[int]:
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def _size(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def _discard(entry: Path) -> None:
    """Take ``entry`` out of the cache at once (a rename), then delete it."""
    aside = entry.with_name(f".discard-{entry.name}-{uuid.uuid4().hex[:8]}")
    os.replace(entry, aside)
    shutil.rmtree(aside, ignore_errors=True)
