"""Teacher, int8 and student of one generative model, side by side in one run.

    .venv/bin/python bench/variants.py --root DIR [--model demo-lm --teacher 1.0.0]

Uses (or makes) in the store under ``DIR``: the teacher (``fleet models train``, demo preset,
about 2.5 minutes), its int8 weight-only version (``fleet models quantize``) and a distilled
student (``fleet models distill``, about 2 minutes). Then, for each, in this process and
interleaved round by round: exact match (measured at registration, on the holdout), weight
memory, and the engine (``bentos/tiny_lm/engine.py``, continuous batching) answering the
same holdout prompts at concurrency 8 — output tokens/s and time to first token p50/p99.
The teacher is the reference run. One thread for torch, as a replica would have on a
one-CPU request; ratios are what travel between machines, not absolute figures.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def ensure(store, model: str, teacher: str) -> dict[str, str]:  # noqa: ANN001
    from bentos.tiny_lm import train
    from fleet.catalog.registry import Registry

    registry = Registry(store)
    have = set(registry.versions(model))
    names = {"teacher": teacher, "int8": f"{teacher}-int8", "student": f"{teacher}-student"}
    if teacher not in have:
        print(f"training {model}:{teacher} (demo preset, about 2.5 minutes) ...", flush=True)
        train.train_and_register(store, model, teacher)
    if names["int8"] not in have:
        train.quantize_and_register(store, model, teacher, names["int8"])
    if names["student"] not in have:
        print(f"distilling {model}:{teacher} (about 2 minutes) ...", flush=True)
        train.distill_and_register(store, model, teacher, names["student"])
    return names


def load(store, model: str, version: str, tmp: Path):  # noqa: ANN001, ANN201
    import json

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from bentos.tiny_lm.answers import quiet
    from bentos.tiny_lm.train import QUANTIZATION, quantize_model, weight_bytes
    from fleet.catalog.registry import Registry

    folder = Registry(store).fetch(model, version, tmp / version)
    with quiet():
        net = AutoModelForCausalLM.from_pretrained(folder).eval()
    if (folder / QUANTIZATION).exists():
        quantize_model(net, json.loads((folder / QUANTIZATION).read_text())["method"])
    return net, AutoTokenizer.from_pretrained(folder), weight_bytes(net)


def serve_once(net, tokenizer, prompts: list[str], concurrency: int, max_tokens: int) -> dict[str, float]:  # noqa: ANN001
    """Every prompt through one engine, ``concurrency`` sequences at a time (a new one joins as one ends)."""
    from bentos.tiny_lm.engine import Engine, Params
    from bentos.tiny_lm.scheduler import Scheduler

    engine = Engine(net, tokenizer, Scheduler(max_running=concurrency, kv_budget=64 * concurrency))
    engine.start()
    done, ttft, tokens = threading.Semaphore(0), [], [0]
    gate = threading.Semaphore(concurrency)
    lock = threading.Lock()

    def sink(event) -> None:  # noqa: ANN001
        if event.finish_reason is not None:
            with lock:
                ttft.append(event.ttft_s)
                tokens[0] += event.completion_tokens
            gate.release()
            done.release()

    started = time.perf_counter()
    for prompt in prompts:
        gate.acquire()
        engine.submit(prompt, Params(max_tokens=max_tokens, min_tokens=max_tokens), sink)
    for _ in prompts:
        done.acquire()
    elapsed = time.perf_counter() - started
    engine.stop()
    ttft.sort()
    return {
        "tokens_s": tokens[0] / elapsed,
        "ttft_p50_ms": statistics.median(ttft) * 1e3,
        "ttft_p99_ms": ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))] * 1e3,
    }


def main() -> None:
    import tempfile

    import torch

    from bentos.tiny_lm import data
    from fleet.catalog.registry import Registry
    from fleet.store import open_store

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--root", type=Path, required=True, help="folder of the store (kept between runs)")
    parser.add_argument("--model", default="demo-lm")
    parser.add_argument("--teacher", default="1.0.0")
    parser.add_argument("--prompts", type=int, default=96)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    store = open_store(f"file://{args.root.absolute() / 'store'}")
    names = ensure(store, args.model, args.teacher)
    prompts = [p for p, _ in data.examples(args.prompts, 99, split="holdout")]
    results: dict[str, list[dict[str, float]]] = {k: [] for k in names}
    with tempfile.TemporaryDirectory() as tmp:
        loaded = {k: load(store, args.model, v, Path(tmp)) for k, v in names.items()}
        for r in range(args.rounds):  # interleaved: each round runs every variant once
            for kind, (net, tokenizer, _) in loaded.items():
                results[kind].append(serve_once(net, tokenizer, prompts, args.concurrency, args.max_tokens))
            print(f"round {r + 1}/{args.rounds} done", flush=True)
    reg = Registry(store)
    ref = statistics.median(x["tokens_s"] for x in results["teacher"])
    print(
        f"\n{args.model}: {args.prompts} holdout prompts x {args.max_tokens} tokens, concurrency {args.concurrency}, "
        f"median of {args.rounds} interleaved rounds, torch on one thread"
    )
    print(
        f"{'variant':<8} {'version':<18} {'params M':>8} {'exact match':>11} {'weights MiB':>11} {'tokens/s':>9} "
        f"{'vs teacher':>10} {'TTFT p50':>9} {'TTFT p99':>9}"
    )
    for kind, version in names.items():
        mv = reg.get(args.model, version)
        tps = statistics.median(x["tokens_s"] for x in results[kind])
        p50 = statistics.median(x["ttft_p50_ms"] for x in results[kind])
        p99 = statistics.median(x["ttft_p99_ms"] for x in results[kind])
        print(
            f"{kind:<8} {version:<18} {mv.metrics.get('params_millions', 0):>8.2f} {mv.metrics['exact_match']:>11.3f} "
            f"{loaded[kind][2] / 2**20:>11.2f} {tps:>9.0f} {tps / ref:>9.2f}x {p50:>7.1f}ms {p99:>7.1f}ms"
        )


if __name__ == "__main__":
    main()
