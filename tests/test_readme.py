"""The README's code blocks run as written, its commands exist, and what a user reads names no internal
words or paths outside the repository."""

import contextlib
import html
import io
import re
import runpy
import shlex
import subprocess
import sys
import warnings

import nbformat
import pytest

from workbench import report
from workbench.cli import build_parser
from workbench.devices import repo_root

ROOT = repo_root()
README = (ROOT / "README.md").read_text()


def _blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README, flags=re.S)


def test_every_python_block_runs_on_its_own():
    blocks = _blocks("python")
    assert len(blocks) >= 2
    # one interpreter (imports are slow), but each block in a fresh namespace: no block leans on another
    runner = "import sys\nfor i, code in enumerate(sys.argv[1:]):\n    exec(compile(code, f'block {i}', 'exec'), {})\n"
    done = subprocess.run([sys.executable, "-c", runner, *blocks], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]


def _help(module: str, sub: list[str]) -> str:
    """What `python -m module *sub --help` prints, run in this process (its imports are mostly made already:
    a new interpreter per command took 4-7 s)."""
    out, argv = io.StringIO(), sys.argv
    sys.argv = [module, *sub, "--help"]
    try:
        with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as done, warnings.catch_warnings():
            warnings.filterwarnings("ignore", "'.*' found in sys.modules", RuntimeWarning)  # already imported
            runpy.run_module(module, run_name="__main__", alter_sys=True)
    finally:
        sys.argv = argv
    assert done.value.code in (0, None), f"python -m {module} {' '.join(sub)} --help exited {done.value.code}"
    return out.getvalue()


def test_every_shell_command_exists():
    targets = set(re.findall(r"^([a-z]+):", (ROOT / "Makefile").read_text(), flags=re.M))
    commands = [line.split("#")[0].strip() for block in _blocks("bash") for line in block.splitlines()]
    commands = [c for c in commands if c]
    assert any(c.startswith("make report") for c in commands) and any(c == "make test" for c in commands)
    parser = build_parser()
    for command in commands:
        words = shlex.split(command)
        if words[0] == "make":
            assert words[1] in targets, command
        elif words[0] == "workbench":
            args = parser.parse_args(words[1:])
            if args.command == "report":  # names, profile and -p values are valid for the real notebooks
                report.runner._plan(args.names, args.profile, dict(args.param), ROOT / "notebooks")
        elif words[0] == "jupyter":
            assert (ROOT / words[-1]).is_dir(), command
        elif words[0] in ("python", "python3") and words[1] == "-m":  # the module (and its subcommand) runs,
            sub = [words[3]] if len(words) > 3 and not words[3].startswith("-") else []  # and --help names
            shown = _help(words[2], sub)                                                  # every option used
            for flag in (w for w in words[3:] if w.startswith("--")):
                assert flag in shown, f"{command}: {flag} is not an option of {words[2]}"
        else:
            assert command == "source .venv/bin/activate", f"untested command in README: {command}"


# NOTE: DESIGN.md is the repository's own (one page for whoever works on the code, linked from the Layout
# section); a path outside the repository (../, shared/) stays internal
INTERNAL = re.compile(r"\.\./|/work/|shared/|GPU\.md|\bissue\b|paper 0\d\d|issue target|session", re.I)


def _user_facing() -> dict[str, str]:
    texts = {p: (ROOT / p).read_text() for p in ("README.md", "reports/README.md", "data/README.md")}
    tour = nbformat.read(ROOT / "notebooks" / "tour.ipynb", as_version=4)
    texts["notebooks/tour.ipynb"] = "\n".join(c.source for c in tour.cells)
    return texts


@pytest.mark.parametrize("name", list(_user_facing()))
def test_no_internal_words_or_outside_paths(name):
    found = INTERNAL.findall(_user_facing()[name])
    assert not found, f"{name} mentions {found}"


def test_the_design_page_linked_is_in_the_repository():
    assert "[DESIGN.md](DESIGN.md)" in README and (ROOT / "DESIGN.md").is_file()


def test_index_names_papers_not_files(tmp_path):
    for name in report.PAPERS:
        folder = tmp_path / "cpu" / name
        folder.mkdir(parents=True)
        (folder / "run.json").write_text('{"status": "ok", "profile": "cpu"}')
    report.write_index(tmp_path)
    page = (tmp_path / "index.html").read_text()
    for name in report.PAPERS:
        assert html.escape(report.paper_citation(name), quote=True) in page
    assert "Pleiss et al., 2017" in page and "Choudhury et al." in page
    text = re.sub(r"<[^>]*>", " ", page + (tmp_path / "cpu" / "index.html").read_text())  # what a reader sees
    assert not INTERNAL.findall(text)
