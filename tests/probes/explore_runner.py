"""Exploration probes, family `runner`: report runner faults (see explore.py). A good report is built first; then
its folder is damaged, something is put in the way, the build is interrupted or the disk fills, and the runner
builds again. Nothing the runner cannot prove it replaced may be lost, nothing outside may change, and every
refusal must name what is in the way (exit status 2)."""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import threading

from explore import cases, cli_refusal, cli_works, probe, short

FAIL = ("-p", "value=-1")  # the fake executor raises for a negative value: a failing rebuild


def _good(sb):
    """A good report at reports/smoke/good; returns its folder."""
    sb.notebooks()
    status, err = sb.report("good", "--profile", "smoke")
    assert status == 0, f"the first build failed: {status} {err}"
    return sb.root / "reports" / "smoke" / "good"


def _kept_report(sb, good):
    """Keep what a good report holds that a failed rebuild must not delete: results and figures."""
    sb.keep(*(good / f for f in ("results.json", "narrow.png", "two_panels.png")))


def _expect(outcome, code: int, *needles: str):
    return cli_refusal(outcome, *needles, code=code) if needles else cli_works(outcome, code)


# ---------------------------------------------------------------------------------------------
# A damaged run.json, then a failing rebuild: the report may be good, so it stays

RUN_JSON = {
    "truncated": '{"status": "ok", "na', "a list": "[]", "empty mapping": "{}", "empty file": "",
    "odd status": '{"status": "weird"}', "status a list": '{"status": ["ok"]}', "status a number": '{"status": 1}',
    "nested deep": "[" * 100000 + "]" * 100000, "binary": "\x00\xff\xfe garbage", "huge number": '{"status": 1' +
    "0" * 5000 + "}", "not UTF-8": "\udcff", "BOM": "\ufeff{\"status\": \"ok\"}",
}


@cases("runner", "damaged run.json, failing rebuild keeps the report", RUN_JSON)
def damaged_run(sb, text):
    good = _good(sb)
    (good / "run.json").write_bytes(text.encode("utf-8", "surrogateescape"))
    _kept_report(sb, good)
    return _expect(sb.report("good", "--profile", "smoke", *FAIL), 1)


RUN_KINDS = ["a named pipe", "a folder", "a link outside", "a dangling link"]


@cases("runner", "run.json that is not a file, failing rebuild", {k: k for k in RUN_KINDS}, timeout=40)
def odd_run(sb, kind):
    good = _good(sb)
    run = good / "run.json"
    run.unlink()
    if kind == "a named pipe":
        os.mkfifo(run)
    elif kind == "a folder":
        run.mkdir()
    elif kind == "a link outside":
        run.symlink_to(sb.outside / "victim.txt")
    else:
        run.symlink_to(sb.root / "nowhere")
    _kept_report(sb, good)
    return _expect(sb.report("good", "--profile", "smoke", *FAIL), 1)


@cases("runner", "damaged run.json, good rebuild replaces it", {"truncated": "{", "a list": "[]"})
def damaged_then_good(sb, text):
    good = _good(sb)
    (good / "run.json").write_text(text)
    return _expect(sb.report("good", "--profile", "smoke"), 0)


# ---------------------------------------------------------------------------------------------
# The marker, damaged or odd: a report the runner made stays its own; nothing outside is followed

MARKERS = {
    "damaged": "{", "files not a list": '{"files": "run.json"}', "empty": "", "nested deep": "[" * 5000 + "]" * 5000,
}


@cases("runner", "odd marker, rebuild", MARKERS)
def odd_marker(sb, text):
    good = _good(sb)
    (good / ".workbench-report").write_text(text)
    return _expect(sb.report("good", "--profile", "smoke"), 0)


@probe("runner", "a marker naming only some files, and one outside")
def partial_marker(sb):
    good = _good(sb)
    (good / ".workbench-report").write_text(json.dumps({"files": ["../../../outside/victim.txt", "run.json"]}))
    sb.keep(good / "results.json")
    return _expect(sb.report("good", "--profile", "smoke"), 2, "good.html")


@cases("runner", "marker not a file, rebuild", {"a folder": "dir", "a link outside": "link", "a named pipe": "fifo"},
       timeout=40)
def marker_kind(sb, kind):
    good = _good(sb)
    marker = good / ".workbench-report"
    marker.unlink()
    {"dir": marker.mkdir, "link": lambda: marker.symlink_to(sb.outside / "victim.txt"),
     "fifo": lambda: os.mkfifo(marker)}[kind]()
    return _expect(sb.report("good", "--profile", "smoke"), 0)


@probe("runner", "marker removed, a picture of yours in the report")
def premarker_picture(sb):
    good = _good(sb)
    (good / ".workbench-report").unlink()
    (good / "holiday.png").write_bytes(b"\x89PNG mine")
    sb.keep(good / "holiday.png")
    return _expect(sb.report("good", "--profile", "smoke"), 2, "holiday.png")


@probe("runner", "marker removed, results.json damaged, the figures")
def premarker_damaged(sb):
    good = _good(sb)
    (good / ".workbench-report").unlink()
    (good / "results.json").write_text("{")
    sb.keep(good / "narrow.png")
    return _expect(sb.report("good", "--profile", "smoke"), 2, "narrow.png")


# ---------------------------------------------------------------------------------------------
# Something of the user's in the way: refused, kept, nothing outside touched


def _in_the_way(sb, good, kind):
    smoke, reports = good.parent, good.parent.parent
    if kind == "notes in the report":
        (good / "notes.txt").write_text("mine")
        return good / "notes.txt", "notes.txt"
    if kind == "a failed-run that is a file":
        (good / "failed-run").write_text("mine")
        return good / "failed-run", "failed-run"
    if kind == "a failed-run linked outside":
        (good / "failed-run").symlink_to(sb.outside / "folder")
        return None, "failed-run"
    if kind == "the report a link outside":
        shutil.rmtree(good)
        good.symlink_to(sb.outside / "folder")
        return None, "symbolic link"
    if kind == "the report a file":
        shutil.rmtree(good)
        good.write_text("mine")
        return good, "is a file"
    if kind == "the profile folder a link outside":
        shutil.rmtree(smoke)
        smoke.symlink_to(sb.outside / "folder")
        return None, "smoke is not a folder"
    if kind == "the profile folder a file":
        shutil.rmtree(smoke)
        smoke.write_text("mine")
        return smoke, "smoke is not a folder"
    if kind == "the index a link outside":
        (reports / "index.html").unlink()
        (reports / "index.html").symlink_to(sb.outside / "victim.txt")
        return None, "index.html was not written by workbench report"
    if kind == "a page of yours":
        (smoke / "index.html").write_text("<html>mine</html>")
        return smoke / "index.html", "index.html was not written"
    if kind == "the lock a folder":
        (reports / ".lock").unlink(missing_ok=True)
        (reports / ".lock").mkdir()
        return None, ".lock"
    if kind == "the lock a link outside":
        (reports / ".lock").unlink(missing_ok=True)
        (reports / ".lock").symlink_to(sb.outside / "victim.txt")
        return None, ".lock is a symbolic link"
    if kind == "the lock a named pipe":
        (reports / ".lock").unlink(missing_ok=True)
        os.mkfifo(reports / ".lock")
        return None, ".lock"
    raise ValueError(kind)


WAY = ["notes in the report", "a failed-run that is a file", "a failed-run linked outside", "the report a link outside",
       "the report a file", "the profile folder a link outside", "the profile folder a file",
       "the index a link outside", "a page of yours", "the lock a folder", "the lock a link outside",
       "the lock a named pipe"]


@cases("runner", "in the way", {k: k for k in WAY}, timeout=40)
def in_the_way(sb, kind):
    good = _good(sb)
    keep, needle = _in_the_way(sb, good, kind)
    if keep is not None:
        sb.keep(keep)
    return _expect(sb.report("good", "--profile", "smoke"), 2, needle)


# ---------------------------------------------------------------------------------------------
# Builds that died: the hidden report comes back, whoever has the process id now

LEFTOVERS = {
    "hidden, id of a live process, failing rebuild": ("old", "live", FAIL, 1),
    "hidden, id of this process, failing rebuild": ("old", "self", FAIL, 1),
    "hidden, dead id, failing rebuild": ("old", "dead", FAIL, 1),
    "hidden, dead id, good rebuild": ("old", "dead", (), 0),
    "hidden twice, failing rebuild": ("old2", "dead", FAIL, 1),
    "hidden failed-run inside the report": ("failed-run", "dead", (), 0),
}


@cases("runner", "leftover", LEFTOVERS)
def leftover(sb, case):
    kind, who, args, code = case
    good = _good(sb)
    pid = {"live": os.getppid(), "self": os.getpid(), "dead": 999_999_999}[who]
    if kind == "failed-run":
        sb.report("good", "--profile", "smoke", *FAIL)
        os.replace(good / "failed-run", good / f".old-failed-run-{pid}-0badc0de")
        from workbench.report.folders import locked, recover

        with locked(sb.root / "reports"):
            recover(good.parent)
        if not (good / "failed-run" / "run.json").is_file():
            return "loss", "the hidden failed run did not come back"
        return _expect(sb.report("good", "--profile", "smoke", *args), code)
    if args:  # a failing rebuild must keep the hidden report, back under its name
        _kept_report(sb, good)
    os.replace(good, good.parent / f".old-good-{pid}-0000beef")
    if kind == "old2":
        shutil.copytree(good.parent / f".old-good-{pid}-0000beef", good.parent / f".old-good-{pid}-0000bee2")
    outcome = sb.report("good", "--profile", "smoke", *args)
    if args:
        sb.report("good", "--profile", "smoke", *args)  # and the build after it
    return _expect(outcome, code)


@cases("runner", "leftover not a folder", {"a link outside": "link", "a file": "file"})
def leftover_odd(sb, kind):
    good = _good(sb)
    hidden = good.parent / ".old-good-999999999-0000beef"
    shutil.rmtree(good)
    if kind == "link":
        hidden.symlink_to(sb.outside / "folder")
        needle = "symbolic link"
    else:
        hidden.write_text("mine")  # restored under its name, then refused: a file the runner did not make
        needle = "is a file"
    status = sb.report("good", "--profile", "smoke")
    if kind == "file":
        mine = hidden.parent / "good"
        if not (mine.is_file() and mine.read_text() == "mine"):
            return "loss", "the file moved aside is gone"
        return _expect(status, 2, needle)
    return _expect(status, 2, needle) if status[0] == 2 else _expect(status, 0)


@probe("runner", "a staging folder linked outside")
def staging_link(sb):
    good = _good(sb)
    (good.parent / ".staging-good-999999999-0000beef").symlink_to(sb.outside / "folder")
    return _expect(sb.report("good", "--profile", "smoke"), 0)


# ---------------------------------------------------------------------------------------------
# Interrupted, or out of space, at each step: the last good report survives

STEPS = {  # where the fault strikes: (module attribute, which call)
    "first rename": ("folders.os.replace", ".old-"), "second rename": ("folders.os.replace", ".staging-"),
    "marker": ("runner.mark", ""), "run.json": ("runner._write_atomic", "run.json"),
    "HTML export": ("runner._export_html", ""), "index": ("runner.write_index", ""),
    "staging folder": ("runner.temp_name", "staging"), "notebook": ("executor", ""),
}


def _strike(sb, step, fault):
    import papermill

    from workbench.report import folders, runner

    where, which = STEPS[step]
    if where == "executor":
        owner, attr = papermill, "execute_notebook"
    else:
        module, attr = where.split(".", 1)
        owner = {"folders": folders, "runner": runner}[module]
        if "." in attr:
            owner, attr = os, attr.split(".")[1]
    real = getattr(owner, attr)

    def faulty(*args, **kwargs):
        text = " ".join(map(str, args))
        if which in text or (which and which in os.path.basename(str(args[0]))):
            raise fault()
        if not which:
            raise fault()
        return real(*args, **kwargs)

    setattr(owner, attr, faulty)
    try:
        return sb.report("good", "--profile", "smoke")
    finally:
        setattr(owner, attr, real)


def _a_good_report(good) -> bool:
    """A good report is in place (the one built first, or a newer good one that replaced it)."""
    run = json.loads((good / "run.json").read_text()) if (good / "run.json").is_file() else {}
    return run.get("status") == "ok" and all((good / f).is_file() for f in ("results.json", "narrow.png"))


@cases("runner", "Ctrl-C at", {k: k for k in STEPS})
def interrupted(sb, step):
    good = _good(sb)
    status, err = _strike(sb, step, KeyboardInterrupt)
    after = sb.report("good", "--profile", "smoke", *FAIL)  # a failing build next: the report must be there
    if not _a_good_report(good):
        return "loss", f"no good report after Ctrl-C at the {step} and a failing build"
    if status != 130:
        return "nonsense", f"exit {short(status)} after Ctrl-C: {short(err)}"
    return _expect(after, 1)


@cases("runner", "disk full at", {k: k for k in STEPS if k != "staging folder"})
def disk_full(sb, step):
    good = _good(sb)
    status, err = _strike(sb, step, lambda: OSError(errno.ENOSPC, "No space left on device"))
    after = sb.report("good", "--profile", "smoke", *FAIL)
    if not _a_good_report(good):
        return "loss", f"no good report after a full disk at the {step} and a failing build"
    if isinstance(status, str) or status not in (1, 0):
        return "traceback" if isinstance(status, str) else "nonsense", f"exit {short(status)}: {short(err)}"
    return _expect(after, 1)


@probe("runner", "SIGINT while a notebook runs", timeout=40)
def sigint(sb):
    import papermill

    good = _good(sb)
    _kept_report(sb, good)
    real = papermill.execute_notebook

    def slow(*args, **kwargs):
        threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGINT)).start()
        threading.Event().wait(5)
        return real(*args, **kwargs)

    papermill.execute_notebook = slow
    status, err = sb.report("good", "--profile", "smoke")
    papermill.execute_notebook = real
    return ("ok", "exit 130") if status == 130 else ("nonsense", f"exit {short(status)}: {short(err)}")


@probe("runner", "two builds at once into one folder", timeout=60)
def concurrent(sb):
    from workbench.report import build_reports

    _good(sb)
    errors = []

    def build():
        try:
            build_reports(["good"], profile="smoke", out_dir=sb.root / "reports", notebooks=sb.root / "notebooks",
                          progress=False)
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=build) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    left = [p.name for p in (sb.root / "reports" / "smoke").iterdir() if p.name.startswith(".")]
    if errors or left or not (sb.root / "reports" / "smoke" / "good" / "results.json").is_file():
        return "nonsense", f"errors {errors}, leftovers {left}"
    return "ok", "both built, one report in place"


# ---------------------------------------------------------------------------------------------
# Profile files: refused naming the file (and line), before any notebook runs

PROFILE_TEXT = {
    "alias bomb": "a: &a [1, 1, 1, 1, 1, 1, 1, 1, 1, 1]\nb: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a, *a]\n"
                  "smoke:\n  value: *b\n",
    "merge key alias": "base: &b {value: 2}\nsmoke:\n  <<: *b\n",
    "nested 5000 deep": "smoke:\n  value: " + "[" * 5000 + "]" * 5000 + "\n",
    "5000-digit number": "smoke:\n  value: " + "7" * 5000 + "\n",
    "octal 010": "smoke:\n  value: 010\n", "base 60": "smoke:\n  value: 1:30\n",
    "python tag": "smoke:\n  value: !!python/name:os.system\n", "binary tag": "smoke:\n  label: !!binary aGk=\n",
    "set tag": "smoke:\n  label: !!set {a: null}\n", "timestamp": "smoke:\n  label: 2001-12-14\n",
    "two documents": "smoke:\n  value: 1\n---\ncpu:\n  value: 2\n", "NUL character": "smoke:\n  value: 1\x00\n",
    "a number as a key": "smoke:\n  1: 2\n", "a list as a key": "smoke:\n  ? [a]\n  : 2\n",
    "duplicate key": "smoke:\n  value: 1\n  value: 2\n", "undeclared parameter": "smoke:\n  nope: 1\n",
    "reserved parameter": "smoke:\n  output_dir: /tmp\n", "unknown profile": "fast:\n  value: 1\n",
    "section a list": "smoke: [1, 2]\n", "top a list": "- smoke\n", "wrong type": "smoke:\n  value: fast\n",
    "float for int": "smoke:\n  value: 1.5\n", "bool for int": "smoke:\n  value: true\n",
    "inf for float": "smoke:\n  rate: .inf\n", "nan for float": "smoke:\n  rate: .nan\n",
    "huge float": "smoke:\n  rate: 1e999\n", "tab indentation": "smoke:\n\tvalue: 1\n",
    "not UTF-8": b"smoke:\n  label: \xff\xfe\n", "2 MB": "smoke:\n  label: " + "x" * (2 * 2**20) + "\n",
}
PROFILE_NEEDLE = {"undeclared parameter": "nope", "wrong type": "value='fast'", "float for int": "value=1.5",
                  "bool for int": "value=True", "inf for float": "rate=inf", "nan for float": "rate=nan",
                  "huge float": "rate='1e999'"}


@cases("runner", "profile file", PROFILE_TEXT)
def profile_file(sb, text):
    folder = sb.notebooks()
    path = folder / "profiles" / "good.yaml"
    path.write_bytes(text if isinstance(text, bytes) else text.encode("utf-8", "surrogateescape"))
    name = next(k for k, v in PROFILE_TEXT.items() if v == text)
    return _expect(sb.report("good", "--profile", "smoke"), 2, PROFILE_NEEDLE.get(name, str(path)))


@cases("runner", "profile file not a file", {k: k for k in ("a named pipe", "a folder", "/dev/zero", "a link loop")},
       timeout=40)
def profile_kind(sb, kind):
    folder = sb.notebooks()
    path = folder / "profiles" / "good.yaml"
    path.unlink()
    if kind == "a named pipe":
        os.mkfifo(path)
    elif kind == "a folder":
        path.mkdir()
    elif kind == "/dev/zero":
        path.symlink_to("/dev/zero")
    else:
        path.symlink_to(path)
    return _expect(sb.report("good", "--profile", "smoke"), 2, str(path))
