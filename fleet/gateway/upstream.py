"""Calls to model services: one pooled async HTTP client per replica, round-robin.

A replica that refuses the connection is skipped for the next one; 503 only when none
answers. A timeout is the caller's deadline passing: 504, not retried.
"""

from __future__ import annotations

import itertools
from typing import Any

import httpx
import numpy as np

from fleet.errors import FleetError


class NoReplica(FleetError):
    status = 503


class UpstreamTimeout(FleetError):
    status = 504


class Upstreams:
    def __init__(self, max_connections: int = 64) -> None:
        self._clients: dict[str, httpx.AsyncClient] = {}
        self._turn: dict[tuple[str, ...], itertools.count] = {}
        self._limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)

    def _client(self, url: str) -> httpx.AsyncClient:
        client = self._clients.get(url)
        if client is None:
            client = self._clients[url] = httpx.AsyncClient(base_url=url, limits=self._limits)
        return client

    async def predict(self, ref: str, endpoints: tuple[str, ...], features: np.ndarray, timeout_s: float) -> np.ndarray:
        if not endpoints:
            raise NoReplica(f"{ref} has no running replica; expected it to be deployed")
        start = next(self._turn.setdefault(endpoints, itertools.count()))
        payload: dict[str, Any] = {"features": features.tolist()}
        failures = []
        for i in range(len(endpoints)):
            url = endpoints[(start + i) % len(endpoints)]
            try:
                resp = await self._client(url).post("/predict", json=payload, timeout=timeout_s)
            except httpx.TimeoutException:
                raise UpstreamTimeout(f"{ref} did not answer within {timeout_s * 1000:.0f} ms") from None
            except httpx.TransportError as exc:
                failures.append(f"{url}: {type(exc).__name__}")
                continue
            if resp.status_code >= 500:
                failures.append(f"{url}: HTTP {resp.status_code}")
                continue
            if resp.status_code != 200:
                raise NoReplica(f"{ref} refused the request: HTTP {resp.status_code} {resp.text[:200]}")
            return np.asarray(resp.json(), dtype=np.float32)
        raise NoReplica(f"no replica of {ref} could answer ({'; '.join(failures)})")

    async def close(self) -> None:
        for client in self._clients.values():
            await client.aclose()
        self._clients.clear()
