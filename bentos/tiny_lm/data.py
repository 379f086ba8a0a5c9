"""Generated text tasks with one exact answer, so a generative model's quality is measurable.

A prompt is ``<task> <word>>`` and its answer a string the task computes from the word:
``reverse abcdef>`` → ``fedcba``. Exact match (the whole answer, nothing more) is the metric.
Words are lowercase letters; which split a word belongs to is decided by a hash of the
prompt, so train and holdout never share a prompt whatever the seeds. Seeded (Python's
``random``, the same on every platform) and deterministic.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable, Iterable, Sequence
from typing import Literal

ALPHABET = "abcdefghijklmnopqrstuvwxyz"
SEP = ">"  # ends the prompt; the answer follows it directly
LETTERS = (3, 8)  # shortest and longest word, inclusive
HOLDOUT_SHARE = 10  # one prompt in this many belongs to the holdout split

Split = Literal["train", "holdout"]

# task name → the answer for a word. Add a task here: prompts and vocabulary follow.
TASKS: dict[str, Callable[[str], str]] = {
    "reverse": lambda word: word[::-1],
    "sort": lambda word: "".join(sorted(word)),
}


def prompt(task: str, word: str) -> str:
    return f"{task} {word}{SEP}"


def split_of(text: str) -> Split:
    """The split a prompt belongs to: fixed by its hash, so no prompt is in both."""
    return "holdout" if int(hashlib.sha256(text.encode()).hexdigest()[:8], 16) % HOLDOUT_SHARE == 0 else "train"


def examples(
    n: int,
    seed: int,
    tasks: Sequence[str] = ("reverse",),
    *,
    split: Split = "train",
    letters: tuple[int, int] = LETTERS,
) -> list[tuple[str, str]]:
    """``n`` (prompt, answer) pairs of ``split``, tasks drawn in turn; the same for the same arguments.

    Train pairs may repeat a prompt (it is sampled); holdout pairs are distinct prompts.
    """
    unknown = [t for t in tasks if t not in TASKS]
    if unknown or not tasks:
        raise ValueError(f"unknown task(s) {unknown or list(tasks)}; known: {', '.join(TASKS)}")
    lo, hi = letters
    if not 1 <= lo <= hi:
        raise ValueError(f"letters {letters} is not a range 1 <= shortest <= longest")
    if split not in ("train", "holdout"):
        raise ValueError(f"split {split!r} is not 'train' or 'holdout'")
    if split == "holdout" and n > _space(lo, hi) * len(tasks) // (2 * HOLDOUT_SHARE):
        raise ValueError(f"{n} distinct holdout prompts asked of words of {lo}-{hi} letters: too few exist")
    rng = random.Random(f"tiny-lm/{split}/{seed}")
    out: list[tuple[str, str]] = []
    seen: set[str] = set()
    while len(out) < n:
        task = tasks[len(out) % len(tasks)]
        word = "".join(rng.choice(ALPHABET) for _ in range(rng.randint(lo, hi)))
        text = prompt(task, word)
        if split_of(text) != split or (split == "holdout" and text in seen):
            continue
        seen.add(text)
        out.append((text, TASKS[task](word)))
    return out


def _space(lo: int, hi: int) -> int:
    return sum(len(ALPHABET) ** k for k in range(lo, hi + 1))


def corpus(tasks: Iterable[str] = TASKS) -> list[str]:
    """Text that holds every character a prompt or answer of ``tasks`` can use (a tokenizer's training text)."""
    return [prompt(t, ALPHABET) + ALPHABET for t in tasks]


def digest(pairs: Iterable[tuple[str, str]]) -> str:
    """SHA-256 of the exact (prompt, answer) pairs trained on (recorded in the manifest)."""
    h = hashlib.sha256()
    for p, a in pairs:
        h.update(p.encode() + b"\0" + a.encode() + b"\n")
    return h.hexdigest()


def exact_match(outputs: Sequence[str], answers: Sequence[str]) -> float:
    """Share of outputs equal to their answer, character for character (0.0 for no pairs)."""
    if len(outputs) != len(answers):
        raise ValueError(f"{len(outputs)} outputs for {len(answers)} answers")
    return sum(o == a for o, a in zip(outputs, answers, strict=True)) / len(answers) if answers else 0.0
