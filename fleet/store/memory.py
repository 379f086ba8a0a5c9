"""In-memory store: the fake for pure unit tests (one process only)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

from fleet.errors import NotFound
from fleet.store._shared import check_key, check_preconditions, check_prefix, content_etag
from fleet.types import ObjectInfo, StoredObject


class MemoryStore:
    def __init__(self) -> None:
        self.url = "memory://"
        self._objects: dict[str, bytes] = {}
        self._written: dict[str, float] = {}
        self._lock = threading.Lock()

    def get(self, key: str) -> StoredObject:
        check_key(key)
        with self._lock:
            if key not in self._objects:
                raise NotFound(f"no object at {key!r} in {self.url}")
            data = self._objects[key]
        return StoredObject(key, data, content_etag(data))

    def put(self, key: str, data: bytes, *, if_match: str | None = None, if_none_match: bool = False) -> str:
        check_key(key)
        data = bytes(data)
        with self._lock:
            current = self._objects.get(key)
            check_preconditions(key, current, if_match, if_none_match)
            self._objects[key] = data
            self._written[key] = time.time()
        return content_etag(data)

    def get_if_changed(self, key: str, etag: str | None) -> StoredObject | None:
        obj = self.get(key)
        return None if obj.etag == etag else obj

    def scan(self, prefix: str = "") -> Iterator[ObjectInfo]:
        check_prefix(prefix)
        with self._lock:
            found = [
                ObjectInfo(k, content_etag(v), self._written[k])
                for k, v in self._objects.items()
                if k.startswith(prefix)
            ]
        yield from sorted(found, key=lambda info: info.key)

    def list(self, prefix: str = "") -> Iterator[str]:
        check_prefix(prefix)
        with self._lock:
            keys = sorted(k for k in self._objects if k.startswith(prefix))
        yield from keys

    def delete(self, key: str) -> None:
        check_key(key)
        with self._lock:
            self._objects.pop(key, None)
            self._written.pop(key, None)
