"""The dashboard's Altair charts, each from one analytics frame. Selections are named so a page can read the
clicked cell back (`st.altair_chart(..., on_select=...)`)."""

from __future__ import annotations

import re

import altair as alt
import polars as pl

HEATMAP_PICK = "cell"
GRID_PICK = "grid_cell"
_OK, _QUARANTINED = "ok", "quarantined"


def _centred(lo: int, hi: int, *, most: int = 32) -> alt.Axis:
    """An axis over cells [i, i+1) whose ticks sit in the middle of each row (not on its edges), labelled with the
    row's integer; at most `most` of them."""
    every = max(1, -(-(hi - lo + 1) // most))
    return alt.Axis(values=[v + 0.5 for v in range(lo, hi + 1, every)], labelExpr="floor(datum.value)", grid=False)


def heatmap(cells: pl.DataFrame, metric: str) -> alt.Chart:
    """Rank x step cells (`views.heatmap`): one rect per bin, coloured by the largest value in it. With one rank a
    row, the rank ticks sit in the middle of their rows."""
    df = cells.with_columns((pl.col("rank_hi") + 1).alias("rank_end"), (pl.col("step_hi") + 1).alias("step_end"))
    pick = alt.selection_point(name=HEATMAP_PICK, fields=["rank_lo", "rank_hi"], on="click")
    single = df.height and bool((df["rank_hi"] == df["rank_lo"]).all())
    top = int(df["rank_hi"].max()) if df.height else 0  # type: ignore[arg-type]
    return alt.Chart(df).mark_rect().encode(
        x=alt.X("step_lo:Q", title="step"), x2="step_end:Q",
        y=alt.Y("rank_lo:Q", title="rank", scale=alt.Scale(reverse=True, domain=[0, top + 1], nice=False),
                axis=_centred(0, top) if single else alt.Undefined), y2="rank_end:Q",
        color=alt.Color("value:Q", title=metric, scale=alt.Scale(scheme="inferno", reverse=True)),
        tooltip=["rank_lo", "rank_hi", "step_lo", "step_hi", alt.Tooltip("value:Q", format=".1f")],
    ).add_params(pick).properties(height=420)


_LABELLED_CELLS = 256
"""Up to this many grid cells carry their rank's number; beyond, the numbers would overlap (the tooltip has it)."""


def grid(cells: pl.DataFrame, metric: str) -> alt.LayerChart | alt.FacetChart | alt.Chart:
    """The dp x pp grid (`views.grid`): each cell the worst of its tensor-parallel ranks, labelled with that rank
    while the cells are few enough to read. Cells are rects on [pp, pp+1) x [dp, dp+1) with ticks in their middles:
    the axis titles are short because Vega's `fit` autosize counts a rotated title's length against the chart's height
    (a long one left the plot no height at all: the hairline grid)."""
    pick = alt.selection_point(name=GRID_PICK, fields=["rank"], on="click")
    df = cells.with_columns((pl.col("pp") + 1).alias("pp_end"), (pl.col("dp") + 1).alias("dp_end"),
                            (pl.col("pp") + 0.5).alias("pp_mid"), (pl.col("dp") + 0.5).alias("dp_mid"))
    dps = int(df["dp"].max()) + 1 if df.height else 1  # type: ignore[arg-type]
    pps = int(df["pp"].max()) + 1 if df.height else 1  # type: ignore[arg-type]
    x = alt.X("pp:Q", title="pipeline stage (pp)", scale=alt.Scale(domain=[0, pps], nice=False),
              axis=_centred(0, pps - 1))
    y = alt.Y("dp:Q", title="dp replica", axis=_centred(0, dps - 1),
              scale=alt.Scale(domain=[0, dps], nice=False, reverse=True))
    rect = alt.Chart(df).mark_rect(stroke="white", strokeWidth=0.5 if dps * pps > 64 else 1).encode(
        x=x, x2="pp_end:Q", y=y, y2="dp_end:Q",
        color=alt.Color("value:Q", title=metric, scale=alt.Scale(scheme="oranges")),
        tooltip=["dp", "pp", "rank", alt.Tooltip("value:Q", format=".3f")]).add_params(pick)
    height = min(max(36 * dps, 160), 600)
    if df.height > _LABELLED_CELLS:
        return rect.properties(height=height)
    text = alt.Chart(df).mark_text(baseline="middle").encode(x="pp_mid:Q", y="dp_mid:Q", text="rank:Q")
    return alt.layer(rect, text).properties(height=height)


def series(df: pl.DataFrame, *, x: str, columns: list[str], color: str | None = None, title: str = "ms"
           ) -> alt.Chart | alt.FacetChart:
    """Lines of `columns` against `x`; with `color`, one line per value of it and one panel per column."""
    long = df.unpivot(index=[x] + ([color] if color else []), on=columns, variable_name="metric", value_name="ms")
    chart = alt.Chart(long).mark_line().encode(
        x=alt.X(f"{x}:Q", title=x), y=alt.Y("ms:Q", title=title),
        color=alt.Color(f"{color}:N" if color else "metric:N"),
        tooltip=[x, "metric", alt.Tooltip("ms:Q", format=".2f")] + ([color] if color else []))
    if color:
        return chart.properties(height=180).facet(row=alt.Row("metric:N", title=None)).resolve_scale(y="independent")
    return chart.properties(height=300)


def stacked(df: pl.DataFrame, *, x: str, parts: list[str]) -> alt.Chart:
    """A stacked bar per `x` of `parts` (ms)."""
    long = df.unpivot(index=[x], on=parts, variable_name="part", value_name="ms")
    return alt.Chart(long).mark_bar().encode(
        x=alt.X(f"{x}:O", title=x, sort=None), y=alt.Y("ms:Q", title="ms per step (median)", stack="zero"),
        color=alt.Color("part:N", sort=parts), tooltip=[x, "part", alt.Tooltip("ms:Q", format=".2f")],
    ).properties(height=360)


def _status_color(statuses: list[str]) -> alt.Color:
    """ok grey, quarantined dark purple, each incident class its own colour."""
    others = sorted(set(statuses) - {_OK, _QUARANTINED})
    palette = ["#d62728", "#ff7f0e", "#e377c2", "#8c564b", "#bcbd22", "#17becf", "#9467bd", "#1f77b4"]
    domain = [_OK, _QUARANTINED] + others
    colors = ["#c7c7c7", "#3f007d"] + [palette[i % len(palette)] for i in range(len(others))]
    return alt.Color("status:N", scale=alt.Scale(domain=domain, range=colors), title="status")


def devices(df: pl.DataFrame) -> alt.Chart:
    """Hosts x local devices, coloured by incident status."""
    return alt.Chart(df).mark_rect(stroke="white").encode(
        x=alt.X("host:N", sort=host_order(df["host"].to_list())), y=alt.Y("local_rank:O", title="local device"),
        color=_status_color(df["status"].unique().to_list()),
        tooltip=["host", "local_rank", "rank", "device", "dp", "tp", "pp", "incidents", "status"],
    ).properties(height=260)


def host_order(hosts: list[str]) -> list[str]:
    """Hosts in the order people number them: host2 before host10 (text order puts host10 first)."""
    return sorted(set(hosts), key=lambda h: [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", h)])


def links(df: pl.DataFrame) -> alt.Chart:
    """Inter-host links as a host x host matrix in host order, coloured by incident status; past 16 hosts every
    host keeps its row and column, the labels thin out to stay readable."""
    both = pl.concat([df, df.with_columns(pl.col("b").alias("a"), pl.col("a").alias("b"))], how="vertical")
    order = host_order(both["a"].to_list())
    every = max(1, -(-len(order) // 16))
    axis = alt.Axis(values=order[::every], labelOverlap=False)
    side = min(max(18 * len(order), 300), 900)
    return alt.Chart(both).mark_rect(stroke="white", strokeWidth=0.5 if len(order) > 32 else 1).encode(
        x=alt.X("a:N", title="host", sort=order, axis=axis), y=alt.Y("b:N", title="host", sort=order, axis=axis),
        color=_status_color(df["status"].unique().to_list()),
        tooltip=["link", alt.Tooltip("gbps:Q", format=".1f"), alt.Tooltip("vs_median_link:Q", format=".2f"),
                 "incidents", "status"],
    ).properties(height=side)


def timeline(df: pl.DataFrame) -> alt.Chart:
    """What happened, when: one mark per entry on its kind's row."""
    return alt.Chart(df.drop_nulls("t_s")).mark_point(filled=True, size=80).encode(
        x=alt.X("t_s:Q", title="seconds since the run's first start"), y=alt.Y("kind:N", title=None),
        color=alt.Color("kind:N", legend=None), tooltip=["t_s", "kind", "what", "rank", "step", "attempt"],
    ).properties(height=40 + 28 * max(df["kind"].n_unique(), 1))


def bars(df: pl.DataFrame, *, x: str, y: str) -> alt.Chart:
    return alt.Chart(df).mark_bar().encode(x=alt.X(f"{x}:O", sort=None), y=alt.Y(f"{y}:Q"),
                                           tooltip=list(df.columns)).properties(height=260)
