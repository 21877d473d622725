"""What a reader of a report page meets: links that lead nowhere and numbers printed raw (NaN, inf)."""

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
        self.text: list[str] = []
        self._hidden = 0

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        self.targets += [attrs[a] for a in ("href", "src") if attrs.get(a)]
        if attrs.get("id"):
            self.ids.add(attrs["id"])
        self._hidden += tag in ("style", "script")

    def handle_endtag(self, tag):
        self._hidden -= tag in ("style", "script") and self._hidden > 0

    def handle_data(self, data):
        if not self._hidden:
            self.text.append(data)


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
    """Pieces of the page's visible text that are a number printed raw: NaN, inf, -inf, +nan%."""
    text = " ".join(_read(page).text)
    return [text[max(0, m.start() - 40):m.end() + 10].strip() for m in _RAW.finditer(text)]
