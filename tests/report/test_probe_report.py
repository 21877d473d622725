"""Bad-input and fault probes of the report files (issue 23): damaged results files (nested past the
decoder's recursion limit, a named pipe) make a report "unreadable" on the page instead of crashing or
hanging write_index; symbolic links never lead the pages, or save_results, outside the output folder;
ranged list parameters refuse empty, nested and non-numeric lists naming the element."""

import json
import os
import threading

import pytest
from runner_cases import run_cli, write_notebook

from workbench.report import Ledger, UsageError, build_reports, save_results, write_index
from workbench.report.results import MAX_DEPTH, read_json_file

needs_fifo = pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="named pipes need POSIX")
RUN = {"status": "ok", "profile": "smoke", "started": "2026-01-01 00:00:00", "seconds": 1.0, "overrides": {}}
RESULTS = {"name": "tiny", "parameters": {"value": 1}, "environment": {"device_name": "CPU"}, "records": {},
           "claims": [{"claim": "c1", "source": "paper", "paper": 1.0, "measured": 2.0, "unit": "x",
                       "verdict": "reproduced"}], "figures": []}


def _report(out, name="tiny", group="smoke", run=RUN, results=RESULTS):
    folder = out / group / name
    folder.mkdir(parents=True, exist_ok=True)
    for file, data in (("run.json", run), ("results.json", results)):
        if data is not None:
            (folder / file).write_text(data if isinstance(data, str) else json.dumps(data))
    return folder


def _within(seconds, fn):
    """fn()'s result, failing the test (not hanging it) when it takes longer than `seconds`."""
    result = {}
    thread = threading.Thread(target=lambda: result.setdefault("value", fn()), daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still running after {seconds} s"
    return result["value"]


def _unblock(fifo):
    """Open the pipe for writing once, so a reader stuck on it (the bug under test) returns."""
    try:
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    except OSError:
        pass


def _outside(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "victim.txt").write_text("user data")
    return outside


def _files(folder):
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


# ---------------------------------------------------------------------------------------------
# Damaged results files


@pytest.mark.parametrize("text", [
    "[" * 100000 + "]" * 100000,  # past the JSON decoder's recursion limit: RecursionError before the fix
    json.dumps(RESULTS).replace('"measured": 2.0', '"measured": ' + "[" * 5000 + "]" * 5000),
    json.dumps({"a": json.loads("[" * (MAX_DEPTH + 5) + "]" * (MAX_DEPTH + 5))}),  # decodes, still too deep
])
def test_results_nested_too_deep_are_damaged_not_a_crash(tmp_path, text):
    path = tmp_path / "results.json"
    path.write_text(text)
    data, problem = read_json_file(path)
    assert data == {} and problem.startswith("nested too deep")
    _report(tmp_path / "out", results=text)
    page = (tmp_path / "out" / "smoke" / "index.html")
    write_index(tmp_path / "out")
    html = page.read_text()
    assert "tiny" in html and "results.json is nested too deep" in html and "damaged files" in html


def test_results_at_ordinary_depth_still_read(tmp_path):
    path = tmp_path / "results.json"
    nested = {"parameters": {"grid": [[1, 2], [3, 4]]}, "records": {"r": [{"a": [1, [2, [3]]]}]}}
    path.write_text(json.dumps(nested))
    assert read_json_file(path) == (nested, None)
    assert read_json_file(tmp_path / "absent.json") == ({}, None)


@needs_fifo
def test_a_named_pipe_for_results_json_is_reported_not_waited_on(tmp_path):
    folder = _report(tmp_path / "out", results=None)
    os.mkfifo(folder / "results.json")
    try:
        assert _within(10, lambda: read_json_file(folder / "results.json")) == ({}, "a named pipe, not a plain file")
        _within(20, lambda: write_index(tmp_path / "out"))
    finally:
        _unblock(folder / "results.json")
    html = (tmp_path / "out" / "smoke" / "index.html").read_text()
    assert "results.json is a named pipe, not a plain file" in html and 'id="tiny"' in html


@needs_fifo
def test_a_build_beside_a_report_whose_results_are_a_pipe_finishes(notebooks, tmp_path, fake):
    out = tmp_path / "reports"
    write_notebook(notebooks, "other")
    build_reports(["good", "other"], profile="smoke", out_dir=out, notebooks=notebooks, progress=False)
    fifo = out / "smoke" / "other" / "results.json"
    fifo.unlink()
    os.mkfifo(fifo)
    try:
        results = _within(60, lambda: build_reports(["good"], profile="smoke", out_dir=out, notebooks=notebooks,
                                                    progress=False))
    finally:
        _unblock(fifo)
    assert results.status.tolist() == ["ok"]
    assert "results.json is a named pipe" in (out / "smoke" / "index.html").read_text()


def test_a_symlinked_results_json_is_not_read(tmp_path):
    outside = _outside(tmp_path)
    (outside / "secret.json").write_text(json.dumps({**RESULTS, "claims": [{"claim": "SECRET", "verdict": "x"}]}))
    folder = _report(tmp_path / "out", results=None)
    (folder / "results.json").symlink_to(outside / "secret.json")
    assert read_json_file(folder / "results.json") == ({}, "a symbolic link, not a plain file")
    write_index(tmp_path / "out")
    html = (tmp_path / "out" / "smoke" / "index.html").read_text()
    assert "SECRET" not in html and "results.json is a symbolic link" in html


# ---------------------------------------------------------------------------------------------
# Symbolic links leading outside the output folder


def test_a_figure_that_is_a_link_outside_is_not_shown_and_is_named(tmp_path):
    outside = _outside(tmp_path)
    folder = _report(tmp_path / "out", results={**RESULTS, "figures": ["fig.png", "../x.png"]})
    (folder / "fig.png").symlink_to(outside / "victim.txt")
    write_index(tmp_path / "out")
    html = (tmp_path / "out" / "smoke" / "index.html").read_text()
    assert 'src="tiny/fig.png"' not in html and "fig.png (a symbolic link)" in html
    assert "../x.png" not in html and "1 figure name(s) that are not plain file names" in html


def test_a_report_folder_that_is_a_link_outside_is_skipped_and_named(tmp_path):
    outside = _outside(tmp_path)
    _report(tmp_path / "out")
    _report(outside, name="fake")
    (tmp_path / "out" / "smoke" / "fake").symlink_to(outside / "smoke" / "fake")
    write_index(tmp_path / "out")
    top, page = (tmp_path / "out" / "index.html").read_text(), (tmp_path / "out" / "smoke" / "index.html").read_text()
    for html in (top, page):
        assert "#fake" not in html and 'id="fake"' not in html
        assert "smoke/fake is a symbolic link" in html
    assert 'id="tiny"' in page


@pytest.mark.parametrize("group", ["smoke", "interactive"])
def test_a_group_folder_that_is_a_link_outside_is_neither_read_nor_written(tmp_path, group):
    outside = _outside(tmp_path)
    _report(outside, group="elsewhere")
    before = _files(outside)
    out = tmp_path / "out"
    out.mkdir()
    (out / group).symlink_to(outside / "elsewhere")
    write_index(out)
    assert _files(outside) == before  # no index.html written through the link
    top = (out / "index.html").read_text()
    assert f"{group} is a symbolic link" in top and "tiny" not in top


def test_save_results_refuses_an_interactive_folder_that_is_a_link(tmp_path, monkeypatch):
    repo = tmp_path / "clone"
    (repo / "notebooks").mkdir(parents=True)
    (repo / "pyproject.toml").write_text("")
    (repo / "reports").mkdir()
    outside = _outside(tmp_path)
    (repo / "reports" / "interactive").symlink_to(outside)
    monkeypatch.chdir(repo / "notebooks")
    with pytest.raises(UsageError, match=r"interactive is a symbolic link .*remove the link"):
        save_results("tour", output_dir="", parameters={}, records={}, ledger=Ledger())
    assert _files(outside) == ["victim.txt"]
    (repo / "reports" / "interactive").unlink()
    (repo / "reports" / "interactive").mkdir()
    (repo / "reports" / "interactive" / "tour").symlink_to(outside)
    with pytest.raises(UsageError, match=r"tour is a symbolic link"):
        save_results("tour", output_dir="", parameters={}, records={}, ledger=Ledger())
    assert _files(outside) == ["victim.txt"]


# ---------------------------------------------------------------------------------------------
# Ranged list parameters


@pytest.fixture
def listed(notebooks):
    write_notebook(notebooks, "listed", "sizes = [1, 2]  # range: 1..100\nrates = [0.5]  # range: 0..1\n"
                                        "spare = []  # range: 0..1\n")
    return notebooks


@pytest.mark.parametrize("arg,message", [
    ("sizes=[1,'a']", "sizes=[1, 'a'] holds 'a', which is not a number (each element a number in 1..100)"),
    ("sizes=[]", "sizes=[] is empty; give at least one value"),
    ("sizes=[[1,2]]", "sizes=[[1, 2]] holds the nested list [1, 2]; give a flat list"),
    ("sizes=[1,True]", "holds True, which is not a number"),
    ("sizes=[1.5]", "sizes=[1.5] holds 1.5, which is not a whole number"),
    ("sizes=[1,1e400]", "holds inf, which is not a finite number"),
    ("rates=[0.5,None]", "rates=[0.5, None] holds None, which is not a number (each element a number in 0..1)"),
])
def test_bad_elements_of_a_ranged_list_are_refused_naming_them(listed, tmp_path, fake, capsys, arg, message):
    assert run_cli(listed, tmp_path / "r", "listed", "--profile", "smoke", "-p", arg) == 2
    assert message in capsys.readouterr().err
    assert not fake.calls and not (tmp_path / "r").exists()


def test_good_ranged_lists_still_run(listed, tmp_path, fake):
    # whole numbers for a float list, an empty list where the default is empty
    for arg in ("sizes=[1,100]", "rates=[0,1]", "spare=[]", "spare=[0.25]"):
        assert run_cli(listed, tmp_path / "r", "listed", "--profile", "smoke", "-p", arg) == 0
    assert [call[0].get(k) for call, k in zip(fake.calls, ("sizes", "rates", "spare", "spare"), strict=True)] == [
        [1, 100], [0, 1], [], [0.25]]


def test_a_profile_list_with_a_bad_element_names_the_file(listed, tmp_path, fake):
    (listed / "profiles" / "listed.yaml").write_text("smoke:\n  sizes: [1, [2]]\n")
    with pytest.raises(UsageError, match=r"listed\.yaml \(smoke\): sizes=\[1, \[2\]\] holds the nested list"):
        build_reports(["listed"], profile="smoke", out_dir=tmp_path / "r", notebooks=listed, progress=False)
    assert not fake.calls
