"""Train a tiny-lm version (a small Llama-architecture causal LM) on a generated task, and register it.

    python -m bentos.tiny_lm.train demo-lm 1.0.0 [--preset demo|test] [--seed 7]

The model learns to answer prompts such as ``reverse abcdef>`` with ``fedcba</s>``: the loss
is on the answer's tokens only (the prompt's are masked), and the holdout's exact match by
greedy generation is the version's quality metric. A fixed number of steps (never a wall
clock) in one thread, seeded: the same config gives the same weights, byte for byte. The
artifact is a ``save_pretrained`` folder (safetensors, tokenizer, generation config) that
``AutoModelForCausalLM`` / ``AutoTokenizer`` load offline.

This module is the family's trainer, what ``fleet models train|quantize|distill`` and ``fleet
up`` call: ``TrainConfig`` and ``PRESETS`` (``config.py``), ``train_and_register``,
``quantize_and_register`` (``QUANT_METHODS``) and ``distill_and_register``.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything is local: never ask the Hub

import argparse
import json
import math
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from bentos.tiny_lm import data
from bentos.tiny_lm.answers import evaluate, generate, quiet
from bentos.tiny_lm.config import MAX_POSITIONS, PRESETS, TrainConfig
from bentos.tiny_lm.tokenizer import train_tokenizer
from fleet.catalog.registry import ModelVersion, Registry, TensorSpec, TrainingData, VersionMetadata
from fleet.types import ObjectStore

Log = Callable[[str], None]
Progress = Callable[[int, int], None]  # (steps done, steps in all), after each optimizer step
PROGRESS_UNIT = "steps"
FAULTS = "fleet_faults.json"  # read by service.py: a rehearsal's slow version


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def model_config(config: TrainConfig, tokenizer: Any) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=config.hidden,
        intermediate_size=config.intermediate,
        num_hidden_layers=config.layers,
        num_attention_heads=config.heads,
        num_key_value_heads=config.heads,
        max_position_embeddings=MAX_POSITIONS,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )


def encode(pairs: Sequence[tuple[str, str]], tokenizer: Any) -> list[tuple[list[int], list[int]]]:
    """Each pair as (``<s>`` + prompt ids, answer ids + ``</s>``)."""
    if not pairs:
        return []
    prompts = tokenizer([p for p, _ in pairs])["input_ids"]
    answers = tokenizer([a for _, a in pairs], add_special_tokens=False)["input_ids"]
    out = []
    for (p, a), prompt_ids, answer_ids in zip(pairs, prompts, answers, strict=True):
        answer_ids = answer_ids + [tokenizer.eos_token_id]
        if len(prompt_ids) + len(answer_ids) > MAX_POSITIONS:
            raise ValueError(f"{p!r} → {a!r} is {len(prompt_ids) + len(answer_ids)} tokens; at most {MAX_POSITIONS}")
        out.append((prompt_ids, answer_ids))
    return out


def collate(batch: Sequence[tuple[list[int], list[int]]], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded input ids, attention mask, and labels that score the answer tokens only."""
    width = max(len(p) + len(a) for p, a in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    labels = torch.full((len(batch), width), -100, dtype=torch.long)
    for i, (p, a) in enumerate(batch):
        n = len(p) + len(a)
        ids[i, :n] = torch.tensor(p + a)
        mask[i, :n] = 1
        labels[i, len(p) : n] = torch.tensor(a)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def lr_factor(step: int, config: TrainConfig) -> float:
    """Linear warmup over ``warmup_steps``, then cosine decay to ``min_lr_ratio``."""
    if step < config.warmup_steps:
        return (step + 1) / config.warmup_steps
    progress = (step - config.warmup_steps) / max(config.steps - config.warmup_steps, 1)
    return config.min_lr_ratio + (1 - config.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))


def teacher_pairs(
    teacher: Path, prompts: Sequence[str], max_new_tokens: int, log: Log = _stderr
) -> list[tuple[str, str]]:
    """(prompt, the teacher's greedy answer) for each prompt: what a student learns from."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(teacher)
    with quiet():
        model = AutoModelForCausalLM.from_pretrained(teacher)
    started = time.perf_counter()
    answers = generate(model.eval(), tokenizer, prompts, max_new_tokens, batch_size=256)
    log(f"the teacher answered {len(prompts)} training prompts in {time.perf_counter() - started:.0f}s")
    return list(zip(prompts, answers, strict=True))


def train(
    config: TrainConfig,
    out: Path,
    *,
    log: Log = _stderr,
    teacher: Path | None = None,
    teacher_ref: str = "",
    progress: Progress | None = None,
) -> VersionMetadata:
    """Train into ``out`` (a save_pretrained folder) on generated data; return the version's metadata.

    With ``teacher`` (a model folder), distil: the training prompts are answered by the teacher,
    and the student (``config``'s size) learns those answers with the teacher's tokenizer; it is
    judged on the true answers like any version."""
    from transformers import AutoTokenizer, GenerationConfig, LlamaForCausalLM

    train_pairs = data.examples(config.train_examples, config.seed, config.tasks, split="train", letters=config.letters)
    holdout = data.examples(config.holdout_examples, config.seed, config.tasks, split="holdout", letters=config.letters)
    if teacher is not None:
        tokenizer = AutoTokenizer.from_pretrained(teacher)
        taught = teacher_pairs(teacher, [p for p, _ in train_pairs], config.letters[1] + 2, log)
        agree = data.exact_match([a for _, a in taught], [a for _, a in train_pairs])
        # an answer too long to train on (a teacher that rambles) is left out, not truncated
        fits = [(p, a) for p, a in taught if len(tokenizer(p)["input_ids"]) + len(a) + 1 <= MAX_POSITIONS]
        log(
            f"teacher exact match on the training prompts {agree:.3f}; {len(taught) - len(fits)} answers too long, left out"
        )
        train_pairs = fits
    else:
        tokenizer = train_tokenizer(data.corpus(config.tasks))
    tokenizer.model_max_length = MAX_POSITIONS
    encoded = encode(train_pairs, tokenizer)

    started = time.perf_counter()
    torch.manual_seed(config.seed)
    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    threads = torch.get_num_threads()
    # Reductions in one order: the same bytes every run, whatever the machine's core count. (Two threads
    # are ~1.8x faster on an idle 2-core machine but give other bytes, and crawl when another process
    # competes for the cores.)
    torch.set_num_threads(1)
    try:
        model = LlamaForCausalLM(model_config(config, tokenizer))
        params_millions = round(model.num_parameters() / 1e6, 3)
        log(f"tiny-lm: {params_millions}M parameters, {config.steps} steps of {config.batch_size} ({config.task})")
        decay = [p for p in model.parameters() if p.ndim >= 2]  # matrices; not the norms' gains
        no_decay = [p for p in model.parameters() if p.ndim < 2]
        opt = torch.optim.AdamW(
            [{"params": decay, "weight_decay": config.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=config.lr,
            betas=(0.9, 0.98),
        )
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, config))
        gen = torch.Generator().manual_seed(config.seed)
        order = torch.randperm(len(encoded), generator=gen)
        cursor, window, train_loss = 0, [], 0.0
        model.train()
        for step in range(config.steps):
            if cursor + config.batch_size > len(order):
                order, cursor = torch.randperm(len(encoded), generator=gen), 0
            idx = order[cursor : cursor + config.batch_size].tolist()
            cursor += config.batch_size
            loss = model(**collate([encoded[i] for i in idx], tokenizer.pad_token_id)).loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            window.append(loss.item())
            if progress is not None:
                progress(step + 1, config.steps)
            if (step + 1) % config.log_every == 0 or step + 1 == config.steps:
                log(
                    f"step {step + 1}/{config.steps}  loss {sum(window) / len(window):.4f}  "
                    f"lr {sched.get_last_lr()[0]:.2e}  {time.perf_counter() - started:.0f}s"
                )
                train_loss, window = sum(window) / len(window), []
        train_seconds = time.perf_counter() - started
        model.eval()
        model.generation_config = GenerationConfig(
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            do_sample=False,
            max_new_tokens=config.letters[1] + 2,
        )
        out.mkdir(parents=True, exist_ok=True)
        with quiet():
            model.save_pretrained(out, safe_serialization=True)
        tokenizer.save_pretrained(out)
        if config.fault_first_token_ms or config.fault_token_ms:
            faults = {"first_token_ms": config.fault_first_token_ms, "token_ms": config.fault_token_ms}
            (out / FAULTS).write_text(json.dumps(faults))
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(deterministic)
    quality = evaluate(out, holdout)
    log(f"holdout exact match {quality['exact_match']:.3f} over {quality['holdout_examples']} prompts")
    hyper: dict[str, Any] = {k: list(v) if isinstance(v, tuple) else v for k, v in vars(config).items()}
    return VersionMetadata(
        framework="transformers",
        description=f"tiny-lm: character-level Llama-architecture causal LM for the task {config.task!r} "
        f"(prompt '{data.prompt(config.tasks[0], 'abc')}' → answer '{data.TASKS[config.tasks[0]]('abc')}')",
        inputs=[TensorSpec(name="text_input", datatype="BYTES", shape=[-1])],
        outputs=[TensorSpec(name="text_output", datatype="BYTES", shape=[-1])],
        hyperparameters={
            **hyper,
            "params_millions": params_millions,
            **({"lineage": {"method": "distill", "teacher": teacher_ref}} if teacher is not None else {}),
        },
        training_data=TrainingData(
            uri=training_uri(config) + (f"&teacher={teacher_ref}" if teacher is not None else ""),
            sha256=data.digest(train_pairs),
        ),
        metrics={
            "exact_match": quality["exact_match"],
            "holdout_examples": float(quality["holdout_examples"]),
            "params_millions": params_millions,
            "train_seconds": round(train_seconds, 1),
            "train_loss": round(train_loss, 4),
        },
    )


def training_uri(config: TrainConfig) -> str:
    lo, hi = config.letters
    return f"generated://tiny-lm?task={config.task}&n={config.train_examples}&seed={config.seed}&letters={lo}-{hi}"


def generated_training_set(uri: str) -> list[tuple[str, str]]:
    """The exact (prompt, answer) pairs a ``generated://tiny-lm?...`` URI names (what a version was trained on)."""
    from urllib.parse import parse_qs, urlsplit

    parts = urlsplit(uri)
    if parts.scheme != "generated" or parts.netloc != "tiny-lm":
        raise ValueError(f"training data {uri!r} is not generated://tiny-lm?task=..&n=..&seed=..; cannot regenerate it")
    q = {k: v[0] for k, v in parse_qs(parts.query).items()}
    lo, hi = (int(x) for x in q.get("letters", f"{data.LETTERS[0]}-{data.LETTERS[1]}").split("-"))
    tasks = tuple(q["task"].split(","))
    return data.examples(int(q["n"]), int(q["seed"]), tasks, split="train", letters=(lo, hi))


def train_and_register(
    store: ObjectStore,
    model: str,
    version: str,
    config: TrainConfig = PRESETS["demo"],
    *,
    parent: str | None = None,
    log: Log = _stderr,
    progress: Progress | None = None,
) -> ModelVersion:
    Registry(store).check_new(model, version, parent=parent)  # refused now, not after the training
    with tempfile.TemporaryDirectory(prefix="fleet-train-") as tmp:
        meta = train(config, Path(tmp) / "artifact", log=log, progress=progress)
        if parent is not None:
            meta = meta.model_copy(update={"parent_version": parent})
        return Registry(store).register(model, version, Path(tmp) / "artifact", meta)


QUANTIZATION = "fleet_quantization.json"  # read by service.py: quantize the weights when they load
QUANT_METHODS = ("int8-weight-only",)


def quantize_model(model: Any, method: str) -> Any:  # noqa: ANN401 - a transformers model
    """``model`` with its linear layers' weights quantized in place by torchao."""
    if method not in QUANT_METHODS:
        raise ValueError(f"quantization {method!r} is not known; expected one of {', '.join(QUANT_METHODS)}")
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    quantize_(model, Int8WeightOnlyConfig())
    return model


def weight_bytes(model: Any) -> int:  # noqa: ANN401
    """Bytes the weights hold in memory (an int8 tensor counts its int8 data and its scales)."""
    total = 0
    for p in model.parameters():
        inner = [
            getattr(p, n) for n in ("qdata", "scale", "zero_point") if isinstance(getattr(p, n, None), torch.Tensor)
        ]
        total += sum(t.numel() * t.element_size() for t in inner) if inner else p.numel() * p.element_size()
    return total


def quantize_and_register(
    store: ObjectStore,
    model: str,
    parent_version: str,
    version: str,
    method: str = "int8-weight-only",
    *,
    log: Log = _stderr,
) -> ModelVersion:
    """``model:parent_version``'s weights, quantized when they load (``fleet_quantization.json``
    beside them, which the service reads), registered as ``version`` with its lineage and its
    quality and weight memory measured on the parent's holdout."""

    from transformers import AutoModelForCausalLM, AutoTokenizer

    if method not in QUANT_METHODS:
        raise ValueError(f"quantization {method!r} is not known; expected one of {', '.join(QUANT_METHODS)}")
    registry = Registry(store)
    registry.check_new(model, version, parent=parent_version)  # refused now, not after the work
    parent = registry.get(model, parent_version)
    if (parent.hyperparameters.get("lineage") or {}).get("method") == "quantize":
        raise ValueError(f"{parent.ref} is quantized already; expected a full-precision parent")
    hyper = parent.hyperparameters
    letters = tuple(hyper.get("letters", data.LETTERS))
    holdout = data.examples(
        int(hyper.get("holdout_examples", 500)),
        int(hyper.get("seed", 7)),
        tuple(str(hyper.get("task", "reverse")).split(",")),
        split="holdout",
        letters=letters,
    )
    with tempfile.TemporaryDirectory(prefix="fleet-quantize-") as tmp:
        folder = registry.fetch(model, parent_version, Path(tmp) / "artifact")
        settings = {"library": "torchao", "method": method}
        (folder / QUANTIZATION).write_text(json.dumps(settings))
        tokenizer = AutoTokenizer.from_pretrained(folder)
        with quiet():
            full = AutoModelForCausalLM.from_pretrained(folder).eval()
            quantized = quantize_model(AutoModelForCausalLM.from_pretrained(folder).eval(), method)
        prompts, answers = zip(*holdout, strict=True)
        exact = data.exact_match(generate(quantized, tokenizer, prompts, max(len(a) for a in answers) + 2), answers)
        before, after = weight_bytes(full), weight_bytes(quantized)
        log(
            f"{method}: exact match {exact:.3f} (parent {parent.metrics.get('exact_match', float('nan')):.3f}), "
            f"weights {before / 2**20:.2f} → {after / 2**20:.2f} MiB"
        )
        metrics = {
            **{k: v for k, v in parent.metrics.items() if k in ("params_millions",)},
            "exact_match": exact,
            "holdout_examples": float(len(holdout)),
            "weight_mib": after / 2**20,
            "parent_weight_mib": before / 2**20,
            "parent_exact_match": parent.metrics.get("exact_match", exact),
        }
        meta = VersionMetadata(
            framework=parent.framework,
            inputs=parent.inputs,
            outputs=parent.outputs,
            hyperparameters={**hyper, "lineage": {"method": "quantize", "parent": parent.ref, "settings": settings}},
            training_data=parent.training_data,
            metrics=metrics,
            baseline_profile=parent.baseline_profile,
            parent_version=parent_version,
            description=f"{parent.description}; {method} (torchao) of {parent.ref}",
        )
        return registry.register(model, version, folder, meta)


def distill_and_register(
    store: ObjectStore,
    model: str,
    teacher_version: str,
    version: str,
    config: TrainConfig | None = None,
    *,
    log: Log = _stderr,
    progress: Progress | None = None,
) -> ModelVersion:
    """A smaller student of ``model:teacher_version`` (the verified artifact), registered as
    ``version`` with its lineage: parent, method and settings, and its measured quality."""
    config = config or PRESETS["student"]
    registry = Registry(store)
    registry.check_new(model, version, parent=teacher_version)  # refused now, not after the training
    teacher = registry.get(model, teacher_version)
    taught = teacher.hyperparameters  # the student learns the teacher's task, on its word lengths
    if "task" in taught and "letters" in taught:
        config = replace(
            config, task=str(taught["task"]), letters=(int(taught["letters"][0]), int(taught["letters"][1]))
        )
    with tempfile.TemporaryDirectory(prefix="fleet-distill-") as tmp:
        folder = registry.fetch(model, teacher_version, Path(tmp) / "teacher")
        meta = train(
            config, Path(tmp) / "artifact", log=log, teacher=folder, teacher_ref=teacher.ref, progress=progress
        )
        metrics = {
            **meta.metrics,
            "teacher_exact_match": teacher.metrics.get("exact_match", float("nan")),
            "teacher_params_millions": teacher.metrics.get("params_millions", float("nan")),
        }
        metrics = {k: v for k, v in metrics.items() if v == v}  # no NaN in a manifest
        meta = meta.model_copy(
            update={
                "parent_version": teacher_version,
                "metrics": metrics,
                "description": f"{meta.description}; distilled from {teacher.ref}",
            }
        )
        return registry.register(model, version, Path(tmp) / "artifact", meta)


def main(argv: list[str] | None = None) -> None:
    from fleet.store import open_store

    parser = argparse.ArgumentParser(description="Train and register a tiny-lm version.")
    parser.add_argument("model")
    parser.add_argument("version")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="demo")
    parser.add_argument("--seed", type=int, help="default: the preset's")
    parser.add_argument("--steps", type=int, help="default: the preset's")
    parser.add_argument("--parent")
    args = parser.parse_args(argv)
    config = PRESETS[args.preset]
    config = replace(config, **{k: v for k in ("seed", "steps") if (v := getattr(args, k)) is not None})
    mv = train_and_register(open_store(), args.model, args.version, config, parent=args.parent)
    print(f"registered {mv.ref}: " + ", ".join(f"{k}={v:.4g}" for k, v in mv.metrics.items()))


if __name__ == "__main__":
    main()
