"""FairQueue on its own, tick by tick: weighted deficit round robin across tenants, priority
and aging within one, the per-tenant and total bounds, and a property test that nothing is
lost or duplicated."""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable
from typing import TypeVar

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from fleet.gateway.fairqueue import PRIORITIES, FairQueue

T = TypeVar("T", bound=Hashable)


def drain(q: FairQueue[T], now: float = 0.0, n: int | None = None) -> list[T]:
    out: list[T] = []
    while (n is None or len(out) < n) and (item := q.pop(now)) is not None:
        out.append(item)
    return out


def backlog(q: FairQueue[str], tenant: str, n: int, weight: float = 1.0, priority: str = "interactive") -> None:
    for i in range(n):
        assert q.push(f"{tenant}{i}", tenant, priority, weight, now=0.0) is None


def test_priorities_live_in_fairqueue_and_slots_reexports_them() -> None:
    assert PRIORITIES == ("interactive", "batch")


def test_within_a_tenant_interactive_goes_before_batch_each_in_arrival_order() -> None:
    q: FairQueue[str] = FairQueue(max_per_tenant=10, max_total=10, aging_s=2.0)
    for item, priority in [("b1", "batch"), ("i1", "interactive"), ("b2", "batch"), ("i2", "interactive")]:
        q.push(item, "t", priority, 1.0, now=0.0)
    assert q.waiting("t", "batch") == q.waiting(priority="batch") == 2 and len(q) == 4
    assert drain(q, now=1.9) == ["i1", "i2", "b1", "b2"]
    assert q.pop(0.0) is None and len(q) == 0


def test_a_batch_request_that_has_aged_counts_as_interactive_by_arrival() -> None:
    q: FairQueue[str] = FairQueue(max_per_tenant=10, max_total=10, aging_s=2.0)
    q.push("i0", "t", "interactive", 1.0, now=0.0)
    q.push("b1", "t", "batch", 1.0, now=0.5)
    q.push("i2", "t", "interactive", 1.0, now=1.0)
    q.push("i3", "t", "interactive", 1.0, now=3.0)
    assert q.pop(now=2.4) == "i0"  # b1 has waited 1.9 s: not aged yet
    assert q.pop(now=2.4) == "i2"
    q.push("i4", "t", "interactive", 1.0, now=2.4)
    assert q.pop(now=2.5) == "b1"  # aged (2.0 s) and older than i3 and i4
    assert drain(q, now=2.5) == ["i3", "i4"]


def test_an_aged_batch_request_still_waits_for_interactive_ones_that_arrived_before_it() -> None:
    q: FairQueue[str] = FairQueue(max_per_tenant=10, max_total=10, aging_s=1.0)
    q.push("i1", "t", "interactive", 1.0, now=0.0)
    q.push("b1", "t", "batch", 1.0, now=0.0)
    q.push("i2", "t", "interactive", 1.0, now=0.0)
    assert drain(q, now=5.0) == ["i1", "b1", "i2"]


def test_weights_one_to_three_get_one_to_three_of_the_pops() -> None:
    q: FairQueue[str] = FairQueue(max_per_tenant=1000, max_total=2000, aging_s=2.0)
    backlog(q, "a", 500, weight=1.0)
    backlog(q, "b", 500, weight=3.0)
    popped = drain(q, n=400)
    assert popped[:8] == ["a0", "b0", "b1", "b2", "a1", "b3", "b4", "b5"]
    assert Counter(item[0] for item in popped) == {"a": 100, "b": 300}
    for n in range(1, 401):  # at every point, within one quantum of the shares
        served = Counter(item[0] for item in popped[:n])
        assert abs(served["a"] - n / 4) <= 1 and abs(served["b"] - 3 * n / 4) <= 3


def test_a_tenant_of_weight_half_is_served_every_other_round() -> None:
    q: FairQueue[str] = FairQueue(max_per_tenant=100, max_total=200, aging_s=2.0)
    backlog(q, "h", 50, weight=0.5)
    backlog(q, "o", 50, weight=1.0)
    popped = drain(q, n=30)
    assert popped[:5] == ["o0", "h0", "o1", "o2", "h1"]
    assert Counter(item[0] for item in popped) == {"h": 10, "o": 20}


def test_the_latest_weight_pushed_for_a_tenant_counts() -> None:
    q: FairQueue[str] = FairQueue(max_per_tenant=100, max_total=200, aging_s=2.0)
    backlog(q, "a", 40, weight=1.0)
    backlog(q, "b", 39, weight=1.0)
    q.push("b-last", "b", "interactive", 3.0, now=0.0)  # b's policy changed: weight 3 from now on
    assert Counter(item[0] for item in drain(q, n=40)) == {"a": 10, "b": 30}


def test_small_weights_keep_their_ratio_and_a_pop_does_not_spin_through_idle_rounds() -> None:
    q: FairQueue[str] = FairQueue(max_per_tenant=100, max_total=200, aging_s=2.0)
    backlog(q, "a", 50, weight=1e-6)
    backlog(q, "b", 50, weight=3e-6)
    assert Counter(item[0] for item in drain(q, n=40)) == {"a": 10, "b": 30}


def test_a_tenant_joining_mid_backlog_gets_its_share_from_then_on_and_no_burst() -> None:
    q: FairQueue[str] = FairQueue(max_per_tenant=1000, max_total=3000, aging_s=2.0)
    backlog(q, "a", 400)
    backlog(q, "b", 400)
    assert Counter(item[0] for item in drain(q, n=101)) == {"a": 51, "b": 50}
    backlog(q, "c", 400)
    after = drain(q, n=9)
    assert Counter(item[0] for item in after) == {"a": 3, "b": 3, "c": 3}
    assert after[:4] == ["b50", "a51", "c0", "b51"]  # c joins at the end of the round
    assert Counter(item[0] for item in drain(q, n=300)) == {"a": 100, "b": 100, "c": 100}


def test_a_tenant_whose_queue_empties_leaves_the_round_and_loses_its_credit() -> None:
    q: FairQueue[str] = FairQueue(max_per_tenant=100, max_total=200, aging_s=2.0)
    q.push("a0", "a", "interactive", 2.5, now=0.0)  # 2.5 credit, 1 used: 1.5 left, then a empties
    backlog(q, "b", 20)
    assert drain(q, n=2) == ["a0", "b0"]
    backlog(q, "a", 10, weight=2.5)  # back, with no credit: 2.5 a turn again, so 2 then 3
    assert drain(q, n=9) == ["b1", "a0", "a1", "b2", "a2", "a3", "a4", "b3", "a5"]


def test_a_tenant_past_its_own_bound_sheds_the_request_it_pushes() -> None:
    q: FairQueue[str] = FairQueue(max_per_tenant=2, max_total=10, aging_s=2.0)
    backlog(q, "a", 2)
    assert q.push("a2", "a", "interactive", 1.0, now=0.0) == "a2"
    assert q.push("b0", "b", "batch", 1.0, now=0.0) is None
    assert len(q) == 3 and q.waiting("a") == 2 and drain(q) == ["a0", "b0", "a1"]


def test_a_full_queue_sheds_the_newest_of_the_longest_tenant_never_another_tenants() -> None:
    q: FairQueue[str] = FairQueue(max_per_tenant=10, max_total=4, aging_s=2.0)
    q.push("a0", "a", "interactive", 1.0, now=0.0)
    q.push("a1", "a", "batch", 1.0, now=0.0)
    q.push("a2", "a", "interactive", 1.0, now=0.0)
    assert q.push("b0", "b", "interactive", 1.0, now=0.0) is None  # 4: full
    assert q.push("a3", "a", "interactive", 1.0, now=0.0) == "a3"  # the flooder sheds its own
    assert q.push("b1", "b", "interactive", 1.0, now=0.0) == "a2"  # a has the most: its newest goes
    assert (q.waiting("a"), q.waiting("b"), len(q)) == (2, 2, 4)
    assert q.push("b2", "b", "batch", 1.0, now=0.0) == "b2"  # b would have 3 to a's 2: b sheds
    assert q.push("c0", "c", "interactive", 1.0, now=0.0) == "a1"  # a newcomer: the longest (a, first of a tie) sheds
    assert (
        q.push("c1", "c", "interactive", 1.0, now=0.0) == "c1"
    )  # c would have 2, as many as b: a tie sheds the pusher
    assert (q.waiting("a"), q.waiting("b"), q.waiting("c")) == (1, 2, 1)
    assert drain(q) == ["a0", "b0", "c0", "b1"]


def test_the_newest_of_the_longest_is_by_arrival_across_both_priorities() -> None:
    q: FairQueue[str] = FairQueue(max_per_tenant=10, max_total=3, aging_s=2.0)
    q.push("a-batch-old", "a", "batch", 1.0, now=0.0)
    q.push("a-int", "a", "interactive", 1.0, now=0.0)
    q.push("a-batch-new", "a", "batch", 1.0, now=0.0)
    assert q.push("b0", "b", "interactive", 1.0, now=0.0) == "a-batch-new"
    assert drain(q) == ["a-int", "b0", "a-batch-old"]


def test_pushing_an_item_twice_or_with_a_bad_priority_or_weight_is_refused() -> None:
    q: FairQueue[str] = FairQueue(max_per_tenant=10, max_total=10, aging_s=2.0)
    item = "x"
    q.push(item, "a", "interactive", 1.0, now=0.0)
    with pytest.raises(ValueError, match="already queued"):
        q.push(item, "b", "batch", 1.0, now=0.0)
    with pytest.raises(ValueError, match="priority 'urgent' is not known"):
        q.push("y", "a", "urgent", 1.0, now=0.0)
    for weight in (0.0, -1.0, 5e-324, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="expected a positive number"):
            q.push("y", "a", "interactive", weight, now=0.0)
    assert len(q) == 1


def test_remove_takes_out_a_waiter_that_gave_up() -> None:
    q: FairQueue[str] = FairQueue(max_per_tenant=10, max_total=10, aging_s=2.0)
    backlog(q, "a", 3)
    q.push("b0", "b", "batch", 1.0, now=0.0)
    assert q.remove("a1") and not q.remove("a1") and not q.remove("never")
    assert q.remove("b0")  # b empties: it leaves the round
    assert (len(q), q.waiting("a"), q.waiting("b"), q.waiting(priority="batch")) == (2, 2, 0, 0)
    assert drain(q) == ["a0", "a2"]


def test_resize_bounds_later_pushes_and_keeps_what_waits() -> None:
    q: FairQueue[str] = FairQueue(max_per_tenant=5, max_total=5, aging_s=2.0)
    backlog(q, "a", 5)
    q.resize(max_per_tenant=2, max_total=3)
    assert len(q) == 5
    assert q.push("a5", "a", "interactive", 1.0, now=0.0) == "a5"
    assert q.push("b0", "b", "interactive", 1.0, now=0.0) == "a4"  # over the total: the longest sheds
    q.resize(max_per_tenant=10, max_total=10)
    assert q.push("a6", "a", "interactive", 1.0, now=0.0) is None
    assert len(q) == 6


_push = st.tuples(
    st.just("push"), st.sampled_from("aaabc"), st.sampled_from(PRIORITIES), st.sampled_from([0.5, 1.0, 3.0])
)
_ops = st.lists(
    st.one_of(
        _push,
        _push,  # pushes outnumber the rest, so the bounds are reached; "a" floods
        _push,
        st.tuples(st.just("pop")),
        st.tuples(st.just("remove"), st.integers(0, 200)),
        st.tuples(st.just("tick"), st.floats(0.0, 3.0)),
        st.tuples(st.just("resize"), st.integers(0, 6), st.integers(0, 12)),
    ),
    min_size=30,
    max_size=150,
)


@settings(max_examples=200, deadline=None)
@given(ops=_ops, max_per_tenant=st.integers(0, 6), max_total=st.integers(0, 12))
def test_no_item_is_lost_or_duplicated_and_the_bounds_hold(
    ops: list[tuple], max_per_tenant: int, max_total: int
) -> None:
    q: FairQueue[int] = FairQueue(max_per_tenant, max_total, aging_s=1.0)
    now, pushed = 0.0, 0
    queued: dict[int, tuple[str, str]] = {}  # item → (tenant, priority)
    left: list[int] = []  # popped, shed or removed
    for op in ops:
        if op[0] == "push":
            _, tenant, priority, weight = op
            item, pushed = pushed, pushed + 1
            before_mine = sum(1 for t, _ in queued.values() if t == tenant)
            before_total = len(queued)
            counts = Counter(t for t, _ in queued.values())
            shed = q.push(item, tenant, priority, weight, now)
            queued[item] = (tenant, priority)
            if shed is not None:
                victim_tenant = queued.pop(shed)[0]
                left.append(shed)
                event("shed the pushed item" if shed == item else "pushed out another tenant's")
                if shed != item:  # pushed out: the longest tenant's newest, never the pusher's own
                    assert victim_tenant != tenant and counts[victim_tenant] == max(counts.values()) > before_mine + 1
                    assert not any(t == victim_tenant and i > shed for i, (t, _) in queued.items())
            mine = sum(1 for t, _ in queued.values() if t == tenant)
            assert mine <= max(q.max_per_tenant, before_mine) and len(queued) <= max(q.max_total, before_total)
        elif op[0] == "pop":
            item = q.pop(now)
            assert (item is None) == (not queued)
            if item is not None:
                queued.pop(item)
                left.append(item)
        elif op[0] == "remove":
            target = op[1]
            assert q.remove(target) == (target in queued)
            if target in queued:
                queued.pop(target)
                left.append(target)
        elif op[0] == "tick":
            now += op[1]
        else:
            q.resize(op[1], op[2])
        assert len(q) == len(queued)
        for tenant in "abc":
            for priority in PRIORITIES:
                assert q.waiting(tenant, priority) == sum(1 for v in queued.values() if v == (tenant, priority))
        for priority in PRIORITIES:
            assert q.waiting(priority=priority) == sum(1 for _, p in queued.values() if p == priority)
    drained = drain(q, now)
    assert sorted(drained) == sorted(queued)
    assert sorted(left + drained) == list(range(pushed))  # every item once: none lost, none twice


def test_would_shed_answers_as_push_would_without_pushing() -> None:
    q: FairQueue[str] = FairQueue(max_per_tenant=2, max_total=3, aging_s=2.0)
    assert not q.would_shed("a")
    q.push("a1", "a", "interactive", 1.0, 0.0)
    q.push("a2", "a", "interactive", 1.0, 0.0)
    assert q.would_shed("a")  # its own bound
    assert not q.would_shed("b")
    q.push("b1", "b", "interactive", 1.0, 0.0)
    assert len(q) == 3
    assert not q.would_shed("c")  # the queue is full, but a has more waiting: a's newest would go
    assert q.would_shed("b") is (q.push("b2", "b", "interactive", 1.0, 0.0) == "b2")  # b ties a once pushed: its own
    assert len(q) == 3


def test_blocked_tenants_are_passed_over_and_keep_their_credit_and_place() -> None:
    q: FairQueue[str] = FairQueue(max_per_tenant=100, max_total=300, aging_s=2.0)
    backlog(q, "a", 20, weight=2.0)
    backlog(q, "b", 20)
    backlog(q, "c", 20, weight=1e-6)
    assert q.pop(0.0) == "a0"  # a's turn: 2 of credit, 1 spent
    assert [q.pop(0.0, blocked={"a"}) for _ in range(2)] == ["b0", "b1"]  # c's weight is tiny: b's every round
    assert q.pop(0.0, blocked={"a", "b"}) == "c0"  # only c may go: its idle rounds are skipped at once
    assert q.pop(0.0, blocked={"a", "b", "c"}) is None and q.waiting() == 56  # nobody may go: nothing lost
    assert q.pop(0.0, blocked={"zz"}) == "a1"  # a tenant not waiting blocks nobody; a spends the credit it kept
    assert drain(q, n=9) == ["b2", "a2", "a3", "b3", "a4", "a5", "b4", "a6", "a7"]  # and the round goes on, 2:1
