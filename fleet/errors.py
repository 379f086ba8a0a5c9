"""One exception root for the fleet; each error carries the HTTP status it maps to.

The CLI prints ``str(error)`` as one line; the gateway answers ``{"error": str(error)}``
with ``error.status``. Messages say what was wrong and what was expected.
"""

from __future__ import annotations


class FleetError(Exception):
    """Root of every error the fleet raises on purpose."""

    status: int = 400


class InvalidInput(FleetError):
    """Input that is malformed or out of range."""

    status = 422


class Unauthorized(FleetError):
    status = 401


class Forbidden(FleetError):
    status = 403


class NotFound(FleetError):
    status = 404


class Conflict(FleetError):
    """The request contradicts stored state (duplicate version, refused transition)."""

    status = 409


class PreconditionFailed(Conflict):
    """A conditional write lost: the object changed (or exists) since it was read."""

    status = 412


class IntegrityError(FleetError):
    """Stored bytes do not match their recorded checksum."""

    status = 500


class ConfigError(FleetError):
    """Bad configuration: environment, policy files, store URL."""

    status = 400


class StoreUnavailable(FleetError):
    """The object store could not be reached or refused the operation."""

    status = 503


class VersionUnavailable(FleetError):
    """A routed version cannot be served now (its manifest is unreadable, say): 503."""

    status = 503
