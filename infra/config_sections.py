"""The sections of the stack config that are mappings of their own: ``gateway``, ``logs`` and
``prefectDatabase`` (infra/config.py's Settings holds them; its docstring says how they are read)."""

from __future__ import annotations

import math
import re
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from fleet.logs.committer import RETENTION_DAYS
from fleet.validation import checked, expected


class _Cfg(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)


class GatewaySettings(_Cfg):
    image_tag: str = Field("0.1.0", min_length=1)  # in the gateway's ECR repository (tags are immutable)
    min_replicas: int = Field(2, ge=1)  # >= 2 so a node drain never takes the whole gateway
    max_replicas: int = Field(6, ge=1)
    # processes per pod on one SO_REUSEPORT socket (FLEET_GATEWAY_WORKERS, the default of
    # `fleet gateway --workers`); they share quotas through the quota store
    workers: int = Field(2, ge=1, le=16)
    cpu: float = Field(gt=0.0)  # the pod's CPU request; default one per worker, and never less
    memory_gib: float = Field(1.0, gt=0.0)
    node_port: int = Field(30080, ge=30000, le=32767)  # the load balancer's target port on the nodes

    @model_validator(mode="before")
    @classmethod
    def _cpu_per_worker_by_default(cls, data: Any) -> Any:
        if isinstance(data, dict) and "cpu" not in data:
            default = cls.model_fields["workers"].default
            workers = data.get("workers", default)
            valid = isinstance(workers, int) and not isinstance(workers, bool)  # else its own error says so
            return {**data, "cpu": float(workers if valid else default)}
        return data

    @model_validator(mode="after")
    def _min_below_max(self) -> GatewaySettings:
        if self.min_replicas > self.max_replicas:
            raise expected(
                f"an integer <= max_replicas ({self.max_replicas})", field="min_replicas", got=self.min_replicas
            )
        return self

    @model_validator(mode="after")
    def _one_cpu_per_worker(self) -> GatewaySettings:
        # each worker is a single-threaded event loop that can keep a CPU busy; the scheduler
        # places pods by this request, so less would put more workers on a node than it has CPUs
        if self.cpu < self.workers:
            raise expected(
                f"a number >= workers ({self.workers}): one CPU per worker process", field="cpu", got=self.cpu
            )
        return self


ATHENA_MIN_CUTOFF_BYTES = 10 * 2**20  # Athena's smallest per-query cutoff: 10 MB (its MB and GB are binary)
AthenaLimitGb = checked(
    float,
    f"a number of GB >= {ATHENA_MIN_CUTOFF_BYTES / 2**30} (10 MB, Athena's smallest cutoff)",
    lambda gb: math.isfinite(gb) and gb * 2**30 >= ATHENA_MIN_CUTOFF_BYTES,
)


class LogSettings(_Cfg):
    """``serving-fleet:logs``: the Iceberg tables of the inference log, feedback, outcomes and
    usage (the models bucket's ``logs/``, infra/storage.py) and the Athena workgroup that
    queries them (infra/analytics.py)."""

    # rows older are dropped by the committer, which must be run with the same number (its
    # default is this one's); lifecycle expires the tables' data files a week after that
    retention_days: int = Field(RETENTION_DAYS, ge=1)
    # what one query may scan before Athena cancels it (it bills per byte scanned)
    athena_bytes_scanned_limit_gb: AthenaLimitGb = 10.0

    @property
    def athena_bytes_scanned_limit(self) -> int:
        """The cutoff in bytes, as Athena takes it."""
        return round(self.athena_bytes_scanned_limit_gb * 2**30)


Host = checked(
    str,
    "a host name or IP address, without scheme or port, like 'prefect.db.internal'",
    re.compile(r"[A-Za-z0-9]([A-Za-z0-9.-]{0,251}[A-Za-z0-9])?").fullmatch,
)


class PrefectDatabaseSettings(_Cfg):
    """``serving-fleet:prefectDatabase``: the Prefect server's PostgreSQL (infra/prefect_db.py).
    An RDS instance by default (Multi-AZ and deletion protection when env is prod); with
    ``external_host``, a database that already exists there instead (user and database
    ``prefect``, the password the stack's ``prefectDbPassword``), and no RDS instance."""

    instance_class: str = Field("db.t4g.small", pattern=r"db\.[a-z0-9]+\.[a-z0-9]+")
    # single-AZ USD per hour, for the cost table: needed only for a class without a recorded price
    # (fleet.planning.stack.RDS_POSTGRES_USD)
    hourly_usd: float | None = Field(None, ge=0.0)
    storage_gib: int = Field(20, ge=20, le=65536)  # gp3's smallest; grows up to max_storage_gib on its own
    max_storage_gib: int = Field(100, ge=20, le=65536)
    backup_days: int = Field(7, ge=1, le=35)  # RDS's automated backups (point-in-time recovery)
    external_host: Host | None = None
    external_port: int = Field(5432, ge=1, le=65535)

    @model_validator(mode="after")
    def _room_to_grow(self) -> PrefectDatabaseSettings:
        if self.max_storage_gib < self.storage_gib:
            raise expected(
                f"an integer >= storage_gib ({self.storage_gib})", field="max_storage_gib", got=self.max_storage_gib
            )
        return self
