"""``fleet top``'s text, pure: sorting and filtering rows, the table's cells within 80 columns,
the head line, the panels' lines and a version's detail (``fleet.cli.top_merge`` has the data)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fleet.types import ERROR_CLASSES, LATENCY_BUCKETS_MS, OUTPUT_TOKEN_BUCKETS

if TYPE_CHECKING:  # numpy comes with the merge: `fleet top` imports it when it runs, no command before
    from fleet.cli.top_merge import FleetTop, Row

SORTS = ("model", "rps", "errors", "p99", "queue")  # the orders of the versions, `s` cycles them


def sort_rows(rows: list[Row], by: str) -> list[Row]:
    name = lambda r: (r.model, r.version)  # noqa: E731
    keys = {
        "model": name,
        "rps": lambda r: (-r.rps, *name(r)),
        "errors": lambda r: (-(r.error_rate or 0.0), -r.requests, *name(r)),
        "p99": lambda r: (-(r.p99_ms or 0.0), *name(r)),
        "queue": lambda r: (-(r.queue + r.held), -r.shed, *name(r)),
    }
    return sorted(rows, key=keys[by])


def matches(row: Row, text: str) -> bool:
    """The filter: a model whose name holds ``text`` (empty: every model)."""
    return text.lower() in row.model.lower()


# (header, width): 67 with the 11 gaps between columns, 78; 80 columns fit with a scroll bar
COLUMNS = (
    ("model", 13),
    ("version", 7),
    ("rps", 6),
    ("err%", 5),
    ("p50", 5),
    ("p99", 5),
    ("tok/s", 5),
    ("share", 5),
    ("rep", 3),
    ("infl", 4),
    ("queue", 5),
    ("shed", 4),
)


def num(value: float | None, width: int = 5) -> str:
    """A number in at most ``width`` characters: 0.52, 12.3, 842, 1.2k, 35k, 1.2M; ``-`` for none."""
    if value is None:
        return "-"
    if value == 0:
        return "0"
    whole = float(value).is_integer()
    for scale, unit in ((1.0, ""), (1e3, "k"), (1e6, "M"), (1e9, "G")):
        if unit and unit != "G" and abs(value) / scale >= 999.5:
            continue  # 1.2M, not 1200k
        for digits in (0,) if whole and scale == 1.0 else (2, 1, 0):
            text = f"{value / scale:.{digits}f}{unit}"
            if len(text) <= width:
                return text
    return "huge"


def fit(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


def cells(row: Row) -> list[str]:
    """The table's cells for ``row``, each within its column's width."""
    pct = None if row.error_rate is None else 100 * row.error_rate
    w = [width for _, width in COLUMNS]
    return [
        fit(row.model, w[0]),
        fit(row.version, w[1]),
        num(row.rps, w[2]),
        num(pct, w[3]),
        num(row.p50_ms, w[4]),
        num(row.p99_ms, w[5]),
        num(row.tokens_per_s, w[6]) if row.generative else "",
        "-" if row.share is None else num(100 * row.share, w[7] - 1) + "%",
        num(row.replicas, w[8]),
        num(row.in_flight, w[9]),
        num(row.queue + row.held, w[10]),
        num(row.shed, w[11]),
    ]


def line(values: list[str]) -> str:
    """One line of the plain table: model and version left, numbers right, one space between."""
    out = []
    for i, ((_, width), value) in enumerate(zip(COLUMNS, values, strict=True)):
        out.append(value.ljust(width) if i < 2 else value.rjust(width))
    return " ".join(out).rstrip()


def headline(top: FleetTop, sort: str = "model", text: str = "") -> str:
    ok = sum(g.ok for g in top.gateways)
    stale = sum(g.ok and g.stale for g in top.gateways)
    parts = [f"{ok}/{len(top.gateways)} gateways"]
    if stale:
        parts.append(f"{stale} stale")
    down = [g for g in top.gateways if not g.ok]
    if down:
        parts.append("not read: " + ", ".join(g.id for g in down[:3]) + ("…" if len(down) > 3 else ""))
    parts.append(f"window {top.window_s}s")
    parts.append(f"sort {sort}")
    if text:
        parts.append(f"filter {text!r}")
    return "  ".join(parts)


def tenant_lines(top: FleetTop) -> list[str]:
    span = f"{top.span_s:.0f}s" if top.span_s < 120 else f"{top.span_s / 60:.0f}min"
    lines = [
        f"quota refusals {num(top.refused_per_s)}/s ({top.refused} in {span})"
        + (": " + ", ".join(f"{t.tenant} {t.refused}" for t in top.tenants_refused[:5]) if top.refused else "")
    ]
    shown = ", ".join(f"{t.tenant} {num(t.rps)}/s" for t in top.tenants)
    lines.append(f"top tenants ({top.tenants_active}+ active): {shown or '-'}")
    return lines


def progress_lines(top: FleetTop, text: str = "") -> list[str]:
    lines = []
    for p in top.progress:
        if text.lower() in p.model.lower():
            lines.append(f"{p.model} {p.headline}")
            if p.evidence:
                lines.append(f"  {p.evidence}")
    return lines or ["no rollout or experiment in progress"]


def bars(counts: list[int], bounds: tuple[float, ...] | list[float], unit: str, width: int = 40) -> list[str]:
    """A histogram as text bars, the buckets holding something only: ``≤ 20ms  ███ 312``."""
    most = max(counts, default=0)
    lines = []
    for i, c in enumerate(counts):
        if not c:
            continue
        label = f"≤ {bounds[i]:g}{unit}" if i < len(bounds) else f"> {bounds[-1]:g}{unit}"
        lines.append(f"{label:>10} {'█' * max(1, round(width * c / most)):<{width}} {c}")
    return lines


def detail_lines(top: FleetTop, row: Row) -> list[str]:
    """A version's detail: its counts, quantiles, histograms, gateways and its model's rollout."""
    share = "-" if row.share is None else f"{100 * row.share:.1f}%"
    errors = ", ".join(f"{c} {row.errors.get(c, 0)}" for c in ERROR_CLASSES)
    rate = "-" if row.error_rate is None else f"{100 * row.error_rate:.2f}%"
    what = "time to first token" if row.generative else "latency"
    lines = [
        f"{row.model} {row.version}  {row.role or 'not routed now'}",
        f"requests {row.requests} in {top.window_s} s ({num(row.rps)}/s), {share} of the model's",
        f"errors {rate}: {errors}",
        f"{what} p50 {num(row.p50_ms)} ms, p99 {num(row.p99_ms)} ms",
        f"replicas {row.replicas} ({row.ejected} ejected), in flight {row.in_flight}, queued {row.queue}, "
        f"held for a cold start {row.held}, shed (503) {row.shed} in {top.span_s:.0f} s",
    ]
    if row.generative:
        stream = f" ({1000 / row.tpot_p50_ms:.0f} tokens/s a stream)" if row.tpot_p50_ms else ""
        lines.append(
            f"time per output token p50 {num(row.tpot_p50_ms)} ms{stream}; {num(row.tokens_per_s)} completion tokens/s"
        )
    lines += ["", f"{what} (ms):", *(bars(row.latency_ms, LATENCY_BUCKETS_MS, "") or ["  nothing in the window"])]
    if row.generative:
        lines += ["", "time per output token (ms):", *bars(row.tpot_ms, LATENCY_BUCKETS_MS, "")]
        lines += ["", "output tokens:", *bars(row.output_tokens, OUTPUT_TOKEN_BUCKETS, "")]
    lines += ["", "requests by gateway:"]
    lines += [f"  {gw} {n}" for gw, n in sorted(row.by_gateway.items())] or ["  none in the window"]
    for p in top.progress:
        if p.model == row.model:
            lines += ["", f"{p.kind}: {p.headline}"]
            if p.evidence:
                lines.append(f"  {p.evidence}")
            for g in p.gates:
                lines.append(
                    f"  {g.get('gate', '?')}: {g.get('status', '?')}, observed {g.get('observed', '-')}, "
                    f"allowed {g.get('allowed', '-')}"
                )
    return lines
