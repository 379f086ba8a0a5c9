"""Request ids that carry their time: UUIDv7 (RFC 9562), so a label finds its request's hour.

``new()`` is what the gateway gives a request that came without an ``X-Request-Id``: 48 bits
of Unix milliseconds, the version, 8 bits that mark the id as the gateway's (``MARK``), then
66 random bits, in the canonical 36-character form; ids sort by time. ``time_of(id)`` reads
the time back, or None for an id the gateway did not make (one a caller chose, UUIDv7 or
not: its time is the caller's clock, and an id reused later would point at the wrong
hour): such an id is looked up only in the recent window (``fleet.logs.logged``).
"""

from __future__ import annotations

import os
import re
import time

MARK = 0xF1  # the top 8 of rand_a's 12 bits in every id the gateway makes
_UUID7 = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-7f1[0-9a-f]-[89ab][0-9a-f]{3}-[0-9a-f]{12}")


def new(now_ms: int | None = None) -> str:
    ms = int(time.time() * 1000) if now_ms is None else now_ms
    rand = int.from_bytes(os.urandom(9), "big")  # 72 bits; 66 are used
    value = (ms & 0xFFFF_FFFF_FFFF) << 80 | 0x7 << 76 | MARK << 68 | (rand >> 62 & 0xF) << 64 | 0b10 << 62
    value |= rand & (2**62 - 1)
    h = f"{value:032x}"
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def time_of(request_id: str) -> float | None:
    """The Unix time (seconds) a gateway's id was made, or None if ``request_id`` is not one."""
    if len(request_id) != 36 or not _UUID7.fullmatch(request_id):
        return None
    return int(request_id[:8] + request_id[9:13], 16) / 1000
