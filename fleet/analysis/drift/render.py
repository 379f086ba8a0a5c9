"""Drift reports for people: a markdown artifact and an SVG of reference vs current histograms.

matplotlib is not among the project's dependencies, so the plot is SVG written here: a small,
dependency-free picture that a Prefect markdown artifact can embed as a data URI and that
``reports/<model>/…`` can hold as a file.
"""

from __future__ import annotations

import base64
from collections.abc import Sequence
from xml.sax.saxutils import escape

from fleet.analysis.drift.report import ConceptDrift, DistributionDrift, DriftReport, FeatureDrift

_REFERENCE, _CURRENT = "#9aa0a6", "#e8710a"
_W, _H, _PAD = 440, 200, 36  # one panel


def _num(value: float | None, digits: int = 4) -> str:
    return "–" if value is None else f"{value:.{digits}g}"


def _stat(s) -> str:
    text = _num(s.value)
    return f"**{text}**" if s.exceeded else text


def drift_markdown(report: DriftReport, concept: ConceptDrift | None = None) -> str:
    """Verdict, one table row per feature (drifting first), predictions and concept drift."""
    t = report.thresholds
    w = "off" if t.wasserstein is None else f"> {t.wasserstein:g}"
    lines = [
        f"## Drift: {report.verdict}",
        "",
        f"{report.reason}. {report.rows} rows (min_rows {report.min_rows}).",
        "",
        f"Thresholds: PSI > {t.psi:g}, JS > {t.js:g}, Wasserstein {w}; alert at "
        f"{t.features_drifting_to_alert} drifting features. KS p < {t.ks_pvalue:g} is shown but never "
        "decides (large samples make it flag everything). Bold: over its threshold.",
        "",
        "| feature | status | PSI | JS | Wasserstein | W / std | KS D | KS p | nulls (baseline) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for f in sorted(report.features, key=lambda f: not f.drifting):
        nulls = f"{_num(f.null_rate, 3)} ({_num(f.baseline_null_rate, 3)})"
        status = f"**{f.status}**" if f.drifting else f.status
        cells = [
            f.feature,
            status,
            _stat(f.psi),
            _stat(f.js),
            _stat(f.wasserstein),
            _num(f.wasserstein_norm),
            _num(f.ks_statistic),
            _stat(f.ks_pvalue),
            nulls,
        ]
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    p = report.prediction
    if p is not None:
        lines += ["", f"Predictions ({p.rows} rows): {'**drifting**' if p.drifting else 'stable'}."]
        for label, d in (("score", p.score), ("classes", p.classes)):
            if d is not None:
                lines.append(f"- {label}: PSI {_stat(d.psi)}, JS {_stat(d.js)}")
    if concept is not None:
        lines += ["", f"Labelled feedback ({concept.rows} rows): {concept.verdict} — {concept.reason}."]
        lines.append(f"- F1 {_num(concept.f1)} vs baseline {_num(concept.baseline_f1)}")
    return "\n".join(lines) + "\n"


def _panel(
    x0: float, y0: float, title: str, bins: Sequence[str], ref: Sequence[float], cur: Sequence[float]
) -> list[str]:
    top = max([*ref, *cur, 1e-12])
    plot_w, plot_h = _W - 2 * _PAD, _H - 2 * _PAD
    slot = plot_w / max(len(bins), 1)
    bar = slot * 0.4
    base_y = y0 + _H - _PAD
    out = [
        f'<text x="{x0 + _PAD}" y="{y0 + 18}" font-size="13" font-weight="bold">{escape(title)}</text>',
        f'<line x1="{x0 + _PAD}" y1="{base_y}" x2="{x0 + _W - _PAD}" y2="{base_y}" stroke="#444"/>',
    ]
    for i, (label, r, c) in enumerate(zip(bins, ref, cur)):
        left = x0 + _PAD + i * slot + slot * 0.1
        for j, (value, colour) in enumerate(((r, _REFERENCE), (c, _CURRENT))):
            h = plot_h * value / top
            out.append(
                f'<rect x="{left + j * bar:.1f}" y="{base_y - h:.1f}" width="{bar:.1f}" height="{h:.1f}" '
                f'fill="{colour}"><title>{escape(label)}: {value:.3%}</title></rect>'
            )
        if i in (0, len(bins) - 1) or len(bins) <= 6:
            anchor = "start" if i == 0 else "end" if i == len(bins) - 1 else "middle"
            x = left if anchor == "start" else left + 2 * bar if anchor == "end" else left + bar
            out.append(
                f'<text x="{x:.1f}" y="{base_y + 14}" font-size="10" text-anchor="{anchor}">{escape(label)}</text>'
            )
    return out


def drift_svg(report: DriftReport, features: Sequence[str] | None = None, *, columns: int = 2) -> bytes:
    """Reference (grey) vs current (orange) histograms, one panel per feature → SVG bytes.

    ``features`` defaults to the drifting ones; the prediction score is added when it drifts.
    """
    names = list(report.drifting_features if features is None else features)
    panels: list[tuple[str, FeatureDrift | DistributionDrift]] = [(n, report.feature(n)) for n in names]
    if (
        report.prediction is not None
        and report.prediction.score is not None
        and (features is None and report.prediction.drifting)
    ):
        panels.append(("prediction score", report.prediction.score))
    panels = [(n, d) for n, d in panels if d.bins]
    rows = max(1, -(-len(panels) // columns))
    width, height = _W * min(columns, max(len(panels), 1)), _H * rows + 24
    body = [
        f'<text x="8" y="16" font-size="12"><tspan fill="{_REFERENCE}">■ reference (baseline)</tspan> '
        f'<tspan fill="{_CURRENT}">■ current window</tspan></text>'
    ]
    if not panels:
        body.append('<text x="8" y="60" font-size="13">no drifting features</text>')
    for k, (name, d) in enumerate(panels):
        title = f"{name} — PSI {_num(d.psi.value, 3)}, JS {_num(d.js.value, 3)}"
        body += _panel(_W * (k % columns), 24 + _H * (k // columns), title, d.bins, d.reference, d.current)
    svg = (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-family="sans-serif">'
        f'<rect width="100%" height="100%" fill="white"/>{"".join(body)}</svg>'
    )
    return svg.encode()


def svg_data_uri(svg: bytes) -> str:
    """For a markdown artifact: ``![drift](<this>)``."""
    return "data:image/svg+xml;base64," + base64.b64encode(svg).decode()
