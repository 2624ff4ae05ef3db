"""The HTML report (autopar.tools.report): its numbers are the plan's own, it is self-contained and
well-formed, it renders in a real browser, and the command line writes it.

Every number the page shows is in a `data-value` attribute of its table cell; the tests read
them back and compare with the records they come from (the Plan and its dp section, a search's
Choice), never with constants.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import xml.etree.ElementTree as ET
from html.parser import HTMLParser
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")

import torch  # noqa: E402

from autopar import Mesh, autoparallelize  # noqa: E402
from autopar.tools.report import CHARTS  # noqa: E402
from autopar.tools.report_facts import facts_of  # noqa: E402
from autopar.tools.report_program import core_plans, position_rows  # noqa: E402

PP_TP_CHARTS = ("chart-mesh", "chart-comm", "chart-memory", "chart-schedule")


class _Tables(HTMLParser):
    """table id → rows of cells, each cell (text, data-value or None)."""

    def __init__(self) -> None:
        super().__init__()
        self.tables: dict[str, list[list[tuple[str, float | None]]]] = {}
        self._table: str | None = None
        self._cell: list | None = None

    def handle_starttag(self, tag: str, attrs: list) -> None:
        a = dict(attrs)
        if tag == "table":
            self._table = a["id"]
            self.tables[self._table] = []
        elif tag == "tr" and self._table:
            self.tables[self._table].append([])
        elif tag in ("td", "th") and self._table:
            value = float(a["data-value"]) if "data-value" in a else None
            self._cell = ["", value]

    def handle_data(self, data: str) -> None:
        if self._cell is not None:
            self._cell[0] += data

    def handle_endtag(self, tag: str) -> None:
        if tag in ("td", "th") and self._cell is not None:
            self.tables[self._table][-1].append(tuple(self._cell))
            self._cell = None
        elif tag == "table":
            self._table = None


def tables(path: Path) -> dict[str, list[list[tuple[str, float | None]]]]:
    parser = _Tables()
    parser.feed(path.read_text())
    return parser.tables


@pytest.fixture(scope="module")
def llama_dp_pp_tp(tmp_path_factory: pytest.TempPathFactory):
    """A traced HF Llama on Mesh(dp=2, pp=2, tp=2) and its report (with PNGs)."""
    from autopar.tools.testing import hf_tiny_llama, token_batch

    ids, labels = token_batch(8, 16, 128)
    prog = autoparallelize(hf_tiny_llama(2), Mesh(dp=2, pp=2, tp=2), (ids,),
                           example_kwargs={"labels": labels})  # fmt: skip
    d = tmp_path_factory.mktemp("report")
    path = prog.report(d / "plan.html", png_dir=d / "png")
    return prog, path


def test_memory_numbers_are_the_data_parallel_plans_own(llama_dp_pp_tp) -> None:
    prog, path = llama_dp_pp_tp
    rows = {r[0][0]: r for r in tables(path)["t-memory"][1:]}
    for m in prog.plan.dp.memory:
        row = rows[f"ZeRO-{m.stage}"]
        assert [c[1] for c in row[1:6]] == [m.weights, m.grads, m.optimizer, m.activations, 0.0]
        assert row[6][1] == m.total
        assert (row[7][0] == "yes") == (m.stage == prog.plan.dp.zero)
    per_rank = [rows[f"pp rank {r}"][6][1] for r in range(prog.mesh.size("pp"))]
    assert max(per_rank) == prog.plan.dp.memory[prog.plan.dp.zero].total  # the max memory_table took
    assert len(set(per_rank)) == len(per_rank)  # the stages hold different layers and heads
    expected = position_rows(prog, prog.mesh.size("dp"), prog.plan.dp.zero,
                             getattr(torch, prog.plan.dp.param_dtype))  # fmt: skip
    assert per_rank == [r.total for r in expected]


def test_step_comm_and_layouts_are_the_stage_plans_own(llama_dp_pp_tp) -> None:
    prog, path = llama_dp_pp_tp
    t = tables(path)
    plans = core_plans(prog)
    step = {r[0][0]: r[1][1] for r in t["t-step"][1:]}
    for i, plan in enumerate(plans):
        assert step[f"stage {i} compute"] == plan.compute_s
        assert step[f"stage {i} tp comm"] == plan.comm_s
    comm = t["t-comm"][1:]  # one step's: under pp a stage's collectives every micro-batch
    m = prog.plan.pp.n_microbatches
    times = {id(c): prog.plan.runs_per_step(c) for c in prog.collectives()}
    assert m > 1 and set(times.values()) == {1, m}  # the loss all-reduce once
    assert sum(r[4][1] for r in comm) == sum(c.bytes * times[id(c)] for c in prog.collectives())
    assert sum(r[3][1] for r in comm) == sum(times.values())
    tp_bytes = sum(r[4][1] for r in comm if r[0][0] == "tp")
    assert tp_bytes == m * sum(c.bytes for p in plans for c in p.collectives if c.axis == "tp")
    dp = [c for c in prog.plan.collectives if c.axis == "dp"]
    dp_bytes = sum(r[4][1] for r in comm if r[0][0] == "dp")
    per_mb = prog.plan.dp.zero >= 2  # ZeRO-2/3 gather and reduce-scatter every micro-batch
    assert dp_bytes == sum(c.bytes * (m if per_mb and c.direction != "step" and c.where != "loss"
                                      else 1) for c in dp)  # fmt: skip
    layouts = {(r[0][0], r[1][0]): r[2][1] for r in t["t-layouts"][1:]}
    assert sum(layouts.values()) == sum(len(p.params) for p in plans)
    for plan in plans:
        for fqn, lay in plan.params:
            assert any(lay == k[1] and _matches(k[0], fqn) for k in layouts)
    axes = {r[0][0]: (r[1][1], r[2][1], r[4][0]) for r in t["t-axes"][1:]}
    for axis, size in prog.mesh.axes:
        assert axes[axis][0] == size
        assert axes[axis][2] == prog.mesh.cluster.axis_link(prog.mesh.axes, axis).name


def _matches(pattern: str, fqn: str) -> bool:
    import re

    return re.fullmatch(re.escape(pattern).replace(r"\*", r"\d+"), fqn) is not None


def test_schedule_and_code_are_the_programs_own(llama_dp_pp_tp) -> None:
    prog, path = llama_dp_pp_tp
    facts = facts_of(prog)
    timeline = prog.timeline()
    drawn = tuple("".join("." if a is None else a[0] for a in row) for row in facts.schedule.slots)
    assert drawn == timeline.rows
    assert facts.schedule.bubble == timeline.bubble
    text = path.read_text()
    for title, src in facts.code:
        assert src == prog.code(int(title.split()[1]))
    assert prog.code(0).splitlines()[1].replace("<", "&lt;")[:40] in text


def test_search_report_numbers_are_the_plans_own(tmp_path: Path) -> None:
    from autopar.planner.auto import parse_degrees, plan_shape
    from cost.hardware import Cluster
    from cost.model import ModelShape

    plan = plan_shape(ModelShape.preset("llama3-8b"), Cluster.preset("dgx-h100", nodes=2), 64,
                      compare=parse_degrees("tp=4,pp=2,dp=2"))  # fmt: skip
    from autopar.tools.report import write_report

    t = tables(write_report(plan, tmp_path / "plan.html"))
    best = plan.best
    ranking = t["t-ranking"][1:]
    by_rank = {int(r[0][1]): r for r in ranking}
    for i, choice in enumerate(plan.result.ranked):
        if i + 1 in by_rank:
            assert by_rank[i + 1][2][1] == choice.step_time_s
            assert by_rank[i + 1][3][1] == choice.memory.total
    assert len(by_rank) == min(len(plan.result.ranked), 40)
    rank, chosen = plan.compare_rank()
    row = next(r for r in ranking if r[0][1] == rank)
    assert row[4][0].startswith("compare") and row[2][1] == chosen.step_time_s
    memory = {r[0][0]: r for r in t["t-memory"][1:]}
    mine = memory[f"ZeRO-{best.config.zero}"]
    assert mine[7][0] == "yes"
    assert [c[1] for c in mine[1:7]] == [v for _, v in best.memory.rows()]
    step = {r[0][0]: r[1][1] for r in t["t-step"][1:]}
    assert step["compute"] == best.step.compute
    assert sum(step.values()) == pytest.approx(best.step_time_s, rel=1e-12)
    exposed = {r[0][0]: r[5][1] for r in t["t-axes"][1:]}
    for axis, seconds in best.step.comm.items():
        if axis in exposed:
            assert exposed[axis] == seconds
    linked = {axis: link for axis, link, _ in plan.links()}
    links = {r[0][0]: r[4][0] for r in t["t-axes"][1:]}
    for axis, link in linked.items():
        assert link in links[axis]


def test_html_is_well_formed_and_self_contained(llama_dp_pp_tp) -> None:
    _, path = llama_dp_pp_tp
    text = path.read_text()
    root = ET.fromstring(text.removeprefix("<!DOCTYPE html>\n"))  # well-formed XML
    ids = {e.get("id") for e in root.iter()}
    assert set(PP_TP_CHARTS) <= ids
    for e in root.iter():
        tag = e.tag.rsplit("}", 1)[-1]
        assert tag not in ("script", "link", "iframe", "img", "object", "embed")
        for key, value in e.attrib.items():
            if key.rsplit("}", 1)[-1] in ("src", "href"):
                assert value.startswith("#"), f"{tag} {key}={value}: an external reference"
    style = "".join(e.text or "" for e in root.iter() if e.tag.endswith("style"))
    assert "url(" not in style and "@import" not in style
    assert "<details" in text  # the per-rank code is collapsible


def test_png_charts_are_drawn(llama_dp_pp_tp) -> None:
    import matplotlib.image as mpimg

    _, path = llama_dp_pp_tp
    for chart in PP_TP_CHARTS:
        image = mpimg.imread(path.parent / "png" / f"{chart}.png")
        assert image.shape[0] > 100 and image.std() > 0.05, chart


def test_measured_schedule_is_drawn_under_the_simulated_one(llama_dp_pp_tp,
                                                            tmp_path: Path) -> None:  # fmt: skip
    prog, _ = llama_dp_pp_tp
    events = [(0, "F", 0, 0.0, 0.001), (1, "F", 0, 0.001, 0.002), (1, "B", 0, 0.002, 0.004),
              (0, "B", 0, 0.004, 0.006)]  # fmt: skip
    assert facts_of(prog, events).schedule.measured == tuple(events)
    text = prog.report(tmp_path / "m.html", measured=events).read_text()
    assert "measured run (train_step)" in text
    assert "measured run" not in prog.report(tmp_path / "s.html").read_text()


def _timed_step(rank: int, groups: dict, share, x, y) -> list:
    """One pipeline step on a pool rank; every pipeline rank's recorded events."""
    from autopar.ops import collectives
    from autopar.runtime import PipelineRunner

    collectives.bind(groups)
    runner = PipelineRunner(share, groups["pp"])
    runner.step(x, y)
    return runner.gather_events()


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_a_pipeline_step_records_the_schedule_it_ran(schedule: str, tmp_path: Path) -> None:
    """The runner times each forward / backward chunk as torch's schedule runs it: per
    pipeline rank the order is the one autopar simulates and prices, every chunk once, and the
    events draw as the report's measured timeline."""
    from autopar.axes.schedule import actions
    from autopar.runtime.pool import get_pool
    from autopar.tools.testing import Config, build, lm_loss, tokens

    c = Config(layers=4, batch=4)
    x, y = tokens(c)
    prog = autoparallelize(build("llama", c), Mesh(pp=2), (x, y), lm_loss, n_microbatches=4,
                           schedule=schedule)  # fmt: skip
    jobs = [(prog.share(r), x, y) for r in range(2)]
    events = get_pool(2).run(_timed_step, prog.mesh.axes, jobs)[0]
    for r, planned in enumerate(actions(schedule, 2, 4)):
        mine = [e for e in events if e[0] == r]
        assert [(k, mb) for _, k, mb, _, _ in sorted(mine, key=lambda e: e[3])] == [
            (k, mb) for k, _, mb in planned]
        assert all(0 <= a <= b for *_, a, b in mine)
    text = prog.report(tmp_path / "measured.html", measured=events).read_text()
    assert "measured run (train_step)" in text


def test_unknown_objects_are_refused_with_what_to_give() -> None:
    with pytest.raises(TypeError, match="give a compiled program"):
        facts_of(object())


def test_cli_plan_and_estimate_write_the_report(tmp_path: Path) -> None:
    from autopar.tools.cli import main

    args = ["--model", "llama3-70b", "--cluster", "dgx-h100", "--nodes", "64",
            "--global-batch", "1024"]  # fmt: skip
    assert main(["plan", *args, "--compare", "tp=8,pp=4,dp=16", "--report",
                 str(tmp_path / "plan.html"), "--png", str(tmp_path / "png")]) == 0  # fmt: skip
    assert set(CHARTS) <= {p.stem for p in (tmp_path / "png").iterdir()}
    ids = {e.get("id") for e in _root(tmp_path / "plan.html").iter()}
    assert set(CHARTS) <= ids
    assert main(["estimate", *args[:6], "--tp", "8", "--pp", "4", "--global-batch", "1024",
                 "--report", str(tmp_path / "est.html")]) == 0  # fmt: skip
    ids = {e.get("id") for e in _root(tmp_path / "est.html").iter()}
    assert set(PP_TP_CHARTS) <= ids and "chart-ranking" not in ids


def _root(path: Path) -> ET.Element:
    return ET.fromstring(path.read_text().removeprefix("<!DOCTYPE html>\n"))


def _chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


def _browser(*args: str) -> subprocess.CompletedProcess:
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
             "--no-first-run", "--disable-background-networking"]  # fmt: skip
    return subprocess.run([_chromium(), *flags, *args], capture_output=True, text=True,
                          timeout=180, check=True)  # fmt: skip


@pytest.mark.skipif(_chromium() is None and os.environ.get("CI") != "true",
                    reason="no chromium on PATH (CI installs Debian's: apt-get install "
                           "chromium); outside CI the browser test is skipped")  # fmt: skip
def test_report_renders_in_headless_chromium(llama_dp_pp_tp, tmp_path: Path) -> None:
    import matplotlib.image as mpimg

    assert _chromium() is not None, "CI=true but chromium is not installed (see .ci/run)"
    _, path = llama_dp_pp_tp
    shot = tmp_path / "shot.png"
    _browser(f"--screenshot={shot}", "--window-size=1200,2400", path.resolve().as_uri())
    image = mpimg.imread(shot)
    assert image.shape[:2] == (2400, 1200)
    assert image[..., :3].std() > 0.05  # not blank: charts and tables drew
    dom = _browser("--dump-dom", path.resolve().as_uri()).stdout
    for chart in PP_TP_CHARTS:
        assert f'id="{chart}"' in dom, chart
    assert "<svg" in dom and "Pipeline schedule" in dom
