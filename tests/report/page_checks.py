"""What a reader of a report page meets: links that lead nowhere, numbers printed raw (NaN, inf) and requests to
other hosts (a script or stylesheet from a CDN: errors offline)."""

from __future__ import annotations

import re
import urllib.parse
from html.parser import HTMLParser
from pathlib import Path


class _Page(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.targets: list[str] = []
        self.ids: set[str] = set()
        self.cells: list[str] = []  # the text of each table cell
        self._cell: list[str] | None = None
        self.loads: list[str] = []  # what the page fetches by itself: scripts, stylesheets, icons, imports
        self._script = False

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "script" and attrs.get("src"):
            self.loads.append(attrs["src"])
        if tag == "link" and attrs.get("href"):
            self.loads.append(attrs["href"])
        self._script = tag == "script"
        self.targets += [attrs[a] for a in ("href", "src") if attrs.get(a)]
        if attrs.get("id"):
            self.ids.add(attrs["id"])
        if tag in ("td", "th"):
            self._cell = []

    def handle_endtag(self, tag):
        self._script = False if tag == "script" else self._script
        if tag in ("td", "th") and self._cell is not None:
            self.cells.append("".join(self._cell))
            self._cell = None

    def handle_data(self, data):
        if self._script:  # a module script's import("https://...")
            self.loads += re.findall(r"""import\s*\(\s*["']([^"']+)""", data)
        if self._cell is not None:
            self._cell.append(data)


def _read(page: Path) -> _Page:
    parsed = _Page()
    parsed.feed(page.read_text(errors="replace"))
    return parsed


def dead_links(page: Path) -> list[str]:
    """Every local href/src of `page` whose file is missing, or whose #fragment names no id on its page."""
    dead = []
    parsed = _read(page)
    for target in parsed.targets:
        url = urllib.parse.urlsplit(target)
        if url.scheme or url.netloc or target.startswith("data:"):
            continue  # not a file beside the page
        path = (page.parent / urllib.parse.unquote(url.path)).resolve() if url.path else page
        if not path.is_file():
            dead.append(f"{target} (no file {path})")
        elif url.fragment and path.suffix == ".html" and urllib.parse.unquote(url.fragment) not in _read(path).ids:
            dead.append(f"{target} (no id {url.fragment!r} in {path.name})")
    return dead


_RAW = re.compile(r"(?<![\w.])[-+]?(nan|inf|infinity)%?(?![\w])", re.IGNORECASE)


def raw_numbers(page: Path) -> list[str]:
    """The table cells of `page` that show a number raw (NaN, inf, -inf, +nan%): ledgers, DataFrames, Stylers.
    Prose is not read: a sentence may say "on an inf/NaN the step is skipped"."""
    return [cell.strip() for cell in _read(page).cells if _RAW.search(cell)]



def remote_loads(page: Path) -> list[str]:
    """What `page` fetches from another host by itself: script and link sources and module imports that are
    http:, https: or protocol-relative URLs (a link a reader clicks is not a request)."""
    return [url for url in _read(page).loads if re.match(r"\s*(https?:)?//", url, re.IGNORECASE)]
