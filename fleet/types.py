"""Contracts that cross module borders: backend protocols and the frozen data they pass.

Every pluggable backend is a Protocol here, with one module per implementation and a
factory that refuses unknown kinds.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol, runtime_checkable


@dataclass(frozen=True, slots=True)
class StoredObject:
    """Bytes read from the store with the ETag that a conditional write can match."""

    key: str
    data: bytes
    etag: str


@runtime_checkable
class ObjectStore(Protocol):
    """A flat key → bytes store with conditional writes (the fleet's only durable state).

    Keys are ``/``-separated relative paths (``routes/demo.json``). ETags are opaque: compare
    them for equality, never parse them.
    """

    url: str

    def get(self, key: str) -> StoredObject:
        """Return the object; raise ``NotFound`` when the key does not exist."""

    def put(
        self,
        key: str,
        data: bytes,
        *,
        if_match: str | None = None,
        if_none_match: bool = False,
    ) -> str:
        """Write ``data`` and return its new ETag.

        ``if_match``: write only if the current ETag equals it (else ``PreconditionFailed``,
        also when the key is missing). ``if_none_match``: write only if the key does not
        exist yet (else ``PreconditionFailed``).
        """

    def list(self, prefix: str = "") -> Iterator[str]:
        """Yield every key starting with ``prefix``, in ascending byte order."""

    def delete(self, key: str) -> None:
        """Remove the key; removing a missing key is not an error."""
