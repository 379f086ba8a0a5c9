"""Object store: the fleet's one durable source of truth, chosen by ``FLEET_STORE``.

``file://<path>`` (default ``file://./.fleet/store``) or ``s3://<bucket>[/<prefix>]``; any
other scheme is refused, never silently replaced by a default.
"""

from __future__ import annotations

import os
import re
from urllib.parse import urlsplit

from fleet.errors import ConfigError
from fleet.store.file import FileStore
from fleet.store.memory import MemoryStore
from fleet.types import ObjectStore

DEFAULT_STORE = "file://./.fleet/store"
ACCEPTED = "file://<path> or s3://<bucket>[/<prefix>]"

__all__ = ["DEFAULT_STORE", "FileStore", "MemoryStore", "ObjectStore", "open_store"]


def open_store(url: str | None = None) -> ObjectStore:
    """Open the store at ``url``, or ``$FLEET_STORE``, or the embedded default."""
    url = url or os.environ.get("FLEET_STORE") or DEFAULT_STORE
    if "://" not in url:
        if re.match(r"^[A-Za-z][A-Za-z0-9+.-]*:", url):
            raise ConfigError(f"FLEET_STORE {url!r} is not a store URL; expected {ACCEPTED}")
        return FileStore(url)  # a bare path is a local directory
    scheme, rest = url.split("://", 1)
    if scheme == "file":
        if not rest:
            raise ConfigError(f"FLEET_STORE {url!r} names no directory; expected {ACCEPTED}")
        return FileStore(rest)
    if scheme == "s3":
        parts = urlsplit(url)
        if not parts.netloc:
            raise ConfigError(f"FLEET_STORE {url!r} names no bucket; expected {ACCEPTED}")
        from fleet.store.s3 import S3Store

        return S3Store(parts.netloc, parts.path)
    raise ConfigError(f"FLEET_STORE scheme {scheme!r} is not supported; expected {ACCEPTED}")
