"""The one-per-fleet sections: the gateway's byte budgets (``gateway:``) and the local
runtime's memory and cache budgets (``runtime:``)."""

from __future__ import annotations

from pydantic import Field

from fleet.catalog.policies.spec import Spec


class GatewaySpec(Spec):
    """Byte budgets of one gateway process: the ``gateway:`` section, one per fleet.

    Each bounds memory that tenants' traffic fills; past it the oldest entries are evicted
    (or new ones dropped and counted), never the process's memory grown.
    """

    max_body_mib: float = Field(4.0, gt=0.0, le=256.0)  # an inference or feedback request body (413)
    inflight_body_mib: float = Field(64.0, gt=0.0)  # all bodies held at once; a tenant gets half (503 / 429)
    admin_max_body_kib: float = Field(64.0, gt=0.0, le=4096.0)  # an admin API request body (413)
    body_read_s: float = Field(30.0, gt=0.0, le=600.0)  # a request body must arrive whole within this (408)
    # each event of a streamed answer, and each answer's bytes, must be taken by the caller
    # within this, else the answer is cut, the connection aborted and what it held (slot,
    # replica connection, concurrency lease, buffered bytes) released
    stream_write_s: float = Field(10.0, gt=0.0, le=600.0)
    shadow_queue_mib: float = Field(64.0, gt=0.0)  # inputs and answers waiting to be mirrored
    inference_log_buffer_mib: float = Field(64.0, gt=0.0)  # sampled rows not yet written to the store
    # a gateway process stages its sampled rows as one file this often, or once this much is buffered
    inference_log_flush_s: float = Field(60.0, ge=0.5, le=3600.0)
    inference_log_flush_mib: float = Field(16.0, gt=0.0)
    feedback_index_mib: float = Field(16.0, gt=0.0)  # recent sampled request ids, for feedback joins
    # POST /v1/feedback calls one tenant may make, in a bucket of their own beside its request
    # quota (shared through Redis like it): past it 429 before the body is read, nothing
    # written. Unset: the tenant's own quota's rps and burst (a tenant without one, unlimited)
    feedback_rps: float | None = Field(None, gt=0.0)
    feedback_burst: int | None = Field(None, ge=1)

    @staticmethod
    def mib(value: float) -> int:
        return int(value * 1024 * 1024)


class RuntimeSpec(Spec):
    """The local runtime's budget: the ``runtime:`` section, one per fleet.

    ``memory_budget_mib``: what the replicas of every version on this machine may hold
    together (their processes' proportional set size). Starting a lazy version past it first
    stops the least recently used idle lazy versions; one that still does not fit is refused
    (503 naming the budget). Eager versions count against it but are never stopped for it.
    ``artifact_cache_mib``: what the verified artifacts cached for packaging may hold on disk
    (``fleet.runtime.cache``); none by default.
    """

    memory_budget_mib: float | None = Field(None, gt=0.0)
    # the local artifact cache (FLEET_CACHE_DIR): least recently used entries past it are removed
    artifact_cache_mib: float | None = Field(None, gt=0.0)
