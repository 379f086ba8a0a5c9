"""Local-disk store: atomic renames for readers, per-key file locks for writers.

Readers never see a half-written object: data goes to ``.tmp/`` on the same filesystem,
is fsynced, then renamed over the key. Conditional writes hold an ``flock`` on one of 256
lock files (chosen by the key's hash), so several processes writing the same key serialise
their check-then-write. The ETag is the SHA-256 of the content.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from fleet.errors import InvalidInput, NotFound, StoreUnavailable
from fleet.store._shared import check_key, check_preconditions, check_prefix, content_etag
from fleet.types import ObjectInfo, StoredObject

_LOCK_STRIPES = 256


class FileStore:
    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root).absolute()
        self.url = f"file://{self.root}"
        if self.root.exists() and not self.root.is_dir():
            raise InvalidInput(f"store root {self.root} is a file; expected a directory")
        self._tmp = self.root / ".tmp"
        self._locks = self.root / ".locks"
        # Folders are made by the first write, so reading a mistyped store path finds
        # nothing instead of quietly creating an empty store there.

    def _path(self, key: str) -> Path:
        return self.root.joinpath(*check_key(key).split("/"))

    def get(self, key: str) -> StoredObject:
        path = self._path(key)
        try:
            data = path.read_bytes()
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            raise NotFound(f"no object at {key!r} in {self.url}") from None
        return StoredObject(key, data, content_etag(data))

    def put(self, key: str, data: bytes, *, if_match: str | None = None, if_none_match: bool = False) -> str:
        path = self._path(key)
        try:
            with self._locked(key):
                if if_match is not None or if_none_match:
                    check_preconditions(key, self._read_or_none(path), if_match, if_none_match)
                self._make_room(key, path)
                self._write(path, data)
        except OSError as exc:  # name the key, never a lock or temporary file of the store's own
            raise StoreUnavailable(
                f"cannot write {key!r} in {self.url}: {exc.strerror or exc}; nothing was changed"
            ) from None
        return content_etag(bytes(data))

    def _write(self, path: Path, data: bytes) -> None:
        fd, tmp = tempfile.mkstemp(dir=self._tmp, prefix=path.name[:40] + ".")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
            _fsync_dir(path.parent)  # the rename itself must survive a crash
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def get_if_changed(self, key: str, etag: str | None) -> StoredObject | None:
        obj = self.get(key)
        return None if obj.etag == etag else obj

    def list(self, prefix: str = "") -> Iterator[str]:
        yield from sorted(self._keys(prefix))

    def scan(self, prefix: str = "") -> Iterator[ObjectInfo]:
        found = []
        for key in self._keys(prefix):
            try:
                st = self._path(key).stat()
            except FileNotFoundError:
                continue  # deleted since the walk
            # every write is a new file renamed over the key: a new inode, whatever the clock's grain
            found.append(ObjectInfo(key, f"{st.st_ino}-{st.st_mtime_ns}-{st.st_size}", st.st_mtime))
        yield from sorted(found, key=lambda info: info.key)

    def _keys(self, prefix: str) -> list[str]:
        check_prefix(prefix)
        # Walk only the deepest directory the prefix names, not the whole store.
        head = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
        base = self.root.joinpath(*head.split("/")) if head else self.root
        keys: list[str] = []
        for dirpath, dirnames, filenames in os.walk(base):
            rel = os.path.relpath(dirpath, self.root)
            rel = "" if rel == "." else rel.replace(os.sep, "/") + "/"
            if not rel:
                dirnames[:] = [d for d in dirnames if not d.startswith(".")]
            keys.extend(k for k in (rel + name for name in filenames) if k.startswith(prefix))
        return keys

    def delete(self, key: str) -> None:
        path = self._path(key)
        with self._locked(key):
            try:
                path.unlink()
            except (FileNotFoundError, IsADirectoryError):
                pass

    def _make_room(self, key: str, path: Path) -> None:
        """Create the key's folders; S3 allows ``a`` and ``a/b`` side by side, disks do not."""
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except (FileExistsError, NotADirectoryError):
            raise InvalidInput(
                f"object key {key!r} cannot be stored in {self.url}: a part of its path is "
                "already an object; expected keys that are not prefixes of other keys"
            ) from None
        if path.is_dir():
            raise InvalidInput(
                f"object key {key!r} cannot be stored in {self.url}: other keys live under it; "
                "expected keys that are not prefixes of other keys"
            )

    @staticmethod
    def _read_or_none(path: Path) -> bytes | None:
        try:
            return path.read_bytes()
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            return None

    @contextmanager
    def _locked(self, key: str) -> Iterator[None]:
        stripe = int(hashlib.sha256(key.encode()).hexdigest()[:8], 16) % _LOCK_STRIPES
        self._tmp.mkdir(parents=True, exist_ok=True)
        self._locks.mkdir(parents=True, exist_ok=True)
        with open(self._locks / f"{stripe:03d}.lock", "a+b") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
