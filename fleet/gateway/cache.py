"""Prediction cache: LRU with a TTL, keyed by model, version and the exact input tensor.

Inference is a pure function of (version, input), so an answer can be reused for the same
bytes; the key holds dtype and shape too, so [1, 4] and [4, 1] never collide. Opt-in per
model in policies (``cache.enabled``). Shadow calls neither read nor fill it.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

import numpy as np


class PredictionCache:
    def __init__(self, max_entries: int, ttl_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_entries, self.ttl_s, self._clock = max_entries, ttl_s, clock
        self._entries: OrderedDict[tuple, tuple[float, np.ndarray]] = OrderedDict()

    @staticmethod
    def key(model: str, version: str, features: np.ndarray) -> tuple:
        return (model, version, features.dtype.str, features.shape, features.tobytes())

    def get(self, key: tuple) -> np.ndarray | None:
        entry = self._entries.get(key)
        if entry is None:
            return None
        expires, value = entry
        if expires <= self._clock():
            del self._entries[key]
            return None
        self._entries.move_to_end(key)
        return value

    def put(self, key: tuple, value: np.ndarray) -> None:
        self._entries[key] = (self._clock() + self.ttl_s, value)
        self._entries.move_to_end(key)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def __len__(self) -> int:
        return len(self._entries)
