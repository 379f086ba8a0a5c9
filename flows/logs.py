"""``commit-logs``: the committer (``fleet.logs.committer``) on a schedule.

Every ``EVERY_S`` it commits what the gateways staged into the log tables, compacts the
settled hours, deletes rows past retention (``FLEET_LOG_RETENTION_DAYS``, default 30) and
expires old snapshots. One run at a time per store (a lease): a run that finds another
still going says so and ends.
"""

from __future__ import annotations

import os

from prefect import flow, get_run_logger

from fleet.logs.committer import EVERY_S, RETENTION_DAYS

__all__ = ["EVERY_S", "commit_logs"]


@flow(name="commit-logs", flow_run_name="commit logs")
def commit_logs(retention_days: int | None = None) -> list[dict]:
    from dataclasses import asdict

    from fleet.errors import Conflict
    from fleet.logs.committer import run
    from fleet.store import open_store

    logger = get_run_logger()
    days = retention_days or int(os.environ.get("FLEET_LOG_RETENTION_DAYS", RETENTION_DAYS))
    try:
        done = run(open_store(), who="flow commit-logs", retention_days=days)
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
