"""How much version choice costs per request, next to the SHA-256 it is built on.

The gateway calls ``choose_version`` once per request, so its cost is pure overhead on
every answer. The reference is one bare SHA-256 of the same routing key in this process:
the floor any sticky hash split pays.

    .venv/bin/python bench/routing.py [--keys 200000]
"""

from __future__ import annotations

import argparse
import hashlib
import time

from fleet import audit
from fleet.catalog.routes.table import Canary, RouteTable, choose_version
from fleet.catalog.tenants import Tenant


def _per_call_ns(fn, keys: list[str]) -> float:
    start = time.perf_counter_ns()
    for k in keys:
        fn(k)
    return (time.perf_counter_ns() - start) / len(keys)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", type=int, default=200_000)
    args = parser.parse_args()
    keys = [f"request-{i}" for i in range(args.keys)]
    table = RouteTable(
        model="demo", stable="1.0.0", canary=Canary(version="1.1.0", weight=10), pins={"globex": "0.9.0"}
    )
    tenant = Tenant(name="acme", entitlements={"demo": ["*"]}, created_at=audit.now(), created_by="bench")
    pinned = tenant.model_copy(update={"name": "globex"})
    cases = {
        "reference: sha256(key)": lambda k: hashlib.sha256(k.encode()).digest(),
        "choose_version, weighted split": lambda k: choose_version(table, tenant, k),
        "choose_version, tenant pin": lambda k: choose_version(table, pinned, k),
        "choose_version, requested version": lambda k: choose_version(table, tenant, k, "1.0.0"),
    }
    for fn in cases.values():  # warm up
        _per_call_ns(fn, keys[:2000])
    print(f"{'case':40} {'ns/call':>10} {'calls/s':>12} {'x reference':>12}")
    ref = None
    for name, fn in cases.items():
        ns = min(_per_call_ns(fn, keys) for _ in range(3))
        ref = ref or ns
        print(f"{name:40} {ns:10.0f} {1e9 / ns:12,.0f} {ns / ref:12.1f}")


if __name__ == "__main__":
    main()
