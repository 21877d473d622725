"""What a report build shows while it runs (`report.progress`): the running notebook, its section (the latest
markdown heading above the executing cell), its cell and its time; one line in place on a terminal, plain lines
now and then in a log, nothing when progress is off. Also: run.json names the machine the notebook ran on."""

import json
import re
import threading
import time

import nbformat
import pytest

from workbench.devices import cpu_features
from workbench.report import build_reports
from workbench.report.progress import PROGRESS_TOPIC, CellHooks, Progress, section_of, tell_driver


def test_a_cells_section_is_its_last_markdown_heading():
    assert section_of("## Fig 3: throughput") == "Fig 3: throughput"
    assert section_of("# Title\nsome text\n### 2. Memory against depth ###\nmore") == "2. Memory against depth"
    assert section_of("  ## indented a little  ") == "indented a little"
    for plain in ("just text", "#hashtag is no heading", "    ## a code block", "", "##"):
        assert section_of(plain) is None, plain


def _cells():
    new_md, new_code = nbformat.v4.new_markdown_cell, nbformat.v4.new_code_cell
    return [new_md("# Workbench tour\nintro"), new_code("value = 1", metadata={"tags": ["parameters"]}),
            new_md("## 1. The meter"), new_code("a = 1"), new_code("   "), new_md("a note, no heading"),
            new_code("b = 2"), new_md("## Fig 3: throughput"), new_code("c = 3")]


def test_cell_hooks_tell_each_code_cell_with_the_heading_above_it():
    told = []
    hooks = CellHooks("tour", lambda *args: told.append(args))
    cells = _cells()
    assert set(hooks.engine_kwargs()) == {"on_notebook_start", "on_cell_start"}  # nbclient's hook names
    hooks.notebook_start(notebook=nbformat.v4.new_notebook(cells=cells))
    for index, cell in enumerate(cells):
        hooks.cell_start(cell=cell, cell_index=index)
    assert told == [("tour", "Workbench tour", "2/9"), ("tour", "1. The meter", "4/9"),
                    ("tour", "1. The meter", "7/9"), ("tour", "Fig 3: throughput", "9/9")]

    def broken(*args):
        raise RuntimeError("a progress line must never fail a notebook")

    CellHooks("tour", broken).cell_start(cell=cells[3], cell_index=3)  # swallowed
    CellHooks("tour", told.append).cell_start(cell=None, cell_index=0)  # whatever nbclient passes


class FakeBar:
    desc, n, total = "reports (cpu)", 1, 7

    def __init__(self, disable=False):
        self.disable, self.postfix, self.lines = disable, None, []

    def set_postfix_str(self, text, refresh=True):
        self.postfix = text

    def write(self, line, file=None):
        self.lines.append(line)


@pytest.fixture
def clock():
    return [1000.0]


def _progress(bar, clock, inline):
    live = Progress(bar, inline=inline)
    live.clock = lambda: clock[0]
    return live


def test_on_a_terminal_one_line_says_what_runs_and_for_how_long(clock):
    bar = FakeBar()
    live = _progress(bar, clock, inline=True)
    live.tell("tour")
    assert bar.postfix == "tour 0s, starting"  # its kernel, before the first cell
    clock[0] += 65
    live.tell("tour", "Fig 3: throughput", "12/40")
    assert bar.postfix == "tour 1m05s, cell 12/40: Fig 3: throughput"
    live.tell("calcgraph", "A heading far too long to show whole on one line of a terminal", "3/9")
    clock[0] += 3600
    live.show()
    assert bar.postfix == ("tour 1h01m, cell 12/40: Fig 3: throughput | calcgraph 1h00m, cell 3/9: "
                           "A heading far too long to show whole on one l...")
    live.done("tour")
    live.event((0.0, {"name": "tour", "section": "late", "cell": "40/40"}))  # a worker's late event: ignored
    live.event("not an event")
    assert bar.postfix.startswith("calcgraph ") and not bar.lines
    live.done("calcgraph")
    assert bar.postfix == ""


def test_in_a_log_plain_lines_now_and_then_not_one_per_cell(clock):
    bar = FakeBar()
    live = _progress(bar, clock, inline=False)
    live.tell("tour")
    assert bar.lines == ["reports (cpu) 1/7: running tour 0s, starting"]
    for cell in range(2, 30):  # cells of one section, then a new section within QUIET seconds
        clock[0] += 0.2
        live.tell("tour", "1. The meter", f"{cell}/40")
    assert len(bar.lines) == 1
    clock[0] += Progress.QUIET
    live.tell("tour", "1. The meter", "31/40")
    assert bar.lines[-1] == "reports (cpu) 1/7: running tour 20s, cell 31/40: 1. The meter"
    clock[0] += Progress.HEARTBEAT - 1
    live.show()
    assert len(bar.lines) == 2  # nothing new, and under a minute
    clock[0] += 1
    live.show()
    assert len(bar.lines) == 3 and bar.lines[-1].endswith("running tour 1m20s, cell 31/40: 1. The meter")
    live.done("tour")
    clock[0] += 600
    live.show()
    assert len(bar.lines) == 3 and bar.postfix is None  # nothing runs: nothing said


def test_nothing_is_shown_when_progress_is_off():
    bar = FakeBar(disable=True)
    with Progress(bar) as live:
        live.tell("tour", "section", "1/2")
        live.done("tour")
        assert not live.ticker.is_alive()
    assert bar.postfix is None and not bar.lines


def test_a_terminal_line_moves_by_itself_during_a_long_cell():
    bar = FakeBar()
    with Progress(bar, inline=True) as live:
        live.tell("tour", "2. One training step", "8/13")
        assert bar.postfix == "tour 0s, cell 8/13: 2. One training step"
        moved = re.compile(r"tour [1-9]\d*s, cell 8/13: 2\. One training step")
        deadline = time.monotonic() + 10
        while not moved.fullmatch(bar.postfix) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert moved.fullmatch(bar.postfix), bar.postfix
    assert bar.postfix == "" and not live.ticker.is_alive()


def test_a_dask_worker_tells_the_build_which_notebook_runs_and_where():
    from distributed import Client, LocalCluster

    bar = FakeBar()
    live = Progress(bar, inline=True)
    seen = threading.Event()

    def event(ev):
        live.event(ev)
        seen.set()

    with LocalCluster(n_workers=1, threads_per_worker=1, processes=False, dashboard_address=None) as cluster, \
            Client(cluster, set_as_default=False) as client:
        client.subscribe_topic(PROGRESS_TOPIC, event)
        client.submit(tell_driver, "tour", "Fig 3: throughput", "12/40", pure=False).result(timeout=30)
        assert seen.wait(30)
        client.unsubscribe_topic(PROGRESS_TOPIC)
    assert bar.postfix.startswith("tour ") and bar.postfix.endswith(", cell 12/40: Fig 3: throughput")
    tell_driver("tour")  # outside a worker: nothing, and no error


def test_the_runner_passes_the_hooks_only_when_progress_is_shown(notebooks, fake, tmp_path, capsys):
    build_reports(profile="smoke", out_dir=tmp_path / "quiet", notebooks=notebooks, progress=False)
    assert "on_cell_start" not in fake.calls[-1][1] and capsys.readouterr().err == ""
    build_reports(profile="smoke", out_dir=tmp_path / "shown", notebooks=notebooks, progress=True)
    hooks = fake.calls[-1][1]
    assert callable(hooks["on_cell_start"]) and callable(hooks["on_notebook_start"])
    assert "reports (smoke) 0/1: running good 0s, starting" in capsys.readouterr().err  # pytest's stderr is no terminal
    run = json.loads((tmp_path / "shown" / "smoke" / "good" / "run.json").read_text())
    here = cpu_features()
    assert run["machine"]["cpu_model"] == here["cpu_model"] and run["machine"]["cpu_isa"] == here["cpu_isa"]
    assert run["machine"]["cpu_flags"] == here["cpu_flags"]


def test_a_real_build_shows_each_section_as_its_cells_run(notebooks, tmp_path, capsys, monkeypatch):
    """A tiny notebook with two headings, run by papermill in the workbench kernel: the log names each."""
    nb = nbformat.read(notebooks / "good.ipynb", as_version=4)
    nb.cells[1:] = [nbformat.v4.new_markdown_cell("## First part"), nbformat.v4.new_code_cell("x = value"),
                    nbformat.v4.new_markdown_cell("text\n## Second part"), nbformat.v4.new_code_cell("print(x)")]
    nbformat.write(nb, notebooks / "good.ipynb")
    monkeypatch.setattr(Progress, "QUIET", 0.0)  # every change of section gets its line
    results = build_reports(profile="smoke", out_dir=tmp_path / "r", notebooks=notebooks, progress=True)
    assert results.status.tolist() == ["ok"]
    err = capsys.readouterr().err
    assert ", cell 4/6: First part" in err and ", cell 6/6: Second part" in err, err
