"""Child process for the writer-storm tests (``tests/test_changes.py``).

``storm_worker.py URL NAME N``: N writes of the records gateways serve from — tenants created,
their limits changed, keys revoked, the shared tenant's limits and the demo route's canary
weight changed by every writer — then print, as JSON, every (key, ETag) this process wrote.
"""

from __future__ import annotations

import json
import sys

from fleet.catalog.routes.store import Router
from fleet.catalog.tenants import Quota, Tenants
from fleet.store import open_store


class Recording:
    """The store, remembering each watched write's (key, ETag)."""

    def __init__(self, store) -> None:  # noqa: ANN001
        self.store, self.url, self.written = store, store.url, []

    def put(self, key: str, data: bytes, **kwargs) -> str:  # noqa: ANN003
        etag = self.store.put(key, data, **kwargs)
        if key.startswith(("routes/", "tenants/")):
            self.written.append([key, etag])
        return etag

    def __getattr__(self, name: str):  # noqa: ANN204
        return getattr(self.store, name)


def main(url: str, name: str, times: int) -> None:
    store = Recording(open_store(url))
    tenants, router = Tenants(store), Router(store)
    for i in range(times):
        step = i % 4
        if step == 0:
            tenants.create(f"{name}-{i}", {"demo": ["*"]})
        elif step == 1:
            tenants.set_limits(f"{name}-{i - 1}", quota=Quota(rps=i + 1, burst=i + 1))
        elif step == 2:
            tenants.revoke(f"{name}-{i - 2}")
        else:
            tenants.set_limits("shared", quota=Quota(rps=1000 * (1 + int(name[1:])) + i, burst=10))
            router.set("demo", weight=(i * 7 + 3 * int(name[1:])) % 97 + 1, why=f"{name} step {i}", who=name)
    print(json.dumps(store.written))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
