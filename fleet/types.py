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


@dataclass(frozen=True, slots=True)
class Deployment:
    """A model version running somewhere, reachable at one URL per replica."""

    model: str
    version: str
    endpoints: tuple[str, ...]


@runtime_checkable
class Runtime(Protocol):
    """Where model services run: local processes, or Kubernetes in production."""

    def deploy(self, model: str, version: str, replicas: int = 1) -> Deployment:
        """Run ``replicas`` ready replicas of the version (idempotent); return their endpoints."""

    def undeploy(self, model: str, version: str) -> None:
        """Stop every replica of the version; stopping what is not running is not an error."""

    def list(self) -> list[Deployment]:
        """Every deployment with at least one live replica."""

    def health(self, model: str, version: str) -> dict[str, bool]:
        """Endpoint → whether it answers its readiness check now."""
