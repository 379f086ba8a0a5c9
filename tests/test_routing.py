"""Routing decisions: the pure version choice, shadow sampling and table validation."""

from __future__ import annotations

import pytest

from fleet import audit
from fleet.catalog.registry import State
from fleet.catalog.routes.table import (
    BUCKETS,
    Canary,
    RouteTable,
    Shadow,
    bucket,
    choose_version,
    should_shadow,
    usable_versions,
    validate_states,
)
from fleet.catalog.tenants import Tenant
from fleet.errors import InvalidInput, NotFound

KEYS = [f"user-{i}" for i in range(100_000)]
# Buckets of user-0, user-1, user-2 and alice for model demo, canary 1.1.0 (see the test).
GOLDEN_BUCKETS = [5861, 6431, 403, 8118]


def tenant(name: str = "acme", versions: list[str] | None = None) -> Tenant:
    return Tenant(name=name, entitlements={"demo": versions or ["*"]}, created_at=audit.now(), created_by="t")


def table(weight: float, **kw) -> RouteTable:
    return RouteTable(model="demo", stable="1.0.0", canary=Canary(version="1.1.0", weight=weight), **kw)


# -- pure choice -----------------------------------------------------------------------


def test_buckets_are_fixed_across_processes_and_releases() -> None:
    """Golden values: a key must land in the same bucket in every gateway process and after
    every upgrade (Python's own hash() is salted per process and would break this)."""
    t = table(30)
    assert [bucket(t, k) for k in ("user-0", "user-1", "user-2", "alice")] == GOLDEN_BUCKETS
    assert all(0 <= bucket(t, k) < BUCKETS for k in KEYS[:1000])
    assert [choose_version(t, None, k).version for k in ("user-0", "user-1", "user-2", "alice")] == [
        "1.1.0" if b < 3000 else "1.0.0" for b in GOLDEN_BUCKETS
    ]


def test_raising_the_weight_only_moves_keys_from_stable_to_canary() -> None:
    previous = {k: choose_version(table(0), None, k).version for k in KEYS[:20_000]}
    assert set(previous.values()) == {"1.0.0"}
    for weight in (0.5, 1, 5, 10, 25, 50, 75, 99, 100):
        current = {k: choose_version(table(weight), None, k).version for k in KEYS[:20_000]}
        moved_back = [k for k in KEYS[:20_000] if previous[k] == "1.1.0" and current[k] == "1.0.0"]
        assert moved_back == [], f"weight {weight} moved keys back to stable"
        previous = current
    assert set(previous.values()) == {"1.1.0"}


@pytest.mark.parametrize("weight", [1, 10, 33.3, 50, 90])
def test_split_matches_the_weight_over_100k_keys(weight: float) -> None:
    t = table(weight)
    share = sum(choose_version(t, None, k).version == "1.1.0" for k in KEYS) / len(KEYS)
    # binomial sd at n=100k is <= 0.16 %; allow ~4 sd
    assert abs(share - weight / 100) < 0.007


def test_reason_tells_why_a_version_was_chosen() -> None:
    t = table(50)
    reasons = {choose_version(t, None, k).reason for k in KEYS[:200]}
    assert reasons == {"stable", "canary"}


def test_pin_beats_the_split_and_requested_version_beats_the_pin() -> None:
    t = table(100, pins={"acme": "0.9.0"})
    assert choose_version(t, tenant("acme"), "k").version == "0.9.0"
    assert choose_version(t, tenant("acme"), "k").reason == "pinned"
    assert choose_version(t, tenant("other"), "k").version == "1.1.0"
    chosen = choose_version(t, tenant("acme"), "k", requested_version="1.0.0")
    assert (chosen.version, chosen.reason) == ("1.0.0", "requested")


def test_a_version_the_tenant_may_not_use_looks_like_one_that_is_not_served() -> None:
    t = table(10)
    with pytest.raises(NotFound) as not_allowed:
        choose_version(t, tenant("acme", ["1.0.0"]), "k", requested_version="1.1.0")
    assert str(not_allowed.value) == "version 1.1.0 of demo is not served; versions you may use: 1.0.0"
    with pytest.raises(NotFound, match="version 2.0.0 of demo is not served; versions you may use: 1.0.0, 1.1.0"):
        choose_version(t, tenant(), "k", requested_version="2.0.0")


def test_another_tenants_pin_is_neither_shown_nor_usable() -> None:
    t = table(10).model_copy(update={"pins": {"globex": "0.9.0"}, "shadow": Shadow(version="2.0.0", percent=5)})
    assert usable_versions(t, tenant()) == {"1.0.0", "1.1.0"}
    assert usable_versions(t, tenant("globex")) == {"1.0.0", "1.1.0", "0.9.0"}
    with pytest.raises(NotFound, match="versions you may use: 1.0.0, 1.1.0$"):
        choose_version(t, tenant(), "k", requested_version="0.9.0")


def test_a_tenant_is_never_split_onto_a_version_it_is_not_entitled_to() -> None:
    t = table(100)  # every key would go to the canary 1.1.0
    assert {choose_version(t, tenant("acme", ["1.0.0"]), k).version for k in KEYS[:200]} == {"1.0.0"}
    promoted = RouteTable(model="demo", stable="1.1.0")
    with pytest.raises(NotFound, match="no version of demo that you may use is served; you may use: 1.0.0"):
        choose_version(promoted, tenant("acme", ["1.0.0"]), "k")


def test_a_model_without_stable_has_nothing_to_serve() -> None:
    with pytest.raises(NotFound, match="no stable version"):
        choose_version(RouteTable(model="demo"), None, "k")


def test_shadow_sampling_follows_its_percent() -> None:
    t = table(0, shadow=Shadow(version="1.1.0", percent=20))
    share = sum(should_shadow(t, k) for k in KEYS[:50_000]) / 50_000
    assert abs(share - 0.2) < 0.01
    assert not any(should_shadow(table(0), k) for k in KEYS[:1000])


# -- validation ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"canary": {"version": "1.1.0", "weight": 5}}, "a canary needs a stable"),
        ({"stable": "1.0.0", "canary": {"version": "1.0.0", "weight": 5}}, "already the stable"),
        ({"stable": "1.0.0", "canary": {"version": "1.1.0", "weight": 101}}, "less than or equal to 100"),
        ({"shadow": {"version": "1.1.0", "percent": 5}}, "a shadow needs a stable"),
    ],
)
def test_table_shape_is_validated(data: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        RouteTable(model="demo", **data)


def test_states_are_validated_per_role() -> None:
    states = {"1.0.0": State.STABLE, "1.1.0": State.REJECTED, "1.2.0": State.REGISTERED, "0.9.0": State.RETIRED}
    with pytest.raises(InvalidInput, match="canary 1.1.0 is rejected"):
        validate_states(table(5), states, "1.0.0")
    with pytest.raises(InvalidInput, match="stable 9.9.9 is not registered"):
        validate_states(RouteTable(model="demo", stable="9.9.9"), states, "1.0.0")
    with pytest.raises(InvalidInput, match="roll it out as a canary first"):
        validate_states(RouteTable(model="demo", stable="1.2.0"), states, "1.0.0")
    with pytest.raises(InvalidInput, match="pin of acme 0.9.0 is retired"):
        validate_states(RouteTable(model="demo", stable="1.0.0", pins={"acme": "0.9.0"}), states, "1.0.0")
    validate_states(RouteTable(model="demo", stable="1.2.0"), states, None)  # first rollout
    validate_states(RouteTable(model="demo", stable="0.9.0"), states, "1.0.0")  # rollback
