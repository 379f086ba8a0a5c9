"""What a saved tiny-lm model answers: greedy generation, cut at ``</s>``, and its exact match
on (prompt, answer) examples — a version's quality metric, and a teacher's answers for its student.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything is local: never ask the Hub

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from bentos.tiny_lm import data


@contextmanager
def quiet() -> Iterator[None]:
    """No transformers progress bars (saving and loading a few MB draws two per version)."""
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            hf_logging.enable_progress_bar()


def generate(
    model: Any, tokenizer: Any, prompts: Sequence[str], max_new_tokens: int, batch_size: int = 64
) -> list[str]:
    """Greedy answers to ``prompts`` (left-padded batches), each cut at its first ``</s>``."""
    side, tokenizer.padding_side = tokenizer.padding_side, "left"
    outputs: list[str] = []
    with torch.inference_mode():
        for i in range(0, len(prompts), batch_size):
            batch = tokenizer(list(prompts[i : i + batch_size]), return_tensors="pt", padding=True)
            ids = model.generate(
                **batch,
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=tokenizer.pad_token_id,
                eos_token_id=tokenizer.eos_token_id,
            )
            for row in ids[:, batch["input_ids"].shape[1] :].tolist():
                if tokenizer.eos_token_id in row:
                    row = row[: row.index(tokenizer.eos_token_id)]
                outputs.append(tokenizer.decode(row, skip_special_tokens=True))
    tokenizer.padding_side = side
    return outputs


def evaluate(model_dir: Path, examples: Sequence[tuple[str, str]]) -> dict[str, Any]:
    """Exact match of greedy generation on ``examples`` (prompt, answer) by the model saved in ``model_dir``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not examples:
        raise ValueError("no examples to evaluate on")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    with quiet():
        model = AutoModelForCausalLM.from_pretrained(model_dir)
    model.eval()
    prompts, answers = zip(*examples, strict=True)
    outputs = generate(model, tokenizer, prompts, max_new_tokens=max(len(a) for a in answers) + 2)
    return {"exact_match": data.exact_match(outputs, answers), "holdout_examples": len(examples)}
