"""A fixed number of HTTP requests at a fixed concurrency, sent by wrk (Debian's package).

wrk is a C load generator: unlike a Python client in the benchmark's own process, it does
not eat the CPU the servers under test need. wrk only knows durations, so a Lua script
counts answers and prints ``DONE`` at the limit; the wall time is taken here, from start
to that line, and wrk is then stopped with SIGINT (which makes it print its summary).

    from bench._wrk import load
    result = load("http://127.0.0.1:3000/predict", bodies, concurrency=16, requests=2000)
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

_SCRIPT = """
local bodies = {%(bodies)s}
local headers = {%(headers)s}
local limit = %(limit)d
local sent, count = 0, 0
request = function()
  sent = sent + 1
  return wrk.format("POST", nil, headers, bodies[(sent %% #bodies) + 1])
end
response = function(status, hdrs, body)
  count = count + 1
  if count == limit then io.write("DONE\\n"); io.flush(); wrk.thread:stop() end
end
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format("RESULT %%d %%d %%d %%f %%f\\n", summary.requests, e.status,
    e.connect + e.read + e.write + e.timeout, latency:percentile(50), latency:percentile(99)))
end
"""


@dataclass(frozen=True)
class Result:
    requests: int
    seconds: float
    non_2xx: int
    socket_errors: int
    p50_ms: float
    p99_ms: float

    @property
    def rps(self) -> float:
        return self.requests / self.seconds

    @property
    def errors(self) -> int:
        return self.non_2xx + self.socket_errors


def _lua(value: str | bytes) -> str:
    """A Lua string literal of ``value``: printable ASCII as is, every other byte as a decimal escape."""
    raw = value.encode() if isinstance(value, str) else value
    return '"' + "".join(chr(b) if 32 <= b < 127 and b not in (34, 92) else f"\\{b:03d}" for b in raw) + '"'


def load(
    url: str,
    bodies: list[str] | list[bytes],
    *,
    concurrency: int,
    requests: int,
    headers: dict[str, str] | None = None,
    timeout_s: float = 600,
) -> Result:
    """POST ``bodies`` (round robin) to ``url`` until ``requests`` answers arrived."""
    if shutil.which("wrk") is None:
        raise SystemExit("wrk is not installed; install it with: apt-get install -y wrk")
    all_headers = {"Content-Type": "application/json", **(headers or {})}
    script = _SCRIPT % {
        "bodies": ", ".join(_lua(b) for b in bodies),
        "headers": ", ".join(f"[{_lua(k)}] = {_lua(v)}" for k, v in all_headers.items()),
        "limit": requests,
    }
    with tempfile.TemporaryDirectory(prefix="fleet-wrk-") as tmp:
        path = Path(tmp) / "load.lua"
        path.write_text(script)
        cmd = ["wrk", "-t1", f"-c{concurrency}", f"-d{int(timeout_s)}s", "--timeout", "30s", "-s", str(path), url]
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        seen = []
        assert proc.stdout is not None
        for line in proc.stdout:
            seen.append(line)
            if line.startswith("DONE"):
                break
        seconds = time.perf_counter() - start
        proc.send_signal(signal.SIGINT)
        rest, _ = proc.communicate(timeout=30)
    lines = [ln for ln in (seen + rest.splitlines()) if ln.startswith("RESULT")]
    if not lines:
        raise RuntimeError(f"wrk gave no result: {''.join(seen)}{rest}")
    n, non2xx, sock, p50_us, p99_us = lines[-1].split()[1:]
    return Result(int(n), seconds, int(non2xx), int(sock), float(p50_us) / 1e3, float(p99_us) / 1e3)


_TIMED_SCRIPT = """
local bodies = {%(bodies)s}
local headers = {%(headers)s}
local sent = 0
request = function()
  sent = sent + 1
  return wrk.format("POST", nil, headers, bodies[(sent %% #bodies) + 1])
end
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format("RESULT %%d %%d %%d %%f %%f %%d\\n", summary.requests, e.status,
    e.connect + e.read + e.write + e.timeout, latency:percentile(50), latency:percentile(99), summary.duration))
end
"""


def load_for(
    url: str,
    bodies: list[str] | list[bytes],
    *,
    concurrency: int,
    seconds: float,
    headers: dict[str, str] | None = None,
) -> Result:
    """POST ``bodies`` (round robin) to ``url`` for ``seconds`` (wrk's ``-d``): the answers that
    arrived in that time, over wrk's own measure of the time (answers still on the way at the
    end are not counted)."""
    if shutil.which("wrk") is None:
        raise SystemExit("wrk is not installed; install it with: apt-get install -y wrk")
    all_headers = {"Content-Type": "application/json", **(headers or {})}
    script = _TIMED_SCRIPT % {
        "bodies": ", ".join(_lua(b) for b in bodies),
        "headers": ", ".join(f"[{_lua(k)}] = {_lua(v)}" for k, v in all_headers.items()),
    }
    with tempfile.TemporaryDirectory(prefix="fleet-wrk-") as tmp:
        path = Path(tmp) / "load.lua"
        path.write_text(script)
        cmd = [
            "wrk",
            "-t1",
            f"-c{concurrency}",
            f"-d{max(1, round(seconds))}s",
            "--timeout",
            "30s",
            "-s",
            str(path),
            url,
        ]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 60)
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT")]
    if not lines:
        raise RuntimeError(f"wrk gave no result: {done.stdout}{done.stderr}")
    n, non2xx, sock, p50_us, p99_us, duration_us = lines[-1].split()[1:]
    return Result(int(n), int(duration_us) / 1e6, int(non2xx), int(sock), float(p50_us) / 1e3, float(p99_us) / 1e3)
