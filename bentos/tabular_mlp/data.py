"""Generated training data with a known rule, so accuracy and drift are measurable.

Four numeric features; the label is 1 when ``1.5·income − 2·debt_ratio + 0.8·age·tenure >
0.25``, with 3 % of labels flipped (the ceiling on accuracy is ~97 %). ``shift`` moves the
feature means, which is how drift is injected later.
"""

from __future__ import annotations

import hashlib

import numpy as np

FEATURES = ("income", "debt_ratio", "age", "tenure")
LABEL_NOISE = 0.03


THRESHOLD = 0.25


def generate(rows: int, seed: int, shift: float = 0.0, threshold: float = THRESHOLD) -> tuple[np.ndarray, np.ndarray]:
    """``rows`` × 4 float32 features and int64 labels, the same for the same arguments.

    ``threshold`` other than 0.25 labels by a different rule: a model trained on it predicts
    a shifted distribution on the same traffic (how a bad version is made on purpose).
    """
    rng = np.random.default_rng(seed)
    x = rng.normal(loc=shift, scale=1.0, size=(rows, len(FEATURES))).astype(np.float32)
    y = (rule(x) > threshold).astype(np.int64)
    flip = rng.random(rows) < LABEL_NOISE
    y[flip] = 1 - y[flip]
    return x, y


def rule(x: np.ndarray) -> np.ndarray:
    return 1.5 * x[:, 0] - 2.0 * x[:, 1] + 0.8 * x[:, 2] * x[:, 3]


def digest(x: np.ndarray, y: np.ndarray) -> str:
    """SHA-256 of the exact bytes trained on (recorded in the manifest)."""
    h = hashlib.sha256()
    h.update(np.ascontiguousarray(x).tobytes())
    h.update(np.ascontiguousarray(y).tobytes())
    return h.hexdigest()
