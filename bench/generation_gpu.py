"""Generation on CUDA vs CPU: the tiny-lm Bento served by ``bentoml serve`` on each device, side by side.

On a GPU machine with the project installed (``make setup``: pip takes torch 2.13's CUDA
build there), one command, printed in about 5 minutes and at most ``--budget-s`` (420 s) plus
the set-up (training 30 steps, two ``bentoml build``; under a minute):

    .venv/bin/python bench/generation_gpu.py

To compare vLLM's engine too, install its CUDA-only wheel into that venv first (it is never
in the lock; ``bentos/tiny_lm/__init__.py`` pins it for the GPU image):
``.venv/bin/python -m pip install vllm==0.33.0``. When ``vllm`` imports, a third variant serves
the same Bento with ``FLEET_ENGINE=vllm``. With no GPU, a quick run proves the machinery:

    .venv/bin/python bench/generation_gpu.py --devices cpu --quick

Asked for CUDA (the default ``--devices cuda,cpu``) where torch sees none, it stops at once,
saying so, before any work.

What it does. One tiny-lm version (the ``--preset``'s architecture — demo: 4.2M parameters,
64 positions — trained ``--train-steps`` steps: throughput does not depend on what the
weights learned, and every request generates exactly ``--max-tokens`` tokens, greedy, with
``min_tokens = max_tokens``; or ``--model-dir``, a ``save_pretrained`` folder of your own) is
registered twice in a fleet folder: ``bench-gpu-lm`` under demo-lm's policy with
``resources.gpu: 1`` (its Bento lists vLLM) and ``bench-cpu-lm`` with ``gpu: 0``. Both are
built with ``fleet package``; then one variant at a time is served by a real ``bentoml serve``
(so no variant shares the GPU or the cores with another):

* ``cuda native``: ``bench-gpu-lm`` with ``FLEET_DEVICE=cuda FLEET_ENGINE=native`` — our KV
  cache and continuous batching (``bentos/tiny_lm/engine.py``) with the model on the GPU;
* ``cpu native``: ``bench-cpu-lm`` with ``FLEET_DEVICE=cpu`` and no GPU visible;
* ``cuda vllm``: ``bench-gpu-lm`` with ``FLEET_ENGINE=vllm`` (``vllm_engine.py``), when vllm is
  installed; last, since it starts slowest (memory profiling, compilation, CUDA graphs).

Each replica's ``/engine`` is read to confirm the engine and device it serves with. After a
warm-up, C callers (asyncio + httpx in this process, ``bench/generation.py``'s client) send
``POST /generate_stream`` back to back for C = 1, 8 and 32: the same holdout prompts in the
same order for every variant, ``--requests`` per cell, at most ``--cell-seconds``. Per cell:
output tokens/s (tokens over the cell's seconds), TTFT (sent → first token event) and TPOT
(first → last token event, per token) p50/p99, and the replica's CPU; printed side by side
with each CUDA variant's tokens/s over the CPU's. Everything started here is stopped by PID
at the end, also on Ctrl-C or an error.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.generation import (
    Bench,
    Cell,
    _box_busy,
    _cell,
    _cpu_of,
    _engine,
    _free_port,
    bench_policies,
    claim_root,
    summarize,
)  # noqa: E402

SOURCE_POLICY = "demo-lm"  # whose policy the bench models copy
GPU_MODEL, CPU_MODEL, VERSION = "bench-gpu-lm", "bench-cpu-lm", "1.0.0"
STOP_SERVER_S = 20.0


@dataclass(frozen=True)
class Variant:
    name: str  # "cuda native", "cpu native", "cuda vllm"
    model: str
    device: str
    engine: str


@dataclass
class Served:
    variant: Variant
    ok: bool
    note: str = ""  # why it did not serve, or what it reported
    ready_s: float = 0.0
    engine: dict = field(default_factory=dict)  # /engine after the cells
    cells: list[Cell] = field(default_factory=list)
    table: dict[int, dict] = field(default_factory=dict)  # concurrency → summarize()


# -- set-up: policies, one trained version under two names, two Bentos ----------------------------------
def write_policies(bench: Bench, gpu_memory_gib: float) -> dict:
    """This tree's policies plus the two bench models: demo-lm's policy with ``gpu: 1`` and ``gpu: 0``."""

    def on_gpu(spec: dict) -> None:
        spec.setdefault("resources", {}).update(gpu=1, gpu_memory_gib=gpu_memory_gib)

    def on_cpu(spec: dict) -> None:
        resources = spec.setdefault("resources", {})
        resources["gpu"] = 0
        resources.pop("gpu_memory_gib", None)

    base = bench_policies(bench.policies, SOURCE_POLICY, {GPU_MODEL: on_gpu, CPU_MODEL: on_cpu})
    from fleet.catalog.policies.loader import load_policies

    load_policies(bench.policies)  # a policy this tree's spec refuses fails here, not in fleet package
    return base


def register(bench: Bench, args: argparse.Namespace) -> dict:
    """The version under both bench names (trained here, or ``--model-dir``); reused from ``--root``."""
    from bentos.tiny_lm.config import PRESETS
    from bentos.tiny_lm.train import train
    from fleet.catalog.registry import Registry, TensorSpec, VersionMetadata

    os.environ["FLEET_ACTOR"] = bench.env["FLEET_ACTOR"]
    registry = Registry(bench.store())
    held = {name: registry.get(name, VERSION) for name in (GPU_MODEL, CPU_MODEL) if VERSION in registry.versions(name)}
    if len(held) == 2 and len({mv.artifact_sha256 for mv in held.values()}) == 1 and not args.model_dir:
        print(f"{GPU_MODEL} and {CPU_MODEL} {VERSION} are registered in {bench.root / 'store'}: not training")
        return next(iter(held.values())).hyperparameters
    if held:
        raise SystemExit(
            f"{bench.root} holds {', '.join(held)} {VERSION} already (another artifact or --model-dir): "
            "pass another --root"
        )
    with tempfile.TemporaryDirectory(prefix="fleet-bench-gpu-") as tmp:
        if args.model_dir:
            folder = Path(args.model_dir).absolute()
            if not (folder / "config.json").exists():
                raise SystemExit(f"--model-dir {folder} holds no config.json; expected a save_pretrained folder")
            meta = VersionMetadata(
                framework="transformers",
                description=f"{folder}, for bench/generation_gpu.py",
                inputs=[TensorSpec(name="text_input", datatype="BYTES", shape=[-1])],
                outputs=[TensorSpec(name="text_output", datatype="BYTES", shape=[-1])],
            )
        else:
            preset = PRESETS[args.preset]
            config = replace(
                preset,
                steps=args.train_steps,
                warmup_steps=min(preset.warmup_steps, max(1, args.train_steps // 3)),
                holdout_examples=min(preset.holdout_examples, 64),
                log_every=max(1, args.train_steps),
            )
            print(
                f"training {args.train_steps} steps of the {args.preset!r} architecture (hidden {config.hidden}, "
                f"{config.layers} layers; what it learns does not matter here) ...",
                flush=True,
            )
            started = time.monotonic()
            folder = Path(tmp) / "artifact"
            meta = train(config, folder, log=lambda line: None)
            print(f"trained in {time.monotonic() - started:.0f} s", flush=True)
        for name in (GPU_MODEL, CPU_MODEL):
            registry.register(name, VERSION, folder, meta)
    return meta.hyperparameters


# -- one variant: serve, measure, stop ------------------------------------------------------------------------
def serve(bench: Bench, variant: Variant, ready_timeout: float) -> tuple[subprocess.Popen | None, str, str, float]:
    """``bentoml serve`` of the variant's Bento with its device and engine; returns the process,
    its URL, a note (why it is not serving, if so) and the seconds it took to be ready."""
    import httpx

    env = {**bench.env, "FLEET_DEVICE": variant.device, "FLEET_ENGINE": variant.engine}
    if variant.device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""  # no GPU in sight: the CPU figures are the CPU's alone
    port = _free_port()
    log_path = bench.root / f"serve-{variant.name.replace(' ', '-')}.log"
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "bentoml",
                "serve",
                f"{variant.model}:{VERSION}",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
            ],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            cwd=bench.root,
            start_new_session=True,
        )
    url = f"http://127.0.0.1:{port}"
    started = time.monotonic()
    while time.monotonic() - started < ready_timeout:
        if proc.poll() is not None:
            return None, url, f"exited with {proc.returncode} while starting: {_tail(log_path)}", 0.0
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/readyz", timeout=2).status_code == 200:
                return proc, url, "", time.monotonic() - started
        time.sleep(0.5)
    stop(proc)
    return None, url, f"not ready after {ready_timeout:.0f} s: {_tail(log_path)}", 0.0


def _tail(path: Path, lines: int = 6) -> str:
    text = path.read_text(errors="replace").strip().splitlines() if path.exists() else []
    return " | ".join(line.strip()[:240] for line in text[-lines:]) + f" (log: {path})"


def stop(proc: subprocess.Popen | None) -> None:
    from fleet.processes import stop_group

    if proc is None or proc.poll() is not None:
        return
    stop_group(proc.pid, timeout_s=STOP_SERVER_S)  # started in a session of its own: its group is its pid
    proc.wait()


def measure(
    proc: subprocess.Popen,
    url: str,
    variant: Variant,
    concurrency: int,
    args: argparse.Namespace,
    prompts: list[str],
    cap_s: float,
) -> Cell:
    """One cell: ``concurrency`` callers back to back, as ``bench/generation.py``'s."""
    from fleet.processes import tree

    pids = tree(proc.pid)
    before, cpu, own, box, t = _engine(url), _cpu_of(pids), os.times(), _box_busy(), time.perf_counter()
    done, seconds, capped = asyncio.run(_cell(url, concurrency, args.requests, cap_s, prompts, args.max_tokens))
    wall = max(time.perf_counter() - t, 1e-9)
    cpu_after, own_after, box_after, after = _cpu_of(pids), os.times(), _box_busy(), _engine(url)
    server = (cpu_after - cpu) / wall
    client = (own_after.user + own_after.system - own.user - own.system) / wall
    return Cell(
        variant.name,
        concurrency,
        0,
        seconds,
        capped,
        done,
        after.get("steps", 0) - before.get("steps", 0),
        after.get("tokens_out", 0) - before.get("tokens_out", 0),
        server,
        client,
        max(0.0, (box_after - box) / wall - server - client),
    )


def run_variant(
    bench: Bench, variant: Variant, args: argparse.Namespace, prompts: list[str], deadline: float
) -> Served:
    left = deadline - time.monotonic()
    if left < 30:
        return Served(variant, False, f"skipped: {max(left, 0):.0f} s of the --budget-s left")
    print(
        f"{variant.name}: bentoml serve {variant.model}:{VERSION} (FLEET_DEVICE={variant.device} "
        f"FLEET_ENGINE={variant.engine}) ...",
        flush=True,
    )
    proc, url, note, ready_s = serve(bench, variant, min(args.ready_timeout, left))
    if proc is None:
        print(f"  {variant.name}: {note}", flush=True)
        return Served(variant, False, note)
    served = Served(variant, True, ready_s=ready_s)
    try:
        info = _engine(url)
        if (info.get("engine"), info.get("device")) != (variant.engine, variant.device):
            served.ok, served.note = (
                False,
                f"serves the {info.get('engine')} engine on {info.get('device')}, not as asked",
            )
            return served
        print(f"  ready in {ready_s:.0f} s: the {info['engine']} engine on {info['device']}; warming up", flush=True)
        warm = asyncio.run(_cell(url, 4, 16, 60, prompts, args.max_tokens))[0]
        if bad := [d.error for d in warm if d.error]:
            served.ok, served.note = False, f"warm-up failed: {bad[0]}"
            return served
        for c in args.concurrency:
            cap = min(args.cell_seconds, deadline - time.monotonic())
            if cap < 2:
                served.note = f"cells from concurrency {c} on skipped: the --budget-s is spent"
                break
            cell = measure(proc, url, variant, c, args, prompts, cap)
            served.cells.append(cell)
            served.table[c] = s = summarize([cell])
            print(
                f"  concurrency {c:>2}: {s['requests']} requests ({s['errors']} errors) in {cell.seconds:.1f} s, "
                f"{s['tokens_per_s']:.0f} tokens/s, TTFT p50 {s['ttft_p50_ms']:.1f} ms, TPOT p50 {s['tpot_p50_ms']:.2f} ms",
                flush=True,
            )
        served.engine = _engine(url)
    finally:
        stop(proc)
    return served


# -- the report ---------------------------------------------------------------------------------------------------
def report(results: list[Served], args: argparse.Namespace, gpu: str | None) -> None:
    print()
    print(
        f"tiny-lm served by bentoml serve, one variant at a time: {args.requests} requests per cell (at most "
        f"{args.cell_seconds:g} s), {args.max_tokens} output tokens each (greedy, min_tokens = max_tokens), "
        f"direct /generate_stream; GPU: {gpu or 'none'}; {os.cpu_count()} cores"
    )
    for r in results:
        state = f"ready in {r.ready_s:.0f} s" if r.ok else "NOT SERVED"
        print(f"  {r.variant.name:<12} {r.variant.model}:{VERSION}  {state}{': ' + r.note if r.note else ''}")
    cpu = next((r for r in results if r.variant.device == "cpu" and r.ok), None)
    head = (
        f"{'conc':>4}  {'variant':<12} | {'req':>4} {'err':>3} {'tok/s':>8} {'vs cpu':>7} | {'TTFT p50':>8} {'p99':>8} | "
        f"{'TPOT p50':>8} {'p99':>7} | {'srv CPU':>7} {'other':>5}"
    )
    print()
    print(head)
    print("-" * len(head))
    for c in args.concurrency:
        for r in results:
            s = r.table.get(c)
            if s is None:
                continue
            base = cpu.table.get(c) if cpu is not None else None
            ratio = (
                f"{s['tokens_per_s'] / base['tokens_per_s']:>6.2f}x"
                if base and base["tokens_per_s"] > 0
                else f"{'':>7}"
            )
            cap = "*" if s["capped"] else " "
            print(
                f"{c:>4}  {r.variant.name:<12} | {s['requests']:>4} {s['errors']:>3} {s['tokens_per_s']:>7.0f}{cap} {ratio} | "
                f"{s['ttft_p50_ms']:>8.1f} {s['ttft_p99_ms']:>8.1f} | {s['tpot_p50_ms']:>8.2f} {s['tpot_p99_ms']:>7.2f} | "
                f"{s['server_cpu']:>7.2f} {s['other_cpu_max']:>5.2f}"
            )
        print()
    print(
        "   tok/s: output tokens / the cell's seconds (first send → last answer); vs cpu: over the CPU variant's at the "
        "same concurrency; TTFT, TPOT: ms, every request of the cell; srv CPU: cores the replica's processes kept busy; "
        "other: cores anything else kept busy (above 0.25 the figures are not this bench's alone); * the cell stopped "
        "at its time cap"
    )
    for r in results:
        errors = [s["first_error"] for s in r.table.values() if s["first_error"]]
        if errors:
            print(f"   {r.variant.name}: first error: {errors[0]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", default="cuda,cpu", help="comma-separated: cuda, cpu")
    parser.add_argument(
        "--engines",
        default="native,vllm",
        help="on CUDA: native, vllm (vllm only when it imports; skipped with a note otherwise)",
    )
    parser.add_argument(
        "--root", type=Path, help="fleet folder to use and keep (a registered version is reused); default a temp folder"
    )
    parser.add_argument("--model-dir", type=Path, help="a save_pretrained folder to serve instead of training one")
    parser.add_argument(
        "--preset", default="demo", help="tiny-lm preset whose architecture is trained (demo, test, ...)"
    )
    parser.add_argument(
        "--train-steps", type=int, default=30, help="optimizer steps (throughput does not depend on them)"
    )
    parser.add_argument("--requests", type=int, default=64, help="requests per cell")
    parser.add_argument("--cell-seconds", type=float, default=20.0, help="no new request in a cell after this")
    parser.add_argument("--concurrency", default="1,8,32", help="comma-separated concurrencies")
    parser.add_argument("--max-tokens", type=int, default=32, help="output tokens per request (min_tokens too)")
    parser.add_argument(
        "--gpu-memory-gib",
        type=float,
        default=8.0,
        help="the GPU model's resources.gpu_memory_gib: vLLM takes this share of the GPU",
    )
    parser.add_argument("--ready-timeout", type=float, default=300.0, help="seconds a replica may take to be ready")
    parser.add_argument(
        "--budget-s",
        type=float,
        default=420.0,
        help="serving and measuring stop after this (set-up not counted): the run prints within it",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a smoke run: the test preset, 5 steps, 16 requests, concurrency 1 and 8, 8 tokens, 15 s cells",
    )
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    if args.quick:
        args.preset, args.train_steps, args.requests, args.max_tokens, args.cell_seconds = "test", 5, 16, 8, 15.0
        if args.concurrency == "1,8,32":
            args.concurrency = "1,8"
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    devices = [d.strip() for d in args.devices.split(",") if d.strip()]
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    if not devices or set(devices) - {"cuda", "cpu"}:
        parser.error(f"--devices {args.devices!r}: expected cuda, cpu or both")
    if set(engines) - {"native", "vllm"}:
        parser.error(f"--engines {args.engines!r}: expected native, vllm or both")
    if not 1 <= args.max_tokens <= 40:
        parser.error("--max-tokens: 1 to 40 (the model's context is 64 positions, prompts up to 18)")
    if args.requests < max(args.concurrency):
        parser.error(f"--requests {args.requests} is fewer than the largest concurrency ({max(args.concurrency)})")

    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    if "cuda" in devices and gpu is None:
        raise SystemExit(
            f"CUDA was asked for (--devices {args.devices}), but torch {torch.__version__} sees no CUDA device "
            f"(torch.version.cuda={torch.version.cuda}: {'a CPU build' if torch.version.cuda is None else 'no driver or no visible GPU'}); "
            "run on a GPU machine (make setup there installs the CUDA build), or pass --devices cpu"
        )
    variants = []
    if "cuda" in devices and "native" in engines:
        variants.append(Variant("cuda native", GPU_MODEL, "cuda", "native"))
    if "cpu" in devices:
        variants.append(Variant("cpu native", CPU_MODEL, "cpu", "native"))
    skipped: list[Served] = []
    if "cuda" in devices and "vllm" in engines:
        vllm = Variant("cuda vllm", GPU_MODEL, "cuda", "vllm")
        if importlib.util.find_spec("vllm") is not None:
            variants.append(vllm)
        else:
            skipped.append(
                Served(
                    vllm, False, "vllm is not installed in this venv (python -m pip install vllm==0.33.0 to include it)"
                )
            )
    if not variants:
        parser.error("nothing to serve: --devices cpu with --engines vllm (vLLM is CUDA-only here)")

    root, _lock = claim_root(args.root, "generation-gpu")

    def _terminate(signum: int, _frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, _terminate)
    started = time.monotonic()
    print(
        f"devices: {', '.join(devices)}; GPU: {gpu or 'none'}; torch {torch.__version__}; fleet folder {root}",
        flush=True,
    )
    for r in skipped:
        print(f"note: {r.variant.name}: {r.note}", flush=True)
    from bentos.tiny_lm.data import examples

    prompts = [p for p, _ in examples(64, seed=2024, split="holdout")]
    bench = Bench(root)
    bench.env["FLEET_ACTOR"] = "bench-generation-gpu"
    write_policies(bench, args.gpu_memory_gib)
    hyper = register(bench, args)
    models = sorted({v.model for v in variants})
    print(f"packaging {', '.join(models)} (bentoml build) ...", flush=True)
    for model in models:
        bench.fleet("package", model, VERSION)
    setup_s = time.monotonic() - started
    deadline = time.monotonic() + args.budget_s
    results = [run_variant(bench, variant, args, prompts, deadline) for variant in variants]  # each stops its server
    results += skipped
    report(results, args, gpu)
    elapsed = time.monotonic() - started
    print(
        f"\nset-up {setup_s:.0f} s, {elapsed:.0f} s in all; model {hyper.get('hidden', '?')} hidden x "
        f"{hyper.get('layers', '?')} layers; logs in {root}"
    )
    if args.json:
        out = {
            "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "gpu": gpu,
            "elapsed_s": elapsed,
            "variants": [
                {
                    "name": r.variant.name,
                    "ok": r.ok,
                    "note": r.note,
                    "ready_s": r.ready_s,
                    "engine": r.engine,
                    "cells": {str(c): s for c, s in r.table.items()},
                    "raw": [{k: v for k, v in asdict(c).items() if k != "requests"} for c in r.cells],
                }
                for r in results
            ],
        }
        args.json.write_text(json.dumps(out, indent=2, default=str))
        print(f"figures written to {args.json}")
    if not any(r.ok and r.table for r in results):
        raise SystemExit("no variant served: see the notes above")


if __name__ == "__main__":
    main()
