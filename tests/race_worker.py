"""Child process for the race tests: increment a shared counter N times by conditional writes."""

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
            store, key, Counter,
            lambda c: Counter(value=(c.value if c else 0) + 1, writers=[*(c.writers if c else []), name]),
        )  # fmt: skip


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4])
