"""Rules shared by the store backends: valid keys (the same on all) and content-hash ETags."""

from __future__ import annotations

import hashlib

from fleet.errors import InvalidInput, PreconditionFailed

_FORBIDDEN_CHARS = ("\\", "\x00")


def check_key(key: str) -> str:
    """Return ``key`` if it is a valid object key, else raise ``InvalidInput``.

    A key is ``/``-separated, relative, with no empty, ``.`` or ``..`` segments; its first
    segment may not start with ``.`` (those names are the file backend's own).
    """
    if not isinstance(key, str) or not key:
        raise InvalidInput(f"object key {key!r} is empty; expected a path like 'routes/demo.json'")
    segments = key.split("/")
    if (
        any(ch in key for ch in _FORBIDDEN_CHARS)
        or any(seg in ("", ".", "..") for seg in segments)
        or segments[0].startswith(".")
    ):
        raise InvalidInput(
            f"object key {key!r} is not valid; expected '/'-separated names with no empty, "
            "'.' or '..' parts, no backslash, and a first part not starting with '.'"
        )
    return key


def check_prefix(prefix: str) -> str:
    """Validate a listing prefix: empty, or a key (optionally ending in ``/``)."""
    if prefix:
        check_key(prefix.rstrip("/") or "/")
    return prefix


def content_etag(data: bytes) -> str:
    """The ETag of the in-memory and file backends: the SHA-256 of the content."""
    return hashlib.sha256(data).hexdigest()


def check_preconditions(key: str, current: bytes | None, if_match: str | None, if_none_match: bool) -> None:
    """The conditional-write rules of the content-hash backends (memory, file)."""
    if if_none_match and current is not None:
        raise PreconditionFailed(f"{key!r} already exists; expected it not to")
    if if_match is not None:
        if current is None:
            raise PreconditionFailed(f"{key!r} does not exist; expected ETag {if_match}")
        if content_etag(current) != if_match:
            raise PreconditionFailed(f"{key!r} changed since it was read (ETag {if_match} is stale)")
