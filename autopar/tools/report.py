"""`prog.report("plan.html")`: one self-contained HTML file with the plan drawn.

    prog.report("plan.html")                       # any compiled program
    autopar plan --model llama3-70b --nodes 64 --global-batch 1024 --report plan.html --png figs/

Algorithm (`write_report`):
1. Read the facts (`autopar.tools.report_facts.facts_of`): every number comes from the plan's own
   record.
2. Draw each part present (`autopar.tools.report_charts`): mesh, communication, memory, pipeline
   schedule, ranking; each becomes inline SVG whose root element carries the chart's id
   (`CHARTS`), and with `png_dir` also `<id>.png`.
3. Write the page: a summary table, each chart beside the table of its numbers (each number
   also in a `data-value` attribute, unrounded), the layouts per module pattern, and the
   per-rank code in collapsible `<details>`. No script, no external reference: styles are
   inline and the page renders offline.
"""

from __future__ import annotations

import html
import io
import re
from pathlib import Path
from typing import Any

from autopar.tools.report_facts import Facts, facts_of

CHARTS = ("chart-mesh", "chart-comm", "chart-memory", "chart-schedule", "chart-ranking")
STYLE = """body{font-family:sans-serif;margin:24px;color:#222;max-width:1400px}
h1{font-size:22px}h2{font-size:17px;border-bottom:1px solid #ccc;padding-bottom:3px}
table{border-collapse:collapse;font-size:13px;margin:8px 0}
td,th{border:1px solid #ddd;padding:3px 8px;text-align:left}th{background:#f3f3f3}
td.n{text-align:right;font-variant-numeric:tabular-nums}
figure{margin:8px 0}svg{max-width:100%;height:auto}
pre{background:#f7f7f7;padding:8px;font-size:12px;overflow-x:auto}.note{color:#666;font-size:13px}"""


def write_report(obj: Any, path: str | Path, *, png_dir: str | Path | None = None,
                 measured: Any = None) -> Path:  # fmt: skip
    """Steps 1-3; returns the path written. `measured`: (pipeline rank, 'F' | 'B',
    micro-batch, start s, end s) events of a measured pipeline step, drawn under the
    simulated one."""
    facts = facts_of(obj, measured)
    figures = figures_of(facts)
    if png_dir is not None:
        write_pngs(figures, png_dir)
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render_html(facts, {k: svg_of(f, k) for k, f in figures.items()}))
    return out


def figures_of(facts: Facts) -> dict[str, Any]:
    """Step 2: chart id → matplotlib Figure, for the parts this plan has."""
    from autopar.tools import report_charts as R

    figures = {"chart-mesh": R.mesh_figure(facts), "chart-comm": R.comm_figure(facts),
               "chart-memory": R.memory_figure(facts)}  # fmt: skip
    if facts.schedule is not None:
        figures["chart-schedule"] = R.schedule_figure(facts)
    if facts.ranking:
        figures["chart-ranking"] = R.ranking_figure(facts)
    return figures


def write_pngs(figures: dict[str, Any], directory: str | Path) -> list[Path]:
    """Step 2: each chart as `<directory>/<chart id>.png`."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    paths = []
    for key, fig in figures.items():
        paths.append(d / f"{key}.png")
        fig.savefig(paths[-1], format="png", dpi=110)
    return paths


def svg_of(fig: Any, chart_id: str) -> str:
    """Step 2: the figure as an inline `<svg id=chart_id>` element (no XML prolog, text kept
    as text, deterministic ids)."""
    import matplotlib

    buf = io.StringIO()
    with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": chart_id}):
        fig.savefig(buf, format="svg", metadata={"Date": None})
    text = buf.getvalue()
    text = text[text.index("<svg") :]
    return re.sub(r"<svg ", f'<svg id="{chart_id}" role="img" ', text, count=1)


def render_html(facts: Facts, svgs: dict[str, str]) -> str:
    """Step 3: the page."""
    parts = [
        f"<h1>autopar report: {_e(facts.title)}</h1>",
        _table(("", ""), facts.summary, "t-summary"),
    ]
    parts += _section("Mesh on the cluster", svgs.get("chart-mesh"), _axes_table(facts))
    parts.insert(-1, f'<p class="note">{_e(_mesh_note(facts))}</p>')
    parts += _section("Communication of one step", svgs.get("chart-comm"),
                      _comm_table(facts) + _step_table(facts))  # fmt: skip
    parts += _section("Memory per rank", svgs.get("chart-memory"), _memory_table(facts))
    if facts.schedule is not None:
        parts += _section("Pipeline schedule", svgs.get("chart-schedule"),
                          f'<p class="note">bubble {facts.schedule.bubble:.1%}</p>')  # fmt: skip
    if facts.ranking:
        parts += _section("Ranking of the search", svgs.get("chart-ranking"), _ranking(facts))
    parts += ["<h2>Parameter layouts per module pattern</h2>", _layouts(facts)]
    parts += ["<h2>Per-rank programs</h2>", _code(facts)]
    if facts.notes:
        parts += ["<h2>Why</h2><ul>", *(f"<li>{_e(n)}</li>" for n in facts.notes), "</ul>"]
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\"/>"
            f"<title>autopar report: {_e(facts.title)}</title><style>{STYLE}</style></head>"
            "<body>\n" + "\n".join(parts) + "\n</body></html>\n")  # fmt: skip


def _mesh_note(facts: Facts) -> str:
    c = facts.cluster
    shown = "every node" if c.nodes <= 4 else f"nodes 0, 1 and {c.nodes - 1}"
    return (f"{c.nodes} node(s) × {c.gpus_per_node} {c.gpu.name}, {shown} drawn; a cell is a "
            "GPU, its colour the axis's group, its number the coordinate on the axis; "
            f"NVLink: {c.intra.name}, inter-node fabric: {c.inter.name}")  # fmt: skip


def _section(title: str, svg: str | None, table: str) -> list[str]:
    return [f"<h2>{_e(title)}</h2>", f"<figure>{svg}</figure>" if svg else "", table]


def _e(text: Any) -> str:
    return html.escape(str(text))


def _num(value: float, text: str) -> str:
    return f'<td class="n" data-value="{value!r}">{_e(text)}</td>'


def _table(head: tuple[str, ...], rows: Any, table_id: str) -> str:
    out = [f'<table id="{table_id}">']
    if any(head):
        out.append("<tr>" + "".join(f"<th>{_e(h)}</th>" for h in head) + "</tr>")
    for row in rows:
        cells = [c if str(c).startswith("<td") else f"<td>{_e(c)}</td>" for c in row]
        out.append("<tr>" + "".join(cells) + "</tr>")
    return "\n".join([*out, "</table>"])


def _axes_table(facts: Facts) -> str:
    rows = [(a.axis, _num(a.size, str(a.size)), _num(a.stride, str(a.stride)),
             "NVLink (inside a node)" if a.in_node else "inter-node fabric", " + ".join(a.links),
             "-" if a.exposed_s is None else _num(a.exposed_s, f"{a.exposed_s:.6f} s"))
            for a in facts.axes]  # fmt: skip
    return _table(("axis", "size", "stride", "groups ride", "links", "exposed"), rows, "t-axes")


def _comm_table(facts: Facts) -> str:
    rows = [(c.axis, c.kind, c.direction, _num(c.count, str(c.count)),
             _num(c.bytes, _bytes(c.bytes))) for c in facts.comm]  # fmt: skip
    return _table(("axis", "kind", "direction", "collectives", "bytes"), rows, "t-comm")


def _step_table(facts: Facts) -> str:
    rows = [(name, _num(s, f"{s:.6f} s")) for name, s in facts.step]
    return (
        _table(("component", "seconds"), rows, "t-step")
        + f'<p class="note">{_e(facts.step_note)}</p>'
    )


def _memory_table(facts: Facts) -> str:
    head = ("bar", "weights", "gradients", "optimizer state", "activations", "reserve",
            "total", "chosen")  # fmt: skip
    rows = [(b.label, *(_num(v, _bytes(v)) for _, v in b.parts),
             _num(b.total, _bytes(b.total)), "yes" if b.chosen else "")
            for b in (*facts.memory, *facts.pipeline_memory)]  # fmt: skip
    cap = f"capacity {facts.capacity / 2**30:.1f} GiB; {facts.memory_note}"
    return _table(head, rows, "t-memory") + f'<p class="note">{_e(cap)}</p>'


def _bytes(n: float) -> str:
    from autopar.plan import _fmt_bytes

    return _fmt_bytes(n)


def _ranking(facts: Facts, limit: int = 40) -> str:
    rows = [(_num(p.rank, str(p.rank)), p.label, _num(p.step_s, f"{p.step_s:.4f} s"),
             _num(p.memory_bytes, f"{p.memory_bytes / 2**30:.1f} GiB"),
             ("compare; " if p.compare else "") + p.loses_on)
            for p in facts.ranking if p.rank <= limit or p.compare]  # fmt: skip
    more = len(facts.ranking) - limit
    tail = f'<p class="note">{more} more configurations in the chart</p>' if more > 0 else ""
    return _table(("rank", "configuration", "step", "memory", "loses on"), rows, "t-ranking") + tail


def _layouts(facts: Facts) -> str:
    if not facts.layouts:
        return ('<p class="note">a search plans degrees, not layouts: compile the chosen '
                "configuration (Mesh.auto) to see them</p>")  # fmt: skip
    rows = [(pattern, lay, _num(n, f"×{n}")) for pattern, lay, n in facts.layouts]
    return _table(("module pattern", "layout", "count"), rows, "t-layouts")


def _code(facts: Facts) -> str:
    if not facts.code:
        return '<p class="note">no per-rank program: this plan is not compiled</p>'
    return "\n".join(f'<details class="code"><summary>{_e(title)}</summary><pre>{_e(src)}</pre></details>'
                     for title, src in facts.code)  # fmt: skip
