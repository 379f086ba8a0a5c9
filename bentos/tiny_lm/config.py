"""What a tiny-lm version is trained as: ``TrainConfig`` (checked before any work is done) and
the named ``PRESETS`` (``fleet models train|distill --preset``).
"""

from __future__ import annotations

from dataclasses import dataclass

from bentos.tiny_lm import data

MAX_POSITIONS = 64  # the longest sequence (prompt and answer, with <s> and </s>) a model takes


@dataclass(frozen=True)
class TrainConfig:
    seed: int = 7
    task: str = "reverse"  # one of data.TASKS, or several joined by "," (drawn in turn)
    letters: tuple[int, int] = data.LETTERS  # shortest and longest word
    hidden: int = 256
    layers: int = 4
    heads: int = 4
    intermediate: int = 1024
    steps: int = 350
    batch_size: int = 64
    lr: float = 3e-3
    warmup_steps: int = 30  # linear warmup, then cosine decay to lr * min_lr_ratio
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.01
    train_examples: int = 40_000
    holdout_examples: int = 500
    log_every: int = 50
    # Faults built into the version, to rehearse a rollback (written to fleet_faults.json, which
    # the service reads): the first token waits this much longer, and so does every later one.
    fault_first_token_ms: float = 0.0
    fault_token_ms: float = 0.0

    def __post_init__(self) -> None:
        """Refuse a config that cannot train, before any work is done."""
        unknown = [t for t in self.tasks if t not in data.TASKS]
        if unknown:
            raise ValueError(f"unknown task(s) {unknown} in {self.task!r}; known: {', '.join(data.TASKS)}")
        lo, hi = self.letters
        if not 1 <= lo <= hi:
            raise ValueError(f"letters {self.letters} is not a range 1 <= shortest <= longest")
        longest = max(len(t) for t in self.tasks) + hi + 3 + hi + 1  # <s>, "<task> <word>>", answer, </s>
        if longest > MAX_POSITIONS:
            raise ValueError(f"words of {hi} letters make sequences of {longest} tokens; at most {MAX_POSITIONS}")
        if self.heads < 1 or self.hidden % self.heads:
            raise ValueError(f"hidden {self.hidden} is not a multiple of heads {self.heads}")
        if min(self.layers, self.intermediate, self.steps, self.batch_size, self.holdout_examples, self.log_every) < 1:
            raise ValueError("layers, intermediate, steps, batch_size, holdout_examples and log_every must be >= 1")
        if self.train_examples < self.batch_size:
            raise ValueError(f"train_examples {self.train_examples} is fewer than one batch ({self.batch_size})")
        if min(self.fault_first_token_ms, self.fault_token_ms) < 0:
            raise ValueError("fault_first_token_ms and fault_token_ms must be >= 0")
        if not (self.lr > 0 and 0 <= self.min_lr_ratio <= 1 and self.warmup_steps >= 0):
            raise ValueError(f"lr {self.lr} must be > 0, min_lr_ratio {self.min_lr_ratio} in [0, 1], warmup >= 0")

    @property
    def tasks(self) -> tuple[str, ...]:
        return tuple(t.strip() for t in self.task.split(","))


# "demo": what the README and the bench use: 4.2M parameters, ~2.5 minutes on one CPU core, holdout exact match
# 0.89 on reverse (300 steps gave 0.72, 400 gave 0.92; lr 5e-3 diverges, 2e-3 is slower; batches of 32 learn less
# per second). "test": ~3 seconds for the test suite; words of 3-4 letters, so that even it learns some (0.22).
PRESETS: dict[str, TrainConfig] = {
    "demo": TrainConfig(),
    "test": TrainConfig(
        letters=(3, 4),
        hidden=64,
        layers=2,
        heads=2,
        intermediate=128,
        steps=300,
        batch_size=32,
        lr=5e-3,
        warmup_steps=20,
        train_examples=4_000,
        holdout_examples=64,
        log_every=100,
    ),
    # students (fleet models distill): the task and word lengths are the teacher's
    "student": TrainConfig(hidden=128, layers=2, heads=2, intermediate=512, steps=350, train_examples=20_000),
    "student-test": TrainConfig(
        letters=(3, 4),
        hidden=32,
        layers=1,
        heads=2,
        intermediate=64,
        steps=150,
        batch_size=32,
        lr=5e-3,
        warmup_steps=10,
        train_examples=1_000,
        holdout_examples=64,
        log_every=50,
    ),
}
