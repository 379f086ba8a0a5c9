"""``bench/hostile.py --cells generation``: two hostile tenants against a real tiny-lm fleet.

Two demo-lm versions trained here (``--preset test``; ``--root`` keeps them for the next
run), served by ``bentoml serve``, behind one ``fleet gateway`` with the repo's policies
(demo-lm: 32 slots per replica, ``tenant_share`` 0.5; ``stream_write_s`` 10). The victim
sends streamed OpenAI completions (16 tokens) from ``VICTIM_CALLERS`` callers back to back
and is timed in this process; each hog runs in a process of its own, so that its work never
holds the victim's interpreter lock. Each cell runs the victim alone, then beside its hog,
for the same seconds:

* ``stalled streams``: the hog opens ``--hog-connections`` connections and pipelines
  ``--hog-pipelined`` streamed completions on each (48 tokens: the context is 64), with a
  4 KiB receive buffer and 536-byte segments, and never reads: once the buffers between are full, the stream in
  progress on each connection waits for a caller that does not read. Reported: the
  victim's TTFT while every hog connection is stalled (``STALL_WINDOW_S``: what the stalls
  cost others) and over the whole phase (its own generations' compute included), the
  stable version's slots in use over time (``fleet_version_in_flight``, every 200 ms, until
  every slot is back), the streams cut at the write deadline (``fleet_callers_stalled_total``)
  and the hog's connections the gateway ended.
* ``tiny timeouts``: stable 1.0.0 and a canary 1.1.0 at 10 %; the hog sends ``--hog-rps``
  completions a second at the canary by name (``demo-lm:1.1.0``) with
  ``X-Fleet-Timeout-Ms`` 0.01 (below ``min_timeout_ms``: 400, the canary never asked) and
  50 (the minimum, which a 48-token answer cannot meet: 504) in turn. Reported: the canary's
  counted requests and errors (``/admin/stats``, what canary analysis reads) alone and
  under the attack, and ``fleet_caller_timeouts_total``.

Targets (issue 28): victim TTFT p99 within 1.5x of alone; the canary's counted error rate unchanged.
On this 2-core machine the replicas, the gateway, the victim and the hog share the cores:
what a hog's own traffic costs in CPU shows in the victim's figures too.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a hog's own process: ``python bench/_hostile_gen.py``
    sys.path.insert(0, str(ROOT))

from bench._scrape import SCRAPE  # noqa: E402
from tests.gateway_env import dropped  # noqa: E402
from tests.serving_env import FleetEnv  # noqa: E402

MODEL = "demo-lm"
ADMIN = {"Authorization": "Bearer e2e-admin-token"}
VICTIM_CALLERS = 2
STALL_WINDOW_S = 6.0  # the victim timed while every hog connection is stalled (the write deadline is 10 s)
PROMPTS = ["reverse abcd>", "reverse hello>", "reverse stream>", "reverse fleet>"]


def _scrape(url: str, name: str, **labels: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", headers=SCRAPE, timeout=10).text
    return sum(
        s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    )


def _text(data: str) -> str:
    choices = json.loads(data).get("choices") or [{}]
    return choices[0].get("text") or ""


def _victim(url: str, key: str, seconds: float) -> dict:
    """Streamed completions from ``VICTIM_CALLERS`` callers for ``seconds``: TTFTs (ms), and
    those of the answers the canary gave apart (``canary``), and errors."""
    stop = time.monotonic() + seconds
    ttfts: list[float] = []
    canary: list[float] = []
    errors: list[str] = []

    def caller(i: int) -> None:
        with httpx.Client(timeout=30) as client:
            n = 0
            while time.monotonic() < stop:
                body = {"model": MODEL, "prompt": PROMPTS[(i + n) % len(PROMPTS)], "max_tokens": 16, "stream": True}
                n += 1
                sent = time.perf_counter()
                first = None
                try:
                    with client.stream(
                        "POST", f"{url}/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}
                    ) as r:
                        if r.status_code != 200:
                            errors.append(f"{r.status_code} {r.read()[:200]!r}")
                            continue
                        for line in r.iter_lines():
                            if first is None and line.startswith("data: {") and _text(line[6:]):
                                first = time.perf_counter()
                except httpx.HTTPError as exc:
                    errors.append(type(exc).__name__)
                    continue
                if first is not None:
                    ttfts.append((first - sent) * 1e3)
                    if r.headers.get("x-fleet-model-version") == "1.1.0":
                        canary.append(ttfts[-1])

    with ThreadPoolExecutor(VICTIM_CALLERS) as pool:
        list(pool.map(caller, range(VICTIM_CALLERS)))
    return {"ttft": ttfts, "canary": canary, "errors": errors}


def _hog_streams(url: str, key: str, connections: int, pipelined: int) -> dict:
    """The stalled-streams hog (in its own process: see ``_Hog``): ``connections`` sockets with a
    4 KiB receive buffer, ``pipelined`` streamed completions sent on each, nothing read. When
    told to stop (stdin closes): how many connections the gateway ended (reset, or closed)."""
    host, port = url.removeprefix("http://").split(":")
    body = json.dumps({"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 48, "min_tokens": 48, "stream": True})
    request = (
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer {key}\r\nContent-Length: {len(body)}\r\n\r\n{body}"
    ).encode()
    sockets = []
    for _ in range(connections):
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        # small segments keep the server's send buffer small (it grows with the segment size:
        # on loopback to megabytes, which would take hundreds of streams to fill)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG, 536)
        s.connect((host, int(port)))
        sockets.append(s)
        threading.Thread(target=_send_all, args=(s, request * pipelined), daemon=True).start()
    sys.stdin.read()  # until the bench says stop
    return {"ended": sum(dropped(s) for s in sockets)}


def _send_all(s: socket.socket, data: bytes) -> None:
    with contextlib.suppress(OSError):  # cut off: what the bench waits for
        s.sendall(data)


def _hog_timeouts(url: str, key: str, rps: float) -> dict:
    """The tiny-timeouts hog: ``rps`` completions a second at the canary by name, alternately with
    ``X-Fleet-Timeout-Ms`` 0.01 and 50, until stdin closes: its answers by status."""
    statuses: dict[str, int] = {}
    stop = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
    with httpx.Client(timeout=30) as client:
        n, started = 0, time.monotonic()
        while not stop.wait(max(started + n / rps - time.monotonic(), 0)):
            asked = "0.01" if n % 2 == 0 else "50"
            n += 1
            r = client.post(
                f"{url}/v1/completions",
                json={"model": f"{MODEL}:1.1.0", "prompt": PROMPTS[0], "max_tokens": 48, "min_tokens": 48},
                headers={"Authorization": f"Bearer {key}", "X-Fleet-Timeout-Ms": asked},
            )
            statuses[str(r.status_code)] = statuses.get(str(r.status_code), 0) + 1
    return statuses


class _Hog:
    """A hostile tenant in a process of its own (``python bench/_hostile_gen.py KIND ...``), so
    that its work never holds this process's interpreter lock while the victim is timed."""

    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, __file__, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )

    def stop(self) -> dict:
        out, _ = self.proc.communicate("", timeout=60)
        return json.loads(out.strip().splitlines()[-1])


class _Sampler(threading.Thread):
    """``fleet_version_in_flight`` of the stable version every 200 ms."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url, self.samples, self._done = url, [], threading.Event()

    def run(self) -> None:
        while not self._done.wait(0.2):
            self.samples.append(_scrape(self.url, "fleet_version_in_flight", model=MODEL, version="1.0.0"))

    def stop(self) -> list[float]:
        self._done.set()
        self.join()
        return self.samples


def _engine(replica: str) -> dict:
    return httpx.post(f"{replica}/engine", json={}, timeout=10).json()


def _canary(url: str) -> dict:
    versions = httpx.get(f"{url}/admin/stats/{MODEL}", params={"window_s": 900}, headers=ADMIN, timeout=10).json()
    v = versions["versions"].get("1.1.0", {"requests": 0, "errors": {}})
    return {"requests": v["requests"], "errors": sum(v["errors"].values())}


def _wait_canary(url: str, key: str, timeout: float = 30) -> None:
    """Until the gateway routes to the canary (its next snapshot): a victim request answered by 1.1.0."""
    deadline = time.monotonic() + timeout
    with httpx.Client(timeout=30) as client:
        while time.monotonic() < deadline:
            r = client.post(
                f"{url}/v1/completions",
                json={"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 1},
                headers={"Authorization": f"Bearer {key}", "X-Fleet-Routing-Key": f"probe-{time.monotonic()}"},
            )
            if r.headers.get("x-fleet-model-version") == "1.1.0":
                return
    raise SystemExit("the gateway did not route to the canary within 30 s")


def _delta(after: dict, before: dict) -> dict:
    return {k: after[k] - before[k] for k in after}


def _fleet(env: FleetEnv) -> dict[str, str]:
    """demo-lm 1.0.0 and 1.1.0 trained (unless the folder has them), routed stable 1.0.0, two
    tenants; their keys."""
    saved = env.root / "bench-keys.json"
    if saved.exists():
        print(f"reusing the fleet in {env.root}", flush=True)
        return json.loads(saved.read_text())
    print("training demo-lm 1.0.0 and 1.1.0 (--preset test) ...", flush=True)
    env.fleet("models", "train", MODEL, "1.0.0", "--preset", "test")
    env.fleet("models", "train", MODEL, "1.1.0", "--preset", "test", "--seed", "11")
    env.fleet("route", "set", MODEL, "--stable", "1.0.0", "-r", "bench")
    keys = {n: env.fleet_json("tenants", "create", n, "--model", MODEL)["api_key"] for n in ("victim", "hog")}  # type: ignore[index]
    saved.write_text(json.dumps(keys))
    return keys


def run(work: Path, seconds: float, connections: int, pipelined: int, hog_rps: float) -> dict:
    os.environ["BENTOML_HOME"] = str(work / "bentoml")  # before BentoML is first imported (training, deploying)
    env = FleetEnv(work)
    try:
        keys = _fleet(env)
        env.fleet("route", "set", MODEL, "--stable", "1.0.0", "--no-canary", "-r", "bench")
        replicas = {v: env.fleet_json("deploy", MODEL, v)["endpoints"][0] for v in ("1.0.0", "1.1.0")}  # type: ignore[index]
        url = env.start_gateway()
        _victim(url, keys["victim"], 5)  # warm: connections, the replica's first batches
        out: dict = {}

        print(f"cell: stalled streams ({seconds:g} s alone, then {seconds:g} s beside the hog)", flush=True)
        sampler = _Sampler(url)  # scraping /metrics as often alone as beside the hog: the same load
        sampler.start()
        alone = _victim(url, keys["victim"], seconds)
        cuts = _scrape(url, "fleet_callers_stalled_total", kind="stream")
        sampler.samples.clear()
        made = _engine(replicas["1.0.0"]).get("finished_length", 0)
        hog = _Hog("streams", url, keys["hog"], str(connections), str(pipelined))
        try:
            # every connection's stream stalled: the replica has answered at least one on each
            # and is idle, though 64 were asked on each; the victim beside that alone, within
            # the write deadline
            stable = replicas["1.0.0"]
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                stats = _engine(stable)
                if stats.get("finished_length", 0) - made >= connections and stats["running"] == stats["waiting"] == 0:
                    break
                time.sleep(0.2)
            stalled = _victim(url, keys["victim"], STALL_WINDOW_S)
            beside = _victim(url, keys["victim"], seconds)
            print("  waiting for every connection's stalled stream to be cut ...", flush=True)
            deadline = time.monotonic() + 180
            while (
                time.monotonic() < deadline
                and _scrape(url, "fleet_callers_stalled_total", kind="stream") - cuts < connections
            ):
                time.sleep(0.5)
        finally:
            ended = hog.stop()["ended"]
        out["streams"] = {
            "alone": alone,
            "stalled": stalled,
            "beside": beside,
            "slots": sampler.stop(),
            "cut": _scrape(url, "fleet_callers_stalled_total", kind="stream") - cuts,
            "connections_ended": ended,
            "slots_after": _scrape(url, "fleet_version_in_flight", model=MODEL, version="1.0.0"),
        }

        print(f"cell: tiny timeouts at the canary ({hog_rps:g} requests a second)", flush=True)
        env.fleet("route", "set", MODEL, "--canary", "1.1.0", "--weight", "10", "-r", "bench")
        _wait_canary(url, keys["victim"])
        _victim(url, keys["victim"], 5)  # warm: the canary replica's first batches
        before = _canary(url)
        alone = _victim(url, keys["victim"], seconds)
        mid = _canary(url)
        caller_timeouts = _scrape(url, "fleet_caller_timeouts_total", version="1.1.0")
        hog = _Hog("timeouts", url, keys["hog"], str(hog_rps))
        try:
            beside = _victim(url, keys["victim"], seconds)
        finally:
            statuses = hog.stop()
        after = _canary(url)
        out["timeouts"] = {
            "alone": alone,
            "beside": beside,
            "canary_alone": _delta(mid, before),
            "canary_beside": _delta(after, mid),
            "hog_statuses": statuses,
            "caller_timeouts": _scrape(url, "fleet_caller_timeouts_total", version="1.1.0") - caller_timeouts,
        }
        return out
    finally:
        env.stop()


def _stable(phase: dict) -> list[float]:
    """The TTFTs of the answers stable gave (the canary's taken out, by value and count)."""
    rest = list(phase["ttft"])
    for x in phase["canary"]:
        rest.remove(x)
    return rest


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def report(out: dict, args: argparse.Namespace) -> None:
    print(
        f"\nvictim: streamed completions of 16 tokens from {VICTIM_CALLERS} callers, {args.seconds:g} s per phase, "
        f"alone then beside the hog (each hog in a process of its own)\n"
        f"stalled streams: {args.hog_connections} connections x {args.hog_pipelined} pipelined 48-token streams, "
        f"never read; tiny timeouts: {args.hog_rps:g} completions a second at demo-lm:1.1.0, X-Fleet-Timeout-Ms "
        f"0.01 and 50 in turn\n"
    )
    print(
        "| cell | TTFT p50 alone | p99 alone | p50 beside | p99 beside | p99 beside/alone | victim answers | errors |"
    )
    print("|---|---|---|---|---|---|---|---|")
    cells = [
        (f"stalled streams: the first {STALL_WINDOW_S:g} s of every hog connection stalled", "streams", "stalled"),
        ("stalled streams: the whole phase (the hog's own generations included)", "streams", "beside"),
        ("tiny timeouts at the canary", "timeouts", "beside"),
    ]
    for title, name, phase in cells:
        a, b = out[name]["alone"], out[name][phase]
        p99a, p99b = _pct(a["ttft"], 99), _pct(b["ttft"], 99)
        print(
            f"| {title} | {_pct(a['ttft'], 50):.1f} ms | {p99a:.1f} ms | {_pct(b['ttft'], 50):.1f} ms | {p99b:.1f} ms | "
            f"{p99b / p99a:.2f}x | {len(a['ttft'])} / {len(b['ttft'])} | {len(a['errors']) + len(b['errors'])} |"
        )
    s = out["streams"]
    slots = s["slots"] or [0.0]
    print(
        f"\nstalled streams: stable's slots in use (of 32; one tenant's cap 16), every 200 ms: max {max(slots):.0f}, "
        f"median {np.median(slots):.0f}, after {s['slots_after']:.0f}; streams cut at the write deadline "
        f"{s['cut']:.0f}; hog connections the gateway ended {s['connections_ended']}/{args.hog_connections}"
    )
    print("  slots in use over time (one sample a second):", " ".join(f"{x:.0f}" for x in slots[::5]))
    t = out["timeouts"]
    a, b = t["alone"], t["beside"]
    print(
        f"tiny timeouts, by the version that answered the victim: canary TTFT p50 {_pct(a['canary'], 50):.1f} / "
        f"p99 {_pct(a['canary'], 99):.1f} ms alone ({len(a['canary'])} answers), {_pct(b['canary'], 50):.1f} / "
        f"{_pct(b['canary'], 99):.1f} ms beside ({len(b['canary'])}); stable p99 {_pct(_stable(a), 99):.1f} ms alone, "
        f"{_pct(_stable(b), 99):.1f} ms beside"
    )
    rate = {k: (v["errors"] / v["requests"] if v["requests"] else float("nan")) for k, v in t.items() if "canary" in k}
    print(
        f"tiny timeouts: canary counted {t['canary_alone']} alone (error rate {rate['canary_alone']:.3f}), "
        f"{t['canary_beside']} under attack (error rate {rate['canary_beside']:.3f}); "
        f"hog answers by status {t['hog_statuses']}; caller timeouts counted apart {t['caller_timeouts']:.0f}"
    )
    errors = (
        out["streams"]["stalled"]["errors"] + out["streams"]["beside"]["errors"] + out["timeouts"]["beside"]["errors"]
    )
    if errors:
        print("victim errors (first 5):", errors[:5])


if __name__ == "__main__":  # a hog's own process (``_Hog``)
    kind, url, key, *rest = sys.argv[1:]
    if kind == "streams":
        result = _hog_streams(url, key, int(rest[0]), int(rest[1]))
    else:
        result = _hog_timeouts(url, key, float(rest[0]))
    print(json.dumps(result), flush=True)
