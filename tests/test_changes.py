"""The change journal and the gateway's copy of routes and tenants kept through it
(``fleet.changes``, ``fleet.gateway.sync``): a steady poll is one store request whatever the
number of records; a writer storm from several processes, on the file store and on moto's
S3, loses and reorders nothing; the change bus (real redis-server) nudges gateways, and while
it is killed and restarted mid-storm they poll and converge."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from fleet import changes, records
from fleet.catalog.routes.store import Router
from fleet.catalog.tenants import Quota, Tenant, Tenants
from fleet.gateway.sync import RecordSync
from fleet.gateway.view import FleetView
from fleet.store import MemoryStore, open_store
from fleet.types import ObjectStore
from tests.fakes import FakeRuntime
from tests.redis_env import RedisServer
from tests.test_registry import register_demo

WORKER = Path(__file__).with_name("storm_worker.py")


class Counting:
    """A store that counts the requests made through it, as S3 bills them."""

    def __init__(self, store: ObjectStore) -> None:
        self.store, self.url = store, store.url
        self.gets = self.lists = 0

    def get(self, key: str):  # noqa: ANN201
        self.gets += 1
        return self.store.get(key)

    def get_if_changed(self, key: str, etag: str | None):  # noqa: ANN201
        self.gets += 1
        return self.store.get_if_changed(key, etag)

    def scan(self, prefix: str = ""):  # noqa: ANN201
        self.lists += 1
        return self.store.scan(prefix)

    def __getattr__(self, name: str):  # noqa: ANN204
        return getattr(self.store, name)


def _tenant_sync(store: ObjectStore) -> RecordSync:
    return RecordSync(store, {"tenants/": Tenant})


def test_a_steady_poll_is_one_request_and_a_change_is_read_once() -> None:
    store = MemoryStore()
    tenants = Tenants(store)
    for i in range(2000):
        tenants.create(f"t{i}", {"demo": ["*"]})
    counting = Counting(store)
    sync = _tenant_sync(counting)
    assert sync.poll() == {"tenants/"} and len(sync.of("tenants/")) == 2000
    assert counting.lists == 1  # the first poll: one listing, then every record once
    for _ in range(5):
        counting.gets = counting.lists = 0
        assert sync.poll() == set()
        assert (counting.gets, counting.lists) == (1, 0)  # the journal alone
    tenants.set_limits("t7", quota=Quota(rps=5, burst=5))
    tenants.revoke("t9")
    counting.gets = 0
    assert sync.poll() == {"tenants/"}
    assert counting.gets == 3  # the journal, then each changed tenant once
    assert sync.of("tenants/")["tenants/t7.json"].quota.rps == 5
    assert all(k.revoked_at is not None for k in sync.of("tenants/")["tenants/t9.json"].keys)


def test_a_reader_too_far_behind_or_on_another_epoch_reads_everything_again(monkeypatch) -> None:
    monkeypatch.setattr(changes, "KEEP", 5)
    store = MemoryStore()
    tenants = Tenants(store)
    tenants.create("a", {"demo": ["*"]})
    sync = _tenant_sync(store)
    sync.poll()
    for i in range(8):  # more entries than the journal keeps
        tenants.set_limits("a", quota=Quota(rps=i + 1, burst=1))
    journal, _ = changes.read(store)
    assert journal.seq == 9 and len(journal.changes) == 5 and journal.since(1) is None
    counting = Counting(store)
    sync.store = counting
    sync.poll()
    assert counting.lists == 1 and sync.of("tenants/")["tenants/a.json"].quota.rps == 8
    store.delete(changes.KEY)  # the journal is lost: the next writer starts a new epoch
    tenants.create("b", {"demo": ["*"]})
    counting.lists = 0
    sync.poll()
    assert counting.lists == 1 and "tenants/b.json" in sync.of("tenants/")


def test_a_write_that_names_no_entry_is_found_by_the_comparison() -> None:
    store = MemoryStore()
    tenants = Tenants(store)
    tenants.create("a", {"demo": ["*"]})
    sync = RecordSync(store, {"tenants/": Tenant}, resync_s=3600)
    sync.poll()
    raw = json.loads(store.get("tenants/a.json").data)
    raw["weight"] = 3.0
    store.put("tenants/a.json", json.dumps(raw).encode())  # a writer that died before its entry
    assert sync.poll() == set()  # the journal does not name it
    sync.resync_s = 0
    assert sync.poll() == {"tenants/"} and sync.of("tenants/")["tenants/a.json"].weight == 3.0


def test_a_corrupt_journal_is_replaced_and_its_readers_start_over() -> None:
    store = MemoryStore()
    tenants = Tenants(store)
    tenants.create("a", {"demo": ["*"]})
    sync = _tenant_sync(store)
    sync.poll()
    store.put(changes.KEY, b"{not json")
    tenants.create("b", {"demo": ["*"]})  # the writer replaces it with a new epoch
    journal, _ = changes.read(store)
    assert journal.seq == 1 and journal.changes[0].key == "tenants/b.json"
    sync.poll()
    assert set(sync.of("tenants/")) == {"tenants/a.json", "tenants/b.json"}


def _storm(store_url: str, writers: int, times: int) -> list[tuple[str, str]]:
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), store_url, f"p{n}", str(times)], stdout=subprocess.PIPE, text=True
        )
        for n in range(writers)
    ]
    try:
        outs = [p.communicate(timeout=600)[0] for p in procs]
    finally:  # a writer that failed or hung leaves none of the others running
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert [p.returncode for p in procs] == [0] * writers
    return [tuple(w) for out in outs for w in json.loads(out)]


def _setup(store: ObjectStore, tmp_path: Path) -> None:
    reg = register_demo(store, tmp_path)
    Router(store, reg).set("demo", stable="1.0.0", canary="1.1.0", weight=1, why="start")
    Tenants(store).create("shared", {"demo": ["*"]})


def test_a_writer_storm_loses_and_reorders_nothing_and_gateways_converge(store_url: str, tmp_path: Path) -> None:
    store = open_store(store_url)
    _setup(store, tmp_path)
    view = FleetView(store, FakeRuntime(), interval=0.01)
    view.refresh()
    stop = threading.Event()

    def poll() -> None:  # a gateway polling all through the storm
        while not stop.is_set():
            view.refresh()

    poller = threading.Thread(target=poll)
    poller.start()
    try:
        written = _storm(store_url, writers=4, times=60)
    finally:
        stop.set()
        poller.join()
    journal, _ = changes.read(store)
    seqs = [c.seq for c in journal.changes]
    assert seqs == list(range(1, journal.seq + 1))  # every entry, in commit order, no gap
    entries = {(c.key, c.etag) for c in journal.changes}
    assert set(written) <= entries  # every write of every process has its entry
    # the storm's last writes: after one more poll, the gateway holds exactly what the store holds
    view.refresh()
    fresh = FleetView(store, FakeRuntime())
    fresh.refresh()
    assert view.snapshot.routes == fresh.snapshot.routes
    assert view.snapshot.keys == fresh.snapshot.keys
    shared = Tenants(store).get("shared")
    assert view.snapshot.keys[shared.keys[0].id].quota == shared.quota
    revoked = [t for t in Tenants(store).list() if all(k.revoked_at is not None for k in t.keys)]
    assert len(revoked) == 4 * 15 and not any(k.id in view.snapshot.keys for t in revoked for k in t.keys)


def test_the_bus_nudges_gateways_and_they_poll_while_it_is_away(tmp_path: Path, run) -> None:  # noqa: ANN001
    """The view polls the journal only every 60 s here: a change seen sooner came by the bus.
    Killed mid-storm, the bus is away: the view polls every ``interval`` again and converges;
    restarted on the same port, it is subscribed again."""
    from fleet.gateway import bus

    store_url = f"file://{tmp_path / 'store'}"
    store = open_store(store_url)
    _setup(store, tmp_path)
    server = RedisServer(tmp_path).start()
    view = FleetView(store, FakeRuntime(), interval=60.0)
    tenants = Tenants(store)
    seen: list[bool] = []

    async def until(condition, what: str) -> None:  # noqa: ANN001
        for _ in range(600):
            if condition():
                return
            await asyncio.sleep(0.05)
        raise AssertionError(f"not within 30 s (the view's poll is 60 s): {what}")

    async def scenario() -> None:
        view.refresh()
        loop = asyncio.create_task(view.run(lambda s: None))
        sub = asyncio.create_task(bus.subscribe(server.url, view.nudge, lambda up: (seen.append(up), view.on_bus(up))))
        try:
            await until(lambda: view.bus_up, "subscribed")
            await asyncio.to_thread(tenants.create, "late", {"demo": ["*"]})  # publishes (FLEET_REDIS_URL)
            await until(lambda: "tenants/late.json" in view.sync.records, "a published change read")
            before = changes.read(store)[0].seq
            storm = asyncio.create_task(asyncio.to_thread(_storm, store_url, 2, 80))
            await until(lambda: changes.read(store)[0].seq >= before + 10, "the storm under way")
            server.stop()  # mid-storm
            killed_at = changes.read(store)[0].seq
            await until(lambda: not view.bus_up, "the bus noticed away")
            view.interval = 0.05  # polling again (a gateway's POLL_S)
            written = await storm
            assert changes.read(store)[0].seq > killed_at + 50  # most of the storm came while it was away
            server.start()
            await until(lambda: view.bus_up, "subscribed again")
            keys = {k for k, _ in written}
            await until(lambda: all(view.sync._etags.get(k) == store.get(k).etag for k in keys), "converged")

            def same() -> bool:  # the records read are not yet the snapshot served: wait for that too
                fresh = FleetView(store, FakeRuntime())
                fresh.refresh()
                return view.snapshot.keys == fresh.snapshot.keys and view.snapshot.routes == fresh.snapshot.routes

            await until(same, "the snapshot served equals a fresh read")
        finally:
            loop.cancel()
            sub.cancel()
            server.stop()

    os.environ["FLEET_REDIS_URL"] = server.url
    try:
        run(scenario)
    finally:
        os.environ.pop("FLEET_REDIS_URL", None)
    assert seen[:3] == [True, False, True]
    fresh = FleetView(store, FakeRuntime())
    fresh.refresh()
    assert view.snapshot.keys == fresh.snapshot.keys and view.snapshot.routes == fresh.snapshot.routes


@pytest.mark.parametrize("writers", [4])
def test_concurrent_notes_on_the_file_store_keep_every_entry(tmp_path: Path, writers: int) -> None:
    """Threads in one process, each with its own store object: the journal's conditional
    rewrite serialises them (the process-level storm is above)."""
    root = tmp_path / "store"
    done: list[int] = []

    def write(n: int) -> None:
        store = open_store(f"file://{root}")
        for i in range(50):
            done.append(changes.note(store, f"tenants/w{n}-{i}.json", f"e{n}-{i}"))

    threads = [threading.Thread(target=write, args=(n,)) for n in range(writers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    journal, _ = changes.read(open_store(f"file://{root}"))
    assert sorted(done) == list(range(1, writers * 50 + 1)) == [c.seq for c in journal.changes]


def test_the_live_gateways_are_counted_by_one_listing_and_dead_records_expire(monkeypatch) -> None:
    from fleet import audit
    from fleet.catalog import gateway_directory as gd

    store, clock = MemoryStore(), [1000.0]
    monkeypatch.setattr("fleet.store.memory.time.time", lambda: clock[0])
    now = audit.now()

    def announce(gid: str, at: float) -> None:
        clock[0] = at
        record = gd.GatewayRecord(id=gid, url="http://127.0.0.1:1", host="h", pid=1, started_at=now, heartbeat_at=now)
        store.put(gd.key(gid), records.dump(record))

    announce("long-dead", 1000.0)
    announce("just-dead", 1000.0 + gd.EXPIRE_AFTER_S - 30)
    announce("other", 1000.0 + gd.EXPIRE_AFTER_S + 5)
    announce("me", 1000.0 + gd.EXPIRE_AFTER_S + 10)
    counting = Counting(store)
    assert gd.count_live(counting, "me") == 2  # me and other; the dead are not counted
    assert (counting.lists, counting.gets) == (1, 0)  # one listing, whatever the number of gateways
    assert sorted(store.list(gd.PREFIX)) == [gd.key("just-dead"), gd.key("me"), gd.key("other")]  # long-dead removed


def test_a_writer_tells_gateways_by_the_bus_when_it_took_the_change_else_by_a_push(monkeypatch) -> None:
    from fleet.catalog import gateway_directory as gd

    pushed: list[str] = []
    monkeypatch.setattr(gd, "notify", lambda store, token=None: pushed.append("push") or {"g": True})
    store = MemoryStore()
    Tenants(store).create("a", {"demo": ["*"]})  # no FLEET_REDIS_URL: nothing published
    assert changes.noted() and not changes.published()
    assert gd.tell(store) == {"g": True} and pushed == ["push"]
    monkeypatch.setattr(changes.Bus, "publish", lambda self, entry: True)
    Tenants(store).create("b", {"demo": ["*"]})
    assert changes.published() and gd.tell(store) is None and pushed == ["push"]


def test_a_flood_of_nudges_costs_at_most_one_poll_per_min_gap(run) -> None:  # noqa: ANN001
    """Whoever can publish on the bus (or push) can wake the view as often as it likes: the
    polls it causes are spaced MIN_GAP_S apart at least."""
    import time

    from fleet.gateway import view as view_module

    counting = Counting(MemoryStore())
    view = FleetView(counting, FakeRuntime(), interval=60.0)

    async def scenario() -> None:
        view.refresh()
        counting.gets = 0
        loop = asyncio.create_task(view.run(lambda s: None))
        start = time.monotonic()
        while time.monotonic() - start < 0.5:
            view.nudge()
            await asyncio.sleep(0.001)
        elapsed = time.monotonic() - start
        loop.cancel()
        assert 2 <= counting.gets <= elapsed / 0.025 + 2, (counting.gets, elapsed)  # nudged ~every ms

    assert view_module.MIN_GAP_S >= 0.025

    run(scenario)
