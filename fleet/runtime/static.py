"""StaticRuntime: model services that run somewhere else, listed in a file.

For servers this fleet does not start (a Triton or BentoML deployment managed by another
team, a test double): ``FLEET_STATIC_ENDPOINTS`` names a JSON or YAML file mapping
``"<model>:<version>"`` to a list of base URLs. The file is read again on every ``list``,
so editing it is how endpoints change. ``deploy`` only checks that the version is listed;
it starts nothing, so it cannot start a lazy version either (``activate`` says so) and has
nothing of its own to unload.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import httpx
import yaml

from fleet.errors import ConfigError
from fleet.runtime.base import DeployFailed, Loaded
from fleet.types import Deployment


class StaticRuntime:
    kind = "static"
    budgets_memory = False
    packages_here = False

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    def _read(self) -> dict[tuple[str, str], tuple[str, ...]]:
        try:
            data = yaml.safe_load(self.path.read_text()) or {}
        except OSError as exc:
            raise ConfigError(f"FLEET_STATIC_ENDPOINTS {self.path}: {exc.strerror}") from None
        except yaml.YAMLError as exc:
            raise ConfigError(f"FLEET_STATIC_ENDPOINTS {self.path}: not valid YAML/JSON ({exc})") from None
        if not isinstance(data, dict):
            raise ConfigError(f"FLEET_STATIC_ENDPOINTS {self.path}: expected a mapping of 'model:version' to URLs")
        out = {}
        for ref, urls in data.items():
            model, sep, version = str(ref).partition(":")
            if not sep or not isinstance(urls, list) or not all(isinstance(u, str) for u in urls):
                raise ConfigError(
                    f"FLEET_STATIC_ENDPOINTS {self.path}: entry {ref!r}; expected 'model:version': [url, ...]"
                )
            out[model, version] = tuple(u.rstrip("/") for u in urls)
        return out

    def deploy(self, model: str, version: str, replicas: int = 1) -> Deployment:
        urls = self._read().get((model, version))
        if not urls:
            raise DeployFailed(
                f"{model}:{version} is not listed in {self.path}; this runtime starts nothing "
                "(FLEET_RUNTIME=static): expected it started by whoever runs the services and listed there",
                summary="this runtime cannot start one (FLEET_RUNTIME=static)",
            )
        return Deployment(model, version, urls)

    def undeploy(self, model: str, version: str) -> None:
        """Nothing to stop: these services are not ours."""

    def release(self, model: str, version: str) -> None:
        """Nothing to hand back: these services are scaled by whoever runs them."""

    def list(self) -> list[Deployment]:
        return [Deployment(m, v, urls) for (m, v), urls in sorted(self._read().items()) if urls]

    def health(self, model: str, version: str) -> dict[str, bool]:
        result = {}
        with httpx.Client(timeout=2.0) as client:
            for url in self._read().get((model, version), ()):
                try:
                    result[url] = client.get(f"{url}/readyz").status_code == 200
                except httpx.HTTPError:
                    result[url] = False
        return result

    def activate(
        self, model: str, version: str, before_start: Callable[[], None] | None = None
    ) -> tuple[Deployment, bool]:
        """What runs of the version, as listed; one that runs nothing cannot be started here."""
        urls = self._read().get((model, version))
        if urls:
            return Deployment(model, version, urls), False
        raise DeployFailed(
            f"{model}:{version} runs no replica and this runtime starts nothing (FLEET_RUNTIME=static, "
            f"{self.path}); expected it started by whoever runs the services",
            summary="this gateway's runtime cannot start one (FLEET_RUNTIME=static)",
        )

    def unload(self, versions: list[tuple[str, str]], on_drain: Callable[[], object] = lambda: None) -> None:
        """Nothing to stop: these services are not ours (``loaded`` lists none of them)."""

    def loaded(self) -> list[Loaded]:
        """None: nothing listed here is this runtime's to stop."""
        return []

    def footprint_mib(self, model: str, version: str) -> float | None:
        return None
