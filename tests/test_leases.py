"""Leases: taken once, renewed by a heartbeat through long steps, checked before acting.

Time-based conditions wait on what the store shows (a renewal that landed), never on a
sleep; ``check``'s age limit is tested with a clock the test moves.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest

from fleet import audit, leases, records
from fleet.errors import Conflict, StoreUnavailable
from fleet.leases import LeaseRecord
from fleet.store import MemoryStore
from tests.fakes import DownStore

KEY = "rollouts/demo.lease"


def take(store: MemoryStore, who: str = "run-1", ttl: float = 0.6, **kwargs) -> leases.Lease:  # noqa: ANN003
    return leases.acquire(store, KEY, what="the rollout of demo", who=who, stale_after=timedelta(seconds=ttl), **kwargs)


def wait_for(condition, timeout: float = 10.0) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


def held(store: MemoryStore) -> LeaseRecord:
    return records.load(store, KEY, LeaseRecord)[0]


def taken_over(store: MemoryStore, who: str = "intruder") -> None:
    """Another run writes its own record over the lease, as a takeover does."""
    record = held(store).model_copy(update={"id": "other", "who": who, "renewed_at": audit.now()})
    store.put(KEY, records.dump(record))


def test_a_second_holder_is_refused_while_the_first_renews() -> None:
    store = MemoryStore()
    first = take(store)
    with pytest.raises(Conflict, match="the rollout of demo is in progress by run-1"):
        take(store, "run-2")
    first.release()
    take(store, "run-2").release()


def test_the_heartbeat_keeps_the_lease_past_its_ttl_while_the_holder_is_busy() -> None:
    """A step longer than the TTL (a deploy, a pause for approval) does not let the lease go."""
    store = MemoryStore()
    lease = take(store, ttl=0.6)
    acquired = held(store).acquired_at
    with lease.kept_alive():  # every 0.2 s
        wait_for(lambda: held(store).renewed_at - acquired > timedelta(seconds=1.2))  # twice the TTL
        with pytest.raises(Conflict, match="in progress by run-1"):
            take(store, "run-2")
        lease.check()  # still the holder
    lease.release()
    assert not records.exists(store, KEY)


def test_without_a_heartbeat_a_lease_older_than_its_ttl_is_taken_over() -> None:
    store = MemoryStore()
    lease = take(store, ttl=0.3)  # its process lives on, busy: only the time since its last renewal counts
    wait_for(lambda: audit.now() - held(store).renewed_at > timedelta(seconds=0.3))
    second = take(store, "run-2", ttl=0.3)
    assert second.taken_over
    with pytest.raises(Conflict, match="lost the lease"):
        lease.renew()


def test_a_heartbeat_that_loses_marks_the_lease_lost_and_stops() -> None:
    store = MemoryStore()
    lease = take(store, ttl=0.3)
    with lease.kept_alive():
        taken_over(store)
        wait_for(lambda: lease._lost is not None)  # noqa: SLF001 - the next beat found out
        with pytest.raises(Conflict, match="lost the lease"):
            lease.check()
        with pytest.raises(Conflict, match="lost the lease"):
            lease.renew()
    lease.release()
    assert held(store).who == "intruder"  # the loser does not release the winner's lease


def test_check_refuses_once_renewals_have_failed_for_two_thirds_of_the_ttl() -> None:
    store, now = DownStore(), [100.0]
    lease = take(store, ttl=30, clock=lambda: now[0])
    now[0] += 19.9
    lease.check()  # renewed 19.9 s ago: 10 s of the lease left
    store.down.set()
    with pytest.raises(StoreUnavailable):
        lease.renew()
    now[0] += 0.2
    with pytest.raises(Conflict, match=r"last renewed 20.1 s ago.*within 20.0 s of a renewal"):
        lease.check()
    store.down.clear()
    lease.renew()  # nobody took it over meanwhile: the holder may act again
    lease.check()


def test_the_heartbeat_retries_through_an_unreachable_store() -> None:
    store = DownStore()
    lease = take(store, ttl=0.6)
    with lease.kept_alive():
        store.down.set()
        before = held(store).renewed_at
        wait_for(lambda: store.refused >= 2)  # two beats failed, and the heartbeat went on
        store.down.clear()
        wait_for(lambda: held(store).renewed_at > before)
    lease.check()


def test_the_heartbeat_ends_with_its_block() -> None:
    store = MemoryStore()
    lease = take(store, ttl=0.3)
    with lease.kept_alive():
        wait_for(lambda: any(t.name == f"lease {KEY}" for t in threading.enumerate()))
    assert not any(t.name == f"lease {KEY}" for t in threading.enumerate())
    lease.release()
