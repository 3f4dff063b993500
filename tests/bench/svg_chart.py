"""Line charts as a small SVG of panels stacked over one time axis, for benchmarks that plot series over time.

An SVG written here rather than matplotlib (not a dependency of the project): the charts are a few polylines with
axes and labels, which renders on any Markdown viewer and diffs as text.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from html import escape

WIDTH = 960
PANEL_HEIGHT = 150
LEFT, RIGHT, TOP, GAP = 70, 170, 30, 42
COLOURS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf", "#7f7f7f")
Points = Sequence[tuple[float, float]]


@dataclass(frozen=True)
class Panel:
    title: str
    lines: Mapping[str, Points]  # legend name → (x, y) points, x ascending


def _ticks(low: float, high: float, count: int = 4) -> list[float]:
    """Round numbers (1, 2 or 5 times a power of ten apart) from low to high, about `count` of them."""
    raw = (high - low or 1.0) / count
    magnitude = 10 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1, 2, 5, 10) if m * magnitude >= raw)
    first = math.ceil(low / step) * step
    return [first + n * step for n in range(int((high - first) / step) + 1)]


def _number(value: float) -> str:
    return f"{value:,.0f}" if abs(value) >= 100 or value == int(value) else f"{value:.2g}"


def chart(panels: Sequence[Panel], markers: Sequence[tuple[float, str]], x_label: str) -> str:
    """The panels one under another, x from 0 to the largest x of any point; each marker a dashed vertical line
    through every panel, its label on the top panel. A name has one colour in every panel."""
    xs = [x for panel in panels for points in panel.lines.values() for x, _ in points]
    x_high = max([*xs, *(x for x, _ in markers), 1.0])
    names = list(dict.fromkeys(name for panel in panels for name in panel.lines))
    colours = {name: COLOURS[k % len(COLOURS)] for k, name in enumerate(names)}
    plot_width = WIDTH - LEFT - RIGHT
    height = TOP + len(panels) * (PANEL_HEIGHT + GAP) + 10
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" viewBox="0 0 {WIDTH} {height}" '
        'font-family="sans-serif" font-size="11">',
        f'<rect width="{WIDTH}" height="{height}" fill="white"/>',
    ]

    def x_at(x: float) -> float:
        return LEFT + plot_width * x / x_high

    for n, panel in enumerate(panels):
        top = TOP + n * (PANEL_HEIGHT + GAP)
        ys = [y for points in panel.lines.values() for _, y in points]
        y_high = max([*ys, 1.0]) * 1.05
        # From zero, unless the values keep well above it: then from near the lowest, so that a slope shows.
        y_low = 0.0 if not ys or min(ys) < y_high / 2 else min(ys) * 0.95

        def y_at(y: float, top: float = top, y_low: float = y_low, y_high: float = y_high) -> float:
            return top + PANEL_HEIGHT * (1 - (y - y_low) / (y_high - y_low))

        out.append(f'<text x="{LEFT}" y="{top - 6}" font-weight="bold">{escape(panel.title)}</text>')
        out.append(
            f'<rect x="{LEFT}" y="{top}" width="{plot_width}" height="{PANEL_HEIGHT}" fill="none" stroke="#999"/>'
        )
        for tick in _ticks(y_low, y_high):
            y = y_at(tick)
            out.append(f'<line x1="{LEFT}" x2="{LEFT + plot_width}" y1="{y:.1f}" y2="{y:.1f}" stroke="#eee"/>')
            out.append(f'<text x="{LEFT - 4}" y="{y + 4:.1f}" text-anchor="end">{_number(tick)}</text>')
        for tick in _ticks(0, x_high, 10):
            x = x_at(tick)
            bottom = top + PANEL_HEIGHT
            out.append(f'<text x="{x:.1f}" y="{bottom + 13}" text-anchor="middle">{_number(tick)}</text>')
        for m, (x_mark, label) in enumerate(markers):
            x = x_at(x_mark)
            out.append(
                f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{top}" y2="{top + PANEL_HEIGHT}" stroke="#555" '
                'stroke-dasharray="3,3"/>'
            )
            if n == 0:
                # Staggered, so that the labels of markers close together do not overlap.
                label_y = top + 10 + 10 * (m % 3)
                out.append(f'<text x="{x + 2:.1f}" y="{label_y}" font-size="9" fill="#333">{escape(label)}</text>')
        for k, (name, points) in enumerate(panel.lines.items()):
            colour = colours[name]
            path = " ".join(f"{x_at(x):.1f},{y_at(y):.1f}" for x, y in points)
            out.append(f'<polyline points="{path}" fill="none" stroke="{colour}" stroke-width="1.5"/>')
            legend_y = top + 12 + 14 * k
            out.append(
                f'<line x1="{WIDTH - RIGHT + 10}" x2="{WIDTH - RIGHT + 28}" y1="{legend_y - 4}" y2="{legend_y - 4}" '
                f'stroke="{colour}" stroke-width="2"/>'
            )
            out.append(f'<text x="{WIDTH - RIGHT + 32}" y="{legend_y}">{escape(name)}</text>')
    out.append(f'<text x="{LEFT + plot_width / 2}" y="{height - 4}" text-anchor="middle">{escape(x_label)}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"
