"""Generation: continuous batching vs one sequence at a time, and the gateway's added time to first token.

    .venv/bin/python bench/generation.py [--root DIR] [--preset demo|test] [--requests 96] [--json out.json]

One trained tiny-lm version (``demo-lm:1.0.0``, trained here with ``fleet models train``
unless ``--root`` names a fleet folder that already holds it: the demo preset takes about
2.5 minutes on one core, ``--preset test`` seconds) is registered again under two model
names that differ only in their policy's ``generation.max_running``: ``bench-lm-cb`` (the
demo-lm policy's, 32: continuous batching) and ``bench-lm-seq`` (1: one sequence at a
time). Both are packaged from the same artifact and the same Bento code
(``bentos/tiny_lm``), deployed with ``fleet deploy`` (``bentoml serve`` on 127.0.0.1) side
by side, and one ``fleet gateway`` stands in front (a tenant entitled to both, each routed
stable to 1.0.0). Each replica's served ``generation.max_running`` is checked (``/metadata``):
``fleet package`` keeps a Bento whose artifact is unchanged even if the policy changed, so a
stale one in a reused ``--root`` is rebuilt (``fleet package --force``).

1. Continuous batching vs one at a time. C callers (asyncio + httpx in this process), each
   sending ``POST /generate_stream`` straight to a replica back to back, for C = 1, 8 and 32;
   the same fixed prompts (``bentos.tiny_lm.data.examples(..., split="holdout")``) in the
   same order, and a fixed output length (``max_tokens = min_tokens = --max-tokens``, greedy)
   so output tokens/s compare fairly. ``--requests`` per cell, at most ``--cell-seconds``; the
   cells alternate between the two replicas (and which goes first alternates between
   ``--rounds``), and each figure pools its rounds. Per request: TTFT (sent → the first event
   with text), TPOT (first → last token event, per token after the first) and its output
   tokens; every stream is read to its end, so connections are reused. Per cell also the
   replica's tokens per engine step (``/engine``), the CPU of the replica and of this client,
   and what anything else kept busy (cores): a cell where other processes used more than
   ``NOISY_CORES`` is run again (``--retry-noisy`` times), and flagged if it stays so.
   Targets: at concurrency 8, continuous batching gives at least 3x the output tokens/s of
   one sequence at a time, with TTFT p99 within the policy's SLO (demo-lm's ``slo.p99_ms``).

2. The gateway's added TTFT. At concurrency 1, ``--pairs`` pairs alternating a direct
   ``/generate_stream`` on the continuous-batching replica and the gateway's OpenAI
   ``POST /v1/completions`` (``stream: true``) for the same prompt and
   ``--gateway-tokens`` output tokens (which of the pair goes first alternates).
   Target: the gateway adds at most 2 ms to TTFT p50. ``--gateway-only`` runs this part
   alone; ``--reference SRC`` starts a second gateway from another copy of the ``fleet``
   package (e.g. ``git archive HEAD fleet | tar -x -C /tmp/ref``) and puts it in the same
   rounds (direct, this gateway, that one, the order rotating): a before/after in one run,
   under the same load. On a busy machine the median of the paired differences is the
   steadier figure; the difference of the p50s moves with the load.

3. Where the time goes: the engine in this process (no HTTP), after the servers are stopped:
   one decode step's time and the tokens/s it allows at running batches of 1, 8 and 32.

The load generator shares the machine's cores with the replica (and the gateway) it loads:
absolute figures move between runs; the ratios within one run are what to compare. Every
process started here is stopped by PID at the end (also on Ctrl-C or an error). One run at a
time per ``--root`` (a lock file there): a run stops the replicas it finds under its root.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import fcntl
import json
import math
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

FLEET = str(Path(sys.executable).with_name("fleet"))
SOURCE, VERSION = "demo-lm", "1.0.0"
CB, SEQ = "bench-lm-cb", "bench-lm-seq"
NAMES = {CB: "continuous", SEQ: "one at a time"}
TENANT = "bench-generation"
NOISY_CORES = 0.25  # other processes' CPU in a cell above which its figures are flagged
TRAIN_MINUTES = {"demo": "~2.5 min", "test": "a few seconds"}


# -- percentiles and the per-request record ----------------------------------------------------
def _percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in 0..100); NaN of nothing."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered), max(1, math.ceil(q / 100 * len(ordered)))) - 1]


@dataclass
class Done:
    """One request: seconds since the cell began, TTFT and TPOT in seconds, output tokens."""

    start: float
    end: float
    ttft: float | None = None
    tpot: float | None = None
    tokens: int = 0
    error: str | None = None


async def _direct(client: object, url: str, prompt: str, tokens: int, t0: float) -> Done:
    """``POST /generate_stream`` on a replica; the service's server-sent events."""
    body = {"prompt": prompt, "max_tokens": tokens, "min_tokens": tokens, "temperature": 0}
    sent = time.perf_counter()
    first = last = None
    k_first = k_last = 0
    final: dict | None = None
    final_at: float | None = None
    try:
        async with client.stream("POST", f"{url}/generate_stream", json=body) as r:  # type: ignore[attr-defined]
            if (refused := await _refused(r, sent, t0)) is not None:
                return refused
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                now = time.perf_counter()
                event = json.loads(line[5:])
                if event.get("text"):
                    if first is None:
                        first, k_first = now, event["completion_tokens"]
                    last, k_last = now, event["completion_tokens"]
                if event.get("finish_reason") is not None and final is None:
                    final, final_at = (
                        event,
                        now,
                    )  # read on to the end of the stream: the connection is kept for the next request
    except Exception as exc:  # noqa: BLE001 - counted as an error of the cell
        return Done(sent - t0, time.perf_counter() - t0, error=f"{type(exc).__name__}: {exc}")
    end = final_at if final_at is not None else time.perf_counter()
    if final is None or final.get("finish_reason") not in ("length", "stop") or first is None:
        return Done(sent - t0, end - t0, error=f"bad end: {final}")
    tpot = (last - first) / (k_last - k_first) if last is not None and k_last > k_first else None
    return Done(sent - t0, end - t0, first - sent, tpot, int(final.get("completion_tokens", 0)))


async def _refused(r: object, sent: float, t0: float) -> Done | None:
    """A non-200 answer as the cell's error (its body's start), else None."""
    if r.status_code == 200:  # type: ignore[attr-defined]
        return None
    text = (await r.aread()).decode(errors="replace")[:200]  # type: ignore[attr-defined]
    return Done(sent - t0, time.perf_counter() - t0, error=f"HTTP {r.status_code}: {text}")  # type: ignore[attr-defined]


async def _gateway(client: object, url: str, key: str, model: str, prompt: str, tokens: int, t0: float) -> Done:
    """The gateway's OpenAI completions, ``stream: true``; TTFT at the first chunk with text."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": tokens,
        "min_tokens": tokens,
        "temperature": 0,
        "stream": True,
    }
    sent = time.perf_counter()
    first = None
    chunks = 0
    try:
        async with client.stream(
            "POST",
            f"{url}/v1/completions",
            json=body,  # type: ignore[attr-defined]
            headers={"Authorization": f"Bearer {key}"},
        ) as r:
            if (refused := await _refused(r, sent, t0)) is not None:
                return refused
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    continue  # read on to the end of the stream: the connection is kept for the next request
                event = json.loads(data)
                if "error" in event:
                    return Done(sent - t0, time.perf_counter() - t0, error=str(event["error"])[:200])
                choices = event.get("choices") or [{}]
                if choices[0].get("text"):
                    chunks += 1
                    if first is None:
                        first = time.perf_counter()
    except Exception as exc:  # noqa: BLE001
        return Done(sent - t0, time.perf_counter() - t0, error=f"{type(exc).__name__}: {exc}")
    end = time.perf_counter()
    if first is None:
        return Done(sent - t0, end - t0, error="no text")
    return Done(sent - t0, end - t0, first - sent, None, chunks)


# -- one cell: C callers back to back --------------------------------------------------------------
async def _cell(
    url: str, concurrency: int, total: int, cap_s: float, prompts: list[str], tokens: int
) -> tuple[list[Done], float, bool]:
    """``total`` requests (the prompts in order) from ``concurrency`` callers, each sending its
    next request as soon as its last one ended; no new request after ``cap_s``. Returns the
    requests, the cell's seconds (start → last answer) and whether the cap cut it short."""
    import httpx

    done: list[Done] = []
    issued = 0
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(120.0), limits=limits) as client:
        t0 = time.perf_counter()

        async def caller() -> None:
            nonlocal issued
            while issued < total and time.perf_counter() - t0 < cap_s:
                i = issued
                issued += 1
                done.append(await _direct(client, url, prompts[i % len(prompts)], tokens, t0))

        await asyncio.gather(*(caller() for _ in range(concurrency)))
    seconds = max((d.end for d in done), default=0.0)
    return done, seconds, issued < total


@dataclass
class Cell:
    model: str
    concurrency: int
    round: int
    seconds: float
    capped: bool
    requests: list[Done] = field(default_factory=list)
    steps: int = 0  # the engine's decode steps during the cell
    engine_tokens: int = 0  # and the tokens it sampled
    server_cpu: float = 0.0  # cores, the replica's process tree
    client_cpu: float = 0.0  # cores, this process
    other_cpu: float = 0.0  # cores, everything else on the machine (another replica, the gateway, other users)


def _cpu_of(pids: list[int]) -> float:
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in pids:
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])
    return total / ticks


def _box_busy() -> float:
    """Seconds of CPU the whole machine has spent busy so far, every core (/proc/stat)."""
    with open("/proc/stat") as f:  # noqa: PTH123
        ticks = [int(x) for x in f.readline().split()[1:]]
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


def _engine(url: str) -> dict:
    import httpx

    return httpx.post(f"{url}/engine", json={}, timeout=10).json()


def run_cell(
    bench: Bench, model: str, concurrency: int, rnd: int, args: argparse.Namespace, prompts: list[str]
) -> Cell:
    url = bench.urls[model]
    pids = bench.replica_pids(model)
    before, cpu, own, box, t = _engine(url), _cpu_of(pids), os.times(), _box_busy(), time.perf_counter()
    done, seconds, capped = asyncio.run(
        _cell(url, concurrency, args.requests, args.cell_seconds, prompts, args.max_tokens)
    )
    wall = time.perf_counter() - t
    cpu_after, own_after, box_after, after = _cpu_of(pids), os.times(), _box_busy(), _engine(url)
    server = (cpu_after - cpu) / wall
    client = (own_after.user + own_after.system - own.user - own.system) / wall
    return Cell(
        model,
        concurrency,
        rnd,
        seconds,
        capped,
        done,
        after["steps"] - before["steps"],
        after["tokens_out"] - before["tokens_out"],
        server,
        client,
        max(0.0, (box_after - box) / wall - server - client),
    )


def summarize(cells: list[Cell]) -> dict:
    """The cells' requests pooled: output tokens/s (tokens over the cells' seconds), TTFT and TPOT p50/p99 (ms)."""
    ok = [d for c in cells for d in c.requests if d.error is None]
    errors = [d.error for c in cells for d in c.requests if d.error is not None]
    seconds = sum(c.seconds for c in cells)
    tokens = sum(d.tokens for d in ok)
    ttft = [d.ttft * 1e3 for d in ok if d.ttft is not None]
    tpot = [d.tpot * 1e3 for d in ok if d.tpot is not None]
    steps = sum(c.steps for c in cells)
    return {
        "requests": len(ok),
        "errors": len(errors),
        "first_error": errors[0] if errors else None,
        "seconds": seconds,
        "output_tokens": tokens,
        "tokens_per_s": tokens / seconds if seconds else float("nan"),
        "ttft_p50_ms": _percentile(ttft, 50),
        "ttft_p99_ms": _percentile(ttft, 99),
        "tpot_p50_ms": _percentile(tpot, 50),
        "tpot_p99_ms": _percentile(tpot, 99),
        "tokens_per_step": sum(c.engine_tokens for c in cells) / steps if steps else float("nan"),
        "server_cpu": sum(c.server_cpu * c.seconds for c in cells) / seconds if seconds else float("nan"),
        "client_cpu": sum(c.client_cpu * c.seconds for c in cells) / seconds if seconds else float("nan"),
        "other_cpu": sum(c.other_cpu * c.seconds for c in cells) / seconds if seconds else float("nan"),
        "other_cpu_max": max((c.other_cpu for c in cells), default=float("nan")),
        "capped": any(c.capped for c in cells),
        "per_round_tokens_per_s": [
            sum(d.tokens for d in c.requests if d.error is None) / c.seconds if c.seconds else float("nan")
            for c in sorted(cells, key=lambda c: c.round)
        ],
    }


# -- part 2: the gateway's added TTFT ----------------------------------------------------------
async def _pairs(
    direct_url: str, gateway_urls: list[str], key: str, model: str, pairs: int, tokens: int, prompts: list[str]
) -> list[tuple[Done, ...]]:
    """``pairs`` rounds of a direct request and one through each gateway (``--reference``: a
    second gateway from another source tree, for a before/after in one run), the same
    prompt; the order within a round rotates, so none is always first."""
    import httpx

    out = []
    async with httpx.AsyncClient(timeout=httpx.Timeout(60.0)) as client:
        t0 = time.perf_counter()
        for i in range(pairs):
            prompt = prompts[i % len(prompts)]
            calls = [None, *gateway_urls]
            shift = i % len(calls)
            done: dict[int, Done] = {}
            for j in [*range(shift, len(calls)), *range(shift)]:
                url = calls[j]
                done[j] = (
                    await _direct(client, direct_url, prompt, tokens, t0)
                    if url is None
                    else await _gateway(client, url, key, model, prompt, tokens, t0)
                )
            out.append(tuple(done[j] for j in range(len(calls))))
    return out


def _added(direct: list[float], via: list[float]) -> dict:
    diffs = [g - d for d, g in zip(direct, via, strict=True)]
    return {
        "gateway_p50_ms": _percentile(via, 50),
        "gateway_p99_ms": _percentile(via, 99),
        "added_p50_ms": _percentile(via, 50) - _percentile(direct, 50),
        "added_p99_ms": _percentile(via, 99) - _percentile(direct, 99),
        "paired_diff_p50_ms": _percentile(diffs, 50),
        "paired_diff_p90_ms": _percentile(diffs, 90),
        "paired_diff_mean_ms": sum(diffs) / len(diffs) if diffs else float("nan"),
    }


def gateway_added(bench: Bench, args: argparse.Namespace, prompts: list[str]) -> dict:
    urls = [bench.gateway_url, *([bench.reference_url] if bench.reference_url else [])]
    warm = asyncio.run(_pairs(bench.urls[CB], urls, bench.key, CB, 20, args.gateway_tokens, prompts))
    if bad := [x.error for pair in warm for x in pair if x.error]:
        raise RuntimeError(f"the gateway's warm-up failed: {bad[0]}")
    from fleet.processes import tree

    pids = bench.replica_pids(CB) + [p for proc in bench.procs for p in tree(proc.pid)]
    box, ours, own, t = _box_busy(), _cpu_of(pids), os.times(), time.perf_counter()
    pairs = asyncio.run(_pairs(bench.urls[CB], urls, bench.key, CB, args.pairs, args.gateway_tokens, prompts))
    wall, own_after = time.perf_counter() - t, os.times()
    other = (
        _box_busy() - box - (_cpu_of(pids) - ours) - (own_after.user + own_after.system - own.user - own.system)
    ) / wall
    good = [p for p in pairs if all(x.error is None for x in p)]
    direct = [p[0].ttft * 1e3 for p in good]
    errors = [x.error for pair in pairs for x in pair if x.error]
    out = {
        "pairs": len(good),
        "errors": len(errors),
        "first_error": errors[0] if errors else None,
        "direct_p50_ms": _percentile(direct, 50),
        "direct_p99_ms": _percentile(direct, 99),
        **_added(direct, [p[1].ttft * 1e3 for p in good]),
        "other_cpu": max(0.0, other),
    }
    if bench.reference_url:
        out["reference"] = {"source": str(args.reference), **_added(direct, [p[2].ttft * 1e3 for p in good])}
    return out


# -- part 3: the engine alone ------------------------------------------------------------------
def engine_alone(artifact: Path, batches: tuple[int, ...], tokens: int, prompts: list[str]) -> list[dict]:
    """One running batch of ``b`` sequences driven by ``Engine.step()`` in this process (no
    HTTP, no server): ms per decode step and the tokens/s that allows."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from bentos.tiny_lm.answers import quiet
    from bentos.tiny_lm.engine import Engine, Params
    from bentos.tiny_lm.scheduler import Scheduler

    with quiet():
        tokenizer = AutoTokenizer.from_pretrained(artifact)
        model = AutoModelForCausalLM.from_pretrained(artifact, dtype=torch.float32)
    out = []
    for b in batches:
        engine = Engine(model, tokenizer, Scheduler(max_running=b, kv_budget=8192, max_waiting=4096))
        steps = passes = 0
        seconds = other = 0.0
        for rep in range(1000):  # the first pass warms up; then passes until a second is measured
            for i in range(b):
                engine.submit(prompts[i % len(prompts)], Params(max_tokens=tokens, min_tokens=tokens), lambda e: None)
            start, box, own = time.perf_counter(), _box_busy(), time.process_time()
            n = 0
            while engine.step():
                n += 1
                if engine.scheduler.idle:
                    break
            if rep:
                took = time.perf_counter() - start
                seconds, steps, passes = seconds + took, steps + n, passes + 1
                other += _box_busy() - box - (time.process_time() - own)
                if seconds >= 1.0:
                    break
        other = max(0.0, other / seconds)
        out.append(
            {
                "batch": b,
                "steps": steps,
                "ms_per_step": seconds / steps * 1e3,
                "tokens_per_s": passes * b * tokens / seconds,
                "threads": torch.get_num_threads(),
                "other_cpu": other,
            }
        )
    return out


# -- the fleet: store, policies, replicas, gateway -------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def claim_root(root: Path | None, bench: str) -> tuple[Path, IO[str]]:
    """The fleet folder (``root``, or a new temporary one) and a lock on it that this process
    holds until it exits: two runs on one folder would stop each other's replicas."""
    root = (root or Path(tempfile.mkdtemp(prefix=f"fleet-bench-{bench}-"))).absolute()
    root.mkdir(parents=True, exist_ok=True)
    lock = open(root / f".bench-{bench}.lock", "w")  # noqa: SIM115 - held until this process exits
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise SystemExit(
            f"another bench/{bench.replace('-', '_')}.py run is using {root} (its start would stop this "
            "run's replicas and the other way round); wait for it or pass another --root"
        ) from None
    return root, lock


def bench_policies(folder: Path, source: str, variants: dict[str, Callable[[dict], None]]) -> dict:
    """This tree's policies copied to ``folder``, plus one model per ``variants`` entry: a copy
    of ``source``'s policy changed by its function, logging nothing. Returns ``source``'s."""
    import yaml

    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    for src in sorted((ROOT / "policies").glob("*.y*ml")):
        shutil.copy(src, folder / src.name)
    doc = yaml.safe_load((folder / "fleet.yaml").read_text())
    base = doc["models"][source]
    for name, change in variants.items():
        spec = json.loads(json.dumps(base))
        change(spec)
        spec["inference_log"] = {"sample_rate": 0.0}
        doc["models"][name] = spec
    (folder / "fleet.yaml").write_text(yaml.safe_dump(doc, sort_keys=False))
    return base


class Bench:
    """A fleet folder (store, BentoML home, run folder, cache, policies) driven through the
    ``fleet`` CLI as in ``tests/serving_env.py``; every process it starts is stopped by PID."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.policies = root / "policies"
        self.env = {
            **os.environ,
            "FLEET_STORE": f"file://{root / 'store'}",
            "BENTOML_HOME": str(root / "bentoml"),
            "FLEET_RUN_DIR": str(root / "run"),
            "FLEET_CACHE_DIR": str(root / "cache"),
            "FLEET_POLICIES": str(self.policies),
            "FLEET_ACTOR": "bench-generation",
            "FLEET_ADMIN_TOKEN": "bench-admin-token",
            "BENTOML_DO_NOT_TRACK": "true",
            "COLUMNS": "200",
        }
        for var in ("FLEET_RUNTIME", "FLEET_STATIC_ENDPOINTS", "FLEET_REDIS_URL", "FLEET_GATEWAY_WORKERS"):
            self.env.pop(var, None)
        self.procs: list[subprocess.Popen[bytes]] = []
        self.urls: dict[str, str] = {}
        self.gateway_url = ""
        self.reference_url = ""
        self.key = ""

    def fleet(self, *args: str, timeout: float = 900, stderr_through: bool = False) -> str:
        proc = subprocess.run(
            [FLEET, *args],
            env=self.env,
            stdout=subprocess.PIPE,
            text=True,
            timeout=timeout,
            cwd=self.root,
            stderr=None if stderr_through else subprocess.PIPE,
        )
        if proc.returncode != 0:
            raise RuntimeError(f"fleet {' '.join(args)} failed ({proc.returncode}): {(proc.stderr or '')[-3000:]}")
        return proc.stdout

    def fleet_json(self, *args: str) -> object:
        return json.loads(self.fleet(*args, "--json"))

    def store(self) -> object:
        from fleet.store import open_store

        return open_store(self.env["FLEET_STORE"])

    def write_policies(self) -> dict:
        """This tree's policies, plus the two bench models: demo-lm's policy, ``max_running`` 32 and 1."""

        def continuous(spec: dict) -> None:  # demo-lm's own running batch (32 unless it says)
            spec.setdefault("generation", {}).setdefault("max_running", 32)

        def one_at_a_time(spec: dict) -> None:
            spec.setdefault("generation", {})["max_running"] = 1

        return bench_policies(self.policies, SOURCE, {CB: continuous, SEQ: one_at_a_time})

    def train(self, preset: str) -> None:
        from bentos.tiny_lm.config import PRESETS
        from fleet.catalog.registry import Registry

        registry = Registry(self.store())
        if VERSION in registry.versions(SOURCE):
            mv = registry.get(SOURCE, VERSION)
            want = PRESETS[preset]
            hp = mv.hyperparameters
            if (hp.get("hidden"), hp.get("layers")) != (want.hidden, want.layers):
                print(
                    f"note: {SOURCE}:{VERSION} in {self.root} was trained with hidden={hp.get('hidden')} "
                    f"layers={hp.get('layers')}, not --preset {preset}'s ({want.hidden}, {want.layers}); using it as it is"
                )
            print(f"{SOURCE}:{VERSION} is registered in {self.root / 'store'}: not training")
            return
        print(
            f"training {SOURCE}:{VERSION} with --preset {preset} ({TRAIN_MINUTES.get(preset, '?')}, one thread) ...",
            flush=True,
        )
        started = time.monotonic()
        self.fleet("models", "train", SOURCE, VERSION, "--preset", preset, timeout=3600, stderr_through=True)
        print(f"trained in {time.monotonic() - started:.0f} s", flush=True)

    def register_copies(self) -> None:
        """The trained artifact registered again as the two bench models (same files, same hash)."""
        from fleet.catalog.registry import Registry, VersionMetadata
        from fleet.runtime.cache import ArtifactCache

        os.environ["FLEET_ACTOR"] = self.env["FLEET_ACTOR"]
        registry = Registry(self.store())
        mv = registry.get(SOURCE, VERSION)
        artifact = ArtifactCache(self.root / "cache").path(registry, SOURCE, VERSION)
        meta = VersionMetadata(
            **{k: getattr(mv, k) for k in VersionMetadata.model_fields}
            | {"parent_version": None, "description": f"{SOURCE}:{VERSION}'s artifact, for bench/generation.py"}
        )
        for name in (CB, SEQ):
            if VERSION in registry.versions(name):
                held = registry.get(name, VERSION).artifact_sha256
                if held != mv.artifact_sha256:
                    raise RuntimeError(
                        f"{name}:{VERSION} in {self.root} holds another artifact than {SOURCE}:{VERSION}; "
                        "use a new --root"
                    )
                continue
            registry.register(name, VERSION, artifact, meta)
        self.artifact = artifact

    def tenant(self) -> None:
        from fleet.catalog.tenants import Tenants

        known = {t.name for t in Tenants(self.store()).list()}
        if TENANT in known:
            self.key = self.fleet_json("tenants", "rotate", TENANT, "--grace", "0")["api_key"]
        else:
            self.key = self.fleet_json("tenants", "create", TENANT, "--model", CB, "--model", SEQ)["api_key"]
        for name in (CB, SEQ):
            self.fleet("route", "set", name, "--stable", VERSION, "-r", "bench/generation.py")

    def deploy(self, expected: dict[str, int]) -> None:
        """Both replicas; each one's served ``generation.max_running`` checked (a Bento built
        before a policy change is rebuilt)."""
        import httpx

        for name, running in expected.items():
            for attempt in range(2):
                url = self.fleet_json("deploy", name, VERSION)["endpoints"][0]  # type: ignore[index]
                served = httpx.post(f"{url}/metadata", json={}, timeout=10).json()["generation"]["max_running"]
                if served == running:
                    break
                if attempt:
                    raise RuntimeError(f"{name} serves max_running={served} after a rebuild; expected {running}")
                print(
                    f"{name}'s Bento serves max_running={served}, the policy says {running}: rebuilding it", flush=True
                )
                self.fleet("undeploy", name, VERSION)
                self.fleet("package", name, VERSION, "--force")
            self.urls[name] = url

    def replica_pids(self, model: str) -> list[int]:
        from fleet.processes import tree

        pids: set[int] = set()
        for state in (self.root / "run" / model / VERSION).glob("replica-*.json"):
            data = json.loads(state.read_text())
            pids |= set(tree(data["pid"])) | set(data.get("workers", ()))
        return sorted(pids)

    def start_gateway(self, source: Path | None = None) -> str:
        """``fleet gateway`` on a free port; ``source``: a folder holding another ``fleet``
        package (a copy of an earlier tree) to run instead of this checkout's (``--reference``)."""
        import httpx

        port = _free_port()
        name = "gateway.log" if source is None else "gateway-reference.log"
        env = self.env if source is None else {**self.env, "PYTHONPATH": str(source)}
        command = (
            [FLEET]
            if source is None
            else [sys.executable, "-c", "import sys; from fleet.cli import main; sys.exit(main())"]
        )
        log = open(self.root / name, "ab")  # noqa: SIM115 - closed once the process has it
        proc = subprocess.Popen(
            [*command, "gateway", "--port", str(port)],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            cwd=self.root,
            start_new_session=True,
        )
        log.close()
        self.procs.append(proc)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"the gateway exited with {proc.returncode}; see {self.root / name}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/v2/health/ready", timeout=1).status_code == 200:
                    if source is None:
                        self.gateway_url = url
                    else:
                        self.reference_url = url
                    return url
            time.sleep(0.2)
        raise RuntimeError(f"the gateway was not ready after 120 s; see {self.root / name}")

    def stop(self) -> None:
        from fleet.processes import stop_group

        for proc in reversed(self.procs):
            if proc.poll() is None:
                stop_group(proc.pid, timeout_s=15)  # started in a session of its own: its group is its pid
                proc.wait()
        self.procs.clear()
        self.stop_replicas()

    def stop_replicas(self) -> None:
        from fleet.runtime.local import LocalRuntime

        LocalRuntime(self.root / "run").stop_all()  # every replica recorded under the run folder, by PID


# -- the report ---------------------------------------------------------------------------------
def report(
    config: dict, table: dict, cells: list[Cell], gateway: dict | None, engine: list[dict] | None, slo_ms: float
) -> dict:
    verdicts: dict = {}
    if table:  # part 1 ran (not --gateway-only)
        print()
        print(
            f"1. continuous batching (max_running {config['max_running']}) vs one sequence at a time (max_running 1): "
            f"{config['requests']} requests per cell (at most {config['cell_seconds']:g} s), {config['rounds']} round(s) "
            f"pooled, {config['max_tokens']} output tokens each (greedy, min_tokens = max_tokens), direct /generate_stream"
        )
        head = (
            f"{'conc':>4} {'serving':<13} | {'req':>4} {'err':>3} {'tok/s':>7} {'TTFT p50':>8} {'p99':>7} {'TPOT p50':>8} "
            f"{'p99':>6} | {'tok/step':>8} {'srv CPU':>7} {'cli CPU':>7} {'other':>5} | {'cb/seq tok/s':>12}"
        )
        print(head)
        print("-" * len(head))
        for c in config["concurrency"]:
            for model in (CB, SEQ):
                s = table[model, c]
                ratio = ""
                if model == SEQ:
                    r = table[CB, c]["tokens_per_s"] / s["tokens_per_s"]
                    per_round = [
                        a / b
                        for a, b in zip(
                            table[CB, c]["per_round_tokens_per_s"], s["per_round_tokens_per_s"], strict=False
                        )
                    ]
                    ratio = f"{r:>5.2f}x (rounds {'/'.join(f'{x:.2f}' for x in per_round)}, median {statistics.median(per_round):.2f})"
                cap = "*" if s["capped"] else " "
                print(
                    f"{c:>4} {NAMES[model]:<13} | {s['requests']:>4} {s['errors']:>3} {s['tokens_per_s']:>6.0f}{cap} "
                    f"{s['ttft_p50_ms']:>8.1f} {s['ttft_p99_ms']:>7.1f} {s['tpot_p50_ms']:>8.2f} {s['tpot_p99_ms']:>6.2f} | "
                    f"{s['tokens_per_step']:>8.1f} {s['server_cpu']:>7.2f} {s['client_cpu']:>7.2f} {s['other_cpu_max']:>5.2f} | {ratio}"
                )
        print(
            "   tok/s: output tokens / the cells' seconds (first send → last answer); TTFT, TPOT: ms, over every request of "
            "the cells; tok/step: tokens the engine sampled per decode step; CPU: cores busy, the replica's processes and "
            "this client; other: the most cores anything else kept busy in one of the cells (the idle replica, the gateway, "
            "other users); cb/seq: pooled, then per round; * a cell stopped at its time cap"
        )
        noisy = [
            f"{NAMES[x.model]} @{x.concurrency} round {x.round + 1} ({x.other_cpu:.2f})"
            for x in cells
            if x.other_cpu > NOISY_CORES
        ]
        if noisy:
            print(
                f"   WARNING: other processes kept more than {NOISY_CORES} cores busy during {len(noisy)} cell(s): "
                f"{', '.join(noisy)}; figures of those cells are not this bench's alone: run again on a quiet machine"
            )
        for model in (CB, SEQ):
            errs = [table[model, c]["first_error"] for c in config["concurrency"] if table[model, c]["first_error"]]
            if errs:
                print(f"   {NAMES[model]}: first error: {errs[0]}")
        if 8 in config["concurrency"]:
            cb8, seq8 = table[CB, 8], table[SEQ, 8]
            ratio = cb8["tokens_per_s"] / seq8["tokens_per_s"]
            verdicts["tokens_per_s_3x_at_8"] = ratio >= 3.0
            verdicts["ttft_p99_within_slo_at_8"] = cb8["ttft_p99_ms"] <= slo_ms
            print(
                f"   target: at concurrency 8 continuous batching >= 3x the tokens/s of one at a time: {ratio:.2f}x, "
                f"{'MET' if ratio >= 3 else 'NOT MET'}; its TTFT p99 within the SLO ({slo_ms:g} ms): "
                f"{cb8['ttft_p99_ms']:.1f} ms, {'MET' if cb8['ttft_p99_ms'] <= slo_ms else 'NOT MET'} "
                f"(one at a time: {seq8['ttft_p99_ms']:.1f} ms)"
            )
    if gateway is not None:
        g = gateway
        print()
        print(
            f"2. the gateway's added TTFT: {g['pairs']} interleaved pairs at concurrency 1 ({g['errors']} errors), "
            f"{config['gateway_tokens']} output tokens, direct /generate_stream vs gateway /v1/completions stream: true"
        )
        print(f"   direct  TTFT p50 {g['direct_p50_ms']:.2f} ms, p99 {g['direct_p99_ms']:.2f} ms")
        print(f"   gateway TTFT p50 {g['gateway_p50_ms']:.2f} ms, p99 {g['gateway_p99_ms']:.2f} ms")
        print(
            f"   added: p50 difference {g['added_p50_ms']:+.2f} ms, p99 difference {g['added_p99_ms']:+.2f} ms; median of "
            f"the paired differences {g['paired_diff_p50_ms']:+.2f} ms (p90 {g['paired_diff_p90_ms']:+.2f} ms, mean "
            f"{g['paired_diff_mean_ms']:+.2f} ms)"
        )
        if "reference" in g:
            r = g["reference"]
            print(
                f"   reference gateway ({r['source']}), in the same rounds: TTFT p50 {r['gateway_p50_ms']:.2f} ms, p99 "
                f"{r['gateway_p99_ms']:.2f} ms; added: p50 {r['added_p50_ms']:+.2f} ms, p99 {r['added_p99_ms']:+.2f} ms; "
                f"paired differences median {r['paired_diff_p50_ms']:+.2f} ms (p90 {r['paired_diff_p90_ms']:+.2f} ms, "
                f"mean {r['paired_diff_mean_ms']:+.2f} ms)"
            )
        verdicts["gateway_adds_at_most_2ms"] = g["added_p50_ms"] <= 2.0
        print(f"   target: the gateway adds <= 2 ms to TTFT p50: {'MET' if g['added_p50_ms'] <= 2.0 else 'NOT MET'}")
        if g["other_cpu"] > NOISY_CORES:
            print(
                f"   WARNING: other processes kept {g['other_cpu']:.2f} cores busy meanwhile: run again on a quiet machine"
            )
        if g["first_error"]:
            print(f"   first error: {g['first_error']}")
    if engine:
        print()
        print(
            f"3. the engine alone (Engine.step() in this process, no HTTP, servers stopped; {engine[0]['threads']} torch "
            f"threads), {config['max_tokens']} tokens per sequence:"
        )
        for e in engine:
            print(
                f"   running batch {e['batch']:>2}: {e['ms_per_step']:6.2f} ms per step -> {e['tokens_per_s']:6.0f} tokens/s; "
                f"other processes {e['other_cpu']:.2f} cores{'  WARNING: not this bench alone' if e['other_cpu'] > NOISY_CORES else ''}"
            )
        for model in (CB,):
            for c in config["concurrency"]:
                match = [e for e in engine if e["batch"] == c]
                if match:
                    served = table[model, c]["tokens_per_s"]
                    print(
                        f"   served at concurrency {c:>2} (continuous): {served:.0f} tokens/s = "
                        f"{served / match[0]['tokens_per_s']:.0%} of the engine alone at that batch"
                    )
    return verdicts


def _log_findings(root: Path) -> None:
    """Tracebacks and errors in the servers' logs, for the reader to look at."""
    import re

    logs = [root / "gateway.log", *sorted((root / "run").glob(f"bench-lm-*/{VERSION}/replica-*.log"))]
    for log in logs:
        if not log.exists():
            continue
        hits = [
            ln
            for ln in log.read_text(errors="replace").splitlines()
            if re.search(r"Traceback|ERROR|Error:|exited with", ln)
        ]
        if hits:
            print(f"   {log.relative_to(root)}: {len(hits)} suspicious lines, first: {hits[0][:200]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--root", type=Path, help="fleet folder to use and keep (a trained model is reused); default a temp folder"
    )
    parser.add_argument(
        "--preset",
        choices=("demo", "test"),
        default="demo",
        help="how demo-lm:1.0.0 is trained if it is not yet (test: seconds, for a smoke run)",
    )
    parser.add_argument("--requests", type=int, default=96, help="requests per cell")
    parser.add_argument("--cell-seconds", type=float, default=40.0, help="no new request in a cell after this")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of cells (the order alternates), pooled")
    parser.add_argument(
        "--retry-noisy",
        type=int,
        default=2,
        help=f"run a cell again (at most this often) when other processes kept more than {NOISY_CORES} cores busy during it",
    )
    parser.add_argument("--concurrency", default="1,8,32", help="comma-separated concurrencies")
    parser.add_argument("--max-tokens", type=int, default=32, help="output tokens per request (min_tokens too)")
    parser.add_argument(
        "--pairs", type=int, default=200, help="direct/gateway pairs for the gateway's added TTFT (0: skip)"
    )
    parser.add_argument("--gateway-tokens", type=int, default=4, help="output tokens per request in the gateway pairs")
    parser.add_argument("--no-engine", action="store_true", help="skip part 3 (the engine alone)")
    parser.add_argument(
        "--gateway-only", action="store_true", help="part 2 only (no cells, no engine): the gateway's added TTFT"
    )
    parser.add_argument(
        "--reference",
        type=Path,
        metavar="SRC",
        help="also run a second gateway from SRC (a folder holding another copy of the fleet package, e.g. "
        "an earlier tree) in the same interleaved rounds of part 2: a before/after in one run",
    )
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    concurrency = [int(c) for c in args.concurrency.split(",")]
    if not 1 <= args.max_tokens <= 40 or not 1 <= args.gateway_tokens <= 40:
        parser.error(
            "--max-tokens and --gateway-tokens: 1 to 40 (the model's context is 64 positions, prompts up to 18)"
        )
    if args.requests < max(concurrency):
        parser.error(f"--requests {args.requests} is fewer than the largest concurrency ({max(concurrency)})")

    root, _lock = claim_root(args.root, "generation")
    bench = Bench(root)
    started = time.monotonic()
    load_before = Path("/proc/loadavg").read_text().split()[0]

    def _terminate(signum: int, _frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, _terminate)
    from bentos.tiny_lm.data import examples

    prompts = [p for p, _ in examples(64, seed=2024, split="holdout")]
    table: dict = {}
    cells: list[Cell] = []
    gateway = engine = None
    try:
        bench.stop_replicas()  # leftovers of an earlier run in --root
        policy = bench.write_policies()
        max_running = policy.get("generation", {}).get("max_running", 32)
        slo_ms = float(policy["slo"]["p99_ms"])
        bench.train(args.preset)
        bench.register_copies()
        bench.tenant()
        setup = time.monotonic()
        print("packaging and deploying both (bentoml build, then bentoml serve) ...", flush=True)
        bench.deploy({CB: max_running, SEQ: 1})
        bench.start_gateway()
        print(
            f"replicas: {bench.urls[CB]} (continuous), {bench.urls[SEQ]} (one at a time); gateway {bench.gateway_url}; "
            f"ready in {time.monotonic() - setup:.0f} s",
            flush=True,
        )
        if args.reference is not None:
            bench.start_gateway(args.reference.absolute())
            print(f"reference gateway ({args.reference}): {bench.reference_url}", flush=True)
        for model in (CB, SEQ):  # warm up: torch's first calls, connections
            asyncio.run(_cell(bench.urls[model], 4, 16, 30, prompts, args.max_tokens))
        for rnd in range(0 if args.gateway_only else args.rounds):
            for c in concurrency:
                order = (CB, SEQ) if (rnd + concurrency.index(c)) % 2 == 0 else (SEQ, CB)
                for model in order:
                    cell = run_cell(bench, model, c, rnd, args, prompts)
                    for _ in range(args.retry_noisy):
                        if cell.other_cpu <= NOISY_CORES:
                            break
                        print(
                            f"  round {rnd + 1} concurrency {c:>2} {NAMES[model]:<13}: other processes kept {cell.other_cpu:.2f} "
                            "cores busy; running the cell again",
                            flush=True,
                        )
                        time.sleep(5)
                        cell = run_cell(bench, model, c, rnd, args, prompts)
                    cells.append(cell)
                    ok = [d for d in cell.requests if d.error is None]
                    print(
                        f"  round {rnd + 1} concurrency {c:>2} {NAMES[model]:<13}: {len(ok)} requests in {cell.seconds:.1f} s, "
                        f"{sum(d.tokens for d in ok) / max(cell.seconds, 1e-9):.0f} tokens/s; other processes "
                        f"{cell.other_cpu:.2f} cores",
                        flush=True,
                    )
        for c in concurrency if cells else ():
            for model in (CB, SEQ):
                table[model, c] = summarize([x for x in cells if x.model == model and x.concurrency == c])
        if args.pairs:
            print(f"gateway pairs ({args.pairs}) ...", flush=True)
            gateway = gateway_added(bench, args, prompts)
    finally:
        bench.stop()
    if not args.no_engine and not args.gateway_only and table:
        print("the engine alone ...", flush=True)
        engine = engine_alone(bench.artifact, tuple(concurrency), args.max_tokens, prompts)
    config = {
        "requests": args.requests,
        "cell_seconds": args.cell_seconds,
        "rounds": args.rounds,
        "concurrency": concurrency,
        "max_tokens": args.max_tokens,
        "gateway_tokens": args.gateway_tokens,
        "max_running": max_running,
        "preset": args.preset,
        "slo_p99_ms": slo_ms,
        "cores": os.cpu_count(),
        "load_before": load_before,
        "root": str(root),
    }
    verdicts = report(config, table, cells, gateway, engine, slo_ms)
    elapsed = time.monotonic() - started
    print()
    print(
        f"{os.cpu_count()} cores shared by this client, the replica and the gateway (load average {load_before} before "
        f"this run); fleet folder {root}; {elapsed:.0f} s in all"
    )
    print("server logs:")
    _log_findings(root)
    if args.json:
        out = {
            "config": config,
            "verdicts": verdicts,
            "elapsed_s": elapsed,
            "cells": {f"{NAMES[m]}@{c}": s for (m, c), s in table.items()},
            "gateway": gateway,
            "engine": engine,
            "raw": [
                {
                    **{k: v for k, v in asdict(c).items() if k != "requests"},
                    "ttft_ms": [d.ttft * 1e3 for d in c.requests if d.ttft is not None],
                }
                for c in cells
            ],
        }
        args.json.write_text(json.dumps(out, indent=2, default=str))
        print(f"figures written to {args.json}")


if __name__ == "__main__":
    main()
