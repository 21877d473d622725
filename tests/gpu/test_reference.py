"""Reference reports (issue 22): reports/reference/<device>/<name>/ shown beside a build, claim by claim; the
archive that brings one back from a GPU machine, and the references committed in the repository."""

import io
import json
import shutil
import subprocess
import tarfile

import pytest

from workbench.devices import repo_root
from workbench.gpu.archive import bundle, bundle_part, listing_text, unpack, write_listing
from workbench.gpu.place import device_slug, write_reference
from workbench.report import reference, write_index
from workbench.report.reference import commit_relation, cuda_memory_rows, read_references
from workbench.report.results import UsageError

PNG = b"\x89PNG\r\n\x1a\n" + b"\x00\x00\x00\rIHDR" + (200).to_bytes(4, "big") + (100).to_bytes(4, "big") + b"\x00" * 8


def _claim(text, measured, verdict, *, unit="x", paper=1.0, source="paper"):
    return {"claim": text, "source": source, "paper": paper, "measured": measured, "spread": None, "unit": unit,
            "scale": "", "device": "", "verdict": verdict, "rule": ""}


def _report(folder, *, device, device_name, commit, claims, records=None, profile="cpu"):
    """A report folder as the runner leaves it: results.json, run.json, the notebook (HTML, .ipynb), a figure."""
    folder.mkdir(parents=True)
    name = folder.name
    env = {"device": device, "device_name": device_name, "torch": "2.11.0+cu130" if device != "cpu" else "2.13.0",
           "cuda": "13.0" if device != "cpu" else None, "python": "3.12.3", "git_commit": commit}
    results = {"name": name, "saved": "2026-11-20 10:00:00", "parameters": {"batch_size": 64}, "environment": env,
               "records": records or {}, "claims": claims, "figures": ["memory_trace.png"]}
    (folder / "results.json").write_text(json.dumps(results))
    (folder / "run.json").write_text(json.dumps({"name": name, "profile": profile, "status": "ok", "seconds": 12.5,
                                                 "started": "2026-11-20 09:59:47", "overrides": {}}))
    (folder / f"{name}.html").write_text("<html>executed</html>")
    (folder / f"{name}.ipynb").write_text(json.dumps({"cells": [
        {"cell_type": "code", "source": "step = training_step()\n", "metadata": {"papermill": {"duration": 3.25}}}]}))
    (folder / "memory_trace.png").write_bytes(PNG)
    return folder


CUDA_CLAIMS = [_claim("AMP trains faster than fp32", 1.6, "partly"),
               _claim("peak memory is exact", 0, "reproduced", unit="bytes of error", source="target"),
               _claim("a row only the GPU run has", 2.0, "reproduced")]
CPU_CLAIMS = [_claim("AMP trains faster than fp32", 0.9, "other device"),
              _claim("peak memory is exact", 0, "reproduced", unit="bytes of error", source="target")]
CUDA_RECORDS = {"step": [{"model": "resnet18", "peak_bytes": 3 * 2**30, "reserved_peak_bytes": 4 * 2**30},
                         {"model": "resnet50", "peak_bytes": 5 * 2**30, "reserved_peak_bytes": 6 * 2**30}],
                "trace": [{"op": "conv", "bytes": 10}]}


@pytest.fixture
def reports(tmp_path):
    """reports/ with a cpu build of `tour` (commit bbb2222) and an H200 reference of it (commit aaa1111)."""
    root = tmp_path / "reports"
    _report(root / "cpu" / "tour", device="cpu", device_name="CPU (test)", commit="bbb2222", claims=CPU_CLAIMS)
    built = _report(tmp_path / "device-build" / "gpu" / "tour", device="cuda:0", device_name="NVIDIA H200",
                    commit=None, claims=CUDA_CLAIMS, records=CUDA_RECORDS, profile="gpu")
    write_reference(built, root / "reference", commit="aaa1111", driver="580.159.03")
    return root


def test_a_reference_folder_holds_results_run_html_figures_and_where_it_ran(reports):
    folder = reports / "reference" / "nvidia-h200" / "tour"
    assert sorted(p.name for p in folder.iterdir()) == [
        "memory_trace.png", "results.json", "run.json", "tour.html"]  # no executed .ipynb
    run = json.loads((folder / "run.json").read_text())
    assert run["status"] == "ok" and run["profile"] == "gpu" and run["seconds"] == 12.5  # the runner's record
    env = run["environment"]
    assert env["device_name"] == "NVIDIA H200" and env["driver"] == "580.159.03" and env["torch"] == "2.11.0+cu130"
    assert env["commit"] == "aaa1111" and env["cuda"] == "13.0" and env["device"] == "cuda:0"
    assert env["cell_seconds"] == [{"cell": 0, "seconds": 3.25, "first_line": "step = training_step()"}]
    assert [r["slug"] for r in read_references(reports / "reference")["tour"]] == ["nvidia-h200"]


def test_the_index_shows_each_claim_beside_the_reference_and_says_it_is_older(reports, monkeypatch):
    monkeypatch.setattr(reference, "_is_ancestor", lambda older, newer, repo: (older, newer) == ("aaa1111", "bbb2222"))
    write_index(reports)
    page = (reports / "cpu" / "index.html").read_text()
    section = page[page.index("Beside the reference"):]
    assert "NVIDIA H200" in section and "driver 580.159.03" in section and "torch 2.11.0+cu130" in section
    assert "The reference is from an older commit (aaa1111) than this build (bbb2222)" in section
    row = section[section.index("AMP trains faster than fp32"):].split("</tr>")[0]
    assert "0.9" in row and "other device" in row and "1.6" in row and "partly" in row  # build, then reference
    only = section[section.index("a row only the GPU run has"):].split("</tr>")[0]
    assert "not in this build" in only and "reproduced" in only
    assert 'href="../reference/nvidia-h200/tour/tour.html"' in section
    memory = section[section.index("CUDA memory on NVIDIA H200"):]
    assert "max_memory_reserved" in memory and "5 GiB" in memory and "6 GiB" in memory  # largest of each column
    top = (reports / "index.html").read_text()
    assert 'href="reference/nvidia-h200/tour/tour.html"' in top and "580.159.03" in top and "aaa1111" in top


def test_no_warning_when_the_reference_is_from_the_build_s_commit(reports):
    results = json.loads((reports / "cpu" / "tour" / "results.json").read_text())
    results["environment"]["git_commit"] = "aaa1111"
    (reports / "cpu" / "tour" / "results.json").write_text(json.dumps(results))
    write_index(reports)
    page = (reports / "cpu" / "index.html").read_text()
    assert "Beside the reference" in page and "class=\"stale\"" not in page


def test_commit_relation():
    assert commit_relation("abc1234", "abc1234def") == "same"
    assert commit_relation(None, "abc1234") == "unknown" and commit_relation("not a commit", "abc1234") == "unknown"
    root = repo_root()
    found = [subprocess.run(["git", "rev-parse", "--short", rev], cwd=root, capture_output=True, text=True)
             for rev in ("HEAD", "HEAD~1")]
    if any(done.returncode != 0 for done in found):
        pytest.skip("needs a git checkout with two commits")
    head, parent = (done.stdout.strip() for done in found)
    assert commit_relation(parent, head, root) == "older"
    assert commit_relation(head, parent, root) == "newer"
    assert commit_relation("0123456", head, root) == "different"


def test_cuda_memory_rows_pair_allocated_with_reserved_on_cuda_only():
    cuda = {"environment": {"device": "cuda:0"}, "records": CUDA_RECORDS}
    assert cuda_memory_rows(cuda) == [{"record": "step", "allocated_column": "peak_bytes",
                                       "reserved_column": "reserved_peak_bytes",
                                       "max_allocated_bytes": 5 * 2**30, "max_reserved_bytes": 6 * 2**30}]
    assert cuda_memory_rows({"environment": {"device": "cpu"}, "records": CUDA_RECORDS}) == []


def test_device_slug():
    assert device_slug("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"
    assert device_slug("CPU (Intel(R) Xeon(R) Platinum)") == "cpu-intel-xeon-platinum"
    assert device_slug("") == "unknown-device"


def test_bundle_and_unpack_round_trip_and_replace_only_reference_folders(reports, tmp_path):
    folder = reports / "reference" / "nvidia-h200" / "tour"
    archive = bundle(folder, tmp_path / "out")
    assert archive.name == "reference-nvidia-h200-tour.tar.gz"
    elsewhere = tmp_path / "elsewhere"
    (target,) = unpack(archive, elsewhere)
    assert target == elsewhere / "nvidia-h200" / "tour"
    assert {p.name: p.read_bytes() for p in target.iterdir()} == {p.name: p.read_bytes() for p in folder.iterdir()}
    (target / "results.json").write_text("{}")
    unpack(archive, elsewhere)  # a reference folder is replaced as a whole
    assert (target / "results.json").read_bytes() == (folder / "results.json").read_bytes()
    mine = elsewhere / "nvidia-h200" / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep")
    with tarfile.open(archive) as tar, tarfile.open(tmp_path / "mine.tar.gz", "w:gz") as out:
        for member in tar.getmembers():
            data = tar.extractfile(member).read()
            member.name = member.name.replace("/tour/", "/mine/")
            out.addfile(member, io.BytesIO(data))
    with pytest.raises(UsageError, match="not a reference folder"):
        unpack(tmp_path / "mine.tar.gz", elsewhere)
    assert (mine / "notes.txt").read_text() == "keep" and not list(elsewhere.glob("nvidia-h200/.incoming-*"))


@pytest.mark.parametrize("member", ["../evil/tour/results.json", "nvidia-h200/tour/run.sh",
                                    "nvidia-h200/tour/sub/results.json", "NVIDIA/tour/results.json", "link"])
def test_unpack_refuses_members_outside_the_reference_layout(tmp_path, member):
    path = tmp_path / "bad.tar.gz"
    with tarfile.open(path, "w:gz") as tar:
        info = tarfile.TarInfo(member)
        if member == "link":
            info.name, info.type, info.linkname = "nvidia-h200/tour/results.json", tarfile.SYMTYPE, "/etc/passwd"
            tar.addfile(info)
        else:
            info.size = 2
            tar.addfile(info, io.BytesIO(b"{}"))
    with pytest.raises(UsageError, match="refusing member"):
        unpack(path, tmp_path / "root")
    assert not (tmp_path / "root").exists()


def test_unpack_refuses_a_folder_whose_run_json_has_no_environment(tmp_path):
    path = tmp_path / "plain.tar.gz"
    with tarfile.open(path, "w:gz") as tar:
        for name, data in (("run.json", b'{"status": "ok"}'), ("results.json", b"{}")):
            info = tarfile.TarInfo(f"nvidia-h200/tour/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    with pytest.raises(UsageError, match="no run.json .or part.json. holding an environment"):
        unpack(path, tmp_path / "root")
    assert not list((tmp_path / "root").glob("nvidia-h200/*"))


def test_a_newer_reference_removes_its_old_figures_and_keeps_everything_else(reports, tmp_path):
    folder = reports / "reference" / "nvidia-h200" / "tour"
    newer = shutil.copytree(folder, tmp_path / "newer" / "nvidia-h200" / "tour")
    (newer / "memory_trace.png").unlink()  # the same reference, no longer drawing memory_trace.png
    results = json.loads((newer / "results.json").read_text())
    (newer / "results.json").write_text(json.dumps({**results, "figures": []}))
    (folder / "notes.md").write_text("mine")
    unpack(bundle(newer, tmp_path / "out"), reports / "reference")
    assert sorted(p.name for p in folder.iterdir()) == ["notes.md", "results.json", "run.json", "tour.html"]


def test_a_part_folder_round_trips_and_is_listed(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "tests.log").write_text("17 passed")
    (out / "tests.xml").write_text("<testsuite/>")
    record = {"status": "ok", "seconds": 95.0, "made": "2026-11-27 10:00:00", "commit": "abc1234",
              "environment": {"device_name": "NVIDIA H100 80GB HBM3", "device": "cuda"}}
    archive = bundle_part([out / "tests.log", out / "tests.xml", out / "elsewhere.log"], record,
                          "nvidia-h100-80gb-hbm3", "tests", out)
    assert archive.name == "tests-nvidia-h100-80gb-hbm3.tar.gz"
    root = tmp_path / "reports" / "reference"
    (folder,) = unpack(archive, root)
    assert sorted(p.name for p in folder.iterdir()) == ["part.json", "tests.log", "tests.xml"]
    assert json.loads((folder / "part.json").read_text())["files"] == ["tests.log", "tests.xml"]
    assert write_listing(root) == root / "README.md"
    listing = (root / "README.md").read_text()
    assert "part `tests`: ok in 95.0 s" in listing and "NVIDIA H100 80GB HBM3" in listing


def test_the_listing_leaves_a_readme_of_yours_alone(reports):
    (reports / "reference" / "README.md").write_text("my own notes")
    assert write_listing(reports / "reference") is None
    assert (reports / "reference" / "README.md").read_text() == "my own notes"


COMMITTED = repo_root() / "reports" / "reference"
H100 = "nvidia-h100-80gb-hbm3"


def test_the_h100_references_are_committed_listed_and_shown_beside_a_build(tmp_path):
    """The 2026-11-26 H100 run (built from 012f1da) as unpacked from its archives: four notebooks, their
    commit as run.json records it, results.json's wrong git_commit kept and explained, never rewritten; and
    the 2026-11-27 run's advisor, stopped at its deadline, kept as the failed report it is."""
    found = read_references(COMMITTED)
    h100 = {name: refs[0] for name, refs in found.items() for r in refs if r["slug"] == H100}
    assert sorted(h100) == ["advisor", "efficient_densenet", "packed_bit_optimizers", "tour", "variable_batch_size"]
    advisor = h100.pop("advisor")
    assert advisor["environment"]["commit"].startswith("a38dca1") and advisor["environment"]["status"] == "failed"
    for ref in h100.values():
        assert ref["environment"]["commit"].startswith("012f1da") and ref["environment"]["status"] == "ok"
        assert ref["results"]["environment"]["git_commit"] == "08a6345"  # as the machine wrote it
        assert (ref["folder"] / f"{ref['name']}.html").is_file() and not list(ref["folder"].glob("*.ipynb"))
    listing = (COMMITTED / "README.md").read_text()
    assert listing == listing_text(COMMITTED), "reports/reference/README.md is stale: run unpack"
    assert "Not built on this device: calcgraph, optorch." in listing and "08a6345" in listing
    assert "part `kernels`: ok" in listing and "part `memory`: stopped" in listing
    reports = tmp_path / "reports"
    head = reference.checkout_commit()
    _report(reports / "cpu" / "tour", device="cpu", device_name="CPU (test)", commit=head, claims=CPU_CLAIMS)
    shutil.copytree(COMMITTED, reports / "reference")
    write_index(reports)
    page = (reports / "cpu" / "index.html").read_text()
    section = page[page.index("Beside the reference"):]
    assert "NVIDIA H100 80GB HBM3" in section and "012f1da" in section and "git_commit 08a6345" in section
    if head is not None:  # a git checkout holding 012f1da in its history
        assert "older commit (012f1da" in section


def test_unpack_reads_no_more_than_its_limit_even_inside_a_header(tmp_path, monkeypatch):
    """A tar header can itself be huge (a pax record): the stream under the member checks stops it."""
    from workbench.gpu import archive

    monkeypatch.setattr(archive, "MAX_ARCHIVE_BYTES", 2**20)
    path = tmp_path / "header.tar.gz"
    with tarfile.open(path, "w:gz", format=tarfile.PAX_FORMAT) as tar:
        info = tarfile.TarInfo("nvidia-h200/tour/run.json")
        info.pax_headers = {"comment": "x" * 4 * 2**20}
        tar.addfile(info, io.BytesIO(b""))
    with pytest.raises(UsageError, match=r"unpacks to more than \d+ MiB"):
        unpack(path, tmp_path / "root")


def test_unpack_takes_an_uncompressed_tar_too(reports, tmp_path):
    folder = reports / "reference" / "nvidia-h200" / "tour"
    path = tmp_path / "plain.tar"
    with tarfile.open(path, "w") as tar:
        for file in sorted(folder.iterdir()):
            tar.add(file, arcname=f"nvidia-h200/tour/{file.name}")
    (target,) = unpack(path, tmp_path / "elsewhere")
    assert (target / "run.json").read_bytes() == (folder / "run.json").read_bytes()
