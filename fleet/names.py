"""Validation of the names and versions that become store keys, URLs and Kubernetes names."""

from __future__ import annotations

import re

import semver

from fleet.errors import InvalidInput

NAME_RE = re.compile(r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?")


def check_name(kind: str, name: str) -> str:
    """Model and tenant names are DNS labels: they end up in URLs, keys and k8s objects."""
    if not isinstance(name, str) or not NAME_RE.fullmatch(name):
        raise InvalidInput(
            f"{kind} name {name!r} is not valid; expected 1-63 lowercase letters, digits "
            "or '-', starting and ending with a letter or digit"
        )
    return name


def check_version(version: str) -> str:
    """Return ``version`` if it is a semantic version (``MAJOR.MINOR.PATCH[-pre][+build]``)."""
    try:
        semver.Version.parse(version)
    except (ValueError, TypeError):
        raise InvalidInput(
            f"version {version!r} is not a semantic version; expected MAJOR.MINOR.PATCH such as 1.2.0 (see semver.org)"
        ) from None
    return version


def version_key(version: str) -> semver.Version:
    """Sort key that orders versions by semver precedence (1.10.0 after 1.9.0)."""
    return semver.Version.parse(version)
