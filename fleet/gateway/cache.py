"""Prediction cache: LRU with a TTL and a byte budget, keyed by version and the exact input.

Inference is a pure function of (version, input), so an answer can be reused for the same
bytes. The key is a SHA-256 of the input's dtype, shape and bytes (so [1, 4] and [4, 1]
never collide, and a 10,000-row input costs 32 bytes of key, not 160 KB); what the cache
holds is counted in bytes, and inserting evicts the least recently used entries until the
total is under ``max_bytes`` again. An answer larger than the whole budget is not cached.
Opt-in per model in policies (``cache.enabled``, ``ttl_s``, ``max_mib``). Shadow calls
neither read nor fill it.
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from collections.abc import Callable

import numpy as np

ENTRY_OVERHEAD = 200  # bytes per entry beyond its answer: the key, the tuple, the dict slot


class PredictionCache:
    def __init__(self, max_bytes: int, ttl_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_bytes, self.ttl_s, self._clock = max_bytes, ttl_s, clock
        self._entries: OrderedDict[bytes, tuple[float, np.ndarray, int]] = OrderedDict()
        self.bytes = 0

    @staticmethod
    def key(version: str, features: np.ndarray, tenant: str | None = None) -> bytes:
        """The answer's key: the version and the exact input, and the tenant that asked
        (``None``: shared between tenants, when the model's policy says so — else a hit would
        tell a tenant that another sent the same input within ``ttl_s``)."""
        scope = "\1shared" if tenant is None else tenant  # \1 is no tenant's name
        h = hashlib.sha256(f"{scope}\0{version}\0{features.dtype.str}\0{features.shape}\0".encode())
        h.update(np.ascontiguousarray(features).data)
        return h.digest()

    def get(self, key: bytes) -> np.ndarray | None:
        entry = self._entries.get(key)
        if entry is None:
            return None
        expires, value, _ = entry
        if expires <= self._clock():
            self._drop(key)
            return None
        self._entries.move_to_end(key)
        return value

    def put(self, key: bytes, value: np.ndarray) -> None:
        size = value.nbytes + ENTRY_OVERHEAD
        if key in self._entries:
            self._drop(key)
        if size > self.max_bytes:
            return
        self._entries[key] = (self._clock() + self.ttl_s, value, size)
        self.bytes += size
        while self.bytes > self.max_bytes:
            _, (_, _, evicted) = self._entries.popitem(last=False)
            self.bytes -= evicted

    def _drop(self, key: bytes) -> None:
        self.bytes -= self._entries.pop(key)[2]

    def __len__(self) -> int:
        return len(self._entries)
