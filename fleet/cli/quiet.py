"""What libraries print stays off a command's terminal; ``fleet -v`` shows it as it comes.

torch, torchao, transformers, BentoML and the others write warnings nobody using ``fleet``
can act on (torchao's "Failed to load …_C_mxfp8….so", torch's pytree deprecations). They
arrive three ways, each caught here for a command (never for ``fleet up`` or ``fleet
gateway``, whose logs are theirs to keep):

* Python's ``warnings``: routed through logging (``logging.captureWarnings``);
* records of loggers that propagate to the root (torchao's): a handler on the root keeps
  them, and prints the fleet's own warnings as Python would without one (the message alone);
* loggers with a console handler of their own, which never reach the root (torch's,
  transformers'): that handler is pointed at the buffer once the library is imported.

What was kept is in memory (``captured()``): an internal error says how many lines there
are, and ``-v`` shows them as they come instead. Child processes (a replica, a server) are
untouched: no environment variable is set.
"""

from __future__ import annotations

import collections
import importlib.abc
import importlib.util
import logging
import os
import sys
from typing import Any

OURS = ("fleet", "flows", "bentos")
# Libraries that install a console handler of their own when imported: taken over after that.
_OWN_HANDLERS = ("torch", "transformers", "bentoml", "huggingface_hub", "torchao")
_lines: collections.deque[str] = collections.deque(maxlen=2000)
_installed = False


def _ours(name: str) -> bool:
    return any(name == p or name.startswith(p + ".") for p in OURS)


def captured() -> list[str]:
    """Every line kept off the terminal so far, oldest first (the last 2,000)."""
    return list(_lines)


class _Buffer:
    """A stream for the libraries' own console handlers: each line into the buffer."""

    def write(self, text: str) -> int:
        _lines.extend(line for line in text.splitlines() if line.strip())
        return len(text)

    def flush(self) -> None:
        pass


BUFFER = _Buffer()


class QuietRoot(logging.Handler):
    """On the root logger: a record of the fleet's own at WARNING or above goes to stderr as
    Python prints it without a handler (the message alone); any other record is kept. Its name
    has no leading underscore on purpose: Prefect's ``setup_logging`` replaces a root whose
    handlers all have one (it takes them for Python's defaults), which would undo this."""

    def __init__(self) -> None:
        super().__init__(logging.NOTSET)
        self.plain = logging.Formatter()
        self.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        try:
            if not _ours(record.name):
                _lines.extend(self.format(record).splitlines())
            elif record.levelno >= logging.WARNING:
                sys.stderr.write(self.plain.format(record) + "\n")
                sys.stderr.flush()
        except Exception:  # noqa: BLE001 - logging's own contract: never raise from a handler
            self.handleError(record)


def _take_console_handlers() -> None:
    """Point every library logger's console handler (stderr or stdout) at the buffer."""
    consoles = {id(s) for s in (sys.stderr, sys.__stderr__, sys.stdout, sys.__stdout__) if s is not None}
    for name, logger in list(logging.root.manager.loggerDict.items()):
        if not isinstance(logger, logging.Logger) or _ours(name):
            continue
        if name.split(".")[0] == "torch" and os.environ.get("TORCH_LOGS"):
            continue  # asked for by name: torch's documented switch
        for handler in logger.handlers:
            if type(handler) is logging.StreamHandler and id(handler.stream) in consoles:
                handler.setStream(BUFFER)  # type: ignore[arg-type]


class _AfterImport(importlib.abc.MetaPathFinder):
    """Takes over the console handlers a library installs once its top-level import has run.

    A spec found without an import (``importlib.util.find_spec("torch")``, as transformers asks
    whether torch is there) is no import: the library stays waited for until one runs."""

    def __init__(self, names: tuple[str, ...]) -> None:
        self.waiting = set(names)
        self.finding: set[str] = set()

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:  # noqa: ANN401
        if fullname not in self.waiting or fullname in self.finding:
            return None
        self.finding.add(fullname)  # the other finders find it; this one stands aside meanwhile
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            self.finding.discard(fullname)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run = spec.loader.exec_module

        def exec_module(module: Any) -> None:  # noqa: ANN401
            try:
                run(module)
            finally:
                self.waiting.discard(fullname)
                if not self.waiting and self in sys.meta_path:
                    sys.meta_path.remove(self)
                _take_console_handlers()

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def install() -> None:
    """Keep what libraries print off the terminal for the rest of this process (a command's)."""
    global _installed
    if _installed:
        return
    _installed = True
    logging.captureWarnings(True)
    logging.root.addHandler(QuietRoot())
    _take_console_handlers()  # libraries imported already
    waiting = tuple(n for n in _OWN_HANDLERS if n not in sys.modules)
    if waiting:
        sys.meta_path.insert(0, _AfterImport(waiting))
