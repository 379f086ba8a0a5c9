"""Runtimes: where model services run, chosen by ``FLEET_RUNTIME``.

``local`` (default): ``bentoml serve`` processes on this machine. Any other kind is
refused, never silently replaced by the local one.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from fleet.errors import ConfigError
from fleet.types import Runtime

KINDS = ("local",)


def open_runtime(kind: str | None = None, *, bento_for: Callable[[str, str], str] | None = None) -> Runtime:
    kind = kind or os.environ.get("FLEET_RUNTIME") or "local"
    if kind == "local":
        from fleet.runtime.local import LocalRuntime

        return LocalRuntime(os.environ.get("FLEET_RUN_DIR", ".fleet/run"), bento_for=bento_for)
    raise ConfigError(f"FLEET_RUNTIME {kind!r} is not supported; expected one of {', '.join(KINDS)}")
