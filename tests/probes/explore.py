"""Hostile-input exploration (issue 35): hundreds of probes in five families, each run in a forked child and its
outcome classified. Run by hand, not by pytest (no `test_` prefix); the findings worth keeping become tests.

    python tests/probes/explore.py                 # every family, counts by family and class
    python tests/probes/explore.py cli data -v     # some families, one line per probe
    python tests/probes/explore.py --list          # names only

Families: `cli` (command-line arguments), `runner` (report runner faults), `library` (the library API), `data`
(the CIFAR and MNIST readers), `unpack` (`workbench.gpu unpack`). Classes:

    refused    a clear refusal naming the bad value (exit status 2 from the command line)
    ok         correct behaviour for an input that is fine (or a refusal where refusing is the behaviour)
    vague      a refusal of the right kind that does not name the value
    traceback  an exception from deep inside (a type a caller cannot expect, or an uncaught one)
    crash      the process died (a signal, a hard exit) or hung past the probe's timeout
    nonsense   bad input accepted without a word, or a wrong result
    loss       a file that had to survive (a good report, a file of the user's) is gone or changed
    outside    something written outside the folder the probe gave (its `outside/` or the repository's reports)

Each probe gets a fresh sandbox folder; its child process may `keep()` files that must survive and write nothing
outside `sandbox/outside` (checked by the parent after the child ends, whatever it did). papermill is replaced by
the runner tests' fake executor (no kernels start), so a probe takes a fraction of a second.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import multiprocessing
import os
import shutil
import sys
import tempfile
import time
import traceback
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
if __name__ == "__main__":  # the family modules `import explore`: one module, one list of probes
    sys.modules["explore"] = sys.modules[__name__]
CLASSES = ("refused", "ok", "vague", "traceback", "crash", "nonsense", "loss", "outside")
FAMILIES = ("cli", "runner", "library", "data", "unpack")


@dataclass
class Probe:
    family: str
    name: str
    run: Callable[[Sandbox], tuple[str, str]]
    timeout: float = 30.0


PROBES: list[Probe] = []


def probe(family: str, name: str, timeout: float = 30.0):
    """Register `fn(sandbox) -> (class, detail)` as a probe."""
    def register(fn):
        PROBES.append(Probe(family, name, fn, timeout))
        return fn
    return register


def cases(family: str, prefix: str, table: dict, timeout: float = 30.0):
    """Register one probe per entry of `table` (name -> argument): `fn(sandbox, argument)`."""
    def register(fn):
        for name, argument in table.items():
            PROBES.append(Probe(family, f"{prefix}: {name}", lambda sb, a=argument, f=fn: f(sb, a), timeout))
        return fn
    return register


# ---------------------------------------------------------------------------------------------
# The sandbox


class Sandbox:
    """A probe's own folder: `outside/` holds files nothing may touch; `keep()` names files that must survive."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.outside = root / "outside"

    def setup(self) -> None:
        self.outside.mkdir(parents=True)
        (self.outside / "victim.txt").write_text("user data outside the given folders")
        (self.outside / "folder").mkdir()
        (self.outside / "folder" / "notes.md").write_text("mine")

    def keep(self, *paths: Path) -> None:
        """Files (or every file under folders) that must still exist with the same bytes after the probe."""
        kept = _read(self.root / ".kept.json", {})
        for path in paths:
            files = [p for p in Path(path).rglob("*") if p.is_file() and not p.is_symlink()] if Path(
                path).is_dir() else [Path(path)]
            kept.update({str(f): _digest(f) for f in files})
        (self.root / ".kept.json").write_text(json.dumps(kept))

    def notebooks(self) -> Path:
        """A notebook folder: `good` (value, rate, flag, label) and `listed` (sizes ranged, a list of names)."""
        from probe_cases import write_notebook

        folder = self.root / "notebooks"
        (folder / "profiles").mkdir(parents=True, exist_ok=True)
        write_notebook(folder, "good")
        write_notebook(folder, "listed", "sizes = [1, 2]  # range: 1..100\nnames = ['a']\nvalue = 1\n")
        (folder / "profiles" / "good.yaml").write_text("smoke:\n  value: 2\ncpu:\n  value: 3\n")
        return folder

    def report(self, *args: str) -> tuple[int | str, str]:
        """`workbench report --notebooks <sandbox>/notebooks --out <sandbox>/reports ARGS` in this process:
        (exit status, or the uncaught exception's text; stderr)."""
        return cli(["report", "--notebooks", str(self.root / "notebooks"), "--out", str(self.root / "reports"),
                    *args])


def _digest(path: Path) -> str | None:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return None


def _read(path: Path, default):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return default


def _snapshot(folder: Path) -> dict[str, str]:
    found = {}
    for path in sorted(folder.rglob("*")) if folder.exists() else []:
        key = str(path.relative_to(folder))
        found[key] = f"link:{os.readlink(path)}" if path.is_symlink() else (
            _digest(path) if path.is_file() else "dir")
    return found


# ---------------------------------------------------------------------------------------------
# Classifying what a call did (in the child)


def short(value, limit: int = 160) -> str:
    try:
        text = value if isinstance(value, str) else repr(value)
    except Exception:  # noqa: BLE001 - a value whose repr fails is itself a finding elsewhere
        text = f"<{type(value).__name__}>"
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit] + "..."


def _where(exc: BaseException) -> str:
    frames = traceback.extract_tb(exc.__traceback__)
    return f" at {Path(frames[-1].filename).name}:{frames[-1].lineno}" if frames else ""


def refusal(call: Callable, *needles: str, types=(ValueError, TypeError)) -> tuple[str, str]:
    """A call that must be refused with one of `types` naming every needle."""
    try:
        result = call()
    except types as exc:
        text = str(exc)
        missing = [n for n in needles if n not in text]
        return ("vague", f"{type(exc).__name__} without {missing}: {short(text)}") if missing else (
            "refused", short(text))
    except Exception as exc:  # noqa: BLE001
        return "traceback", f"{type(exc).__name__}{_where(exc)}: {short(str(exc))}"
    return "nonsense", f"accepted; returned {short(result)}"


def works(call: Callable, check: Callable | None = None) -> tuple[str, str]:
    """A call that must work (and pass `check(result)` when given)."""
    try:
        result = call()
    except Exception as exc:  # noqa: BLE001
        return "traceback", f"{type(exc).__name__}{_where(exc)}: {short(str(exc))}"
    if check is not None and not check(result):
        return "nonsense", f"wrong result {short(result)}"
    return "ok", short(result, 80)


def cli(argv: list[str], main: Callable | None = None) -> tuple[int | str, str]:
    """(exit status, stderr) of `workbench ARGV` run here; an uncaught exception gives its text as the status."""
    if main is None:
        from workbench.cli import main
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = main(argv)
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
        except BaseException as exc:  # noqa: BLE001 - KeyboardInterrupt included: the command should catch it
            return f"{type(exc).__name__}{_where(exc)}: {short(str(exc))}", err.getvalue()
    return code, err.getvalue()


def cli_refusal(outcome: tuple[int | str, str], *needles: str, code: int = 2) -> tuple[str, str]:
    """A command that must exit with `code` (2: a refusal) and a message naming every needle."""
    status, err = outcome
    if isinstance(status, str):
        return "traceback", status
    if status != code:
        return "nonsense", f"exit {status}, expected {code}: {short(err)}"
    missing = [n for n in needles if n not in err]
    return ("vague", f"exit {status} without {missing}: {short(err)}") if missing else ("refused", short(err))


def cli_works(outcome: tuple[int | str, str], code: int = 0) -> tuple[str, str]:
    status, err = outcome
    if isinstance(status, str):
        return "traceback", status
    return ("ok", f"exit {status}") if status == code else ("nonsense", f"exit {status}: {short(err)}")


# ---------------------------------------------------------------------------------------------
# Running the probes


def _child(index: int, root: str) -> None:
    sandbox = Sandbox(Path(root))
    os.chdir(root)
    quiet = os.open(os.devnull, os.O_WRONLY)  # the C++ libraries' own log lines (the profiler's) go nowhere
    os.dup2(quiet, 1)
    os.dup2(quiet, 2)
    try:
        import torch

        torch.set_num_threads(1)
        kind, detail = PROBES[index].run(sandbox)
    except BaseException as exc:  # noqa: BLE001 - a probe's own setup failing is reported, not hidden
        kind, detail = "traceback", f"probe raised {type(exc).__name__}{_where(exc)}: {short(str(exc))}"
    (Path(root) / ".result.json").write_text(json.dumps([kind, detail]))
    os._exit(0)  # no atexit handlers, no finalizers of the parent's objects


def run_one(index: int, base: Path, reports: Path) -> tuple[str, str, float]:
    item = PROBES[index]
    root = base / f"p{index:04d}"
    sandbox = Sandbox(root)
    sandbox.setup()
    outside, in_repo = _snapshot(sandbox.outside), _snapshot(reports)
    start = time.perf_counter()
    child = multiprocessing.get_context("fork").Process(target=_child, args=(index, str(root)))
    child.start()
    child.join(item.timeout)
    if child.is_alive():
        child.kill()
        child.join()
        kind, detail = "crash", f"hung: still running after {item.timeout:.0f} s"
    elif child.exitcode != 0:
        kind, detail = "crash", f"the process died (exit status {child.exitcode})"
    else:
        kind, detail = _read(root / ".result.json", ["crash", "no result written"])
    seconds = time.perf_counter() - start
    lost = [k for k, v in _read(root / ".kept.json", {}).items() if not Path(k).is_file() or _digest(Path(k)) != v]
    if lost:
        gone = ", ".join(str(Path(p).relative_to(root)) for p in lost[:4])
        kind, detail = "loss", f"{gone} gone or changed; {detail}"
    changed = _snapshot(sandbox.outside) != outside or _snapshot(reports) != in_repo
    if changed:
        kind, detail = "outside", "wrote outside the given folder; " + detail
    return kind, detail, seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n")[:2]))
    parser.add_argument("families", nargs="*", metavar="FAMILY", help=f"some of {', '.join(FAMILIES)} (default: all)")
    parser.add_argument("-v", "--verbose", action="store_true", help="one line per probe")
    parser.add_argument("-k", default="", help="only probes whose name contains this")
    parser.add_argument("--list", action="store_true")
    parser.add_argument("--keep", action="store_true", help="keep the sandboxes (printed at the end)")
    args = parser.parse_args(argv)
    # NOTE: the optim probes build the C++ update kernels; a folder of our own, so a build another process
    # holds the lock of elsewhere does not make them wait (a "hang" that is only a queue)
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(tempfile.gettempdir()) / "ext-probes"))
    unknown = sorted(set(args.families) - set(FAMILIES))
    if unknown:
        parser.error(f"unknown families {unknown}; choose from {', '.join(FAMILIES)}")
    families = args.families or list(FAMILIES)
    _load(families)
    chosen = [i for i, p in enumerate(PROBES) if p.family in families and args.k in p.name]
    if args.list:
        print("\n".join(f"{PROBES[i].family:8} {PROBES[i].name}" for i in chosen))
        return 0
    from workbench.devices import repo_root

    base = Path(tempfile.mkdtemp(prefix="workbench-explore-"))
    counts: dict[str, Counter] = defaultdict(Counter)
    findings = []
    start = time.perf_counter()
    for i in chosen:
        kind, detail, seconds = run_one(i, base, repo_root() / "reports")
        item = PROBES[i]
        counts[item.family][kind] += 1
        if kind not in ("refused", "ok"):
            findings.append(f"{item.family:8} {kind:9} {item.name}: {detail}")
        if args.verbose:
            print(f"{item.family:8} {kind:9} {seconds:5.1f}s {item.name}: {short(detail, 200)}", flush=True)
        if not args.keep:
            shutil.rmtree(base / f"p{i:04d}", ignore_errors=True)
    print(f"\n{len(chosen)} probes in {time.perf_counter() - start:.0f} s (load {os.getloadavg()[0]:.1f})\n")
    print(f"{'family':10}" + "".join(f"{c:>10}" for c in CLASSES) + f"{'total':>8}")
    for family in families:
        row = counts[family]
        print(f"{family:10}" + "".join(f"{row[c]:>10}" for c in CLASSES) + f"{sum(row.values()):>8}")
    total = sum(counts.values(), Counter())
    print(f"{'all':10}" + "".join(f"{total[c]:>10}" for c in CLASSES) + f"{sum(total.values()):>8}")
    if findings:
        print("\nfindings:\n" + "\n".join(findings))
    if args.keep:
        print(f"\nsandboxes in {base}")
    else:
        shutil.rmtree(base, ignore_errors=True)
    return 0


def _load(families: list[str]) -> None:
    """Import the family modules (each registers its probes), then what every child shares: the fake papermill."""
    import importlib

    import matplotlib

    matplotlib.use("Agg")
    for family in families:
        importlib.import_module(f"explore_{family}")
    if "library" in families:
        importlib.import_module("explore_others")  # other helpers' modules, marked [owner]
    import papermill
    import torch  # noqa: F401 - imported once here, not in every child
    from probe_cases import FakeExecutor

    import workbench.data  # noqa: F401
    from workbench.cli import build_parser
    from workbench.report import runner

    build_parser()  # its imports (the advisor's command) too

    papermill.execute_notebook = FakeExecutor()
    runner._export_html = lambda nb: nb.with_suffix(".html").write_text("<html></html>")
    runner._add_kernel_path()


if __name__ == "__main__":
    sys.exit(main())
