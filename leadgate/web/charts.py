"""Server-rendered SVG charts of the operator insights (pygal), for the console's
Insights page.

The console shows them as ``<img>``: an image never runs scripts, and the page's strict
Content-Security-Policy stays as it is (no inline script or style in the page). Opened
directly, an SVG is a document of its own: it is served with a CSP that forbids scripts
(pygal embeds its configuration in a ``<script>`` element, which then never runs).
Every label is one of our own words or a number; nothing a user typed is drawn.
"""

from __future__ import annotations

import functools
import importlib
import sys
from collections.abc import Callable
from types import ModuleType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from leadgate.review.insights import InsightsView


@functools.cache
def _pygal() -> ModuleType:
    # Imported on the first chart, not with the service: most processes never draw one,
    # and pygal's import took 0.15 s (``python -X importtime``).
    pygal = importlib.import_module("pygal")
    importlib.import_module("pygal.style")
    # pygal appends a legacy ``sys.meta_path`` finder (for its optional map plugins, which
    # we do not use) that has ``find_module`` but no ``find_spec``: anything walking
    # ``sys.meta_path`` the modern way (pytest's importlib mode, importlib.util users)
    # fails with AttributeError once it is there. Take it out again.
    sys.meta_path[:] = [f for f in sys.meta_path if type(f).__name__ != "PluginImportFixer"]
    return pygal


#: The charts the console shows, in page order: name -> title.
CHARTS = {
    "decisions": "Decisions per day, by verdict",
    "deciders": "Decisions per day, lead or human",
    "time": "Time to decision (minutes)",
    "agreement": "Lead–human agreement",
    "rounds": "Revision rounds used",
    "deliveries": "Deliveries by outcome",
}
SVG_CSP = "default-src 'none'; style-src 'unsafe-inline'; frame-ancestors 'self'"

_VERDICTS = ("approved", "changesRequested", "escalated", "rejected", "returned", "cancelled")
_COLORS = {
    "approved": "#1e7a3c",
    "changesRequested": "#c58a00",
    "escalated": "#b3261e",
    "rejected": "#7b3f9e",
    "returned": "#1f5fbf",
    "cancelled": "#7a8291",
    "lead": "#5b4bb7",
    "human": "#e07b00",
}
_STYLE = dict(
    background="white",
    plot_background="white",
    foreground="#1d2430",
    foreground_strong="#1d2430",
    foreground_subtle="#5b6575",
    font_family="system-ui, sans-serif",
    title_font_size=15,
    label_font_size=11,
    major_label_font_size=11,
    legend_font_size=12,
    value_font_size=12,
)


def _chart(kind: str, title: str, colors: list[str]) -> Any:
    pygal = _pygal()
    return getattr(pygal, kind)(
        js=[],
        width=640,
        height=320,
        title=title,
        style=pygal.style.Style(colors=tuple(colors) or ("#1f5fbf",), **_STYLE),
        legend_at_bottom=True,
        legend_at_bottom_columns=4,
        print_values=False,
        show_y_guides=True,
        no_data_text="No data yet",
        x_label_rotation=0,
        truncate_label=-1,
        margin=16,
        margin_bottom=24,
        max_scale=6,
        disable_xml_declaration=False,
    )


def _day_labels(days: list[str]) -> list[str]:
    # Month-day is enough on the axis; long windows label about every fifth day.
    step = max(1, len(days) // 10)
    return [d[5:] if i % step == 0 else "" for i, d in enumerate(days)]


def _decisions(data: InsightsView) -> Any:
    per_day = data["decisions"]["perDay"]
    present = [v for v in _VERDICTS if any(d["byVerdict"].get(v) for d in per_day)]
    chart = _chart("StackedBar", CHARTS["decisions"], [_COLORS[v] for v in present])
    chart.x_labels = _day_labels([d["day"] for d in per_day])
    for verdict in present:
        chart.add(verdict, [d["byVerdict"].get(verdict, 0) for d in per_day])
    return chart


def _deciders(data: InsightsView) -> Any:
    per_day = data["decisions"]["perDay"]
    present = [w for w in ("lead", "human") if any(d["byDecider"].get(w) for d in per_day)]
    chart = _chart("StackedBar", CHARTS["deciders"], [_COLORS[w] for w in present])
    chart.x_labels = _day_labels([d["day"] for d in per_day])
    for who in present:
        chart.add(who, [d["byDecider"].get(who, 0) for d in per_day])
    return chart


def _minutes(ms: float | None) -> float | None:
    return None if ms is None else round(ms / 60_000, 2)


def _time(data: InsightsView) -> Any:
    ttd = data["timeToDecision"]
    chart = _chart("Bar", CHARTS["time"], ["#1f5fbf", "#8fb3e8"])
    if not ttd["lead"]["count"] and not ttd["human"]["count"]:
        return chart
    chart.x_labels = ["lead", "human"]
    chart.add("median", [_minutes(ttd["lead"]["medianMs"]), _minutes(ttd["human"]["medianMs"])])
    chart.add("p90", [_minutes(ttd["lead"]["p90Ms"]), _minutes(ttd["human"]["p90Ms"])])
    return chart


def _agreement(data: InsightsView) -> Any:
    agreement = data["agreement"]
    chart = _chart("StackedBar", CHARTS["agreement"], ["#1e7a3c", "#b3261e"])
    if not agreement["confirmed"] and not agreement["overrode"]:
        return chart
    kinds = (agreement["escalated"], agreement["changesRequested"])
    chart.x_labels = ["lead escalated", "lead: changes, no rounds left"]
    chart.add("human confirmed", [k["confirmed"] for k in kinds])
    chart.add("human overrode", [k["overrode"] for k in kinds])
    return chart


def _rounds(data: InsightsView) -> Any:
    rounds = data["roundsUsed"]
    chart = _chart("Bar", CHARTS["rounds"], ["#5b4bb7"])
    if not rounds:
        return chart
    chart.x_labels = [str(r["rounds"]) for r in rounds]
    chart.add("items", [r["items"] for r in rounds])
    return chart


def _deliveries(data: InsightsView) -> Any:
    by_outcome = data["deliveries"]["byOutcome"]
    chart = _chart("Bar", CHARTS["deliveries"], ["#1f5fbf"])
    if not by_outcome:
        return chart
    names = sorted(by_outcome)
    chart.x_labels = names
    chart.add("deliveries", [by_outcome[n] for n in names])
    return chart


_RENDER: dict[str, Callable[[InsightsView], Any]] = {
    "decisions": _decisions,
    "deciders": _deciders,
    "time": _time,
    "agreement": _agreement,
    "rounds": _rounds,
    "deliveries": _deliveries,
}


def render(name: str, data: InsightsView) -> bytes:
    """The SVG of chart ``name`` (a key of :data:`CHARTS`) for insights ``data``."""
    return bytes(_RENDER[name](data).render())
