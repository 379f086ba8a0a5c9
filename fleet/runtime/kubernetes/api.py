"""The Kubernetes API as the runtime uses it: the few calls it makes (``KubeApi``, a fake in
tests) and their REST implementation over httpx (``HttpKubeApi``). Objects are written with
server-side apply (field manager ``serving-fleet``), so a deploy is idempotent and never fights
the HPA over ``spec.replicas`` (which it leaves alone)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import quote

import httpx

from fleet.errors import ConfigError, FleetError

FIELD_MANAGER = "serving-fleet"
_PLURALS = {
    "Deployment": "deployments",
    "Service": "services",
    "ScaledObject": "scaledobjects",
    "PodDisruptionBudget": "poddisruptionbudgets",
    "Pod": "pods",
    "ConfigMap": "configmaps",
}


class KubeApiError(FleetError):
    status = 502


class KubeApi(Protocol):
    """The few Kubernetes API calls the runtime makes (a fake in tests, HTTP in a cluster)."""

    def apply(self, obj: dict) -> dict:
        """Server-side apply ``obj`` (create or update the fields this manager owns)."""

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict | None:
        """The object, or None when it does not exist."""

    def list(self, api_version: str, kind: str, namespace: str, selector: dict[str, str]) -> list[dict]:
        """Objects whose labels match every ``selector`` pair."""

    def delete(self, api_version: str, kind: str, namespace: str, name: str) -> None:
        """Delete; a missing object is not an error."""

    def patch(self, api_version: str, kind: str, namespace: str, name: str, patch: dict) -> dict | None:
        """JSON merge patch (RFC 7386); None when the object does not exist."""


def _path(api_version: str, kind: str, namespace: str, name: str | None = None) -> str:
    base = f"/api/{api_version}" if "/" not in api_version else f"/apis/{api_version}"
    return f"{base}/namespaces/{namespace}/{_PLURALS[kind]}" + (f"/{name}" if name else "")


class HttpKubeApi:
    """The Kubernetes REST API over httpx: in a pod with its service-account token, or at
    ``FLEET_KUBE_API`` (e.g. ``kubectl proxy``'s http://127.0.0.1:8001, which authenticates)."""

    TOKEN = Path("/var/run/secrets/kubernetes.io/serviceaccount/token")
    CA = Path("/var/run/secrets/kubernetes.io/serviceaccount/ca.crt")

    def __init__(
        self,
        base_url: str,
        *,
        token: Callable[[], str | None] = lambda: None,
        verify: Any = True,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.token = token
        self.client = httpx.Client(
            base_url=base_url, verify=verify, timeout=httpx.Timeout(10.0, connect=5.0), transport=transport
        )

    @classmethod
    def from_environment(cls) -> HttpKubeApi:
        if url := os.environ.get("FLEET_KUBE_API"):
            return cls(url, token=lambda: os.environ.get("FLEET_KUBE_TOKEN"))
        host, port = os.environ.get("KUBERNETES_SERVICE_HOST"), os.environ.get("KUBERNETES_SERVICE_PORT", "443")
        if not host:
            raise ConfigError(
                "FLEET_RUNTIME=kubernetes needs to run in a pod, or FLEET_KUBE_API set to the API "
                "server's URL (for example `kubectl proxy` at http://127.0.0.1:8001)"
            )
        # projected tokens rotate: read the file for every request
        return cls(f"https://{host}:{port}", token=lambda: cls.TOKEN.read_text().strip(), verify=str(cls.CA))

    def _send(self, method: str, path: str, **kwargs: Any) -> httpx.Response | None:
        headers = kwargs.pop("headers", {})
        if token := self.token():
            headers["Authorization"] = f"Bearer {token}"
        try:
            response = self.client.request(method, path, headers=headers, **kwargs)
        except httpx.HTTPError as exc:
            raise KubeApiError(f"Kubernetes API {method} {path}: {type(exc).__name__}: {exc}") from None
        if response.status_code == 404:
            return None
        if response.is_error:
            try:
                message = response.json().get("message") or response.text
            except ValueError:
                message = response.text
            raise KubeApiError(
                f"Kubernetes API {method} {path}: {response.status_code} {response.reason_phrase}: {message}"
            )
        return response

    def apply(self, obj: dict) -> dict:
        meta = obj["metadata"]
        path = _path(obj["apiVersion"], obj["kind"], meta["namespace"], meta["name"])
        response = self._send(
            "PATCH",
            path,
            params={"fieldManager": FIELD_MANAGER, "force": "true"},
            content=json.dumps(obj),
            headers={"Content-Type": "application/apply-patch+yaml"},
        )
        if response is None:  # 404 on apply: the kind itself is missing (KEDA not installed?)
            raise KubeApiError(f"Kubernetes API has no {obj['kind']} ({obj['apiVersion']}) in {meta['namespace']}")
        return response.json()

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict | None:
        response = self._send("GET", _path(api_version, kind, namespace, name))
        return None if response is None else response.json()

    def list(self, api_version: str, kind: str, namespace: str, selector: dict[str, str]) -> list[dict]:
        params = {"labelSelector": ",".join(f"{k}={v}" for k, v in sorted(selector.items()))}
        response = self._send("GET", _path(api_version, kind, namespace), params=params)
        return [] if response is None else response.json().get("items", [])

    def delete(self, api_version: str, kind: str, namespace: str, name: str) -> None:
        self._send("DELETE", _path(api_version, kind, namespace, quote(name)), json={"propagationPolicy": "Background"})

    def patch(self, api_version: str, kind: str, namespace: str, name: str, patch: dict) -> dict | None:
        response = self._send(
            "PATCH",
            _path(api_version, kind, namespace, quote(name)),
            content=json.dumps(patch),
            headers={"Content-Type": "application/merge-patch+json"},
        )
        return None if response is None else response.json()
