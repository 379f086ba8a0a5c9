"""Request ids that carry their time: UUIDv7 (RFC 9562), so a label finds its request's hour.

``new()`` is what the gateway gives a request that came without an ``X-Request-Id``: 48 bits
of Unix milliseconds, then 74 random bits, in the canonical 36-character form; ids sort by
time. ``time_of(id)`` reads the time back, or None for an id that is not a UUIDv7 (one a
caller chose): such an id is looked up only in the recent window (``fleet.logs.logged``).
"""

from __future__ import annotations

import os
import re
import time

_UUID7 = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-7[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}")


def new(now_ms: int | None = None) -> str:
    ms = int(time.time() * 1000) if now_ms is None else now_ms
    rand = int.from_bytes(os.urandom(10), "big")  # 80 bits; 74 are used
    value = (ms & 0xFFFF_FFFF_FFFF) << 80 | 0x7 << 76 | (rand >> 68 & 0xFFF) << 64 | 0b10 << 62 | rand & (2**62 - 1)
    h = f"{value:032x}"
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def time_of(request_id: str) -> float | None:
    """The Unix time (seconds) a UUIDv7 id was made, or None if ``request_id`` is not one."""
    if len(request_id) != 36 or not _UUID7.fullmatch(request_id):
        return None
    return int(request_id[:8] + request_id[9:13], 16) / 1000
