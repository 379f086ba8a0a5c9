"""``commit-logs``: the committer (``fleet.logs.committer``) on a schedule.

Every ``EVERY_S`` it commits what the gateways staged into the log tables, compacts the
settled hours, deletes rows past retention (``FLEET_LOG_RETENTION_DAYS``, default 30) and
expires old snapshots. Then, under the same lease, it copies each usage hour that is final
(``USAGE_FINAL_H`` after its start: the gateways have let it go) from the usage files into
the usage table, one commit per hour that also records the hour as done (the table property
``fleet.usage.through``), so an hour is copied once whatever kills a run. One run at a time
per store (a lease): a run that finds another still going says so and ends.
"""

from __future__ import annotations

import os

from prefect import flow, get_run_logger

from fleet.logs.committer import EVERY_S, RETENTION_DAYS

__all__ = ["EVERY_S", "commit_logs", "copy_usage"]

USAGE_FINAL_H = 3  # an hour's usage files are final this long after its start (let go after two)
USAGE_FIRST_H = 48  # a table with no usage yet starts this far back
USAGE_PER_RUN = 72  # hours copied in one run at most (a longer backlog is caught up over runs)
THROUGH = "fleet.usage.through"


@flow(name="commit-logs", flow_run_name="commit logs")
def commit_logs(retention_days: int | None = None) -> list[dict]:
    from dataclasses import asdict

    from fleet.errors import Conflict
    from fleet.logs.committer import run
    from fleet.store import open_store

    logger = get_run_logger()
    days = retention_days or int(os.environ.get("FLEET_LOG_RETENTION_DAYS", RETENTION_DAYS))
    try:
        store = open_store()
        done = run(
            store,
            who="flow commit-logs",
            retention_days=days,
            also=lambda logs, check: copy_usage(store, logs, check, log=logger.info),
        )
    except Conflict as exc:
        logger.info("another committer is running: %s", exc)
        return []
    for d in done:
        if d.files or d.compacted or d.expired or d.rejected or d.recovered:
            logger.info(
                "%s: %d files (%d rows) committed, %d rejected, %d recovered, %d hours compacted, "
                "%d snapshots expired, %d files deleted",
                d.table,
                d.files,
                d.rows,
                len(d.rejected),
                d.recovered,
                d.compacted,
                d.expired,
                d.deleted,
            )
    return [asdict(d) for d in done]


def copy_usage(store, logs, check, *, now=None, log=lambda *a: None) -> list[str]:  # noqa: ANN001
    """Copy every final usage hour not copied yet into the usage table (oldest first, at most
    ``USAGE_PER_RUN``); return the hours copied."""
    from datetime import UTC, datetime, timedelta

    from fleet.logs.committer import append_through
    from fleet.usage.records import HOUR_FMT
    from fleet.usage.rollup import hour_files

    table = logs.table("usage", fresh=True)
    now = now or datetime.now(UTC)
    last = now.replace(minute=0, second=0, microsecond=0) - timedelta(hours=USAGE_FINAL_H)
    through = table.properties.get(THROUGH)
    hour = (
        datetime.strptime(through, HOUR_FMT).replace(tzinfo=UTC) + timedelta(hours=1)
        if through
        else last - timedelta(hours=USAGE_FIRST_H)
    )
    if hour > last:
        return []
    last = min(last, hour + timedelta(hours=USAGE_PER_RUN - 1))
    by_hour, bad = hour_files(store, hour, last)
    for b in bad:
        log("usage file %s left out of the usage table: %s", b.key, b.reason)
    # one commit per hour with traffic (it records the hours before it done too), and one for
    # the empty hours after the last: a quiet fleet costs a commit a run, not one per hour
    copied, pending = [], hour
    while hour <= last:
        copied.append(f"{hour:{HOUR_FMT}}")
        if hour in by_hour:
            append_through(table, _usage_rows(hour, by_hour[hour]), THROUGH, copied[-1], check)
            pending = hour + timedelta(hours=1)
        hour += timedelta(hours=1)
    if pending <= last:
        append_through(table, _usage_rows(last, []), THROUGH, copied[-1], check)
    log("usage hours copied into the usage table: %s to %s", copied[0], copied[-1])
    return copied


def _usage_rows(hour, files):  # noqa: ANN001, ANN202 - a pyarrow Table in the usage table's columns
    import pyarrow as pa

    from fleet.logs.tables import arrow_schema

    traffic = [(f.gateway, t) for f in files for t in f.traffic]
    schema = arrow_schema("usage")
    return pa.table(
        {
            "ts": pa.array([hour] * len(traffic), schema.field("ts").type),
            "model": [t.model for _, t in traffic],
            "tenant": [t.tenant for _, t in traffic],
            "version": [t.version for _, t in traffic],
            "gateway": [g for g, _ in traffic],
            "requests": pa.array([t.requests for _, t in traffic], pa.int64()),
            "rows": pa.array([t.rows for _, t in traffic], pa.int64()),
            "upstream_s": pa.array([t.upstream_s for _, t in traffic], pa.float64()),
            "tokens": pa.array([t.tokens for _, t in traffic], pa.int64()),
        },
        schema=schema,
    )
