"""Small PNG charts drawn with Pillow (line charts and a heat map), for ``launch/report.py``.

No plotting library is needed: Pillow is already a dependency. Example::

    chart = Chart("reward", x_label="step", y_label="mean reward")
    chart.line("train", [1, 2, 3], [0.1, 0.3, 0.4])
    chart.save(Path("reward.png"))
"""

from __future__ import annotations

import math
from pathlib import Path

from PIL import Image, ImageDraw, ImageFont

W, H = 800, 450
LEFT, RIGHT, TOP, BOTTOM = 70, 20, 40, 55
COLORS = [(31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189), (140, 86, 75)]


def _font(size: int = 13):
    try:
        return ImageFont.load_default(size=size)
    except TypeError:  # Pillow < 10.1: one bitmap size
        return ImageFont.load_default()


def nice_ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    """About ``n`` round tick values covering [lo, hi]."""
    if not (math.isfinite(lo) and math.isfinite(hi)) or hi <= lo:
        hi = lo + 1.0
    raw = (hi - lo) / n
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    first = math.ceil(lo / step) * step
    return [round(first + i * step, 10) for i in range(int((hi - first) / step + 1e-9) + 1)]


def _fmt(v: float) -> str:
    return f"{v:.0f}" if abs(v) >= 100 or float(v).is_integer() else f"{v:.3g}"


class Chart:
    def __init__(self, title: str, *, x_label: str, y_label: str) -> None:
        self.title, self.x_label, self.y_label = title, x_label, y_label
        self.series: list[tuple[str, list[float], list[float], bool, list[bool]]] = []

    def line(self, name: str, xs, ys, *, points: bool = False, breaks: set[int] = frozenset()) -> None:
        """A series; the line is not drawn into index ``i`` for ``i`` in ``breaks`` (a gap: a restart)."""
        pts = [
            (float(x), float(y), i in breaks)
            for i, (x, y) in enumerate(zip(xs, ys, strict=True))
            if x is not None and y is not None and math.isfinite(float(y))
        ]
        self.series.append((name, [p[0] for p in pts], [p[1] for p in pts], points, [p[2] for p in pts]))

    def save(self, path: Path) -> Path:
        img = Image.new("RGB", (W, H), "white")
        d = ImageDraw.Draw(img)
        xs = [x for _, sx, _, _, _ in self.series for x in sx]
        ys = [y for _, _, sy, _, _ in self.series for y in sy]
        x0, x1 = (min(xs), max(xs)) if xs else (0.0, 1.0)
        y0, y1 = (min(ys), max(ys)) if ys else (0.0, 1.0)
        if y1 - y0 < 1e-12:
            y0, y1 = y0 - 0.5, y1 + 0.5
        if x1 - x0 < 1e-12:
            x0, x1 = x0 - 0.5, x1 + 0.5
        pad = 0.05 * (y1 - y0)
        y0, y1 = y0 - pad, y1 + pad
        px = lambda x: LEFT + (x - x0) / (x1 - x0) * (W - LEFT - RIGHT)  # noqa: E731
        py = lambda y: H - BOTTOM - (y - y0) / (y1 - y0) * (H - TOP - BOTTOM)  # noqa: E731
        _axes(d, self.title, self.x_label, self.y_label, nice_ticks(x0, x1), nice_ticks(y0, y1), px, py)
        for i, (name, sx, sy, points, gaps) in enumerate(self.series):
            c = COLORS[i % len(COLORS)]
            pts = [(px(x), py(y)) for x, y in zip(sx, sy, strict=True)]
            if len(pts) > 1 and not points:
                run: list[tuple[float, float]] = []
                for p, gap in zip(pts, gaps, strict=True):
                    if gap and len(run) > 1:
                        d.line(run, fill=c, width=2)
                    run = [p] if gap else run + [p]
                if len(run) > 1:
                    d.line(run, fill=c, width=2)
            for p in pts if (points or len(pts) == 1) else []:
                d.ellipse([p[0] - 4, p[1] - 4, p[0] + 4, p[1] + 4], fill=c)
            lx, ly = W - RIGHT - 230, TOP + 10 + 16 * i
            d.line([(lx, ly), (lx + 18, ly)], fill=c, width=3)
            d.text((lx + 24, ly - 7), name, fill=c, font=_font())
        path.parent.mkdir(parents=True, exist_ok=True)
        img.save(path, "PNG")
        return path


def _axes(d, title, x_label, y_label, xt, yt, px, py) -> None:
    f = _font()
    d.rectangle([LEFT, TOP, W - RIGHT, H - BOTTOM], outline=(0, 0, 0))
    d.text((W - RIGHT - 8 * len(title), 8), title, fill=(0, 0, 0), font=_font(16))
    for t in xt:
        x = px(t)
        if LEFT <= x <= W - RIGHT:
            d.line([(x, H - BOTTOM), (x, H - BOTTOM + 5)], fill=(0, 0, 0))
            d.text((x - 12, H - BOTTOM + 8), _fmt(t), fill=(0, 0, 0), font=f)
    for t in yt:
        y = py(t)
        if TOP <= y <= H - BOTTOM:
            d.line([(LEFT - 5, y), (LEFT, y)], fill=(0, 0, 0))
            d.line([(LEFT, y), (W - RIGHT, y)], fill=(235, 235, 235))
            d.text((5, y - 7), _fmt(t), fill=(0, 0, 0), font=f)
    d.text(((W - len(x_label) * 7) // 2, H - 22), x_label, fill=(0, 0, 0), font=f)
    d.text((5, TOP - 16), y_label, fill=(0, 0, 0), font=f)


def heatmap(path: Path, title: str, columns: dict[int, dict[int, int]], *, x_label: str, y_label: str) -> Path:
    """One column per x (step), one cell per y (staleness), shade = share of the column's samples."""
    img = Image.new("RGB", (W, H), "white")
    d = ImageDraw.Draw(img)
    xs = sorted(columns)
    ys = sorted({y for c in columns.values() for y in c}) or [0]
    y_lo, y_hi = min(0, ys[0]), ys[-1]
    x_lo, x_hi = (xs[0], xs[-1]) if xs else (0, 1)
    cw = (W - LEFT - RIGHT) / max(1, x_hi - x_lo + 1)
    ch = (H - TOP - BOTTOM) / (y_hi - y_lo + 1)
    px = lambda x: LEFT + (x - x_lo + 0.5) * cw  # noqa: E731
    py = lambda y: H - BOTTOM - (y - y_lo + 0.5) * ch  # noqa: E731
    for x in xs:
        total = sum(columns[x].values()) or 1
        for y, n in columns[x].items():
            share = n / total
            shade = (int(255 - 224 * share), int(255 - 136 * share), int(255 - 75 * share))
            left, top = LEFT + (x - x_lo) * cw, H - BOTTOM - (y - y_lo + 1) * ch
            d.rectangle([left, top, left + cw, top + ch], fill=shade)
    _axes(
        d,
        title,
        x_label,
        y_label,
        [t for t in nice_ticks(x_lo, x_hi) if float(t).is_integer()],
        list(range(y_lo, y_hi + 1)),
        px,
        py,
    )
    d.text((W - RIGHT - 260, TOP + 4), "shade: share of the step's samples", fill=(0, 0, 0), font=_font())
    path.parent.mkdir(parents=True, exist_ok=True)
    img.save(path, "PNG")
    return path
