"""A dependency-free SVG line plot: reward curves without matplotlib in the trainer's deps."""

from __future__ import annotations

from pathlib import Path

COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f")


def line_plot(series: dict[str, list[tuple[float, float]]], path: Path, title: str, x_label: str) -> None:
    """One polyline per series (NaN points left out), a legend, and the axes' ranges as labels.

    Series named alike up to a ``#`` suffix (``trl-2t#1``, ``trl-2t#2``) share a colour.
    """
    clean = {name: [(x, y) for x, y in points if y == y] for name, points in series.items()}
    clean = {name: points for name, points in clean.items() if len(points) >= 2}
    if not clean:
        return
    xs = [x for points in clean.values() for x, _ in points]
    ys = [y for points in clean.values() for _, y in points]
    width, height, pad = 720, 360, 48
    x0, x1, y0, y1 = min(xs), max(xs), min(ys), max(ys)
    x1 = x1 if x1 > x0 else x0 + 1
    y1 = y1 if y1 > y0 else y0 + 1e-6

    def xy(x: float, y: float) -> str:
        px = pad + (x - x0) / (x1 - x0) * (width - 2 * pad)
        py = height - pad - (y - y0) / (y1 - y0) * (height - 2 * pad)
        return f"{px:.1f},{py:.1f}"

    families = list(dict.fromkeys(name.split("#")[0] for name in clean))
    color = {family: COLORS[i % len(COLORS)] for i, family in enumerate(families)}
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}">',
        '<rect width="100%" height="100%" fill="white"/>',
        f'<text x="{pad}" y="20" font-family="sans-serif" font-size="14">{title}</text>',
        f'<text x="{pad}" y="{height - 10}" font-family="sans-serif" font-size="12">{x_label} {x0:g} .. {x1:g}</text>',
        f'<text x="5" y="{pad}" font-family="sans-serif" font-size="12">{y1:.3f}</text>',
        f'<text x="5" y="{height - pad}" font-family="sans-serif" font-size="12">{y0:.3f}</text>',
    ]
    for name, points in clean.items():
        polyline = " ".join(xy(x, y) for x, y in points)
        stroke = color[name.split("#")[0]]
        parts.append(f'<polyline fill="none" stroke="{stroke}" stroke-width="1.5" points="{polyline}"/>')
    for i, family in enumerate(families):
        y = pad + 16 * i
        parts.append(
            f'<text x="{width - pad - 120}" y="{y}" font-family="sans-serif" font-size="12" '
            f'fill="{color[family]}">{family}</text>'
        )
    parts.append("</svg>\n")
    path.write_text("".join(parts))
