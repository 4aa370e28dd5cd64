"""A run as HTML: the plots (Plotly figures) and the page (Jinja2 templates in agent/templates).

`render_report(view)` is one self-contained file: plotly.js, the figures, the styles and the
script are inlined, and a Content-Security-Policy forbids the page any network request. The live
view of `kloop serve` renders the same body (`render_body`) and swaps it in when the record grows.

Everything the agent wrote (titles, reasons, notes, diffs, transcripts) is data: Jinja escapes it,
hover texts are escaped before Plotly sees them, and JSON inside <script> cannot close the tag.
"""

from __future__ import annotations

import html
import json
import math
from functools import lru_cache
from typing import Any

import plotly.graph_objects as go
import plotly.io as pio
from jinja2 import Environment, PackageLoader, select_autoescape
from markdown_it import MarkdownIt
from markupsafe import Markup
from plotly.subplots import make_subplots

from agent.run_view import METHOD_BENCH, METHOD_GATE, AttemptView, RunView, kernel_deltas
from tools.fmt import fmt_num, kernel_name, real
from tools.fmt import fmt_time as _fmt_time

# one colour per gate stage that can reject; accepted is the staircase's colour
STAGE_COLORS = {
    "scope": "#7f7f7f", "static": "#8c564b", "build": "#d62728", "check": "#ff7f0e",
    "timing": "#9467bd", "e2e": "#e377c2", "interrupted": "#bcbd22", "pending": "#17becf", "": "#7f7f7f",
}
ACCEPTED_COLOR = "#2ca02c"
BASE_COLOR = "#1f77b4"
COMPARATOR_COLORS = ["#e377c2", "#8c564b", "#bcbd22", "#17becf"]
FONT = dict(family="ui-sans-serif, system-ui, -apple-system, Segoe UI, Roboto, sans-serif", size=11)
CSP_REPORT = ("default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; img-src data: blob:; "
              "font-src data:")


def _esc(text: Any, limit: int = 240) -> str:
    """Text for a Plotly hover label (which reads a little HTML): escaped, cut, one line per 100 chars."""
    s = str(text)
    s = s if len(s) <= limit else s[:limit] + "…"
    return "<br>".join(html.escape(s[i:i + 100]) for i in range(0, len(s), 100)) or ""


def _layout(**kw) -> dict:
    base = dict(font=FONT, margin=dict(l=56, r=16, t=28, b=40), paper_bgcolor="white", plot_bgcolor="white",
                hoverlabel=dict(font=dict(size=11)),
                legend=dict(orientation="h", x=0, y=1.01, yanchor="bottom", font=dict(size=10)))
    base.update(kw)
    return base


def _axis(**kw) -> dict:
    return dict(showgrid=True, gridcolor="#eee", zeroline=False, linecolor="#999", mirror=True, ticks="outside", **kw)


def fmt_time(seconds: float | None) -> str:
    return _fmt_time(seconds, micro="µs")


def _rate_kind(view: RunView, flops: float | None, nbytes: float | None) -> str:
    """'gbps' for memory-bound shapes, 'tflops' for compute-bound (by the roofline, else by intensity)."""
    if not flops:
        return "gbps"
    if not nbytes:
        return "tflops"
    if view.peak_flops and view.peak_bytes:
        return "gbps" if nbytes / view.peak_bytes >= flops / view.peak_flops else "tflops"
    return "gbps" if flops / nbytes < 10 else "tflops"


# ---- figures --------------------------------------------------------------------------------------

def fig_progress(view: RunView) -> go.Figure:
    """Speedup over the baseline by attempt: accepted steps as a staircase, every other attempt a
    point coloured by the stage that rejected it (at the speedup it measured, or on the staircase
    when it never reached timing)."""
    fig = go.Figure()
    atts = view.attempts
    last = atts[-1].number if atts else 1
    xs, ys, level = [0], [1.0], 1.0
    for a in atts:
        if a.verdict == "accepted" and a.level:
            xs.append(a.number)
            ys.append(a.level)
            level = a.level
    xs.append(last)
    ys.append(level)
    fig.add_trace(go.Scatter(x=xs, y=ys, mode="lines", line=dict(shape="hv", color=ACCEPTED_COLOR, width=2),
                             name="best so far", hoverinfo="skip"))

    def points(group: list[AttemptView], name: str, color: str, symbol: str) -> None:
        if not group:
            return
        y, err_hi, err_lo, text = [], [], [], []
        for a in group:
            if a.level and a.speedup:
                y.append(a.level)
                err_hi.append(a.level * (a.hi / a.speedup - 1) if a.hi else 0)
                err_lo.append(a.level * (1 - a.lo / a.speedup) if a.lo else 0)
            else:  # never timed: drawn on the staircase at the best of its time
                y.append(_level_before(atts, a.number))
                err_hi.append(0)
                err_lo.append(0)
            sp = f"x{a.speedup:.4f} [{a.lo:.4f}, {a.hi:.4f}] vs best" if a.speedup and a.lo and a.hi else "not timed"
            text.append(f"<b>#{a.number}</b> {_esc(a.title, 120)}<br>{a.verdict} ({a.stage or '-'}): {sp}"
                        + (f"<br>x{a.level:.3f} over base" if a.level else "") + f"<br>{_esc(a.reason, 200)}")
        fig.add_trace(go.Scatter(
            x=[a.number for a in group], y=y, mode="markers", name=name, text=text, hovertemplate="%{text}<extra></extra>",
            marker=dict(color=color, size=8 if name == "accepted" else 7, symbol=symbol, line=dict(width=1, color="white")),
            error_y=dict(type="data", array=err_hi, arrayminus=err_lo, visible=True, thickness=1, width=2, color=color),
            customdata=[a.number for a in group],
        ))

    points([a for a in atts if a.verdict == "accepted"], "accepted", ACCEPTED_COLOR, "circle")
    stages: dict[str, list[AttemptView]] = {}
    for a in atts:
        if a.verdict != "accepted":
            stages.setdefault(a.stage if a.verdict != "pending" else "pending", []).append(a)
    for stage, group in stages.items():
        label = "being judged" if stage == "pending" else f"rejected: {stage or '?'}"
        points(group, label, STAGE_COLORS.get(stage, "#7f7f7f"), "circle-open" if stage != "timing" else "diamond")
    ys = [y for tr in fig.data for y, e in zip(tr.y, (tr.error_y.array if tr.error_y and tr.error_y.array is not None else [0] * len(tr.y)))
          for y in (y, y + e)] + [y - e for tr in fig.data if tr.error_y and tr.error_y.arrayminus is not None
                                  for y, e in zip(tr.y, tr.error_y.arrayminus)]
    fig.update_layout(_layout(height=280, xaxis=_axis(title="attempt", range=[-0.5, last + 0.5], **_int_ticks(last)),
                              yaxis=_axis(title="× baseline (gate A/B, compounded)", type="log", **_log_axis(ys)),
                              hovermode="closest"))
    return fig


def _int_ticks(last: int) -> dict:
    """An attempt axis: whole numbers only (Plotly's default puts ticks at 0.5 on a short range)."""
    return {"tickmode": "linear", "tick0": 0, "dtick": max(1, math.ceil(last / 20)), "tickformat": "d"}


def _log_axis(values: list[float]) -> dict:
    """range and labelled ticks of a log axis holding `values` (a little padding around them)."""
    vals = [v for v in values if v and 1e-300 < v < 1e300 and math.isfinite(v)] or [1.0]
    lo, hi = min(vals) / 1.15, max(vals) * 1.15
    return {"range": [math.log10(lo), math.log10(hi)], **_log_ticks(lo, hi)}


def _level_before(atts: list[AttemptView], number: int) -> float:
    level = 1.0
    for a in atts:
        if a.number >= number:
            break
        if a.verdict == "accepted" and a.level:
            level = a.level
    return level


def fig_shapes(view: RunView) -> go.Figure | None:
    """Per bench shape over the accepted commits, all from the gate's verdicts (METHOD_GATE): the time
    per call (top, against the roofline bound) and the speedup on that shape, compounded from the
    verdicts' per-shape speedups (bottom). The quick bench and its comparators are another method:
    they are a table of their own, never points on these axes."""
    series = [s for s in view.series if s.times]
    if not series:
        return None
    n = len(series)
    fig = make_subplots(rows=2, cols=n, shared_xaxes=True, vertical_spacing=0.08, horizontal_spacing=0.06,
                        subplot_titles=[s.shape for s in series])
    for i, s in enumerate(series, start=1):
        kind = _rate_kind(view, s.flops, s.bytes)
        work, unit, scale = (s.bytes, "GB/s", 1e9) if kind == "gbps" else (s.flops, "TFLOP/s", 1e12)
        peak = view.peak_bytes if kind == "gbps" else view.peak_flops
        tscale, tunit = (1e3, "ms") if max(s.times) >= 1e-3 else (1e6, "µs")
        rates = [work / t / scale if work else None for t in s.times]
        text = [f"{lab}: {fmt_time(t)} per call, x{sp:.3f} base on {html.escape(s.shape)}"
                + (f", {r:.1f} {unit}" if r else "") + (f" ({100 * r * scale / peak:.1f}% of peak)" if r and peak else "")
                + f"<br>{METHOD_GATE}"
                for lab, t, sp, r in zip(s.labels, s.times, s.speedups, rates)]
        fig.add_trace(go.Scatter(x=s.labels, y=[t * tscale for t in s.times], mode="lines+markers", name=f"time {s.shape}",
                                 showlegend=False, line=dict(color=BASE_COLOR, shape="hv"), meta=[s.shape, "time", tscale],
                                 marker=dict(size=6), text=text, hovertemplate="%{text}<extra></extra>"), row=1, col=i)
        fig.add_trace(go.Scatter(x=s.labels, y=s.speedups, mode="lines+markers", name=f"speedup {s.shape}",
                                 showlegend=False, line=dict(color=ACCEPTED_COLOR, shape="hv"), meta=[s.shape, "speedup", 1],
                                 marker=dict(size=6), text=text, hovertemplate="%{text}<extra></extra>"), row=2, col=i)
        if s.bound:
            fig.add_hline(y=s.bound * tscale, line=dict(color="black", dash="dot", width=1), row=1, col=i,
                          annotation=dict(text=f"roofline bound {fmt_time(s.bound)}", font=dict(size=9)),
                          annotation_position="bottom left")
        fig.update_yaxes(_axis(title=f"{tunit} per call", rangemode="tozero"), row=1, col=i)
        fig.update_yaxes(_axis(title="× base on this shape" if i == 1 else None, rangemode="tozero"), row=2, col=i)
        fig.update_xaxes(_axis(type="category"), row=1, col=i)
        fig.update_xaxes(_axis(type="category", title="accepted commits" if i == 1 else None), row=2, col=i)
    fig.update_layout(_layout(height=420, showlegend=False, hovermode="closest", margin=dict(l=56, r=16, t=36, b=40)))
    for a in fig.layout.annotations:
        if a.text in {s.shape for s in series}:
            a.font = dict(size=11)
    return fig


def roofline_method(view: RunView) -> str:
    """The one method the roofline's points come from: the gate's when a commit was accepted (then the
    comparators, timed by the quick bench, are left to the quick-bench table), else the quick bench."""
    return METHOD_GATE if any(s.times for s in view.series) else METHOD_BENCH


def fig_roofline(view: RunView) -> go.Figure | None:
    """Arithmetic intensity vs attained FLOP/s per bench shape (each point named by its shape), from one
    method only (`roofline_method`): baseline and best by the gate, or baseline and comparators by the
    quick bench. Without known peak rates (a CPU) no roof is drawn and the plot says so."""
    gate = roofline_method(view) == METHOD_GATE
    pts: list[tuple[str, str, float, float, str]] = []  # (group, shape, intensity, flop/s, hover)
    for s in view.series:
        if not (s.flops and s.bytes):
            continue
        ai = s.flops / s.bytes
        if gate and s.times:
            pts.append(("baseline", s.shape, ai, s.flops / s.times[0], f"{s.shape} baseline {fmt_time(s.times[0])}"))
            if len(s.times) > 1:
                pts.append(("best", s.shape, ai, s.flops / s.times[-1], f"{s.shape} best ({s.labels[-1]}) {fmt_time(s.times[-1])}"))
        elif not gate and s.bench_time:
            pts.append(("baseline", s.shape, ai, s.flops / s.bench_time, f"{s.shape} baseline {fmt_time(s.bench_time)}"))
            for c in s.comparators:
                pts.append((c.name, s.shape, ai, s.flops / c.time, f"{s.shape} {html.escape(c.name)} {fmt_time(c.time)}"))
    if not pts:
        return None
    fig = go.Figure()
    ais = [p[2] for p in pts]
    lo, hi = min(ais) / 8, max(ais) * 8
    roofs = bool(view.peak_flops and view.peak_bytes)
    if roofs:
        ridge = view.peak_flops / view.peak_bytes
        lo, hi = min(lo, ridge / 8), max(hi, ridge * 4)
        xs = [lo, ridge, hi]
        fig.add_trace(go.Scatter(x=xs, y=[min(view.peak_flops, x * view.peak_bytes) / 1e12 for x in xs], mode="lines",
                                 name="roofline", line=dict(color="black", width=1.5), hoverinfo="skip"))
    styles = {"baseline": (BASE_COLOR, "circle"), "best": (ACCEPTED_COLOR, "star")}
    groups = list(dict.fromkeys(p[0] for p in pts))
    for j, g in enumerate(groups):
        color, symbol = styles.get(g, (COMPARATOR_COLORS[j % len(COMPARATOR_COLORS)], "diamond-open"))
        gp = [p for p in pts if p[0] == g]
        fig.add_trace(go.Scatter(x=[p[2] for p in gp], y=[p[3] / 1e12 for p in gp], mode="markers+text", name=g,
                                 marker=dict(color=color, symbol=symbol, size=10 if g == "best" else 8),
                                 textposition="middle right", textfont=dict(size=9, color=color),
                                 text=[html.escape(p[1]) for p in gp], meta=[p[1] for p in gp],
                                 hovertext=[f"{p[4]}<br>{p[3] / 1e12:.3f} TFLOP/s at {p[2]:.3g} FLOP/B" for p in gp],
                                 hovertemplate="%{hovertext}<extra></extra>"))
    ys = [p[3] / 1e12 for p in pts] + ([view.peak_flops / 1e12] if view.peak_flops else [])
    ylo, yhi = min(ys) / 2, max(ys) * 2
    notes = [dict(text="measured by the " + html.escape(roofline_method(view).split(":")[0])
                  + ("" if roofs else f" · no peak rates known for {html.escape(view.device)}: no roofs drawn"),
                  xref="paper", yref="paper", x=0, y=1.0, xanchor="left", yanchor="bottom", showarrow=False,
                  font=dict(size=10, color="#666"))]
    fig.update_layout(_layout(height=300, hovermode="closest", annotations=notes, margin=dict(l=56, r=16, t=40, b=40),
                              legend=dict(orientation="h", x=1, xanchor="right", y=1.01, yanchor="bottom", font=dict(size=10)),
                              xaxis=_axis(title="arithmetic intensity (FLOP/byte)", type="log", range=[math.log10(lo), math.log10(hi)],
                                          **_log_ticks(lo, hi)),
                              yaxis=_axis(title="TFLOP/s", type="log", range=[math.log10(ylo), math.log10(yhi)], **_log_ticks(ylo, yhi))))
    return fig


def _log_ticks(lo: float, hi: float) -> dict:
    """Ticks at 1, 2, 5 x 10^k within [lo, hi] (finer on a short range), labelled in full: Plotly's
    default labels minor ticks '2', '5' (0.2 and 0.5 read as 2 and 5)."""
    if not (0 < lo < hi < math.inf) or math.log10(hi) - math.log10(lo) > 60:
        return {}  # a record's absurd figures: Plotly's own ticks
    def within(mantissas):
        vals = [m * 10.0 ** e for e in range(math.floor(math.log10(lo)) - 1, math.ceil(math.log10(hi)) + 1) for m in mantissas]
        return [float(f"{v:.6g}") for v in vals if lo <= v <= hi]

    vals = within((1, 2, 5))
    if len(vals) < 3:
        vals = within((1, 1.2, 1.5, 2, 3, 5, 7))
    if len(vals) < 3:
        vals = within((1, 1.1, 1.2, 1.3, 1.4, 1.5, 1.6, 1.8, 2, 2.5, 3, 4, 5, 6, 7, 8, 9))
    if len(vals) > 9:
        vals = [v for v in vals if f"{v:.6g}".lstrip("0.").startswith("1")]
    return {"tickmode": "array", "tickvals": vals, "ticktext": [f"{v:g}" for v in vals]}


def fig_compare(views: list[RunView]) -> go.Figure:
    """The staircases of several runs on one plot."""
    fig = go.Figure()
    for i, v in enumerate(views):
        color = [ACCEPTED_COLOR, BASE_COLOR, "#d62728", "#9467bd"][i % 4]
        xs, ys, level = [0], [1.0], 1.0
        for a in v.accepted:
            if a.level:
                xs.append(a.number)
                ys.append(a.level)
                level = a.level
        xs.append(v.attempts[-1].number if v.attempts else 0)
        ys.append(level)
        fig.add_trace(go.Scatter(x=xs, y=ys, mode="lines+markers", line=dict(shape="hv", color=color), name=f"{v.run_id} ({v.device})",
                                 hovertemplate="attempt %{x}: x%{y:.3f}<extra></extra>"))
    last = max((v.attempts[-1].number for v in views if v.attempts), default=1)
    fig.update_layout(_layout(height=280, xaxis=_axis(title="attempt", **_int_ticks(last)),
                              yaxis=_axis(title="× baseline (gate A/B, compounded)", type="log",
                                          **_log_axis([y for tr in fig.data for y in tr.y]))))
    return fig


def figure_json(fig: go.Figure | None) -> Markup | None:
    """A figure as JSON safe to place inside <script type="application/json">."""
    if fig is None:
        return None
    text = pio.to_json(fig, validate=False, remove_uids=True)
    return Markup(text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026"))


# ---- the page -------------------------------------------------------------------------------------

PLOTLY_BUNDLE = "plotly-basic.min.js"  # agent/static: scatter/bar/pie only, 1.2 MB (the full bundle is 4.8 MB)


@lru_cache(maxsize=1)
def plotly_js() -> str:
    """plotly.js's basic bundle (the figures here are scatter traces only): the report inlines it."""
    from importlib.resources import files

    return files("agent").joinpath("static", PLOTLY_BUNDLE).read_text(encoding="utf-8")


def plotly_bundle_version() -> str | None:
    import re

    m = re.search(r"plotly\.js \(basic - minified\) v(\S+)", plotly_js()[:400])
    return m.group(1) if m else None


@lru_cache(maxsize=1)
def _env() -> Environment:
    env = Environment(loader=PackageLoader("agent", "templates"), autoescape=select_autoescape(["html", "j2"]),
                      trim_blocks=True, lstrip_blocks=True)
    env.filters["t"] = fmt_time
    env.filters["kernel"] = kernel_name  # 'bwd_dkdv<128,false>', not 'void (anonymous namespace)::bwd_dk...'
    env.filters["sp"] = lambda x: f"x{x:.4f}" if real(x) is not None else "-"
    for digits in (1, 2, 3, 4):  # a figure with n decimals; '-', 'nan' or '?' when it is not a finite number
        env.filters[f"f{digits}"] = lambda x, d=digits: fmt_num(x, f".{d}f")
    env.filters["usd"] = lambda x: f"${x:.2f}" if real(x) is not None else "-"
    env.filters["tojson_pretty"] = lambda x: json.dumps(x, indent=1, ensure_ascii=False, default=str) if not isinstance(x, str) else x
    env.globals["diff_lines"] = diff_lines
    env.globals["markdown"] = markdown
    env.globals["stage_colors"] = STAGE_COLORS
    return env


_md = MarkdownIt("commonmark", {"html": False, "linkify": False}).enable("table")


def markdown(text: str) -> Markup:
    """The agent's notes as HTML (raw HTML in them is escaped; markdown-it drops unsafe link schemes)."""
    return Markup(_md.render(text))


def diff_lines(patch: str) -> list[tuple[str, str]]:
    """(css class, line) for a unified diff."""
    out = []
    for line in patch.splitlines():
        if line.startswith(("diff --git", "index ", "+++ ", "--- ", "new file", "deleted file")):
            cls = "dh"
        elif line.startswith("@@"):
            cls = "dk"
        elif line.startswith("+"):
            cls = "da"
        elif line.startswith("-"):
            cls = "dd"
        else:
            cls = ""
        out.append((cls, line))
    return out


def body_context(view: RunView) -> dict:
    best = view.best_kernels()
    return {
        "v": view,
        "fig_progress": figure_json(fig_progress(view)),
        "fig_shapes": figure_json(fig_shapes(view)),
        "fig_roofline": figure_json(fig_roofline(view)),
        "deltas": {a.number: kernel_deltas(a, best) for a in view.attempts},
        "best_kernels": best,
        "sass_recorded": any(k.sass_total is not None for k in best + view.baseline_kernels),
        "rate_kinds": {s.shape: _rate_kind(view, s.flops, s.bytes) for s in view.series},
        "methods": {"gate": METHOD_GATE, "bench": METHOD_BENCH},
        "roofline_method": roofline_method(view),
        "comparator_names": list(dict.fromkeys(c.name for s in view.series for c in s.comparators)),
    }


def render_body(view: RunView) -> str:
    """The run's content (header, plots, attempts, notes, transcript) as an HTML fragment."""
    return _env().get_template("run_body.html.j2").render(**body_context(view))


def render_page(title: str, body: str, plotly_src: str | None = None, live: dict | None = None,
                csp: str = CSP_REPORT) -> str:
    """A whole page around `body`: plotly.js inlined (self-contained) unless `plotly_src` names a URL."""
    inline = None if plotly_src else Markup(plotly_js().replace("</script", "<\\/script"))
    return _env().get_template("page.html.j2").render(title=title, body=Markup(body), plotly_inline=inline,
                                                      plotly_src=plotly_src, csp=csp, live=live)


def render_report(view: RunView) -> str:
    """One self-contained HTML page: opens with no network (everything inlined, CSP forbids requests)."""
    return render_page(f"kloop {view.run_id}", render_body(view))


def render_compare_body(views: list[RunView]) -> str:
    return _env().get_template("compare_body.html.j2").render(views=views, rows=compare_rows(views), method=METHOD_GATE,
                                                              fig=figure_json(fig_compare(views)))


def render_compare(views: list[RunView]) -> str:
    """Two (or more) runs side by side, self-contained like the report."""
    return render_page("kloop compare " + " vs ".join(v.run_id for v in views), render_compare_body(views))


def render_index(runs: list, root: str = "", links: bool = True) -> str:
    """The list of runs (`RunRow`s; kloop serve's home page body)."""
    return _env().get_template("runs_body.html.j2").render(runs=runs, root=root, links=links)


def compare_rows(views: list[RunView]) -> list[dict]:
    """Attempts matched across runs: by identical patch first (a replay of the same attempt), then by number."""
    import hashlib

    def key(a: AttemptView) -> str:
        return hashlib.sha256(a.patch.encode()).hexdigest() if a.patch.strip() else f"#{a.number}"

    order: list[str] = []
    cells: dict[str, list[AttemptView | None]] = {}
    for i, v in enumerate(views):
        for a in v.attempts:
            k = key(a)
            if k not in cells or cells[k][i] is not None:
                k = k if k not in cells else f"{k}/{v.run_id}/{a.number}"
                cells[k] = [None] * len(views)
                order.append(k)
            cells[k][i] = a
    return [{"title": next(a.title for a in cells[k] if a), "cells": cells[k]} for k in order]
