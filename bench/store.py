"""Latency of one audited-state write (conditional read-modify-write) on each store backend.

Routes, tenants and version states all change through ``fleet.records.update``: a read,
a pure change and a conditional write. The reference is the in-memory backend in the same
process; the file store pays fsync + rename + flock, the S3 store real HTTP to a moto
server on 127.0.0.1 (real AWS adds network round trips on top).

    .venv/bin/python bench/store.py [--updates 300]
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import tempfile
import time

from pydantic import BaseModel

from fleet import records
from fleet.store import FileStore, MemoryStore, open_store


class Counter(BaseModel):
    value: int = 0


def _bench(store, n: int) -> list[float]:
    times = []
    for _ in range(n):
        start = time.perf_counter()
        records.update(store, "bench/counter.json", Counter, lambda c: Counter(value=(c.value if c else 0) + 1))
        times.append((time.perf_counter() - start) * 1e3)
    assert records.load(store, "bench/counter.json", Counter)[0].value == n
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--updates", type=int, default=300)
    args = parser.parse_args()
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "bench")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one access-log line per request

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        os.environ["AWS_ENDPOINT_URL_S3"] = f"http://{host}:{port}"
        import boto3

        boto3.client("s3").create_bucket(Bucket="bench")
        with tempfile.TemporaryDirectory() as tmp:
            stores = {
                "reference: memory": MemoryStore(),
                "file (fsync + rename + flock)": FileStore(tmp),
                "s3 (moto on 127.0.0.1)": open_store("s3://bench/fleet"),
            }
            print(f"{'backend':32} {'p50 ms':>8} {'p99 ms':>8} {'updates/s':>10} {'x reference':>12}")
            ref = None
            for name, store in stores.items():
                t = _bench(store, args.updates)
                p50, p99 = statistics.median(t), statistics.quantiles(t, n=100)[98]
                ref = ref or p50
                print(f"{name:32} {p50:8.3f} {p99:8.3f} {1e3 / statistics.mean(t):10.0f} {p50 / ref:12.1f}")
    finally:
        server.stop()


if __name__ == "__main__":
    main()
