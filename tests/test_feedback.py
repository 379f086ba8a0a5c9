"""Feedback: labels for earlier requests, joined to the inference log; unknown ids reported."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import numpy as np
import pytest

from fleet.catalog.policies.models import Outcome
from fleet.errors import InvalidInput
from fleet.logs.feedback import check_outcomes, labelled, parse, with_outcomes
from tests.gateway_env import MODEL, GatewayEnv, infer, wait_for


def test_labels_join_the_logged_requests_of_the_same_tenant_and_the_rest_are_reported(tmp_path: Path) -> None:
    e = GatewayEnv(tmp_path, inference_log={"sample_rate": 1.0})
    try:
        e.register("1.0.0")
        e.stub("1.0.0")
        e.route(stable="1.0.0")
        key, other = e.tenant("apps"), e.tenant("others")
        a, _ = e.gateway()
        b, _ = e.gateway()  # a second gateway that never served these requests
        two_rows = {
            "inputs": [{"name": "features", "shape": [2, 4], "datatype": "FP32", "data": [1, 0, 0, 0, -1, 1, 0, 0]}]
        }
        with httpx.Client(base_url=a, timeout=30) as client:
            ids = [infer(client, key, two_rows).headers["x-request-id"] for _ in range(3)]
            theirs = infer(client, other).headers["x-request-id"]
            r = client.post(
                "/v1/feedback",
                headers={"Authorization": f"Bearer {key}"},
                json={
                    "model": MODEL,
                    "feedback": [
                        {"request_id": ids[0], "label": 1},
                        {"request_id": ids[0], "row": 1, "label": 0},
                        {"request_id": "never-served", "label": 1},
                        {"request_id": theirs, "label": 0},
                    ],
                },
            )
            assert r.status_code == 200, r.text
            assert r.json()["accepted"] == 2
            assert r.json()["unknown"] == [{"request_id": "never-served", "row": 0}, {"request_id": theirs, "row": 0}]
            bad = client.post(
                "/v1/feedback",
                headers={"Authorization": f"Bearer {key}"},
                json={"model": MODEL, "feedback": [{"request_id": ids[1], "label": "yes"}]},
            )
            assert bad.status_code == 422 and "expected the true class as an integer" in bad.json()["error"]
        # gateway b learns of a's requests from the log in the store (after a flushed it)
        wait_for(lambda: any(True for _ in e.store.list("logs/staging/inference/")), timeout=10, what="a flush")
        with httpx.Client(base_url=b, timeout=30) as client:
            r = client.post(
                "/v1/feedback",
                headers={"Authorization": f"Bearer {key}"},
                json={"model": MODEL, "feedback": [{"request_id": ids[1], "label": 1}]},
            )
            assert r.status_code == 200 and r.json() == {**r.json(), "accepted": 1, "unknown": []}
            none = client.post(
                "/v1/feedback",
                headers={"Authorization": f"Bearer {key}"},
                json={"model": MODEL, "feedback": [{"request_id": "nope", "label": 1}]},
            )
            assert none.status_code == 404 and none.json()["unknown"] == [{"request_id": "nope", "row": 0}]
            assert "none of the 1 label(s) matched" in none.json()["error"]  # an error body like any other
        now = datetime.now(UTC)
        frame = labelled(e.store, MODEL, now - timedelta(hours=1), now + timedelta(minutes=1))
        got = {(r.request_id, r.row): r.label for r in frame.itertuples() if r.label == r.label}  # NaN != NaN
        assert got == {(ids[0], 0): 1, (ids[0], 1): 0, (ids[1], 0): 1}
        assert len(frame) == 3 * 2 + 1  # every logged row, labelled or not
    finally:
        e.stop()


def test_feedback_has_a_quota_of_its_own_and_an_id_labelled_many_times_counts_once(tmp_path: Path) -> None:
    """A tenant flooding POST /v1/feedback is refused past its own bucket (429, before the body
    is read: nothing written); one request id given 40 times in a call is one label (the last),
    and a request id the caller logged twice (its own X-Request-Id) is labelled once."""
    e = GatewayEnv(tmp_path, inference_log={"sample_rate": 1.0}, limits={"feedback_rps": 0.1, "feedback_burst": 3})
    try:
        e.register("1.0.0")
        e.stub("1.0.0")
        e.route(stable="1.0.0")
        key = e.tenant("apps")
        url, _ = e.gateway()
        auth = {"Authorization": f"Bearer {key}"}
        with httpx.Client(base_url=url, timeout=30) as client:
            for _ in range(2):  # the caller reuses its id: two logged requests, one id
                assert infer(client, key, **{"X-Request-Id": "order-7"}).status_code == 200
            given = [{"request_id": "order-7", "label": 1}] * 40 + [{"request_id": "order-7", "label": 0}]
            calls = [
                client.post("/v1/feedback", headers=auth, json={"model": MODEL, "feedback": given}) for _ in range(6)
            ]
        assert [c.status_code for c in calls] == [200, 200, 200, 429, 429, 429], [c.text for c in calls]
        assert all(c.json()["accepted"] == 1 for c in calls[:3])  # 41 items, one id: one label
        refused = calls[3]
        assert "feedback quota of 0.1 calls/s" in refused.json()["error"] and int(refused.headers["retry-after"]) >= 1
        assert len(list(e.store.list("logs/staging/feedback/"))) == 3  # nothing written past the quota
        wait_for(lambda: any(True for _ in e.store.list("logs/staging/inference/")), timeout=10, what="a flush")
        now = datetime.now(UTC)
        frame = labelled(e.store, MODEL, now - timedelta(hours=1), now + timedelta(minutes=1))
        rows = frame[frame["request_id"] == "order-7"]
        assert len(rows) == 1 and rows["label"].tolist() == [0]  # the first logged request, the last label
    finally:
        e.stop()


def test_a_log_file_that_is_not_parquet_is_skipped_and_named_never_the_end_of_a_read() -> None:
    """A file cut short (or written over by hand) among the inference log's, the labels' and
    the outcomes': the readers skip it, log it and name it; the good files are all read."""
    from fleet.logs.feedback import write, write_outcomes
    from fleet.logs.inference import InferenceLog, Sample
    from fleet.store import MemoryStore

    store, now = MemoryStore(), datetime.now(UTC)
    log = InferenceLog(store, "gw")
    for i in range(3):
        features, outputs = np.array([[0.1, 0.2]], np.float32), np.array([[0.7, 0.3]], np.float32)
        log.record(Sample(now.timestamp(), f"r{i}", "m", "1.0.0", "apps", 1.0, features, outputs, ("x", "y")))
    assert log.flush() == 3
    _, given = parse({"model": "m", "feedback": [{"request_id": "r0", "label": 1, "outcomes": {"clicked": 1}}]})
    write(store, "m", "apps", given, "gw")
    write_outcomes(store, "m", "apps", given, "gw")
    hour, ms = f"{now:%Y/%m/%d/%H}", int(now.timestamp() * 1000)
    bad = [f"logs/staging/{kind}/{hour}/{ms}-{ms}-broken-1.parquet" for kind in ("inference", "feedback", "outcomes")]
    for key in bad:
        store.put(key, b"PAR1 cut short")
    unreadable: list[str] = []
    frame = labelled(store, "m", now - timedelta(hours=1), now + timedelta(minutes=1), unreadable)
    assert sorted(frame["request_id"]) == ["r0", "r1", "r2"] and frame.set_index("request_id")["label"]["r0"] == 1
    outcomes = with_outcomes(store, "m", now - timedelta(hours=1), now + timedelta(minutes=1), ["clicked"], unreadable)
    assert outcomes.set_index("request_id")["outcome:clicked"]["r0"] == 1
    assert set(unreadable) == set(bad)


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"feedback": [{"request_id": "a", "label": 1}]}, "no model"),
        ({"model": "m", "feedback": []}, "no model or no feedback list"),
        ({"model": "m", "feedback": [{"label": 1}]}, "request_id is None"),
        ({"model": "m", "feedback": [{"request_id": "a", "label": 1, "row": -1}]}, "row is -1"),
        ({"model": "m", "feedback": [{"request_id": "a", "label": True}]}, "label is True"),
        ({"model": "m", "feedback": [{"request_id": "a"}]}, "neither a label nor outcomes"),
        ({"model": "m", "feedback": [{"request_id": "a", "outcomes": {}}]}, "expected an object of named numbers"),
        ({"model": "m", "feedback": [{"request_id": "a", "outcomes": [1]}]}, "expected an object of named numbers"),
        ({"model": "m", "feedback": [{"request_id": "a", "outcomes": {"Clicked!": 1}}]}, "lowercase letters"),
        ({"model": "m", "feedback": [{"request_id": "a", "outcomes": {"clicked": "yes"}}]}, "expected a finite number"),
        ({"model": "m", "feedback": [{"request_id": "a", "outcomes": {"clicked": True}}]}, "expected a finite number"),
        (
            {"model": "m", "feedback": [{"request_id": "a", "outcomes": {"x": float("nan")}}]},
            "expected a finite number",
        ),
    ],
)
def test_malformed_feedback_says_what_was_expected(body: dict, message: str) -> None:
    with pytest.raises(InvalidInput, match=message):
        parse(body)


def test_the_index_of_logged_requests_is_per_tenant_and_bounded_in_bytes() -> None:
    """Ten 60,000-row requests once froze the gateway for 24 s: the index held one entry per
    row and evicted with ``pop(next(iter()))``, quadratic as it emptied. It now holds one
    entry per request, evicts in O(1), and never joins one tenant's id to another's request."""
    from fleet.logs.logged import LoggedRequests
    from fleet.store import MemoryStore

    logged = LoggedRequests(MemoryStore(), max_bytes=64 * 1024)
    logged.remember("m", "apps", "same-id", 3)
    logged.remember("m", "rivals", "same-id", 1)
    assert logged.owned("m", "apps", {("same-id", 0), ("same-id", 2), ("same-id", 3)}) == {
        ("same-id", 0),
        ("same-id", 2),
    }
    assert logged.owned("m", "rivals", {("same-id", 0), ("same-id", 1)}) == {("same-id", 0)}
    assert logged.owned("m", "third", {("same-id", 0)}) == set()
    for i in range(100_000):  # far past the budget: the oldest go, one at a time
        logged.remember("m", "apps", f"r{i}", 60_000)
    # the recent requests': half of what the counted labels' eighth and the listings' sixteenth leave
    assert logged.bytes <= 26 * 1024 + 4 * 1024  # (and the listings the lookups made, within their sixteenth)
    assert logged.owned("m", "apps", {("r99999", 59_999)}) == {("r99999", 59_999)}
    assert logged.owned("m", "apps", {("r0", 0)}) == set()
    # an answer's label counts once; the memory of which were counted is bounded too
    assert logged.first_labels("m", "apps", ["a", "a", "b"]) == [True, False, True]
    assert logged.first_labels("m", "rivals", ["a"]) == [True]  # per tenant
    logged.first_labels("m", "apps", [f"l{i}" for i in range(100_000)])
    assert logged.bytes <= 64 * 1024  # all of it within the index's budget
    assert logged.first_labels("m", "apps", ["a"]) == [True]  # long forgotten: counts again


def test_made_up_ids_cost_no_scan_of_the_log_and_another_gateways_flush_is_seen_within_a_second(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A flood of feedback for ids nobody logged used to list all 25 hours of the log per
    call. The staged files are listed once a ``LIST_EVERY_S`` however many calls come; a file
    another gateway stages is found once the listing is that old."""
    from fleet.logs import ids
    from fleet.logs import logged as module
    from fleet.logs.inference import GenSample, InferenceLog, digest
    from fleet.store import MemoryStore

    class Counting(MemoryStore):
        lists = 0

        def list(self, prefix: str = ""):  # noqa: ANN202 - MemoryStore's
            Counting.lists += 1
            return super().list(prefix)

    clock = [1000.0]
    monkeypatch.setattr(module.time, "monotonic", lambda: clock[0])
    now = datetime(2026, 12, 6, 12, 30, tzinfo=UTC)

    def logged_elsewhere(request_id: str) -> None:
        log = InferenceLog(store, "gw-other")
        log.record(
            GenSample(
                now.timestamp(), request_id, "lm", "1.0.0", "apps", 80.0, 12.0, 14, 5, "stop", digest("x"), None, None
            )
        )
        assert log.flush() == 1

    store = Counting()
    logged_elsewhere("early")
    here = module.LoggedRequests(store)
    for i in range(500):
        made_up = f"made-up-{i}" if i % 2 else ids.new(int(now.timestamp() * 1000) - i * 1000)
        assert here.owned("lm", "apps", {(made_up, 0)}, now) == set()
    assert Counting.lists == 1 == here.listings  # one listing for 500 calls
    assert here.owned("lm", "apps", {("early", 0)}, now) == {("early", 0)}
    logged_elsewhere("late")
    assert here.owned("lm", "apps", {("late", 0)}, now) == set()  # within the second: not listed again yet
    clock[0] += module.LIST_EVERY_S
    assert here.owned("lm", "apps", {("late", 0)}, now) == {("late", 0)}
    assert Counting.lists == 2


def test_labels_must_be_classes_of_the_model() -> None:
    from fleet.logs.feedback import check_classes

    _, given = parse({"model": "m", "feedback": [{"request_id": "a", "label": 1}, {"request_id": "b", "label": 2}]})
    check_classes(given[:1], 2)
    with pytest.raises(InvalidInput, match=r"feedback\[1\].label is 2; expected a class of this model, 0 to 1"):
        check_classes(given, 2)


def test_a_generations_answer_is_found_in_memory_and_in_its_log_file_within_its_tenant_only() -> None:
    """Exact-match feedback needs which version answered and its output's digest: from the
    gateway's recent samples, or from the log file another gateway wrote."""
    from fleet.logs.inference import GenSample, InferenceLog, digest
    from fleet.logs.logged import LoggedRequests
    from fleet.store import MemoryStore

    store = MemoryStore()
    log = InferenceLog(store, "gw-a")
    log.record(
        GenSample(
            datetime.now(UTC).timestamp(),
            "from-file",
            "lm",
            "1.1.0",
            "apps",
            80.0,
            12.0,
            14,
            5,
            "stop",
            digest("dcba"),
            prompt=None,
            output=None,
        )
    )
    assert log.flush() == 1
    here = LoggedRequests(store)
    here.remember("lm", "apps", "in-memory", 1, ("1.0.0", digest("cba")))
    assert here.answers("lm", "apps", {"in-memory", "from-file", "unknown"}) == {
        "in-memory": ("1.0.0", digest("cba")),
        "from-file": ("1.1.0", digest("dcba")),
    }
    assert here.answers("lm", "rivals", {"in-memory", "from-file"}) == {}
    assert here.owned("lm", "apps", {("from-file", 0), ("from-file", 1)}) == {
        ("from-file", 0)
    }  # one row per generation
    assert here.bytes > 0


def test_a_generative_models_labels_are_texts_of_single_answers_and_bounded() -> None:
    from fleet.logs.feedback import MAX_LABEL_CHARS, check_classes, check_texts

    _, given = parse({"model": "lm", "feedback": [{"request_id": "a", "label": "dcba"}]})
    check_texts(given, "lm")
    with pytest.raises(InvalidInput, match="expected the true class as an integer"):
        check_classes(given, 2)  # a text is no class of a tensor model
    _, classes = parse({"model": "lm", "feedback": [{"request_id": "a", "label": 1}]})
    with pytest.raises(InvalidInput, match="lm is generative: expected the text"):
        check_texts(classes, "lm")
    _, second_row = parse({"model": "lm", "feedback": [{"request_id": "a", "label": "x", "row": 1}]})
    with pytest.raises(InvalidInput, match="expected row 0"):
        check_texts(second_row, "lm")
    with pytest.raises(InvalidInput, match=f"expected at most {MAX_LABEL_CHARS}"):
        parse({"model": "lm", "feedback": [{"request_id": "a", "label": "x" * (MAX_LABEL_CHARS + 1)}]})


def test_a_feedback_request_carries_a_bounded_number_of_outcomes() -> None:
    from fleet.logs.feedback import MAX_OUTCOME_ROWS, TooManyLabels

    items = [
        {"request_id": f"r{i}", "outcomes": {f"o{k}": 1 for k in range(20)}} for i in range(MAX_OUTCOME_ROWS // 20 + 1)
    ]
    with pytest.raises(TooManyLabels, match=f"more than {MAX_OUTCOME_ROWS} outcomes"):
        parse({"model": "m", "feedback": items})


def test_outcomes_must_be_declared_by_the_models_policy_and_within_their_bounds() -> None:
    declared = {"clicked": Outcome(min=0, max=1), "revenue": Outcome(min=0)}
    _, items = parse({"model": "m", "feedback": [{"request_id": "a", "outcomes": {"clicked": 1, "revenue": 3.5}}]})
    assert items[0].label is None and items[0].outcomes == (("clicked", 1.0), ("revenue", 3.5))
    check_outcomes(items, "m", declared)
    for given, message in [
        ({"bought": 1}, "not an outcome of m; expected one of: clicked, revenue"),
        ({"clicked": 2}, "clicked is 2; expected 0 to 1"),
        ({"revenue": -1}, "revenue is -1; expected 0 to inf"),
    ]:
        _, items = parse({"model": "m", "feedback": [{"request_id": "a", "outcomes": given}]})
        with pytest.raises(InvalidInput, match=message):
            check_outcomes(items, "m", declared)
    _, items = parse({"model": "m", "feedback": [{"request_id": "a", "outcomes": {"clicked": 1}}]})
    with pytest.raises(InvalidInput, match="none \\(add them under the model's outcomes"):
        check_outcomes(items, "m", {})
    with pytest.raises(ValueError, match="expected min <= max"):
        Outcome(min=2, max=1)


def test_outcomes_join_the_logged_requests_of_the_same_tenant_by_version(tmp_path: Path) -> None:
    """Outcomes beside labels or alone, through a real gateway: stored apart from labels, joined
    per tenant to the logged requests, each with the version that answered."""
    e = GatewayEnv(
        tmp_path, inference_log={"sample_rate": 1.0}, outcomes={"clicked": {"min": 0, "max": 1}, "revenue": {"min": 0}}
    )
    try:
        e.register("1.0.0", "1.1.0")
        e.stub("1.0.0")
        e.stub("1.1.0")
        e.route(stable="1.0.0")
        e.route(canary="1.1.0", weight=0)  # reached by its version path only
        key, other = e.tenant("apps"), e.tenant("others")
        url, _ = e.gateway()
        auth = {"Authorization": f"Bearer {key}"}
        with httpx.Client(base_url=url, timeout=30) as client:
            ids = [infer(client, key).headers["x-request-id"] for _ in range(2)]
            pinned = client.post(
                f"/v2/models/{MODEL}/versions/1.1.0/infer",
                headers=auth,
                json={"inputs": [{"name": "features", "shape": [1, 4], "datatype": "FP32", "data": [1, 0, 0, 0]}]},
            )
            assert pinned.status_code == 200, pinned.text
            theirs = infer(client, other).headers["x-request-id"]
            r = client.post(
                "/v1/feedback",
                headers=auth,
                json={
                    "model": MODEL,
                    "feedback": [
                        {"request_id": ids[0], "label": 1, "outcomes": {"clicked": 1, "revenue": 12.5}},
                        {"request_id": ids[1], "outcomes": {"clicked": 0}},
                        {"request_id": pinned.headers["x-request-id"], "outcomes": {"clicked": 1}},
                        {"request_id": theirs, "outcomes": {"clicked": 1}},
                    ],
                },
            )
            assert r.status_code == 200, r.text
            assert r.json()["accepted"] == 3 and r.json()["unknown"] == [{"request_id": theirs, "row": 0}]
            refused = client.post(
                "/v1/feedback",
                headers=auth,
                json={
                    "model": MODEL,
                    "feedback": [
                        {"request_id": ids[1], "outcomes": {"clicked": 1}},
                        {"request_id": ids[0], "outcomes": {"bought": 1}},
                    ],
                },
            )
            assert refused.status_code == 422 and "bought is not an outcome of" in refused.json()["error"]
        now = datetime.now(UTC)

        def joined():  # noqa: ANN202
            return with_outcomes(
                e.store, MODEL, now - timedelta(hours=1), now + timedelta(minutes=1), ["clicked", "revenue"]
            )

        wait_for(lambda: len(joined()) == 4, timeout=10, what="the gateway's log of 4 requests flushed")
        frame = joined()
        got = {
            (rid, version): (clicked, revenue)
            for rid, version, clicked, revenue in zip(
                frame["request_id"], frame["version"], frame["outcome:clicked"], frame["outcome:revenue"], strict=True
            )
            if clicked == clicked
        }
        assert got.keys() == {(ids[0], "1.0.0"), (ids[1], "1.0.0"), (pinned.headers["x-request-id"], "1.1.0")}
        assert got[ids[0], "1.0.0"] == (1.0, 12.5) and got[ids[1], "1.0.0"][0] == 0.0
        assert len(frame) == 4  # every logged request, the other tenant's too, with or without outcomes
        labels = labelled(e.store, MODEL, now - timedelta(hours=1), now + timedelta(minutes=1))
        assert {r.request_id: r.label for r in labels.itertuples() if r.label == r.label} == {ids[0]: 1}
    finally:
        e.stop()
