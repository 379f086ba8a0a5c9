"""``fleet top``: a live view of the fleet in the terminal, from the gateways' own stats.

Each refresh asks every live gateway (``fleet.catalog.gateway_directory.live``, re-listed
every ``GATEWAYS_S``) for ``GET /admin/top`` — one request per gateway, every model in it —
with the scoped ``stats`` credential canary analysis uses, only at trusted hosts, and merges
the answers (``fleet.cli.top_merge``). Rollouts and experiments are read from the store
every ``PROGRESS_S``: one listing of ``rollouts/`` and of ``experiments/``, and a record only
when its listing token changed. The view itself is ``fleet.cli.top_view`` (textual); with
``--once``, ``--json`` or stdout not a terminal, one plain table (or JSON) is printed.
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

import httpx
import orjson

from fleet import records
from fleet.catalog import gateway_directory
from fleet.catalog.experiments import ExperimentState
from fleet.catalog.rollouts import Phase, RolloutState
from fleet.cli._output import console
from fleet.cli.top_merge import FleetTop, Gateway, Progress, merge
from fleet.cli.top_text import COLUMNS, cells, headline, line, matches, progress_lines, sort_rows, tenant_lines
from fleet.errors import ConfigError, FleetError
from fleet.types import ObjectStore

GATEWAYS_S = 5.0  # the gateway directory is re-read this often (a listing and the fresh records)
PROGRESS_S = 5.0  # rollouts/ and experiments/ are listed this often
RECENT_S = 600.0  # a rollout or experiment that ended is shown this long after
TIMEOUT_S = 2.0  # a gateway slower than this is shown as not read, this refresh


class ProgressReader:
    """Rollouts and experiments in progress (or ended within ``RECENT_S``), re-read only when changed."""

    KINDS = (("rollouts/", RolloutState), ("experiments/", ExperimentState))

    def __init__(self, store: ObjectStore, every_s: float = PROGRESS_S) -> None:
        self.store, self.every_s = store, every_s
        self._tokens: dict[str, str] = {}
        self._states: dict[str, RolloutState | ExperimentState] = {}
        self._read_at = -float("inf")

    def read(self, now: float | None = None) -> list[Progress]:
        now = time.time() if now is None else now
        if time.monotonic() - self._read_at >= self.every_s:
            self._read_at = time.monotonic()
            for prefix, cls in self.KINDS:
                listed = {i.key: i.token for i in self.store.scan(prefix) if i.key.endswith(".json")}
                for key in [k for k in self._states if k.startswith(prefix) and k not in listed]:
                    self._states.pop(key, None)
                    self._tokens.pop(key, None)
                for key, token in listed.items():
                    if self._tokens.get(key) != token:
                        self._tokens[key] = token
                        try:
                            state, _ = records.load_or_none(self.store, key, cls)
                        except FleetError:  # a record nobody can read: fleet doctor names it
                            state = None
                        if state is None:
                            self._states.pop(key, None)
                        else:
                            self._states[key] = state
        shown = [p for s in self._states.values() if (p := describe(s, now)) is not None]
        return sorted(shown, key=lambda p: (p.done, p.model, p.kind))


def describe(state: RolloutState | ExperimentState, now: float) -> Progress | None:
    """One line (and its evidence) for a stored rollout or experiment; None once it ended long ago."""
    if isinstance(state, RolloutState):
        last = state.reports[-1] if state.reports else None
        if state.done and now - state.updated_at.timestamp() > RECENT_S:
            return None
        where = state.shown
        if state.step >= 0 and not state.done:  # "step 2", or "approval, step 3"
            where = f"step {state.step + 1}" if state.phase is Phase.STEP else f"{where}, step {state.step + 1}"
        seen = f", {last.canary_requests}/{last.stable_requests} req" if last and last.ticks else ""
        evidence = last.summary if last else state.reason
        if state.evidence:
            looks = state.evidence.get("looks")
            evidence = f"{evidence} (sequential evidence, {looks} looks)" if looks else evidence
        return Progress(
            kind="rollout",
            model=state.model,
            headline=f"{state.strategy} {state.champion}→{state.version}: {where}, weight {state.weight:g}%{seen}",
            evidence=evidence or state.reason,
            gates=list(last.gates) if last else [],
            done=state.done,
        )
    running = state.status.value == "running"
    if not running and now - (state.ticked_at or state.started_at.timestamp()) > RECENT_S:
        return None
    a, b = state.arms
    head = f"experiment {a} vs {b} ({state.split[0]:g}/{state.split[1]:g}) on {state.metric}: {state.status.value}"
    if state.winner:
        head += f", winner {state.winner}"
    evidence = state.summary
    if state.ticks:
        t = state.ticks[-1]
        interval = "" if t.lo is None or t.hi is None else f" in [{t.lo:+.4g}, {t.hi:+.4g}]"
        diff = "" if t.diff is None else f", B−A {t.diff:+.4g}{interval}"
        evidence = f"n {t.n[0]}/{t.n[1]}, mean {t.mean[0]:.4g}/{t.mean[1]:.4g}{diff}" + (
            f"; {state.summary}" if state.summary else ""
        )
    return Progress(kind="experiment", model=state.model, headline=head, evidence=evidence, done=not running)


class FleetReader:
    """One refresh: every live gateway's ``/admin/top`` answer, merged, with the rollouts'
    and experiments' progress."""

    def __init__(self, store: ObjectStore, token: str, window_s: int = 10, tenants: int = 10) -> None:
        self.store, self.token, self.window_s, self.tenants = store, token, window_s, tenants
        self.match = ""  # only models whose name holds it: the gateways leave the others out
        self.progress = ProgressReader(store)
        self._gateways: list[gateway_directory.GatewayRecord] = []
        self._listed_at = -float("inf")
        self._networks = gateway_directory.trusted_networks()

    def gateways(self) -> list[gateway_directory.GatewayRecord]:
        if time.monotonic() - self._listed_at >= GATEWAYS_S:
            self._gateways = gateway_directory.live(self.store)
            self._listed_at = time.monotonic()
        return self._gateways

    async def read(self, client: httpx.AsyncClient) -> FleetTop:
        gateways, progress = await asyncio.to_thread(lambda: (self.gateways(), self.progress.read()))
        answers = await asyncio.gather(*(self._ask(client, g) for g in gateways))
        return merge(answers, at=time.time(), window_s=self.window_s, tenants=self.tenants, progress=progress)

    async def _ask(
        self, client: httpx.AsyncClient, record: gateway_directory.GatewayRecord
    ) -> tuple[Gateway, dict[str, Any] | None]:
        gw = Gateway(record.id, record.url)
        if not gateway_directory.trusted(record, self._networks):
            gw.ok, gw.error = False, "not on loopback or in FLEET_GATEWAY_NETWORKS: not asked"
            return gw, None
        url = f"{record.url.rstrip('/')}/admin/top"
        # twice the tenants shown: a tenant just outside one gateway's list still counts in the sum
        params: dict[str, Any] = {"window_s": self.window_s, "tenants": min(50, 2 * self.tenants)}
        if self.match:
            params["match"] = self.match
        try:
            r = await client.get(
                url,
                params=params,
                headers={"Authorization": gateway_directory.credential(self.token, "stats", record.id)},
            )
        except httpx.HTTPError as exc:
            gw.ok, gw.error = False, f"unreachable: {type(exc).__name__} {exc}".strip()
            return gw, None
        if r.status_code != 200:
            gw.ok = False
            gw.error = {
                401: "refused the admin token: check FLEET_ADMIN_TOKEN",
                403: "has no admin API: start it with FLEET_ADMIN_TOKEN set",
                404: "has no /admin/top: a gateway from before fleet top (restart it on this version)",
            }.get(r.status_code, f"answered {r.status_code}: {r.text[:200]}")
            return gw, None
        try:
            return gw, orjson.loads(r.content)
        except orjson.JSONDecodeError:
            gw.ok, gw.error = False, "answered something that is not JSON"
            return gw, None


def open_reader(window_s: int, tenants: int) -> FleetReader:
    """The reader, or an error that says what to do: no admin token, no live gateway."""
    from fleet.store import open_store

    token = os.environ.get("FLEET_ADMIN_TOKEN")
    if not token:
        raise ConfigError(
            "fleet top reads the gateways' stats with a credential made from the admin token: set "
            "FLEET_ADMIN_TOKEN (next to `fleet up` it is read from .fleet/admin-token)"
        )
    store = open_store()
    reader = FleetReader(store, token, window_s, tenants)
    if not reader.gateways():
        raise ConfigError(
            f"no live gateway is registered in {store.url} (gateways/*.json with a heartbeat in the last "
            f"{gateway_directory.STALE_AFTER_S:.0f} s): start one with `fleet up` or `fleet gateway`, "
            "or point --store / FLEET_STORE at the fleet's store"
        )
    return reader


async def read_once(reader: FleetReader) -> FleetTop:
    async with httpx.AsyncClient(timeout=TIMEOUT_S) as client:
        top = await reader.read(client)
    down = [g for g in top.gateways if not g.ok]
    if down and len(down) == len(top.gateways):
        raise ConfigError("no gateway could be read: " + "; ".join(f"{g.id} at {g.url} {g.error}" for g in down))
    return top


def print_plain(top: FleetTop, sort: str, text: str) -> None:
    """One plain table and the panels' lines: what ``--once`` and a pipe get."""
    console.print(headline(top, sort, text), highlight=False, soft_wrap=True)
    console.print(line([name for name, _ in COLUMNS]), highlight=False, markup=False, style="bold")
    for r in sort_rows(top.rows, sort):
        if matches(r, text):
            console.print(line(cells(r)), highlight=False, markup=False)
    for text_line in progress_lines(top, text) + tenant_lines(top):
        console.print(text_line, highlight=False, markup=False)
    for g in top.gateways:
        if not g.ok:
            console.print(f"gateway {g.id} at {g.url} {g.error}", highlight=False, markup=False)
