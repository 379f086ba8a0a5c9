"""Where a replica's start goes: one line per phase on stderr, read by ``bench/coldstart.py``.

``mark("imported")`` writes ``fleet-phase <pid> imported <unix time>`` to the replica's log
(BentoML's server and its workers share it). Copied into every Bento beside the family's
service, like ``integrity.py``; it imports nothing but the standard library, so marking the
start of the service's own imports measures them. Off the request path: a start marks a
handful of lines, never a request.
"""

from __future__ import annotations

import os
import sys
import time

PREFIX = "fleet-phase"


def mark(phase: str) -> None:
    if os.environ.get("FLEET_BENTO_BUILD"):  # weights.BUILDING: `bentoml build` imports the service; no start
        return
    print(f"{PREFIX} {os.getpid()} {phase} {time.time():.6f}", file=sys.stderr, flush=True)
