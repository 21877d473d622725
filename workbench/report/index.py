"""The index pages: one per profile (every notebook's ledger, run details, the CPU it ran on, figures) and one
linking them."""

from __future__ import annotations

import html
import json
import os
import stat
import time
import urllib.parse
from pathlib import Path

from ..devices import isa_summary
from .folders import GENERATOR, page_is_ours
from .ledger import VERDICT_CSS, format_value, ledger_html, tally_text, verdict_class
from .reference import (
    REFERENCE, checkout_commit, commit_mismatch, commit_relation, cuda_memory_rows, read_references,
)
from .results import (
    _NOFOLLOW, _NONBLOCK, FAILED_RUN, INTERACTIVE, NAME_PATTERN, PROFILES, UsageError, _write_atomic, paper_citation,
    read_json_file,
)

_CSS = """
body{font-family:system-ui,sans-serif;margin:2em;max-width:1400px}
table{border-collapse:collapse;margin:.5em 0 1.5em}td,th{border:1px solid #ccc;padding:4px 8px;font-size:14px}
.ok{color:#176317}.failed{color:#b00020}.note{color:#555;font-size:13px;margin:0}
.paper{color:#333;font-style:italic}.rebuild{border:1px solid #b00020;padding:.3em .8em;background:#fff4f4}
figure{display:inline-block;margin:6px;vertical-align:top}figcaption{font-size:12px;color:#555}
img{width:720px;max-width:100%;border:1px solid #ddd}img.wide{width:1300px}pre{white-space:pre-wrap;color:#b00020}
.stale{color:#8a4b00;font-weight:600}
"""


def _e(value) -> str:
    """Any value as text safe inside HTML elements and quoted attributes."""
    return html.escape(str(value), quote=True)


def _href(*parts: str) -> str:
    return _e("/".join(urllib.parse.quote(p) for p in parts))


def _png_size(path: Path) -> tuple[int, int] | None:
    try:
        fd = os.open(path, os.O_RDONLY | _NOFOLLOW | _NONBLOCK)
    except OSError:
        return None
    try:
        head = os.read(fd, 24) if stat.S_ISREG(os.fstat(fd).st_mode) else b""
    except OSError:
        return None
    finally:
        os.close(fd)
    if len(head) < 24 or head[:8] != b"\x89PNG\r\n\x1a\n":
        return None
    return int.from_bytes(head[16:20], "big"), int.from_bytes(head[20:24], "big")


def _plain_file(path: Path) -> str | None:
    """None when `path` is a plain file (not a link); else why it is not shown."""
    try:
        mode = os.lstat(path).st_mode
    except OSError:
        return "missing"
    if stat.S_ISLNK(mode):
        return "a symbolic link"
    return None if stat.S_ISREG(mode) else "not a plain file"


def _figures_html(folder: Path, prefix: str, figures) -> str:
    """The report's figures: only plain files inside its folder (a results.json cannot point the page elsewhere,
    a symbolic link is not followed); the page says which were left out and why, naming no odd name."""
    parts, left_out, odd = [], [], 0
    for f in figures if isinstance(figures, list) else []:
        if not isinstance(f, str) or not f or "/" in f or "\\" in f or f.startswith("."):
            odd += 1
            continue
        why = _plain_file(folder / f)
        if why is not None:
            left_out.append(f"{f} ({why})")
            continue
        size = _png_size(folder / f)
        wide = size is not None and size[0] >= 1.6 * size[1]  # two-panel figures get twice the width
        css = ' class="wide"' if wide else ""
        parts.append(f'<figure><a href="{_href(prefix, f)}"><img src="{_href(prefix, f)}" alt="{_e(f)}"{css}>'
                     f"</a><figcaption>{_e(f)}</figcaption></figure>")
    if odd:
        left_out.append(f"{odd} figure name(s) that are not plain file names")
    if left_out:
        parts.append(f'<p class="note">Figures not shown (only plain files inside the report folder are): '
                     f"{_e('; '.join(left_out))}</p>")
    return "".join(parts)


_LINK_NOTE = "a symbolic link; reports are read only from real folders inside the output folder"


def _entries(folder: Path, skipped: list[str] | None = None) -> list[dict]:
    """The report folders of one profile (or of JupyterLab runs), by name; hidden/odd names skipped, and
    symbolic links skipped with a line in `skipped`. A report whose run.json or results.json is damaged
    (not JSON, nested too deep, a named pipe, a link) is listed with what is wrong in its `problems`."""
    skipped = [] if skipped is None else skipped
    entries = []
    for sub in sorted(folder.iterdir()) if folder.is_dir() and not folder.is_symlink() else []:
        if not NAME_PATTERN.fullmatch(sub.name):
            continue
        if sub.is_symlink():
            skipped.append(f"{folder.name}/{sub.name} is {_LINK_NOTE}")
            continue
        if not sub.is_dir():
            continue
        (run, run_problem), (results, results_problem) = (read_json_file(sub / "run.json"),
                                                          read_json_file(sub / "results.json"))
        problems = [f"{f} is {why}" for f, why in (("run.json", run_problem), ("results.json", results_problem))
                    if why]
        if not run and not results and not problems:
            continue
        if not run and not results:
            run = {"status": "unreadable", "profile": folder.name, "started": _mtime(sub),
                   "interactive": folder.name == INTERACTIVE}
        elif not run:  # saved from JupyterLab: results only, with its parameters and when it was saved
            run = {"status": "ok", "profile": folder.name, "started": results.get("saved") or _mtime(sub),
                   "parameters": results.get("parameters"), "interactive": folder.name == INTERACTIVE}
        failed = {}
        if (sub / FAILED_RUN).is_symlink():
            problems.append(f"{FAILED_RUN} is {_LINK_NOTE}")
        elif (sub / FAILED_RUN).is_dir():
            failed, failed_problem = read_json_file(sub / FAILED_RUN / "run.json")
            if failed_problem:
                problems.append(f"{FAILED_RUN}/run.json is {failed_problem}")
        entries.append({"name": sub.name, "run": run, "results": results, "failed_run": failed, "folder": sub,
                        "problems": problems})
    return entries


def _tally_text(results: dict) -> str:
    claims = results.get("claims") if isinstance(results.get("claims"), list) else []
    return tally_text([c for c in claims if isinstance(c, dict)])


def _mtime(folder: Path) -> str:
    try:
        return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime((folder / "results.json").stat().st_mtime))
    except OSError:
        return "—"


def _overrides_text(run: dict) -> str:
    overrides = run.get("overrides")
    if not isinstance(overrides, dict) or not overrides:
        return "none"
    return " ".join(f"-p {k}={json.dumps(v)}" for k, v in overrides.items())


def _settings_html(run: dict) -> str:
    """A build's `-p` overrides; a JupyterLab run's parameters (all of them, folded)."""
    if not run.get("interactive"):
        return f"<code>{_e(_overrides_text(run))}</code>"
    parameters = run.get("parameters") if isinstance(run.get("parameters"), dict) else {}
    text = " ".join(f"{k}={json.dumps(v)}" for k, v in parameters.items()) or "none recorded"
    return f"<details><summary>{len(parameters)} parameters</summary><code>{_e(text)}</code></details>"


def _machine(entry: dict) -> str:
    """The CPU a report ran on and its instruction sets, "AMD EPYC 9654 (AVX-512 BF16)", from the notebook's own
    environment record, else the runner's run.json; "—" for a report made before either recorded it."""
    for record in (entry["results"].get("environment"), entry["run"].get("machine")):
        if isinstance(record, dict) and isinstance(record.get("cpu_model"), str) and record["cpu_model"]:
            isa = record.get("cpu_isa") if isinstance(record.get("cpu_isa"), str) else None
            if isa is None and isinstance(record.get("cpu_flags"), dict):
                isa = isa_summary(record)
            return f"{record['cpu_model']} ({isa})" if isa else record["cpu_model"]
    return "—"


def _status(entry: dict) -> tuple[str, str]:
    """(css class, text) of an entry's status."""
    status = str(entry["run"].get("status", "?"))
    if entry["failed_run"]:
        return "failed", "rebuild failed; last good report shown"
    if entry.get("problems"):
        return "failed", f"{status}; damaged files"
    return ("ok" if status == "ok" else "failed"), status


def _claims(results: dict) -> list[dict]:
    claims = results.get("claims") if isinstance(results, dict) and isinstance(results.get("claims"), list) else []
    return [c for c in claims if isinstance(c, dict) and isinstance(c.get("claim"), str)]


_RELATION = {
    "older": "The reference is from an older commit ({r}) than {b}: rebuild it on the GPU to compare like with like.",
    "newer": "The reference is from a newer commit ({r}) than {b}.",
    "different": "The reference is from another commit ({r}) than {b}.",
}


def _reference_note(ref: dict, build_commit, up: str, against: str) -> str:
    """Where a reference ran (device, driver, torch, CUDA, commit), its links, and a warning when its commit
    is not the one it is compared with."""
    env, name, slug = ref["environment"], ref["name"], ref["slug"]
    where = ", ".join(f"{k} {env[k]}" for k in ("driver", "torch", "cuda", "python") if env.get(k))
    links = " · ".join(f'<a href="{_href(*up, REFERENCE, slug, name, f)}">{_e(text)}</a>'
                       for f, text in ((f"{name}.html", "notebook (HTML)"), ("results.json", "results.json"))
                       if (ref["folder"] / f).is_file())
    text = (f"Reference <b>{_e(env.get('device_name') or slug)}</b> ({_e(where or 'versions not recorded')}), "
            f"profile {_e(env.get('profile', '?'))}, status {_e(env.get('status', '?'))}, commit "
            f"<code>{_e(env.get('commit') or 'unknown')}</code>, made {_e(env.get('made', '?'))}. {links}")
    relation = commit_relation(env.get("commit"), build_commit)
    if relation in _RELATION:
        text += (' <span class="stale">' + _e(_RELATION[relation].format(r=env.get("commit"), b=against)) + "</span>")
    mismatch = commit_mismatch(ref)
    if mismatch:
        text += f' <span class="stale">{_e(mismatch)}.</span>'
    return f'<p class="note">{text}</p>'


def _cell(claim: dict | None, missing: str) -> str:
    if claim is None:
        return f"<td>—</td><td>{_e(missing)}</td>"
    verdict = str(claim.get("verdict", ""))
    value = format_value(claim.get("measured"), str(claim.get("unit") or ""))
    return f'<td>{_e(value)}</td><td class="{verdict_class(verdict)}">{_e(verdict)}</td>'


def _memory_table(ref: dict) -> str:
    rows = cuda_memory_rows(ref["results"])
    if not rows:
        return ""
    body = "".join(f"<tr><td>{_e(r['record'])}</td><td>{_e(r['allocated_column'])}</td>"
                   f"<td>{_e(format_value(r['max_allocated_bytes'], 'bytes'))}</td><td>{_e(r['reserved_column'])}</td>"
                   f"<td>{_e(format_value(r['max_reserved_bytes'], 'bytes'))}</td></tr>" for r in rows)
    return (f"<p class='note'>CUDA memory on {_e(ref['environment'].get('device_name') or ref['slug'])}: "
            "max_memory_allocated (what tensors held) beside max_memory_reserved (what the caching allocator "
            "took from the GPU, what runs out)</p><table><tr><th>record</th><th>allocated column</th>"
            f"<th>largest</th><th>reserved column</th><th>largest</th></tr>{body}</table>")


def _beside_reference(entry: dict, references: list[dict]) -> str:
    """Every claim of this build beside the same claim in each reference report of the notebook."""
    if not references:
        return ""
    results = entry["results"]
    env = results.get("environment") if isinstance(results.get("environment"), dict) else {}
    build = {c["claim"]: c for c in _claims(results)}
    refs = [{c["claim"]: c for c in _claims(ref["results"])} for ref in references]
    texts = list(dict.fromkeys([*build, *(t for r in refs for t in r)]))
    against = f"this build ({env.get('git_commit') or 'commit unknown'})"
    parts = ["<h3>Beside the reference</h3>"]
    parts += [_reference_note(ref, env.get("git_commit"), ("..",), against) for ref in references]
    head = "".join(f"<th colspan=2>{_e(ref['environment'].get('device_name') or ref['slug'])} "
                   f"({_e(ref['environment'].get('profile', '?'))})</th>" for ref in references)
    rows = []
    for text in texts:
        first = build.get(text) or next(r[text] for r in refs if text in r)
        unit = str(first.get("unit") or "")
        cells = _cell(build.get(text), "not in this build") + "".join(
            _cell(r.get(text), "not in the reference") for r in refs)
        rows.append(f"<tr><td>{_e(text)}</td><td>{_e(first.get('source', 'paper'))}</td>"
                    f"<td>{_e(format_value(first.get('paper'), unit))}</td><td>{_e(unit)}</td>{cells}</tr>")
    device = env.get("device_name") or "this build"
    parts.append(f"<table><tr><th rowspan=2>claim</th><th rowspan=2>source</th><th rowspan=2>paper</th>"
                 f"<th rowspan=2>unit</th><th colspan=2>this build ({_e(device)})</th>{head}</tr>"
                 f"<tr>{'<th>measured</th><th>verdict</th>' * (1 + len(references))}</tr>{''.join(rows)}</table>")
    parts += [_memory_table(ref) for ref in references]
    return "\n".join(p for p in parts if p)


def _references_summary(references: dict[str, list[dict]], head_commit) -> str:
    """The top page's list of reference reports, each with where it ran and whether its commit is older."""
    rows = []
    for name, refs in sorted(references.items()):
        for ref in refs:
            env, slug = ref["environment"], ref["slug"]
            relation = commit_relation(env.get("commit"), head_commit)
            stale = f' <span class="stale">({relation} than this checkout, {_e(head_commit)})</span>' if relation in (
                "older", "newer", "different") else ""
            link = f'<a href="{_href(REFERENCE, slug, name, name + ".html")}">{_e(name)}</a>' if (
                ref["folder"] / f"{name}.html").is_file() else _e(name)
            rows.append(f"<tr><td>{link}</td><td>{_e(paper_citation(name))}</td>"
                        f"<td>{_e(env.get('device_name') or slug)}</td><td>{_e(env.get('driver') or '—')}</td>"
                        f"<td>{_e(env.get('torch') or '—')}</td><td>{_e(env.get('profile', '?'))}</td>"
                        f"<td>{_e(env.get('status', '?'))}</td><td>{_e(env.get('made', '—'))}</td>"
                        f"<td><code>{_e(env.get('commit') or 'unknown')}</code>{stale}</td>"
                        f"<td>{_e(_tally_text(ref['results']))}</td></tr>")
    if not rows:
        return ""
    return (f'<h2 id="{REFERENCE}">reference</h2><p class="note">reports kept in reports/reference/&lt;device&gt;/ '
            "(the gpu profile on a GPU); each profile page shows them beside its own build, claim by claim</p>"
            "<table><tr><th>notebook</th><th>paper</th><th>device</th><th>driver</th><th>torch</th><th>profile</th>"
            f"<th>status</th><th>made</th><th>commit</th><th>paper claims</th></tr>{''.join(rows)}</table>")


def _file_links(folder: Path, prefix: tuple[str, ...], files) -> list[str]:
    """Links to those of `files` ((file name, text) pairs) that are plain files in `folder`: a run in JupyterLab
    writes results.json and figures but no executed notebook, a failed run may have stopped before its HTML."""
    return [f'<a href="{_href(*prefix, f)}">{_e(text)}</a>' for f, text in files if _plain_file(folder / f) is None]


def _section(entry: dict, references: list[dict] | None = None) -> str:
    name, run, results = entry["name"], entry["run"], entry["results"]
    cls, status = _status(entry)
    env = results.get("environment") if isinstance(results.get("environment"), dict) else {}
    links = _file_links(entry["folder"], (name,), ((f"{name}.html", "notebook (HTML)"),
                                                   (f"{name}.ipynb", "notebook (.ipynb)"),
                                                   ("results.json", "results.json")))
    parts = [
        f'<h2 id="{_e(name)}">{_e(name)} <span class="{cls}">({_e(status)})</span></h2>',
        f'<p class="paper">{_e(paper_citation(name))}</p>',
        f"<p>{' · '.join(links)}</p>" if links else "",
    ]
    where = (f"on {_e(env.get('device_name', 'unknown device'))}, torch {_e(env.get('torch', '?'))}, "
             f"CPU {_e(_machine(entry))}")
    if run.get("interactive"):
        parts.append(f"<p>Run in JupyterLab, saved {_e(run.get('started', '—'))} {where}. "
                     f"Parameters: {_settings_html(run)}</p>")
    else:
        parts.append(f"<p>Profile {_e(run.get('profile'))}, run {_e(run.get('started', '—'))}, "
                     f"{_e(run.get('seconds', '—'))} s {where}. Overrides: {_settings_html(run)}.</p>")
    failed = entry["failed_run"]
    if failed:
        failed_links = _file_links(entry["folder"] / FAILED_RUN, (name, FAILED_RUN),
                                   ((f"{name}.html", "failed run (HTML)"), (f"{name}.ipynb", "failed run (.ipynb)")))
        parts.append(
            f'<div class="rebuild"><p>The rebuild of {_e(failed.get("started", "?"))} '
            f"(overrides <code>{_e(_overrides_text(failed))}</code>) failed; the report below is the last good one. "
            f"{' · '.join(failed_links)}</p><pre>{_e(failed.get('error'))}</pre></div>")
    if run.get("error"):
        parts.append(f"<pre>{_e(run['error'])}</pre>")
    if entry.get("problems"):
        parts.append(f'<p class="failed">This report\'s files are unreadable, so what they hold is not shown: '
                     f"{_e('; '.join(entry['problems']))}. Rebuild it (or remove the folder).</p>")
    claims = results.get("claims") if isinstance(results.get("claims"), list) else []
    parts.append(ledger_html([c for c in claims if isinstance(c, dict)]))
    parts.append(_beside_reference(entry, references or []))
    parts.append(_figures_html(entry["folder"], name, results.get("figures")))
    return "\n".join(parts)


def _summary_rows(entries: list[dict], prefix: str) -> str:
    rows = []
    for entry in entries:
        name, run = entry["name"], entry["run"]
        cls, status = _status(entry)
        target = (f"{prefix}/" if prefix else "") + "index.html"
        rows.append(
            f'<tr><td><a href="{_e(target)}#{_e(name)}">{_e(name)}</a></td><td>{_e(paper_citation(name))}</td>'
            f'<td class="{cls}">{_e(status)}</td><td>{_e(run.get("started", "—"))}</td>'
            f'<td>{_e(run.get("seconds", "—"))}</td><td>{_e(_machine(entry))}</td>'
            f"<td>{_settings_html(run)}</td><td>{_e(_tally_text(entry['results']))}</td></tr>")
    settings = "parameters" if entries and entries[0]["run"].get("interactive") else "overrides"
    head = (f"<tr><th>notebook</th><th>paper</th><th>status</th><th>run at</th><th>seconds</th><th>CPU</th>"
            f"<th>{settings}</th>"
            "<th>paper claims</th></tr>")
    return f"<table>{head}{''.join(rows)}</table>"


def _page(title: str, body: str) -> str:
    return (f"<!doctype html><html><head><meta charset='utf-8'>{GENERATOR}<title>{_e(title)}</title>"
            f"<style>{_CSS}{VERDICT_CSS}</style></head><body><h1>{_e(title)}</h1>{body}</body></html>")


_GROUP_NOTES = {
    "smoke": "seconds-long runs that check the notebooks work; toy sizes, so no verdicts",
    "cpu": "the default report, sized for a laptop-class CPU",
    "gpu": "each paper at its own scale on one GPU, training cut to minutes (the reference report's profile)",
    "paper": "the papers' own sizes and training lengths (needs a GPU and hours)",
    INTERACTIVE: "results saved by notebooks run in JupyterLab with their own parameters; "
                 "each run replaces the notebook's previous one",
}


def write_index(out_dir: str | Path) -> Path:
    """Rebuild `<out_dir>/<profile>/index.html` for each profile present and the top `<out_dir>/index.html`
    that links them. Every value from a report folder is escaped; only folders named like notebooks count.
    A page of that name that the runner did not write is refused (UsageError), never overwritten."""
    out = Path(out_dir)
    groups, pages, skipped = [], {}, []
    references = read_references(out / REFERENCE)
    for group in (*PROFILES, INTERACTIVE):
        if (out / group).is_symlink():  # neither read nor written through: it leads out of the output folder
            skipped.append(f"{group} is {_LINK_NOTE}; its index page is not written")
            continue
        left_out: list[str] = []
        entries = _entries(out / group, left_out)
        skipped += left_out
        if not entries:
            continue
        note = f'<p class="note">Skipped: {_e("; ".join(left_out))}</p>' if left_out else ""
        body = (f'<p><a href="../index.html">all profiles</a> · {_e(_GROUP_NOTES[group])}</p>{note}'
                + _summary_rows(entries, "") + "".join(_section(e, references.get(e["name"])) for e in entries))
        pages[out / group / "index.html"] = _page(f"Workbench reports: {group}", body)
        groups.append(f'<h2 id="{_e(group)}"><a href="{_href(group, "index.html")}">{_e(group)}</a></h2>'
                      f'<p class="note">{_e(_GROUP_NOTES[group])}</p>{_summary_rows(entries, group)}')
    if references:
        groups.append(_references_summary(references, checkout_commit()))
    body = "".join(groups) or "<p>No reports yet: run <code>make report</code>.</p>"
    if skipped:
        body += ('<h2 id="skipped">skipped</h2><p class="note">Not listed (nothing is read or written outside the '
                 f"output folder): {_e('; '.join(skipped))}</p>")
    path = out / "index.html"
    pages[path] = _page("Workbench reports", body)
    foreign = [str(page) for page in pages if not page_is_ours(page)]
    if foreign:
        raise UsageError(f"{', '.join(foreign)}: not written by workbench report; refusing to overwrite "
                         f"(move it away or choose another output folder)")
    for page, text in pages.items():
        _write_atomic(page, text)
    return path
