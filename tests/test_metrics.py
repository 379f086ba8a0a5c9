"""Metrics sources against real HTTP servers on 127.0.0.1 answering with stored API answers.

The Prometheus answers in tests/fixtures/metrics/prom_*.json have the shape of real
``/api/v1/query`` responses (compact JSON, sample values as strings, the metric object
holding only the labels an aggregation keeps, a vector in no particular order); the gateway
answers follow docs/architecture.md, "Gateway telemetry". This is not a test against a real
Prometheus scraping a real gateway.
"""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Callable, Iterator
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import pytest

from fleet import audit, records
from fleet.analysis.sources import (
    BadMetricsAnswer,
    MemoryMetrics,
    MetricsUnavailable,
    open_metrics,
    sum_windows,
)
from fleet.analysis.sources.gateway import GatewayMetrics
from fleet.analysis.sources.prometheus import PrometheusMetrics
from fleet.catalog import gateway_directory
from fleet.catalog.gateway_directory import GatewayRecord
from fleet.errors import ConfigError, FleetError, InvalidInput
from fleet.store import MemoryStore
from fleet.types import LATENCY_BUCKETS_MS, OUTPUT_TOKEN_BUCKETS, MetricsSource, latency_bucket, score_bin

FIXTURES = Path(__file__).parent / "fixtures" / "metrics"
MODEL, END = "demo-classifier", 1764590060.0
TOKEN = "admin-token-for-tests"

Answer = tuple[int, bytes]


class Server:
    """A real HTTP server on a random port of 127.0.0.1; ``answer(path, query) -> (status, body)``."""

    def __init__(self, answer: Callable[[str, dict[str, str], dict[str, str]], Answer]) -> None:
        self.seen: list[tuple[str, dict[str, str], dict[str, str]]] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
                parts = urlsplit(self.path)
                query = {k: v[0] for k, v in parse_qs(parts.query).items()}
                headers = dict(self.headers.items())
                outer.seen.append((parts.path, query, headers))
                status, body = answer(parts.path, query, headers)
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:
                pass

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._httpd.server_address[1]}"
        self._thread = threading.Thread(target=self._httpd.serve_forever, args=(0.05,), daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()


@pytest.fixture
def serve() -> Iterator[Callable[..., Server]]:
    servers: list[Server] = []

    def start(answer) -> Server:
        servers.append(Server(answer))
        return servers[-1]

    yield start
    for s in servers:
        s.close()


def fixture(name: str) -> bytes:
    return (FIXTURES / name).read_bytes()


def dead_url() -> str:
    """A URL nobody listens on: a port the OS just handed out and took back."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


# -- Prometheus ---------------------------------------------------------------------------

PROM_ANSWERS = {
    "fleet_version_requests_total": "prom_requests.json",
    "fleet_version_errors_total": "prom_errors.json",
    "fleet_upstream_duration_seconds_bucket": "prom_latency.json",
    "fleet_predictions_total": "prom_predictions.json",
    "fleet_shadow_requests_total": "prom_shadow.json",
    # a tensor model: no generation series
    "fleet_time_per_output_token_seconds_bucket": "prom_empty.json",
    "fleet_generation_output_tokens_bucket": "prom_empty.json",
    "fleet_feedback_labels_total": "prom_empty.json",
}


def prometheus(overrides: dict[str, Answer] | None = None):
    """An /api/v1/query handler answering each metric's query from its stored answer."""

    def answer(path: str, query: dict[str, str], headers) -> Answer:
        assert path == "/api/v1/query"
        metric = next(m for m in PROM_ANSWERS if m in query["query"])
        if overrides and metric in overrides:
            return overrides[metric]
        return 200, fixture(PROM_ANSWERS[metric])

    return answer


def test_prometheus_window_from_stored_answers(serve) -> None:
    server = serve(prometheus())
    w = PrometheusMetrics(server.url).window(MODEL, "1.1.0", END - 60, END)
    assert (w.model, w.version, w.start, w.end) == (MODEL, "1.1.0", END - 60, END)
    assert w.requests == 813  # increase() extrapolates: 813.35 rounds to 813
    assert w.errors == {"5xx": 2, "timeout": 1, "unreachable": 0}  # no series: zero
    # cumulative le buckets → per-bucket counts; le=0.3 came back below le=0.2 (extrapolated
    # from a younger series) and is clamped to 0 instead of going negative
    assert w.latency_ms == (0, 3, 20, 140, 200, 180, 150, 70, 30, 10, 4, 2, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0)
    assert w.predictions == (301, 200, 120, 80, 50, 30, 15, 10, 5, 0)
    assert (w.shadow_pairs, w.shadow_agreed) == (120, 118)
    assert w.tpot_ms == () and w.output_tokens == ()  # no generations: no histograms, no generation gates


def test_prometheus_window_of_a_generative_version_has_time_per_token_and_output_lengths(serve) -> None:
    lengths = {
        "+Inf": 100,
        **{
            str(float(b)): c
            for b, c in zip(OUTPUT_TOKEN_BUCKETS, [0, 0, 5, 20, 60, 90, 100, 100, 100, 100, 100, 100, 100], strict=True)
        },
    }
    body = {
        "status": "success",
        "data": {
            "resultType": "vector",
            "result": [{"metric": {"le": le}, "value": [END, str(v)]} for le, v in lengths.items()],
        },
    }
    server = serve(
        prometheus(
            {
                "fleet_time_per_output_token_seconds_bucket": (200, fixture("prom_latency.json")),
                "fleet_generation_output_tokens_bucket": (200, json.dumps(body).encode()),
            }
        )
    )
    w = PrometheusMetrics(server.url).window(MODEL, "1.1.0", END - 60, END)
    assert w.tpot_ms == w.latency_ms  # the same bucket layout, read the same way
    assert w.output_tokens == (0, 0, 5, 15, 40, 30, 10, 0, 0, 0, 0, 0, 0, 0)
    assert (w.labelled, w.matched) == (0, 0)


def test_prometheus_window_counts_exact_match_labels_by_outcome(serve) -> None:
    body = {
        "status": "success",
        "data": {
            "resultType": "vector",
            "result": [
                {"metric": {"outcome": "match"}, "value": [END, "40.4"]},
                {"metric": {"outcome": "mismatch"}, "value": [END, "9.7"]},
            ],
        },
    }
    server = serve(prometheus({"fleet_feedback_labels_total": (200, json.dumps(body).encode())}))
    w = PrometheusMetrics(server.url).window(MODEL, "1.1.0", END - 60, END)
    assert (w.labelled, w.matched) == (50, 40)  # extrapolated counts rounded, as every other counter


def test_prometheus_queries_increase_over_the_window_at_its_end(serve) -> None:
    server = serve(prometheus())
    PrometheusMetrics(server.url + "/").window(MODEL, "1.1.0", END - 59.2, END)
    queries = [q for _, q, _ in server.seen]
    assert len(queries) == 8
    assert {q["time"] for q in queries} == {"1764590060.000"}
    for q in queries:  # a 59.2 s window asks for ceil = 60 s, for this model and version only
        assert '{model="demo-classifier",version="1.1.0"' in q["query"] and "[60s]))" in q["query"]
    by_metric = {m: q["query"] for q in queries for m in PROM_ANSWERS if m in q["query"]}
    assert by_metric["fleet_upstream_duration_seconds_bucket"].startswith("sum by (le) (increase(")
    assert by_metric["fleet_version_errors_total"].startswith("sum by (class) (increase(")
    assert 'outcome=~"agree|disagree"' in by_metric["fleet_shadow_requests_total"]


def test_prometheus_escapes_label_values(serve) -> None:
    server = serve(lambda *_: (200, fixture("prom_empty.json")))
    PrometheusMetrics(server.url).window('we"ird\\', "1.0.0", END - 10, END)
    assert 'model="we\\"ird\\\\"' in server.seen[0][1]["query"]


def test_prometheus_empty_results_are_zeros_not_an_error(serve) -> None:
    server = serve(lambda *_: (200, fixture("prom_empty.json")))
    w = PrometheusMetrics(server.url).window(MODEL, "9.9.9", END - 60, END)
    assert (w.requests, w.error_count, sum(w.latency_ms), sum(w.predictions), w.shadow_pairs) == (0, 0, 0, 0, 0)
    assert len(w.latency_ms) == len(LATENCY_BUCKETS_MS) + 1


def test_unreachable_prometheus_raises_metrics_unavailable_with_its_url() -> None:
    url = dead_url()
    with pytest.raises(MetricsUnavailable, match=f"Prometheus at {url}/api/v1/query could not be reached"):
        PrometheusMetrics(url, timeout_s=2).window(MODEL, "1.1.0", END - 60, END)


def test_prometheus_timeout_is_unavailable_and_a_bad_query_is_a_bad_answer(serve) -> None:
    timeout = serve(prometheus({"fleet_version_requests_total": (503, fixture("prom_timeout.json"))}))
    with pytest.raises(MetricsUnavailable, match="503 timeout: query timed out") as caught:
        PrometheusMetrics(timeout.url).window(MODEL, "1.1.0", END - 60, END)
    assert not isinstance(caught.value, BadMetricsAnswer) and caught.value.status == 503
    bad = serve(prometheus({"fleet_version_requests_total": (400, fixture("prom_bad_data.json"))}))
    with pytest.raises(BadMetricsAnswer, match="400 bad_data: invalid parameter") as caught:
        PrometheusMetrics(bad.url).window(MODEL, "1.1.0", END - 60, END)
    assert caught.value.status == 502
    proxy = serve(lambda *_: (502, b"<html>Bad Gateway</html>"))
    with pytest.raises(MetricsUnavailable, match="502 without a JSON body"):
        PrometheusMetrics(proxy.url).window(MODEL, "1.1.0", END - 60, END)


def test_prometheus_histogram_with_other_buckets_is_refused(serve) -> None:
    answer = json.loads(fixture("prom_latency.json"))
    answer["data"]["result"][3]["metric"]["le"] = "0.25"
    server = serve(prometheus({"fleet_upstream_duration_seconds_bucket": (200, json.dumps(answer).encode())}))
    with pytest.raises(BadMetricsAnswer, match="has bucket le=0.25"):
        PrometheusMetrics(server.url).window(MODEL, "1.1.0", END - 60, END)


def test_prometheus_url_is_checked_at_the_boundary() -> None:
    with pytest.raises(ConfigError, match="'prometheus:9090' is not a URL"):
        PrometheusMetrics("prometheus:9090")


# -- gateways -----------------------------------------------------------------------------


def gateway(name: str, token: str = TOKEN):
    def answer(path: str, query: dict[str, str], headers: dict[str, str]) -> Answer:
        given = headers.get("Authorization", "")
        gid = given.split(" ", 1)[-1].split(":")[1] if ":" in given else ""
        if TOKEN in given or not gateway_directory.verify(given, token, "stats", gid):  # scoped, never the token itself
            return 401, b'{"error": "admin token required"}'
        assert path == f"/admin/stats/{MODEL}"
        return 200, fixture(name)

    return answer


def announce(store: MemoryStore, url: str, gid: str, age_s: float = 0.0) -> None:
    t = audit.now() - timedelta(seconds=age_s)
    record = GatewayRecord(id=gid, url=url, host="h", pid=1, started_at=t, heartbeat_at=t)
    if age_s:  # announce() stamps a fresh heartbeat; a dead gateway's record is just old
        store.put(gateway_directory.key(gid), records.dump(record))
    else:
        gateway_directory.announce(store, record)


def test_gateway_source_sums_every_live_gateway(serve) -> None:
    a, b = serve(gateway("gateway_stats_a.json")), serve(gateway("gateway_stats_b.json"))
    store = MemoryStore()
    announce(store, a.url, "gw-a")
    announce(store, b.url + "/", "gw-b")
    source = GatewayMetrics(store, TOKEN, clock=lambda: END)
    stable = source.window(MODEL, "1.0.0", END - 59.5, END)
    assert stable.requests == 812 + 400
    assert stable.errors == {"5xx": 2, "timeout": 1, "unreachable": 0}
    assert sum(stable.latency_ms) == 811 + 398 and stable.latency_ms[-1] == 1
    assert stable.predictions[:4] == (60, 150, 300, 330)
    # the range the gateways covered: b's started a second before a's
    assert (stable.start, stable.end) == (1764590000.0, 1764590061.0)
    canary = source.window(MODEL, "1.1.0", END - 59.5, END)  # only gateway a saw the canary
    assert (canary.requests, canary.errors["5xx"], canary.errors["unreachable"]) == (95, 4, 1)
    for server in (a, b):
        assert [(p, q) for p, q, _ in server.seen] == [
            (f"/admin/stats/{MODEL}", {"window_s": "61"})
        ] * 2  # start's second included


def test_gateway_refusing_the_token_is_a_config_error(serve) -> None:
    server = serve(gateway("gateway_stats_a.json", token="another"))
    store = MemoryStore()
    announce(store, server.url, "gw-a")
    with pytest.raises(ConfigError, match="refused the admin token \\(401\\); check FLEET_ADMIN_TOKEN"):
        GatewayMetrics(store, TOKEN, clock=lambda: END).window(MODEL, "1.0.0", END - 60, END)


def test_one_unreachable_live_gateway_fails_the_read(serve) -> None:
    server, dead = serve(gateway("gateway_stats_a.json")), dead_url()
    store = MemoryStore()
    announce(store, server.url, "gw-a")
    announce(store, dead, "gw-dead")
    with pytest.raises(MetricsUnavailable, match=f"gateway at {dead}/admin/stats/{MODEL} could not be reached"):
        GatewayMetrics(store, TOKEN, timeout_s=2, clock=lambda: END).window(MODEL, "1.0.0", END - 60, END)


def test_gateways_with_stale_heartbeats_are_not_asked(serve) -> None:
    server = serve(gateway("gateway_stats_a.json"))
    store = MemoryStore()
    announce(store, server.url, "gw-a")
    announce(store, dead_url(), "gw-gone", age_s=gateway_directory.STALE_AFTER_S + 5)
    w = GatewayMetrics(store, TOKEN, clock=lambda: END).window(MODEL, "1.0.0", END - 60, END)
    assert w.requests == 812


def test_a_gateway_announcing_an_untrusted_url_fails_the_read_and_gets_nothing(serve, monkeypatch) -> None:
    server = serve(gateway("gateway_stats_a.json"))
    store = MemoryStore()
    announce(store, server.url, "gw-a")
    announce(store, "http://203.0.113.7:8000", "gw-planted")  # written by whoever can write gateways/
    monkeypatch.delenv("FLEET_GATEWAY_NETWORKS", raising=False)
    with pytest.raises(
        MetricsUnavailable, match="gw-planted announces http://203.0.113.7:8000, which is not on loopback"
    ):
        GatewayMetrics(store, TOKEN, clock=lambda: END).window(MODEL, "1.0.0", END - 60, END)
    assert server.seen == []  # refused before anyone was asked
    monkeypatch.setenv("FLEET_GATEWAY_NETWORKS", "203.0.113.0/24")
    with pytest.raises(MetricsUnavailable, match="gw-planted/|203.0.113.7:8000/admin/stats"):
        GatewayMetrics(store, TOKEN, timeout_s=0.5, clock=lambda: END).window(MODEL, "1.0.0", END - 60, END)


def test_no_live_gateway_is_unavailable_not_zeros() -> None:
    store = MemoryStore()
    with pytest.raises(MetricsUnavailable, match="no live gateway registered in memory://"):
        GatewayMetrics(store, TOKEN, clock=lambda: END).window(MODEL, "1.0.0", END - 60, END)


def test_gateway_source_serves_only_windows_ending_now() -> None:
    source = GatewayMetrics(MemoryStore(), TOKEN, clock=lambda: END)
    with pytest.raises(InvalidInput, match="ending now; asked for one ending at .*\\+120.0 s from now"):
        source.window(MODEL, "1.0.0", END - 180, END - 120)
    with pytest.raises(InvalidInput, match="window of 902 s; gateways keep at most the last 900 s"):
        source.window(MODEL, "1.0.0", END - 900.5, END)


def test_gateway_with_another_bucket_layout_is_refused(serve) -> None:
    stats = json.loads(fixture("gateway_stats_a.json"))
    stats["latency_buckets_ms"][0] = 0.5
    server = serve(lambda *_: (200, json.dumps(stats).encode()))
    store = MemoryStore()
    announce(store, server.url, "gw-a")
    with pytest.raises(BadMetricsAnswer, match="uses latency buckets \\[0.5, 2"):
        GatewayMetrics(store, TOKEN, clock=lambda: END).window(MODEL, "1.0.0", END - 60, END)


def test_gateway_answer_of_the_wrong_shape_names_the_field(serve) -> None:
    stats = json.loads(fixture("gateway_stats_a.json"))
    stats["versions"]["1.0.0"]["latency_ms"] = [1, 2]
    server = serve(lambda *_: (200, json.dumps(stats).encode()))
    store = MemoryStore()
    announce(store, server.url, "gw-a")
    with pytest.raises(BadMetricsAnswer, match="invalid at versions.1.0.0.latency_ms"):
        GatewayMetrics(store, TOKEN, clock=lambda: END).window(MODEL, "1.0.0", END - 60, END)


# -- factory, fake, shared helpers ----------------------------------------------------------


def test_open_metrics_defaults_to_the_gateways(monkeypatch) -> None:
    monkeypatch.delenv("FLEET_METRICS", raising=False)
    monkeypatch.delenv("FLEET_ADMIN_TOKEN", raising=False)
    with pytest.raises(ConfigError, match="needs FLEET_ADMIN_TOKEN"):
        open_metrics(store=MemoryStore())
    monkeypatch.setenv("FLEET_ADMIN_TOKEN", TOKEN)
    source = open_metrics(store=MemoryStore())
    assert isinstance(source, GatewayMetrics) and isinstance(source, MetricsSource)


def test_open_metrics_prometheus_needs_its_url(monkeypatch) -> None:
    monkeypatch.setenv("FLEET_METRICS", "prometheus")
    monkeypatch.delenv("FLEET_PROMETHEUS_URL", raising=False)
    with pytest.raises(ConfigError, match="needs FLEET_PROMETHEUS_URL"):
        open_metrics()
    monkeypatch.setenv("FLEET_PROMETHEUS_URL", "http://prometheus:9090")
    source = open_metrics()
    assert isinstance(source, PrometheusMetrics) and source.url == "http://prometheus:9090"


@pytest.mark.parametrize("kind", ["datadog", "memory", "Gateway"])
def test_unknown_metrics_kind_is_refused_not_replaced(monkeypatch, kind: str) -> None:
    monkeypatch.setenv("FLEET_PROMETHEUS_URL", "http://prometheus:9090")
    monkeypatch.setenv("FLEET_METRICS", kind)
    expected = f"FLEET_METRICS '{kind}' is not a metrics source; expected one of gateway, prometheus"
    with pytest.raises(ConfigError, match=expected):
        open_metrics()
    monkeypatch.delenv("FLEET_METRICS")
    with pytest.raises(ConfigError, match=f"'{kind}'"):
        open_metrics(kind)


def test_errors_share_the_fleet_root_and_carry_a_status() -> None:
    assert issubclass(MetricsUnavailable, FleetError) and MetricsUnavailable.status == 503
    assert issubclass(BadMetricsAnswer, MetricsUnavailable)  # a rollout holds on either


def test_memory_fake_sums_what_was_served_in_the_window() -> None:
    m = MemoryMetrics()
    m.answered(MODEL, "1.1.0", at=100.0, latency_ms=12.0, scores=[0.7, 1.0], count=50)
    m.failed(MODEL, "1.1.0", at=101.0, error_class="timeout")
    m.shadow_pair(MODEL, "1.1.0", at=102.0, agreed=True, count=3)
    m.shadow_pair(MODEL, "1.1.0", at=102.0, agreed=False)
    m.answered(MODEL, "1.0.0", at=100.0, latency_ms=8.0)  # another version
    m.answered(MODEL, "1.1.0", at=110.0, latency_ms=12.0)  # just past the window's end
    w = m.window(MODEL, "1.1.0", 100.0, 110.0)
    assert (w.start, w.end, w.requests, w.errors["timeout"]) == (100.0, 110.0, 51, 1)
    assert w.latency_ms[latency_bucket(12.0)] == 50 and sum(w.latency_ms) == 50
    assert w.predictions[7] == 50 and w.predictions[9] == 50
    assert (w.shadow_pairs, w.shadow_agreed) == (4, 3)
    assert m.window(MODEL, "2.0.0", 0, 1000).requests == 0
    assert m.reads == [(MODEL, "1.1.0", 100.0, 110.0), (MODEL, "2.0.0", 0, 1000)]
    m.unavailable = "Prometheus down"
    with pytest.raises(MetricsUnavailable, match="Prometheus down"):
        m.window(MODEL, "1.1.0", 100.0, 110.0)
    with pytest.raises(InvalidInput, match="error class 'oops'"):
        m.failed(MODEL, "1.1.0", at=1.0, error_class="oops")


def test_sum_windows_adds_ticks_and_refuses_other_versions() -> None:
    m = MemoryMetrics()
    m.answered(MODEL, "1.1.0", at=5.0, latency_ms=3.0, count=2)
    m.failed(MODEL, "1.1.0", at=15.0)
    ticks = [m.window(MODEL, "1.1.0", 0.0, 10.0), m.window(MODEL, "1.1.0", 10.0, 20.0)]
    total = sum_windows(ticks, MODEL, "1.1.0", 0.0, 20.0)
    assert (total.start, total.end, total.requests, total.error_count) == (0.0, 20.0, 3, 1)
    assert sum_windows([], MODEL, "1.1.0", 0.0, 20.0).requests == 0
    with pytest.raises(InvalidInput, match="cannot add a window of demo-classifier 1.1.0 to demo-classifier 1.0.0"):
        sum_windows(ticks, MODEL, "1.0.0", 0.0, 20.0)


def test_binning_follows_the_prometheus_le_rule() -> None:
    assert [latency_bucket(ms) for ms in (0.0, 1.0, 1.01, 10.0, 10.1, 10000.0, 10000.1)] == [0, 0, 1, 5, 6, 20, 21]
    assert [score_bin(s) for s in (0.0, 0.0999, 0.1, 0.35, 0.99, 1.0)] == [0, 0, 1, 3, 9, 9]
