"""Child process for the race tests.

``race_worker.py URL KEY N NAME``: increment a shared counter N times by conditional writes.
``race_worker.py URL MODEL N NAME --weights``: change the model's canary weight N times.
"""

from __future__ import annotations

import sys

from pydantic import BaseModel

from fleet import records
from fleet.store import open_store


class Counter(BaseModel):
    value: int = 0
    writers: list[str] = []


def main(url: str, key: str, times: int, name: str) -> None:
    store = open_store(url)
    for _ in range(times):
        records.update(
            store,
            key,
            Counter,
            lambda c: Counter(value=(c.value if c else 0) + 1, writers=[*(c.writers if c else []), name]),
        )


def weights(url: str, model: str, times: int, name: str) -> None:
    from fleet.catalog.routes.store import Router

    router = Router(open_store(url))
    for i in range(times):
        # no write in any interleaving sets the weight already there (that would be a no-op, no
        # revision): p1 writes 7i + 53, p2 7j + 3 (mod 100), neither ever 0 (the start), and
        # 7(j - i) = 50 (mod 100) needs |j - i| = 50
        offset = 53 if name == "p1" else 3
        router.set(model, weight=(i * 7 + offset) % 100, why=f"{name} step {i}", who=name)


if __name__ == "__main__":
    run = weights if "--weights" in sys.argv else main
    run(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4])
