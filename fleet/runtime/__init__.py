"""Runtimes: where model services run, chosen by ``FLEET_RUNTIME``.

``local`` (default): ``bentoml serve`` processes on this machine. ``static``: services run
elsewhere, listed in the file ``FLEET_STATIC_ENDPOINTS``. Any other kind is refused, never
silently replaced by the local one.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from fleet.errors import ConfigError
from fleet.runtime.base import Runtime

KINDS = ("local", "static", "kubernetes")


def open_runtime(kind: str | None = None, *, bento_for: Callable[[str, str], str] | None = None) -> Runtime:
    kind = kind or os.environ.get("FLEET_RUNTIME") or "local"
    if kind == "local":
        from fleet.runtime.local import LocalRuntime

        return LocalRuntime(os.environ.get("FLEET_RUN_DIR", ".fleet/run"), bento_for=bento_for)
    if kind == "static":
        from fleet.runtime.static import StaticRuntime

        path = os.environ.get("FLEET_STATIC_ENDPOINTS")
        if not path:
            raise ConfigError("FLEET_RUNTIME=static needs FLEET_STATIC_ENDPOINTS, the file listing the endpoints")
        return StaticRuntime(path)
    if kind == "kubernetes":  # Deployments on EKS; images are built by the pipeline, not here
        from fleet.runtime.kubernetes.runtime import KubernetesRuntime

        return KubernetesRuntime.from_environment()
    raise ConfigError(f"FLEET_RUNTIME {kind!r} is not supported; expected one of {', '.join(KINDS)}")
