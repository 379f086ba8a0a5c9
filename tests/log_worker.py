"""Child processes for the log-table tests (``tests/test_log_tables.py``).

``log_worker.py write URL NAME FLUSHES ROWS``: a gateway's log writer staging FLUSHES files of
ROWS samples each (three models, the oldest an hour and a half back); after each flush
returns it prints the flush's request ids as one JSON line: those are acknowledged.

``log_worker.py commit URL STEP``: one committer run that kills its own process (SIGKILL, no
clean-up) at STEP: ``after-intent`` (the intent written, nothing appended) or ``after-append``
(the snapshot committed, the staged files not yet deleted); ``none`` runs to the end.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import numpy as np

from fleet.store import open_store

MODELS = ("alpha", "beta", "gamma")


def write(url: str, name: str, flushes: int, rows: int) -> None:
    from fleet.logs.inference import InferenceLog, Sample

    log = InferenceLog(open_store(url), name)
    now = time.time()
    for f in range(flushes):
        ids = []
        for i in range(rows):
            rid = f"{name}-{f}-{i}"
            ts = now - 5400 + (f * rows + i) * 7.0 % 5400
            model = MODELS[i % len(MODELS)]
            features = np.full((1, 2), float(i), np.float32)
            log.record(Sample(ts, rid, model, "1.0.0", "apps", 2.0, features, np.array([[0.3, 0.7]]), ("x", "y")))
            ids.append(rid)
        assert log.flush() == rows
        print(json.dumps(ids), flush=True)


def commit(url: str, step: str) -> None:
    from pyiceberg.table import Table

    from fleet.logs import committer

    def die(*args, **kwargs) -> None:  # noqa: ANN002, ANN003
        os.kill(os.getpid(), signal.SIGKILL)

    if step == "after-intent":
        Table.append = die  # type: ignore[method-assign]
    elif step == "after-append":
        committer._delete_all = die  # type: ignore[assignment]  # noqa: SLF001
    committer.run(open_store(url), who=f"test {step}", maintain=False)
    print("done", flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "write":
        write(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
    else:
        commit(sys.argv[2], sys.argv[3])
