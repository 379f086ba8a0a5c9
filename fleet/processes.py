"""Child process groups: is one alive, stop it (SIGTERM, then SIGKILL), read its log's tail.

Services are started with ``start_new_session=True``: BentoML and Prefect fork workers, and
signalling the whole group is the only way to stop those too.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

STOP_TIMEOUT_S = 10.0


def alive(pid: int, marker: bytes) -> bool:
    """Is ``pid`` a live (not zombie) process whose command line contains ``marker``?

    The marker guards against a pid reused by an unrelated process after a crash.
    """
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return True  # no /proc (macOS): trust kill(0)
    return stat.rsplit(")", 1)[1].split()[0] != "Z" and marker in cmdline


def stop_group(pgid: int, timeout_s: float = STOP_TIMEOUT_S) -> None:
    """SIGTERM the process group, then SIGKILL what is left after ``timeout_s``."""
    try:
        os.killpg(pgid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        _reap(pgid)
        if not group_alive(pgid):
            return
        time.sleep(0.1)
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    _reap(pgid)


def group_alive(pgid: int) -> bool:
    """Whether any process of the group still runs (zombies waiting to be reaped do not)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return not Path("/proc/self").exists()  # no /proc: trust killpg(0)


def _reap(pid: int) -> None:
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


def tail(path: str | Path, lines: int = 25) -> str:
    try:
        text = Path(path).read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    return "\n".join(text[-lines:]) or "(empty log)"
