"""What a ``fleet`` command prints must be the fleet's own: ``assert_quiet`` fails on any line a
library wrote (a warning, a library's log line, a traceback). Every helper that runs the CLI in
the tests calls it on what the command printed, stdout and stderr.

Without ``-v`` the CLI keeps these lines off the terminal (``fleet.cli.quiet``); a line caught
here means a new source of noise, to be kept there, or fixed where it comes from.
"""

from __future__ import annotations

import re

NOISE = (
    # warnings.showwarning's format: "<file>:<line>: <Category>: message"
    re.compile(r"\S+\.py:\d+: \w*Warning:"),
    re.compile(r"\b(Future|Deprecation|PendingDeprecation|User|Runtime|Resource|Syntax|Import|Unicode)Warning\b"),
    re.compile(r"\bFailed to load\b"),  # torchao's C extensions
    re.compile(r"^[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ \S+:\d+\]"),  # torch's (glog-like) log format
    re.compile(r"^Traceback \(most recent call last\):"),
    re.compile(r"^(DEBUG|INFO|WARNING|ERROR|CRITICAL):[\w.]+:"),  # logging.basicConfig's format
    re.compile(r"^\[(transformers|torch|bentoml|prefect)\]"),  # transformers' handler names its library
)


def noise(output: str) -> list[str]:
    """The lines of ``output`` a library printed."""
    return [line for line in output.splitlines() if any(p.search(line) for p in NOISE)]


def assert_quiet(output: str, what: str = "the command") -> None:
    """``output`` (a command's stdout and stderr) holds no line a library printed."""
    found = noise(output)
    assert not found, (
        f"{what} printed lines that are not the fleet's own:\n" + "\n".join(found[:20]) + f"\n---\n{output[-4000:]}"
    )
