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


def _table() -> dict[int, tuple[int, int, str]]:
    """pid → (ppid, pgid, state) of every process, read from /proc ({} without /proc)."""
    found = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        found[int(stat.parent.name)] = (int(fields[1]), int(fields[2]), fields[0])
    return found


def parent_pid(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def tree(pid: int) -> list[int]:
    """``pid``, its process group and every descendant — also those in sessions of their own
    (BentoML starts each worker in a new session, so signalling the group misses them)."""
    table = _table()
    members = {p for p, (_, pgid, _) in table.items() if pgid == pid} | {pid}
    grew = True
    while grew:
        more = {p for p, (ppid, _, _) in table.items() if ppid in members} - members
        members |= more
        grew = bool(more)
    return sorted(p for p in members if p in table or p == pid)


def stop_group(pgid: int, timeout_s: float = STOP_TIMEOUT_S, also: tuple[int, ...] = ()) -> None:
    """SIGTERM the process group, its descendants and ``also``; SIGKILL what is left after ``timeout_s``."""
    targets = set(tree(pgid)) | {p for p in also if alive(p, b"")}
    _signal_all(pgid, targets, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        _reap(pgid)
        if not any(_running(p) for p in targets):
            return
        time.sleep(0.1)
    _signal_all(pgid, targets, signal.SIGKILL)
    _reap(pgid)


def _signal_all(pgid: int, pids: set[int], sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    if state == "Z":
        _reap(pid)
        return False
    return True


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
