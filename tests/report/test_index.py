"""The index pages list notebooks run in JupyterLab (reports/interactive/<name>/) at once, with their
parameters and the time they were saved."""

import json
import re

import pandas as pd

from workbench.report import Ledger, at_least, save_results


def _clone(tmp_path, monkeypatch):
    repo = tmp_path / "my-clone"
    (repo / "notebooks").mkdir(parents=True)
    (repo / "pyproject.toml").write_text("")
    monkeypatch.chdir(repo / "notebooks")  # Jupyter starts the kernel in the notebook's folder
    return repo


def test_a_jupyterlab_run_is_listed_with_its_parameters_and_time(tmp_path, monkeypatch, capsys):
    repo = _clone(tmp_path, monkeypatch)
    ledger = Ledger(verdicts=False)
    ledger.add("x is large", paper=4, measured=5, unit="x", scale="tiny", device="cpu", rule=at_least(4))
    path = save_results("tour", output_dir="", parameters={"batch_size": 4, "stem": "cifar"},
                        records={"r": pd.DataFrame({"a": [1]})}, ledger=ledger)
    saved = json.loads(path.read_text())["saved"]
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d", saved)
    reports = repo / "reports"
    assert f"listed in {reports / 'index.html'}" in capsys.readouterr().out
    top = (reports / "index.html").read_text()  # written by save_results itself, no build needed
    assert 'href="interactive/index.html#tour"' in top and saved in top and "2 parameters" in top
    page = (reports / "interactive" / "index.html").read_text()
    assert f"Run in JupyterLab, saved {saved}" in page
    assert "batch_size=4 stem=&quot;cifar&quot;" in page and "x is large" in page
    assert "each run replaces the notebook&#x27;s previous one" in page


def test_a_page_that_is_not_ours_is_left_alone_and_the_run_still_saved(tmp_path, monkeypatch, capsys):
    repo = _clone(tmp_path, monkeypatch)
    (repo / "reports").mkdir()
    (repo / "reports" / "index.html").write_text("<html>my notes</html>")
    path = save_results("tour", output_dir="", parameters={}, records={}, ledger=Ledger())
    assert path.is_file()
    assert "the index was not updated" in capsys.readouterr().err
    assert (repo / "reports" / "index.html").read_text() == "<html>my notes</html>"


def test_every_link_on_the_index_pages_leads_to_a_file(tmp_path, monkeypatch):
    """A JupyterLab run writes results.json and figures, no executed notebook: its section links only what is
    there (it linked notebook (HTML) and (.ipynb) for every run: 14 dead links on one page). A failed rebuild
    that stopped before its HTML links only its notebook."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from tests.report.page_checks import dead_links
    from workbench.report import write_index

    repo = _clone(tmp_path, monkeypatch)
    fig = plt.figure()
    save_results("tour", output_dir="", parameters={"batch_size": 4}, records={}, ledger=Ledger(),
                 figures={"memory": fig})
    plt.close(fig)
    save_results("optorch", output_dir="", parameters={}, records={}, ledger=Ledger())
    reports = repo / "reports"
    page = reports / "interactive" / "index.html"
    assert not dead_links(reports / "index.html") and not dead_links(page), dead_links(page)
    text = page.read_text()
    assert "notebook (HTML)" not in text and "results.json</a>" in text and 'src="tour/memory.png"' in text
    # a profile build's folder: the executed notebook and its HTML are linked; a failed rebuild without HTML
    folder = reports / "cpu" / "tour"
    (folder / "failed-run").mkdir(parents=True)
    for f in ("tour.ipynb", "tour.html", "failed-run/tour.ipynb"):
        (folder / f).write_text("{}")
    (folder / "run.json").write_text(json.dumps({"status": "ok", "profile": "cpu", "started": "2026-01-01"}))
    (folder / "results.json").write_text(json.dumps({"name": "tour", "claims": []}))
    (folder / "failed-run" / "run.json").write_text(json.dumps({"status": "failed", "error": "boom"}))
    write_index(reports)
    cpu = (reports / "cpu" / "index.html").read_text()
    assert "notebook (HTML)" in cpu and "failed run (.ipynb)" in cpu and "failed run (HTML)" not in cpu
    for page in (reports / "index.html", reports / "cpu" / "index.html", reports / "interactive" / "index.html"):
        assert not dead_links(page), dead_links(page)


def test_each_report_names_the_cpu_and_its_instruction_sets(tmp_path):
    """Two builds compare like with like only on the same kind of CPU: each row and section names the CPU model
    and a short ISA summary, from the notebook's environment record, else from the runner's run.json; a report
    made before either recorded it shows a dash."""
    from workbench.devices import ISA_FLAGS
    from workbench.report import write_index

    sapphire = {f: True for f in ISA_FLAGS}
    reports = {
        "tour": ({"cpu_model": "AMD EPYC 9654", "cpu_isa": "AVX-512 BF16"}, None),
        "optorch": ({}, {"cpu_model": "Intel(R) Xeon(R) Platinum 8480+", "cpu_flags": sapphire,
                         "cpu_capability": "AVX512", "onednn_max_cpu_isa": "AVX512_CORE_BF16"}),
        "calcgraph": ({"torch": "2.13.0"}, None),
    }
    for name, (environment, machine) in reports.items():
        folder = tmp_path / "cpu" / name
        folder.mkdir(parents=True)
        run = {"status": "ok", "profile": "cpu", "started": "2026-01-01", **({"machine": machine} if machine else {})}
        (folder / "run.json").write_text(json.dumps(run))
        (folder / "results.json").write_text(json.dumps({"name": name, "claims": [], "environment": environment}))
    write_index(tmp_path)
    page, top = (tmp_path / "cpu" / "index.html").read_text(), (tmp_path / "index.html").read_text()
    for text in (page, top):
        assert "<th>CPU</th>" in text and "<td>AMD EPYC 9654 (AVX-512 BF16)</td>" in text
        assert ("<td>Intel(R) Xeon(R) Platinum 8480+ (AVX-512 BF16 FP16, AMX-BF16, oneDNN max AVX512_CORE_BF16)"
                "</td>") in text
        assert '<td>—</td><td><code>none</code></td>' in text  # calcgraph: CPU not recorded, no overrides
    assert "torch ?, CPU AMD EPYC 9654 (AVX-512 BF16)." in page and "torch 2.13.0, CPU —." in page
