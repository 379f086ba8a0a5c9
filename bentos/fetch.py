"""One version's files from the store into a staging folder: ranged, parallel, resumable, verified.

A replica's image holds code only; at start it fetches its version's artifact
(``models/<model>/<version>/artifact/<file>`` in the store ``FLEET_STORE`` names) into the
node cache (``weights.py``). Shipped in every Bento beside the service: it imports the
standard library only (boto3 lazily, for ``s3://`` stores).

Each file is fetched in ``chunk_bytes`` ranges (one ranged GET each, ``concurrency`` at once
over all files: one S3 connection moves ~90 MB/s, a node's network several GB/s) written in
place into ``<file>.part``; a finished range is appended to ``<file>.part.done``. A fetch that
was killed resumes from those records and asks only for the ranges it lacks. A whole file is
then hashed and compared with the manifest's SHA-256 and size before it is renamed to its
name: a mismatch after a resume downloads the file once more from zero (a range written by a
process killed mid-write is caught here); a mismatch of a fresh download is refused with
``FetchError`` naming the file and both digests, so the replica never reports ready on it.
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlsplit

CHUNK_BYTES = 64 << 20  # one ranged GET: large enough that a request's latency is noise
CONCURRENCY = 16  # ranged GETs in flight; S3 serves ~90 MB/s per connection
REPORT_EVERY_S = 5.0  # progress lines in the pod log
_READ = 1 << 20


class FetchError(Exception):
    """The artifact cannot be fetched or does not match its manifest; the message says which file and why."""


class Source(Protocol):
    """Where artifact files are read from: whole sizes and byte ranges of keys."""

    url: str

    def size(self, key: str) -> int: ...

    def read(self, key: str, start: int, end: int) -> Iterator[bytes]:
        """Bytes ``start`` up to (not including) ``end`` of ``key``, in pieces."""
        ...


class FolderSource:
    """A ``file://`` store: keys are paths under ``root``."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        self.url = f"file://{self.root}"

    def _path(self, key: str) -> Path:
        return self.root.joinpath(*key.split("/"))

    def size(self, key: str) -> int:
        try:
            return self._path(key).stat().st_size
        except FileNotFoundError:
            raise FetchError(f"{key} is not in the store {self.url}") from None

    def read(self, key: str, start: int, end: int) -> Iterator[bytes]:
        with open(self._path(key), "rb") as f:
            f.seek(start)
            left = end - start
            while left > 0 and (piece := f.read(min(_READ, left))):
                left -= len(piece)
                yield piece


class S3Source:
    """An ``s3://bucket/prefix`` store through boto3 (endpoint from ``AWS_ENDPOINT_URL_S3``;
    credentials from the pod's IAM role)."""

    def __init__(self, bucket: str, prefix: str = "", *, client: Any = None) -> None:  # noqa: ANN401
        self.bucket, self.prefix = bucket, prefix.strip("/")
        self.url = f"s3://{bucket}/{self.prefix}".rstrip("/")
        if client is None:
            import boto3
            from botocore.config import Config

            client = boto3.session.Session().client(
                "s3",
                config=Config(
                    retries={"total_max_attempts": 5, "mode": "standard"},
                    max_pool_connections=CONCURRENCY * 2,
                    connect_timeout=10,
                    read_timeout=60,
                ),
            )
        self._s3 = client

    def _key(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def size(self, key: str) -> int:
        try:
            return int(self._s3.head_object(Bucket=self.bucket, Key=self._key(key))["ContentLength"])
        except Exception as exc:  # noqa: BLE001 - botocore raises ClientError for a missing key
            raise FetchError(f"{key} cannot be read from the store {self.url}: {type(exc).__name__}: {exc}") from exc

    def read(self, key: str, start: int, end: int) -> Iterator[bytes]:
        resp = self._s3.get_object(Bucket=self.bucket, Key=self._key(key), Range=f"bytes={start}-{end - 1}")
        yield from resp["Body"].iter_chunks(_READ)


def open_source(url: str) -> Source:
    """The store ``url`` names: ``s3://bucket[/prefix]``, ``file://path`` or a bare path (as ``FLEET_STORE``)."""
    if url.startswith("s3://"):
        parts = urlsplit(url)
        if not parts.netloc:
            raise FetchError(f"FLEET_STORE {url!r} names no bucket; expected s3://<bucket>[/<prefix>]")
        return S3Source(parts.netloc, parts.path)
    if url.startswith("file://"):
        return FolderSource(url[len("file://") :])
    if "://" in url:
        raise FetchError(f"FLEET_STORE {url!r}: only s3:// and file:// stores hold artifacts a replica can fetch")
    return FolderSource(url)


class Progress:
    """Bytes fetched and the rate, as a line in the log every ``every_s`` and at the end."""

    def __init__(self, what: str, total: int, log: Callable[[str], None], every_s: float = REPORT_EVERY_S) -> None:
        self.what, self.total, self.log, self.every_s = what, total, log, every_s
        self.done = self.fetched = 0
        self.started = self.last = time.monotonic()
        self._lock = threading.Lock()

    def add(self, n: int, *, fetched: bool = True) -> None:
        with self._lock:
            self.done += n
            self.fetched += n if fetched else 0
            now = time.monotonic()
            if now - self.last >= self.every_s:
                self.last = now
                self.log(self.line())

    def line(self) -> str:
        took = max(time.monotonic() - self.started, 1e-9)
        return (
            f"fetching {self.what}: {self.done / 2**20:.1f} of {self.total / 2**20:.1f} MiB "
            f"({100 * self.done / max(self.total, 1):.0f} %), {self.fetched / 2**20 / took:.1f} MiB/s"
        )


def fetch_files(
    source: Source,
    prefix: str,
    listing: Mapping[str, Mapping[str, Any]],
    staging: Path,
    *,
    what: str,
    chunk_bytes: int = CHUNK_BYTES,
    concurrency: int = CONCURRENCY,
    log: Callable[[str], None] = lambda _: None,
) -> int:
    """Make ``staging`` hold every listed file, each verified; the bytes downloaded (0: all were there).

    ``prefix`` + a listed path is the file's key in ``source``. Every file is hashed once,
    after its last range landed (files are hashed in parallel); one already in ``staging``
    under its name (an earlier run verified it) is hashed again and kept if it matches.
    """
    staging.mkdir(parents=True, exist_ok=True)
    total = sum(int(d["size"]) for d in listing.values())
    progress = Progress(what, total, log)
    parts = [
        _PartFile(rel, staging.joinpath(*rel.split("/")), int(d["size"]), str(d["sha256"]), chunk_bytes)
        for rel, d in sorted(listing.items())
    ]
    # a file under its name was verified by an earlier run before its rename: hashed again here,
    # so that every file of the entry was hashed by this process (the cache records that)
    kept = set(_parallel(concurrency, lambda p: p.final_intact(), parts))
    todo = [p for p in parts if p.rel not in kept]
    for part in todo:
        progress.add(part.resume(), fetched=False)
    progress.add(sum(p.size for p in parts if p.rel in kept), fetched=False)
    _download(source, prefix, todo, progress, concurrency)
    retry = [p for p, ok in zip(todo, _parallel(concurrency, lambda p: p.check(fresh=not p.resumed), todo)) if not ok]
    if retry:  # a resumed file that fails its hash: its ranges may be torn; fetch it once more from zero
        for part in retry:
            log(f"{part.rel}: resumed bytes do not match the manifest; downloading it again from the start")
            part.reset()
        _download(source, prefix, retry, progress, concurrency)
        _parallel(concurrency, lambda p: p.check(fresh=True), retry)
    log(progress.line() + f"; done in {time.monotonic() - progress.started:.1f} s")
    return progress.fetched


def _parallel(concurrency: int, work: Callable[[_PartFile], Any], parts: list[_PartFile]) -> list[Any]:
    """``work`` over ``parts`` on up to ``concurrency`` threads (hashlib and file I/O release the
    GIL: a node's cores hash its shards at once); results in order, the first error raised."""
    if not parts:
        return []
    with ThreadPoolExecutor(max_workers=max(1, min(concurrency, len(parts))), thread_name_prefix="hash") as pool:
        return list(pool.map(work, parts))


def _download(source: Source, prefix: str, parts: list[_PartFile], progress: Progress, concurrency: int) -> None:
    jobs = [(part, index) for part in parts for index in part.missing()]
    if not jobs:
        return
    source_sizes = {part.rel: source.size(prefix + part.rel) for part in parts if part.missing()}
    for part in parts:
        if part.rel in source_sizes and source_sizes[part.rel] != part.size:
            raise FetchError(
                f"{part.rel} in {source.url} has {source_sizes[part.rel]} bytes, expected {part.size} "
                f"(sha256 {part.sha256}) as the manifest lists; refusing the store's copy"
            )

    def run(job: tuple[_PartFile, int]) -> None:
        part, index = job
        start, end = part.span(index)
        at = start
        fd = os.open(part.part, os.O_WRONLY)
        try:
            for piece in source.read(prefix + part.rel, start, end):
                os.pwrite(fd, piece, at)
                at += len(piece)
                progress.add(len(piece))
        finally:
            os.close(fd)
        if at != end:
            raise FetchError(
                f"{part.rel}: bytes {start}-{end - 1} came back short ({at - start} bytes) from {source.url}"
            )
        part.finished(index)

    with ThreadPoolExecutor(max_workers=max(1, concurrency), thread_name_prefix="fetch") as pool:
        for _ in pool.map(run, jobs):  # the first failure is raised here
            pass


class _PartFile:
    """A file being fetched: ``<name>.part`` at its full size, and the ranges already in it."""

    def __init__(self, rel: str, final: Path, size: int, sha256: str, chunk: int) -> None:
        self.rel, self.final, self.size, self.sha256, self.chunk = rel, final, size, sha256, max(1, chunk)
        self.part = final.with_name(final.name + ".part")
        self.record = final.with_name(final.name + ".part.done")
        self.done: set[int] = set()
        self.resumed = False
        self._lock = threading.Lock()

    @property
    def chunks(self) -> int:
        return (self.size + self.chunk - 1) // self.chunk

    def span(self, index: int) -> tuple[int, int]:
        return index * self.chunk, min(self.size, (index + 1) * self.chunk)

    def final_intact(self) -> str | None:
        """``rel`` if the file is already here under its name with the manifest's bytes."""
        if not (self.final.is_file() and self.final.stat().st_size == self.size):
            return None
        if _sha256(self.final)[0] == self.sha256:
            return self.rel
        self.final.unlink()
        return None

    def resume(self) -> int:
        """Read what an earlier run left; the bytes already here."""
        self.final.parent.mkdir(parents=True, exist_ok=True)
        if self.part.is_file() and self.part.stat().st_size == self.size and self.record.is_file():
            header, *lines = self.record.read_text().splitlines()
            if header == f"chunk {self.chunk}":  # another chunk size: the ranges do not line up
                self.done = {int(x) for x in lines if x.isdigit() and int(x) < self.chunks}
        if not self.done:
            self.reset()
            return 0
        self.resumed = True
        return sum(self.span(i)[1] - self.span(i)[0] for i in self.done)

    def reset(self) -> None:
        self.done, self.resumed = set(), False
        with open(self.part, "wb") as f:
            f.truncate(self.size)
        self.record.write_text(f"chunk {self.chunk}\n")

    def missing(self) -> list[int]:
        return [i for i in range(self.chunks) if i not in self.done]

    def finished(self, index: int) -> None:
        with self._lock:  # after its bytes are written: a kill before this line refetches the range
            self.done.add(index)
            with open(self.record, "a") as f:
                f.write(f"{index}\n")

    def check(self, *, fresh: bool) -> bool:
        """Hash the whole ``.part``; rename it into place if it matches. False for a resumed
        file that does not (the caller downloads it again); ``FetchError`` for a fresh one."""
        got, size = _sha256(self.part)
        if got == self.sha256 and size == self.size:
            os.replace(self.part, self.final)
            self.record.unlink(missing_ok=True)
            return True
        if not fresh:
            return False
        self.part.unlink(missing_ok=True)
        self.record.unlink(missing_ok=True)
        raise FetchError(
            f"{self.rel}: the store's copy fails its checksum: expected sha256 {self.sha256} ({self.size} bytes) "
            f"as the manifest lists, got sha256 {got} ({size} bytes); refusing to load a file changed after "
            "registration"
        )


def _sha256(path: Path) -> tuple[str, int]:
    digest, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while piece := f.read(_READ):
            digest.update(piece)
            size += len(piece)
    return digest.hexdigest(), size
