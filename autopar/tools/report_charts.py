"""The report's charts: one matplotlib `Figure` per part, drawn from a `Facts` record.

Algorithm (each `*_figure`):
1. `mesh_figure`: one row per mesh axis over the nodes shown (all, or the first two and the
   last); each GPU cell is coloured by the axis group it belongs to and labelled with its
   coordinate on the axis; the title names the link the groups cross.
2. `comm_figure`: bytes per (axis, collective kind) in forward, backward and after the step;
   beside it the step's components (compute, exposed communication, bubble, optimizer).
3. `memory_figure`: stacked per-rank bars per ZeRO stage with the capacity line and the chosen
   stage outlined; beside it, under a pipeline, one bar per pipeline rank.
4. `schedule_figure`: one row per pipeline rank, a block per forward / backward action
   (labelled by micro-batch), idle slots hatched; a measured timeline below when recorded.
5. `ranking_figure`: step time against memory of every ranked configuration, the best and
   the hand-chosen one marked, the capacity drawn.
Figures are built without pyplot (no global state, no display).
"""

from __future__ import annotations

from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from autopar.tools.report_facts import Facts, MemoryBar

GIB = 2**30
PART_COLOURS = {"weights": "#4c72b0", "gradients": "#dd8452", "optimizer state": "#55a868",
                "activations": "#c44e52", "reserve": "#8c8c8c"}  # fmt: skip
DIRECTION_COLOURS = {"fwd": "#4c72b0", "bwd": "#dd8452", "step": "#55a868"}
ACTION_COLOURS = {"F": "#4c72b0", "B": "#dd8452"}
GROUP_COLOURS = ("#a6cee3", "#b2df8a", "#fb9a99", "#fdbf6f", "#cab2d6", "#ffff99", "#1f78b4",
                 "#33a02c", "#e31a1c", "#ff7f00", "#6a3d9a", "#b15928")  # fmt: skip


def shown_nodes(nodes: int) -> list[int]:
    """Nodes drawn on the mesh picture: all up to four, else the first two and the last."""
    return list(range(nodes)) if nodes <= 4 else [0, 1, nodes - 1]


def mesh_figure(facts: Facts) -> Figure:
    """Step 1."""
    from autopar.tools.report_facts import group_of

    cl = facts.cluster
    nodes, gpn = shown_nodes(cl.nodes), cl.gpus_per_node
    world = _world(facts)
    rows = max(len(facts.axes), 1)
    fig = Figure(figsize=(max(6.0, 0.45 * gpn * len(nodes) + 1.5), 1.25 * rows + 0.4))
    for i, row in enumerate(facts.axes or ()):
        ax = fig.add_subplot(rows, 1, i + 1)
        x = 0.0
        for k, node in enumerate(nodes):
            if k and node != nodes[k - 1] + 1:
                ax.text(x + 0.4, 0.5, "…", ha="center", va="center", fontsize=14)
                x += 1.0
            ax.add_patch(Rectangle((x - 0.1, -0.15), gpn + 0.2, 1.3, fill=False, lw=1.2))
            ax.text(x + gpn / 2, 1.3, f"node {node}", ha="center", va="bottom", fontsize=7)
            for local in range(gpn):
                rank = node * gpn + local
                _cell(ax, x + local, rank, row, world, group_of)
            x += gpn + 0.6
        ax.set_xlim(-0.3, x)
        ax.set_ylim(-0.3, 1.75)
        ax.axis("off")
        where = "NVLink inside a node" if row.in_node else "inter-node fabric"
        exposed = "" if row.exposed_s is None else f" · exposed {_seconds(row.exposed_s)}"
        ax.set_title(f"{row.axis}={row.size} (stride {row.stride}): {where} · "
                     f"{' + '.join(row.links)}{exposed}", fontsize=9, loc="left")  # fmt: skip
    fig.tight_layout()
    return fig


def _world(facts: Facts) -> int:
    size = 1
    for row in facts.axes:
        size *= row.size
    return size


def _cell(ax, x: float, rank: int, row, world: int, group_of) -> None:
    if rank >= world:
        ax.add_patch(Rectangle((x, 0), 0.9, 1, color="#eeeeee"))
        return
    group = group_of(rank, row.stride, row.size)
    ax.add_patch(Rectangle((x, 0), 0.9, 1, color=GROUP_COLOURS[group % len(GROUP_COLOURS)]))
    ax.text(x + 0.45, 0.5, str((rank // row.stride) % row.size), ha="center", va="center",
            fontsize=7)  # fmt: skip


def comm_figure(facts: Facts) -> Figure:
    """Step 2."""
    fig = Figure(figsize=(11, max(2.6, 0.4 * max(len(facts.comm), len(facts.step)) + 1.2)))
    left, right = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    keys = sorted({(c.axis, c.kind) for c in facts.comm})
    height = 0.8 / 3
    for j, direction in enumerate(("fwd", "bwd", "step")):
        values = [sum(c.bytes for c in facts.comm if (c.axis, c.kind) == k
                      and c.direction == direction) for k in keys]  # fmt: skip
        if any(values):
            left.barh([i + j * height for i in range(len(keys))], values, height,
                      label=direction, color=DIRECTION_COLOURS[direction])  # fmt: skip
    left.set_yticks([i + height for i in range(len(keys))], [f"{a} {k}" for a, k in keys])
    left.invert_yaxis()
    left.set_xlabel("bytes per step (message = full tensor)")
    if keys:
        left.legend(fontsize=8)
        left.set_xscale("log")
    left.set_title("communication per axis and collective kind", fontsize=10)
    names = [n for n, _ in facts.step]
    values = [v for _, v in facts.step]
    colours = [_step_colour(n) for n in names]
    right.barh(range(len(names)), values, color=colours)
    right.set_yticks(range(len(names)), names)
    right.invert_yaxis()
    for i, v in enumerate(values):
        right.text(v, i, f" {_seconds(v)}", va="center", fontsize=8)
    right.set_xlim(0, max(values or [1.0]) * 1.3 or 1.0)
    right.set_xlabel("seconds")
    right.set_title("step: compute next to exposed communication", fontsize=10)
    fig.tight_layout()
    return fig


def _step_colour(name: str) -> str:
    if "comm" in name:
        return "#dd8452"
    return {"bubble": "#c44e52", "optimizer": "#55a868"}.get(name.split()[-1], "#4c72b0")


def memory_figure(facts: Facts) -> Figure:
    """Step 3."""
    panels = [(facts.memory, "per-rank memory per ZeRO stage")]
    if facts.pipeline_memory:
        panels.append((facts.pipeline_memory, "per pipeline rank (chosen stage)"))
    fig = Figure(figsize=(5.2 * len(panels) + 1.5, 3.6))
    for i, (bars, title) in enumerate(panels):
        ax = fig.add_subplot(1, len(panels), i + 1)
        _stacked(ax, bars, facts.capacity)
        ax.set_title(title, fontsize=10)
    handles = [Rectangle((0, 0), 1, 1, color=c) for c in PART_COLOURS.values()]
    fig.legend(handles, list(PART_COLOURS), loc="center right", fontsize=8)
    fig.tight_layout(rect=(0, 0, 0.83, 1))
    return fig


def _stacked(ax, bars: tuple[MemoryBar, ...], capacity: float) -> None:
    """Bars in the unit that suits them; the capacity drawn, or named when far above."""
    top = max(b.total for b in bars)
    unit, name = _unit(max(top, capacity if capacity < 5 * top else 0.0))
    for i, bar in enumerate(bars):
        bottom = 0.0
        for part, value in bar.parts:
            ax.bar(i, value / unit, 0.6, bottom=bottom, color=PART_COLOURS[part])
            bottom += value / unit
        if bar.chosen:
            ax.add_patch(Rectangle((i - 0.33, 0), 0.66, bottom, fill=False, lw=2.2,
                                   edgecolor="black"))  # fmt: skip
        ax.text(i, bottom, f"{bottom:.1f}" + ("\nchosen" if bar.chosen else ""),
                ha="center", va="bottom", fontsize=8)  # fmt: skip
    label = f"capacity {capacity / GIB:.0f} GiB"
    if capacity < 5 * top:
        ax.axhline(capacity / unit, color="#c44e52", ls="--", lw=1.2)
        ax.text(len(bars) - 0.5, capacity / unit, label, ha="right", va="bottom", fontsize=8,
                color="#c44e52")  # fmt: skip
    else:
        ax.text(0.98, 0.97, label + " (far above)", ha="right", va="top", fontsize=8,
                color="#c44e52", transform=ax.transAxes)  # fmt: skip
    ax.set_ylim(0, max(top, capacity if capacity < 5 * top else 0.0) / unit * 1.25)
    ax.set_ylabel(f"{name} per rank")
    ax.set_xticks(range(len(bars)), [b.label for b in bars], fontsize=8)


def _unit(nbytes: float) -> tuple[float, str]:
    for unit, name in ((GIB, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if nbytes >= unit:
            return float(unit), name
    return 1.0, "B"


def schedule_figure(facts: Facts) -> Figure:
    """Step 4."""
    s = facts.schedule
    p, width = len(s.slots), max(len(r) for r in s.slots)
    panels = 2 if s.measured else 1
    fig = Figure(figsize=(min(14.0, max(7.0, 3.0 + 0.28 * width)), 0.5 * p * panels + 1.6 * panels))
    ax = fig.add_subplot(panels, 1, 1)
    for r, row in enumerate(s.slots):
        _idle(ax, r, len(row))
        for t, action in enumerate(row):
            if action is not None:
                _action(ax, t, 1.0, r, action, labelled=width <= 64)
    _rank_axis(ax, p, width, "slot (one action per slot)")
    ax.set_title(f"simulated: {s.name}; bubble {s.bubble:.1%} of rank-slots (hatched)",
                 fontsize=10, loc="left")  # fmt: skip
    if s.measured:
        ax = fig.add_subplot(panels, 1, 2)
        t0 = min(e[3] for e in s.measured)
        end = max((e[4] - t0) * 1e3 for e in s.measured)
        for r in range(p):
            _idle(ax, r, end)
        for r, kind, mb, a, b in s.measured:
            _action(ax, (a - t0) * 1e3, (b - a) * 1e3, r, (kind, -1, mb), labelled=True)
        _rank_axis(ax, p, end, "milliseconds")
        ax.set_title("measured run (train_step)", fontsize=10, loc="left")
    handles = [Rectangle((0, 0), 1, 1, color=c) for c in ACTION_COLOURS.values()]
    handles.append(Rectangle((0, 0), 1, 1, fill=False, hatch="///", edgecolor="#999999"))
    fig.legend(handles, ["forward", "backward", "idle (bubble)"], loc="lower center", ncol=3,
               fontsize=8)  # fmt: skip
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    return fig


def _idle(ax, r: int, width: float) -> None:
    ax.add_patch(Rectangle((0, r - 0.4), width, 0.8, fill=False, hatch="///",
                           edgecolor="#bbbbbb", lw=0))  # fmt: skip


def _action(ax, x: float, w: float, r: int, action: tuple[str, int, int],
            labelled: bool) -> None:  # fmt: skip
    kind, _, mb = action
    ax.add_patch(Rectangle((x, r - 0.4), w * 0.96, 0.8, color=ACTION_COLOURS[kind]))
    if labelled:
        ax.text(x + w / 2, r, str(mb), ha="center", va="center", fontsize=7, color="white")


def _rank_axis(ax, p: int, width: float, xlabel: str) -> None:
    ax.set_xlim(0, width)
    ax.set_ylim(p - 0.5, -0.5)
    ax.set_yticks(range(p), [f"pp rank {r}" for r in range(p)], fontsize=8)
    ax.set_xlabel(xlabel, fontsize=8)


def ranking_figure(facts: Facts) -> Figure:
    """Step 5."""
    fig = Figure(figsize=(8, 4.2))
    ax = fig.add_subplot(1, 1, 1)
    pts = facts.ranking
    ax.scatter([p.step_s for p in pts], [p.memory_bytes / GIB for p in pts], s=14,
               color="#4c72b0", alpha=0.6, label="ranked configuration")  # fmt: skip
    best = pts[0]
    ax.scatter([best.step_s], [best.memory_bytes / GIB], s=160, marker="*", color="#c44e52",
               label=f"best: {_short(best.label)}", zorder=3)  # fmt: skip
    for p in pts:
        if p.compare:
            ax.scatter([p.step_s], [p.memory_bytes / GIB], s=90, marker="D", color="#55a868",
                       label=f"compare (rank {p.rank}): {_short(p.label)}", zorder=3)  # fmt: skip
    ax.axhline(facts.capacity / GIB, color="#c44e52", ls="--", lw=1)
    ax.set_xlabel("predicted step time (s)")
    ax.set_ylabel("memory per rank (GiB)")
    ax.set_title(f"{len(pts)} ranked configurations: step time vs memory", fontsize=10)
    ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    return fig


def _short(label: str) -> str:
    return " ".join(label.split()[:5])


def _seconds(s: float) -> str:
    return f"{s:.3f} s" if s >= 1 else f"{s * 1e3:.3f} ms" if s >= 1e-3 else f"{s * 1e6:.1f} µs"
