"""A hostile tenant beside a normal one: what the victim feels, and what the gateway holds.

One ``fleet gateway`` process in front of a stub model (``tests/stub_model.py``; the
gateway's own work is what is measured). The victim sends one-row requests back to back
(wrk, one connection); the flooder sends, as fast as four connections allow, a rotation of
maximum-size valid requests (10,000 rows, ~420 KB), requests of 60,000 rows cut at the 4 MiB
body limit (refused with 413 after decoding), and 4 MiB of a JSON array that never closes
(400). The flooder has no quota: the worst case. A thread probes ``/v2/health/live``
every 10 ms; another samples the gateway's resident memory (its process and its decode
worker) every 50 ms.

Cells, interleaved in one run: the victim alone, then beside the flood, for each decode
mode — ``process`` (the default: large bodies decoded in a worker process) and ``inline``
(``FLEET_DECODE_WORKERS=0``: everything decoded on the event loop, the way it was) — and
once more with the default decode but the flooder under a 20 req/s quota, as every
production tenant is (its requests past the quota are refused before their body is read).

    .venv/bin/python bench/hostile.py [--requests 3000] [--rounds 2] [--cells tensors|generation|all]

Targets (issue 11): victim p99 under the flood within 1.5x of alone; liveness p99 under
100 ms; the gateway's peak RSS under its baseline plus its configured budgets.
Needs Debian's wrk (apt-get install -y wrk).

``--cells generation`` (issue 28) runs two more cells against a real tiny-lm fleet instead:
a tenant holding pipelined streams it never reads, and a tenant sending tiny timeouts at
the canary (``bench/_hostile_gen.py`` says how; ``--seconds``, ``--hog-connections``,
``--hog-pipelined``, ``--hog-rps``, ``--root``). Targets: the victim's TTFT p99 within 1.5x of alone; the canary's
counted error rate unchanged.
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench._scrape import SCRAPE  # noqa: E402
from bench._wrk import load  # noqa: E402
from tests.gateway_env import MODEL, GatewayEnv  # noqa: E402

LIMITS = {"shadow_queue_mib": 16, "inference_log_buffer_mib": 16, "feedback_index_mib": 8, "inflight_body_mib": 16}
CACHE_MIB = 16
FLOOD_LUA = """
local bodies = {}
for i, name in ipairs({%(files)s}) do
  local f = io.open(name, "rb"); bodies[i] = f:read("*all"); f:close()
end
local n = 0
request = function()
  n = n + 1
  return wrk.format("POST", nil, {["Content-Type"] = "application/json", ["Authorization"] = "Bearer %(key)s"},
                    bodies[(n %% #bodies) + 1])
end
"""


def _rss(pid: int, children: bool = False) -> int:
    """Resident bytes of the gateway process, or (``children``) of its decode workers."""
    pids = [int(p) for p in subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()]
    total = 0
    for p in pids if children else [pid]:
        try:
            with open(f"/proc/{p}/status") as status:  # noqa: PTH123
                total += next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS:"))
        except (FileNotFoundError, StopIteration):
            pass
    return total


class Watch:
    """Liveness probes and RSS samples while a cell runs."""

    def __init__(self, url: str, pid: int) -> None:
        self.url, self.pid = url, pid
        self.probes: list[float] = []
        self.peak_rss = self.peak_workers = 0
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._probe), threading.Thread(target=self._sample)]

    def __enter__(self) -> Watch:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join()

    def _probe(self) -> None:
        with httpx.Client(timeout=30) as client:
            while not self._stop.is_set():
                t0 = time.perf_counter()
                client.get(f"{self.url}/v2/health/live")
                self.probes.append((time.perf_counter() - t0) * 1e3)
                self._stop.wait(0.01)

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak_rss = max(self.peak_rss, _rss(self.pid))
            self.peak_workers = max(self.peak_workers, _rss(self.pid, children=True))
            self._stop.wait(0.05)


def _flood_bodies(work: Path, kinds: str) -> list[Path]:
    rng = np.random.default_rng(0)

    def tensor(rows: int) -> bytes:
        data = rng.normal(size=rows * 4).round(4).tolist()
        return json.dumps(
            {"inputs": [{"name": "features", "shape": [rows, 4], "datatype": "FP32", "data": data}]}
        ).encode()

    limit = 4 * 1024 * 1024
    bodies = {
        "max-valid": tensor(10_000),
        "over-limit": tensor(60_000)[:limit],
        "unclosed": (
            b'{"inputs":[{"name":"features","shape":[100000,4],"datatype":"FP32","data":[' + b"1.5," * 1_100_000
        )[:limit],
    }
    if kinds == "refused":
        del bodies["max-valid"]
    paths = []
    for name, body in bodies.items():
        path = work / f"{name}.json"
        path.write_bytes(body)
        paths.append(path)
    return paths


def _flood(url: str, key: str, files: list[Path], work: Path) -> subprocess.Popen[str]:
    script = work / "flood.lua"
    script.write_text(FLOOD_LUA % {"files": ", ".join(json.dumps(str(f)) for f in files), "key": key})
    return subprocess.Popen(
        ["wrk", "-t2", "-c4", "-d600s", "--timeout", "30s", "-s", str(script), f"{url}/v2/models/{MODEL}/infer"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def _victim(url: str, key: str, requests: int):  # noqa: ANN202 - bench._wrk.Result
    rng = np.random.default_rng(1)
    bodies = [
        json.dumps(
            {
                "inputs": [
                    {
                        "name": "features",
                        "shape": [1, 4],
                        "datatype": "FP32",
                        "data": rng.normal(size=4).round(3).tolist(),
                    }
                ]
            }
        )
        for _ in range(200)
    ]
    return load(
        f"{url}/v2/models/{MODEL}/infer",
        bodies,
        concurrency=1,
        requests=requests,
        headers={"Authorization": f"Bearer {key}"},
    )


def _held_max(url: str) -> float:
    """The largest bucket bound of the gateway's own event-loop holds (``fleet_event_loop_held_seconds``)."""
    from prometheus_client.parser import text_string_to_metric_families

    buckets = [
        (float(s.labels["le"]), s.value)
        for f in text_string_to_metric_families(httpx.get(f"{url}/metrics", headers=SCRAPE).text)
        for s in f.samples
        if s.name == "fleet_event_loop_held_seconds_bucket"
    ]
    total = max(v for _, v in buckets)
    return min(le for le, v in buckets if v == total) * 1000


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def run_mode(mode: str, quota: bool, work: Path, requests: int, rounds: int, kinds: str) -> dict:
    root = work / f"{mode}-{'quota' if quota else 'free'}"
    root.mkdir()
    env = GatewayEnv(
        root,
        limits=LIMITS,
        cache={"enabled": False, "max_mib": CACHE_MIB},
        inference_log={"sample_rate": 0.2},
        max_queue=1000,
    )
    try:
        env.register("1.0.0")
        env.stub("1.0.0")
        env.route(stable="1.0.0")
        victim = env.tenant("victim")
        flooder = env.tenant("flooder", rps=20, burst=20) if quota else env.tenant("flooder")
        extra = {"FLEET_DECODE_WORKERS": "0"} if mode == "inline" else {}
        url, proc = env.gateway(**extra)
        files = _flood_bodies(work, kinds)
        _victim(url, victim, 300)  # warm: connections, the decode worker, pyarrow's first write
        time.sleep(3)
        baseline = _rss(proc.pid)
        out: dict = {
            "alone": [],
            "flood": [],
            "live_alone": [],
            "live_flood": [],
            "peak": 0,
            "baseline": baseline,
            "flood_answers": 0,
            "workers": 0,
            "held_max": 0.0,
        }
        for _ in range(rounds):
            with Watch(url, proc.pid) as w:
                out["alone"].append(_victim(url, victim, requests))
            out["live_alone"] += w.probes
            flood = _flood(url, flooder, files, work)
            try:
                time.sleep(2)  # the flood under way
                with Watch(url, proc.pid) as w:
                    out["flood"].append(_victim(url, victim, requests))
                out["live_flood"] += w.probes
                out["peak"] = max(out["peak"], w.peak_rss)
                out["workers"] = max(out["workers"], w.peak_workers)
            finally:
                flood.send_signal(signal.SIGINT)
                text, _ = flood.communicate(timeout=30)
            out["flood_answers"] += int(next((ln.split()[0] for ln in text.splitlines() if "requests in" in ln), "0"))
        out["held_max"] = _held_max(url)
        return out
    finally:
        env.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=3000, help="victim requests per cell")
    parser.add_argument("--rounds", type=int, default=2, help="alone/flood pairs per mode")
    parser.add_argument(
        "--flood",
        choices=["all", "refused"],
        default="all",
        help="all: the rotation above; refused: only the bodies the gateway refuses (none reaches the model)",
    )
    parser.add_argument("--cells", choices=["tensors", "generation", "all"], default="tensors")
    parser.add_argument("--seconds", type=float, default=30.0, help="generation cells: seconds per phase")
    parser.add_argument("--hog-connections", type=int, default=32, help="generation: the hog's connections")
    parser.add_argument("--hog-pipelined", type=int, default=64, help="generation: streams pipelined on each")
    parser.add_argument("--hog-rps", type=float, default=20.0, help="generation: the tiny-timeouts hog's rate")
    parser.add_argument(
        "--root",
        type=Path,
        help="generation: a folder to keep the trained fleet in, and reuse it from (default: a temp one)",
    )
    args = parser.parse_args()
    if args.cells != "tensors":
        from bench import _hostile_gen

        with tempfile.TemporaryDirectory(prefix="fleet-hostile-gen-") as tmp:
            root = args.root or Path(tmp)
            root.mkdir(parents=True, exist_ok=True)
            out = _hostile_gen.run(root, args.seconds, args.hog_connections, args.hog_pipelined, args.hog_rps)
        _hostile_gen.report(out, args)
        if args.cells == "generation":
            return
    if shutil.which("wrk") is None:
        raise SystemExit("wrk is not installed; install it with: apt-get install -y wrk")
    budgets_mib = sum(LIMITS.values()) + CACHE_MIB
    rows = []
    with tempfile.TemporaryDirectory(prefix="fleet-hostile-") as tmp:
        for mode, quota in (("process", False), ("process", True), ("inline", False)):
            r = run_mode(mode, quota, Path(tmp), args.requests, args.rounds, args.flood)
            alone_p50 = statistics.median(x.p50_ms for x in r["alone"])
            alone_p99 = statistics.median(x.p99_ms for x in r["alone"])
            flood_p50 = statistics.median(x.p50_ms for x in r["flood"])
            flood_p99 = statistics.median(x.p99_ms for x in r["flood"])
            errors = sum(x.errors for x in r["alone"] + r["flood"])
            rows.append(
                (
                    f"{mode}, flooder {'20 req/s quota' if quota else 'no quota'}",
                    alone_p50,
                    alone_p99,
                    flood_p50,
                    flood_p99,
                    flood_p99 / alone_p99,
                    _pct(r["live_alone"], 99),
                    _pct(r["live_flood"], 99),
                    r["held_max"],
                    r["baseline"] / 2**20,
                    r["peak"] / 2**20,
                    r["baseline"] / 2**20 + budgets_mib,
                    r["workers"] / 2**20,
                    errors,
                    r["flood_answers"],
                )
            )
    print(
        f"\nvictim: {args.requests} one-row requests per cell at concurrency 1; flooder: 4 connections, "
        f"flood {args.flood!r}; {args.rounds} rounds; budgets {budgets_mib} MiB (buffers, cache, bodies in flight)\n"
    )
    print(
        "| decode, flooder | victim p50 alone | p99 alone | p50 flood | p99 flood | p99 flood/alone | live p99 alone | "
        "live p99 flood | loop held max | RSS base MiB | RSS peak MiB | base+budgets MiB | worker RSS MiB | victim errors | "
        "flood answers |"
    )
    print("|---|" + "---|" * 14)
    for r in rows:
        print(
            f"| {r[0]} | {r[1]:.2f} ms | {r[2]:.2f} ms | {r[3]:.2f} ms | {r[4]:.2f} ms | {r[5]:.2f}x | {r[6]:.1f} ms | "
            f"{r[7]:.1f} ms | <= {r[8]:.0f} ms | {r[9]:.0f} | {r[10]:.0f} | {r[11]:.0f} | {r[12]:.0f} | {r[13]} | {r[14]} |"
        )


if __name__ == "__main__":
    main()
