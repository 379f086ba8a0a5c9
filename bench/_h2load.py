"""A fixed number of unary gRPC calls at a fixed concurrency, sent by h2load (Debian's nghttp2-client).

h2load is nghttp2's C load generator for HTTP/2. A unary gRPC call is an HTTP/2 POST of one
length-prefixed message with ``content-type: application/grpc``, so h2load can send it as a
fixed body over one connection with ``concurrency`` streams in flight, as one gRPC channel
does. h2load does not read gRPC's status trailer; callers count failures from the server's
own counters. Latencies come from h2load's per-request log.

    from bench._h2load import grpc_load
    result = grpc_load("127.0.0.1:8001", "/inference.GRPCInferenceService/ModelInfer", message, concurrency=16, requests=2000)
"""

from __future__ import annotations

import re
import shutil
import struct
import subprocess
import tempfile
from pathlib import Path

from bench._wrk import Result


def grpc_load(
    address: str,
    method: str,
    message: bytes,
    *,
    concurrency: int,
    requests: int,
    metadata: dict[str, str] | None = None,
    timeout_s: float = 600,
) -> Result:
    """``requests`` calls of ``method`` with the serialised ``message`` on one HTTP/2 connection."""
    if shutil.which("h2load") is None:
        raise SystemExit("h2load is not installed; install it with: apt-get install -y nghttp2-client")
    with tempfile.TemporaryDirectory(prefix="fleet-h2load-") as tmp:
        body, log = Path(tmp) / "message", Path(tmp) / "requests.log"
        body.write_bytes(b"\0" + struct.pack(">I", len(message)) + message)  # gRPC framing: not compressed, length
        headers = {"content-type": "application/grpc", "te": "trailers", **(metadata or {})}
        cmd = [
            "h2load",
            "-n",
            str(requests),
            "-c",
            "1",
            "-m",
            str(concurrency),
            "-d",
            str(body),
            f"--log-file={log}",
            *(a for k, v in headers.items() for a in ("-H", f"{k}: {v}")),
            f"http://{address}{method}",
        ]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False)
        finished = re.search(r"finished in ([0-9.]+)(m?s),", done.stdout)
        counts = re.search(
            r"requests: (\d+) total, \d+ started, (\d+) done, (\d+) succeeded, (\d+) failed, (\d+) errored", done.stdout
        )
        if done.returncode or not finished or not counts:
            raise RuntimeError(f"h2load failed ({done.returncode}): {done.stdout}{done.stderr}")
        latencies = sorted(int(line.split()[2]) / 1e3 for line in log.read_text().splitlines() if line.strip())
    seconds = float(finished.group(1)) / (1e3 if finished.group(2) == "ms" else 1)
    _, finished_n, succeeded, failed, errored = (int(g) for g in counts.groups())
    return Result(
        finished_n,
        seconds,
        failed,
        errored + int(counts.group(1)) - finished_n,
        latencies[len(latencies) // 2],
        latencies[max(0, int(len(latencies) * 0.99) - 1)],
    )
