"""Progress of long work on stderr: a bar with an ETA on a terminal, a plain line now and then
otherwise (a log, a test, a CI job), so a user knows the work goes on and about how long it has
left. Library code takes a ``progress(done, total)`` callback and prints nothing itself."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from fleet.cli._output import err_console

PLAIN_EVERY_S = 5.0  # without a terminal: a line at the start, at most one every this many seconds, and the end


class Steps:
    """``advance(done, total)`` for a trainer's callback; ``log(line)`` for its own lines, printed
    above the bar."""

    def __init__(self, what: str, unit: str, progress: Progress | None) -> None:
        self.what, self.unit, self._progress = what, unit, progress
        self._task = progress.add_task(what, total=None, unit=unit) if progress is not None else None
        self._started: float | None = None
        self._said = -PLAIN_EVERY_S

    def advance(self, done: int, total: int) -> None:
        now = time.monotonic()
        if self._started is None:
            self._started = now
        if self._progress is not None and self._task is not None:
            self._progress.update(self._task, completed=done, total=total)
            return
        if done < total and now - self._said < PLAIN_EVERY_S:
            return
        self._said = now
        left = _eta(now - self._started, done, total)
        err_console.print(
            f"{self.what}: {done}/{total} {self.unit}" + (f", about {left} left" if left else ""),
            highlight=False,
            soft_wrap=True,
        )

    def log(self, line: str) -> None:
        (self._progress.console if self._progress is not None else err_console).print(
            f"[dim]{line}[/]", highlight=False, soft_wrap=True
        )


def _eta(elapsed: float, done: int, total: int) -> str:
    if done <= 0 or done >= total or elapsed < 1:
        return ""
    seconds = elapsed / done * (total - done)
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.0f} min"


@contextmanager
def counting(what: str, unit: str) -> Iterator[Steps]:
    """Counted work (training steps, epochs): ``what`` names it, ``unit`` its steps."""
    if not err_console.is_terminal:
        yield Steps(what, unit, None)
        return
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[unit]}"),
        TimeRemainingColumn(),
        console=err_console,
        transient=True,
    ) as progress:
        yield Steps(what, unit, progress)
