"""In-memory store: the fake for pure unit tests (one process only)."""

from __future__ import annotations

import threading
from collections.abc import Iterator

from fleet.errors import NotFound
from fleet.store._shared import check_key, check_preconditions, check_prefix, content_etag
from fleet.types import StoredObject


class MemoryStore:
    def __init__(self) -> None:
        self.url = "memory://"
        self._objects: dict[str, bytes] = {}
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
        return content_etag(data)

    def list(self, prefix: str = "") -> Iterator[str]:
        check_prefix(prefix)
        with self._lock:
            keys = sorted(k for k in self._objects if k.startswith(prefix))
        yield from keys

    def delete(self, key: str) -> None:
        check_key(key)
        with self._lock:
            self._objects.pop(key, None)
