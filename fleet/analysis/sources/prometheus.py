"""Metrics from Prometheus (production): instant queries of ``increase(...[Ns])`` at
``time=end`` over the gateway's exposition (names in docs/architecture.md, "Gateway
telemetry"), summed over every gateway instance and tenant.

- requests: ``fleet_version_requests_total``; errors: ``fleet_version_errors_total`` by ``class``
- latency: ``fleet_upstream_duration_seconds_bucket`` by ``le``, cumulative, turned into
  per-bucket counts. The upstream histogram, not ``fleet_request_duration_seconds``: it is
  the one the gateway observes exactly where its windowed stats record latency (answered
  requests of a version only), so both sources give the same ArmWindow. The request
  histogram also counts failures, 4xx answers and cache hits.
- predictions: ``fleet_predictions_total`` by ``bin``; shadow pairs:
  ``fleet_shadow_requests_total`` with outcome ``agree`` / ``disagree``.
- generations: the upstream histogram holds their time to first token (as the windowed
  stats' latency does); ``fleet_time_per_output_token_seconds_bucket`` and
  ``fleet_generation_output_tokens_bucket`` give ``tpot_ms`` and ``output_tokens``, empty when
  the version served no generation; ``fleet_feedback_labels_total`` by ``outcome`` (match,
  mismatch) gives ``labelled`` and ``matched``.

``increase`` extrapolates to the range's edges, so counts come back as floats: they are
rounded, and bucket differences that extrapolation made negative are clamped to 0. It
errs by up to about two scrape intervals over the range (measured: +6 % on a 12 s range
scraped every second), so keep analysis windows many scrape intervals long. A
series that does not exist (nothing served) is an empty result, read as zeros.
"""

from __future__ import annotations

import math
from urllib.parse import urlsplit

import httpx

from fleet.analysis.sources._common import BadMetricsAnswer, MetricsUnavailable
from fleet.errors import ConfigError
from fleet.types import ERROR_CLASSES, LATENCY_BUCKETS_MS, OUTPUT_TOKEN_BUCKETS, PREDICTION_BINS, ArmWindow

REQUESTS = "fleet_version_requests_total"
ERRORS = "fleet_version_errors_total"
LATENCY = "fleet_upstream_duration_seconds_bucket"
PREDICTIONS = "fleet_predictions_total"
TPOT = "fleet_time_per_output_token_seconds_bucket"
OUTPUT_TOKENS = "fleet_generation_output_tokens_bucket"
SHADOW = "fleet_shadow_requests_total"
LABELS = "fleet_feedback_labels_total"  # exact-match feedback on generations, by outcome match | mismatch
_PAIR_OUTCOMES = ',outcome=~"agree|disagree"'  # both answers arrived: what agreement is over


class PrometheusMetrics:
    max_window_s: int | None = None  # Prometheus keeps its retention: far longer than a look's gap

    def __init__(self, url: str, *, timeout_s: float = 10.0) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ConfigError(f"FLEET_PROMETHEUS_URL {url!r} is not a URL; expected http(s)://host:port[/prefix]")
        self.url = url.rstrip("/")
        self._timeout = httpx.Timeout(timeout_s)

    def window(self, model: str, version: str, start: float, end: float) -> ArmWindow:
        range_s = max(1, math.ceil(end - start))
        sel = f'model="{_quote(model)}",version="{_quote(version)}"'

        def inc(metric: str, extra: str = "") -> str:
            return f"increase({metric}{{{sel}{extra}}}[{range_s}s])"

        with httpx.Client(timeout=self._timeout) as client:
            ask = lambda query, label=None: self._query(client, query, end, label)  # noqa: E731
            requests = ask(f"sum({inc(REQUESTS)})")
            errors = ask(f"sum by (class) ({inc(ERRORS)})", "class")
            buckets = ask(f"sum by (le) ({inc(LATENCY)})", "le")
            predictions = ask(f"sum by (bin) ({inc(PREDICTIONS)})", "bin")
            shadow = ask(f"sum by (outcome) ({inc(SHADOW, _PAIR_OUTCOMES)})", "outcome")
            tpot = ask(f"sum by (le) ({inc(TPOT)})", "le")
            lengths = ask(f"sum by (le) ({inc(OUTPUT_TOKENS)})", "le")
            labels = ask(f"sum by (outcome) ({inc(LABELS)})", "outcome")
        agreed, disagreed = _count(shadow.get("agree", 0.0)), _count(shadow.get("disagree", 0.0))
        return ArmWindow(
            model=model,
            version=version,
            start=end - range_s,
            end=end,
            requests=_count(requests.get(None, 0.0)),
            errors={c: _count(errors.get(c, 0.0)) for c in ERROR_CLASSES},
            latency_ms=self._buckets(buckets),
            predictions=self._bins(predictions),
            shadow_pairs=agreed + disagreed,
            shadow_agreed=agreed,
            tpot_ms=self._buckets(tpot, metric=TPOT) if tpot else (),
            output_tokens=self._buckets(lengths, OUTPUT_TOKEN_BUCKETS, 1.0, OUTPUT_TOKENS) if lengths else (),
            labelled=_count(labels.get("match", 0.0)) + _count(labels.get("mismatch", 0.0)),
            matched=_count(labels.get("match", 0.0)),
        )

    def _query(self, client: httpx.Client, query: str, at: float, label: str | None) -> dict[str | None, float]:
        """label value (None for an unlabelled result) → sample value of an instant vector."""
        url = f"{self.url}/api/v1/query"
        try:
            r = client.get(url, params={"query": query, "time": f"{at:.3f}"})
        except httpx.HTTPError as exc:
            raise MetricsUnavailable(f"Prometheus at {url} could not be reached: {exc}") from None
        try:
            body = r.json()
        except ValueError:
            body = None
        if not isinstance(body, dict):
            kind = MetricsUnavailable if r.status_code >= 500 else BadMetricsAnswer
            raise kind(f"Prometheus at {url} answered {r.status_code} without a JSON body: {r.text[:200]}")
        if body.get("status") != "success":
            # 503/504: timed out or aborted (try again); 400/422: the query itself is wrong
            kind = MetricsUnavailable if r.status_code >= 500 else BadMetricsAnswer
            what = f"{body.get('errorType')}: {body.get('error')}"
            raise kind(f"Prometheus at {url} answered {r.status_code} {what} (query {query})")
        data = body.get("data") or {}
        if data.get("resultType") != "vector":
            raise BadMetricsAnswer(
                f"Prometheus at {url}: expected a vector for {query}, got {data.get('resultType')!r}"
            )
        out: dict[str | None, float] = {}
        for sample in data.get("result", []):
            try:
                key = sample["metric"].get(label) if label else None
                value = float(sample["value"][1])
            except (KeyError, IndexError, TypeError, ValueError):
                raise BadMetricsAnswer(f"Prometheus at {url}: malformed sample {sample!r} for {query}") from None
            out[key] = out.get(key, 0.0) + (0.0 if math.isnan(value) else value)
        return out

    def _buckets(
        self,
        cumulative: dict[str | None, float],
        bounds: tuple[float, ...] = LATENCY_BUCKETS_MS,
        scale: float = 1000.0,
        metric: str = LATENCY,
    ) -> tuple[int, ...]:
        """{le: cumulative count} → counts per bucket of ``bounds`` (``le`` × ``scale``: seconds
        to the milliseconds analysis reads) and the open one."""
        n = len(bounds) + 1
        if not cumulative:
            return (0,) * n
        by_bound = {}
        for le, value in cumulative.items():
            bound = math.inf if le == "+Inf" else _float(le, self.url) * scale
            matches = [i for i, b in enumerate(bounds) if math.isclose(b, bound, rel_tol=1e-9)]
            if bound != math.inf and not matches:
                expected = [b / scale for b in bounds]
                raise BadMetricsAnswer(
                    f"Prometheus at {self.url}: {metric} has bucket le={le}; expected {expected} and +Inf"
                )
            by_bound[len(bounds) if bound == math.inf else matches[0]] = value
        missing = sorted(set(range(n)) - set(by_bound))
        if missing:
            raise BadMetricsAnswer(f"Prometheus at {self.url}: {metric} lacks buckets {missing} of {n}")
        counts, below = [], 0.0
        for i in range(n):
            counts.append(_count(by_bound[i] - below))
            below = max(below, by_bound[i])
        return tuple(counts)

    def _bins(self, by_bin: dict[str | None, float]) -> tuple[int, ...]:
        counts = [0] * PREDICTION_BINS
        for label, value in by_bin.items():
            if label is None or not label.isdigit() or int(label) >= PREDICTION_BINS:
                expected = f"0..{PREDICTION_BINS - 1}"
                raise BadMetricsAnswer(
                    f"Prometheus at {self.url}: {PREDICTIONS} has bin={label!r}; expected {expected}"
                )
            counts[int(label)] = _count(value)
        return tuple(counts)


def _quote(value: str) -> str:
    """A PromQL double-quoted string's content."""
    return value.replace("\\", "\\\\").replace('"', '\\"')


def _count(value: float) -> int:
    return max(0, round(value))


def _float(text: str | None, url: str) -> float:
    try:
        return float(text)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise BadMetricsAnswer(f"Prometheus at {url}: bucket le={text!r} is not a number") from None
