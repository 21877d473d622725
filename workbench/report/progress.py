"""What a report build shows while it runs: which notebooks run, where they are, and for how long.

papermill executes a notebook through nbclient, whose `on_notebook_start` and `on_cell_start` hooks it passes on
(`CellHooks`): each code cell, as it starts, is told with its section, the latest markdown heading above it. In
the serial build the hooks tell the bar (`Progress`) directly; in a Dask worker they log a Dask event
(`tell_driver`, topic `PROGRESS_TOPIC`) that the build's client subscribes to (`Client.subscribe_topic`).
On a terminal the bar's postfix is one line updated in place; in a log, plain lines now and then.

Issue 48 ("every CPU a user has": a build of minutes said only `reports (cpu): 0/7`).
"""

from __future__ import annotations

import re
import sys
import threading
import time

__all__ = ["PROGRESS_TOPIC", "CellHooks", "Progress", "section_of", "tell_driver"]

PROGRESS_TOPIC = "workbench-report-progress"  # the Dask event topic of a worker's running notebook


def tell_driver(name: str, section: str | None = None, cell: str | None = None) -> None:
    """In a Dask worker: a notebook has started (no section, no cell yet), or one of its code cells has."""
    try:
        from distributed import get_worker

        get_worker().log_event(PROGRESS_TOPIC, {"name": name, "section": section, "cell": cell})
    except Exception:  # noqa: BLE001 - not in a worker, or it is closing: progress never fails a notebook
        pass


def section_of(markdown: str) -> str | None:
    """The last markdown heading in a cell's text ("## Fig 3: throughput" -> "Fig 3: throughput"), else None."""
    headings = re.findall(r"^ {0,3}#{1,6}[ \t]+(.+?)(?:[ \t]+#+)?[ \t]*$", markdown, flags=re.MULTILINE)
    return headings[-1].strip() if headings else None


class CellHooks:
    """nbclient's `on_notebook_start` and `on_cell_start` hooks (papermill passes them to its client): each code
    cell, as it starts, is told to `tell(name, section, "12/40")`, its section the latest markdown heading above."""

    def __init__(self, name: str, tell) -> None:
        self.name, self.tell, self.section, self.cells = name, tell, None, "?"

    def engine_kwargs(self) -> dict:
        return {"on_notebook_start": self.notebook_start, "on_cell_start": self.cell_start}

    def notebook_start(self, notebook=None, **_) -> None:
        self.cells = len(getattr(notebook, "cells", None) or []) or "?"

    def cell_start(self, cell=None, cell_index: int = 0, **_) -> None:
        # NOTE: nbclient does not catch what a hook raises: the notebook would fail for its progress line.
        try:
            if cell.cell_type == "markdown":
                self.section = section_of(cell.source) or self.section
            elif cell.cell_type == "code" and cell.source.strip():
                self.tell(self.name, self.section, f"{cell_index + 1}/{self.cells}")
        except Exception:  # noqa: BLE001
            pass


def _cut(text: str, most: int = 48) -> str:
    return text if len(text) <= most else text[:most - 3].rstrip() + "..."


def _clock(seconds: float) -> str:
    seconds = int(seconds)
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


class Progress:
    """Beside the bar's count of notebooks: each running notebook, its section, its cell and how long it has run.
    On a terminal (or a Jupyter widget) one line updated in place, each second, so the time moves during a long
    cell; elsewhere (a CI log) a plain line when what runs changes, at most every QUIET s, and every HEARTBEAT s
    while nothing does. Nothing at all when the bar is disabled."""

    QUIET, HEARTBEAT = 15.0, 60.0

    def __init__(self, bar, inline: bool | None = None) -> None:
        self.bar, self.on, self.lock = bar, not getattr(bar, "disable", True), threading.Lock()
        self.inline = (sys.stderr.isatty() or hasattr(bar, "container")) if inline is None else inline
        self.running: dict[str, tuple[float, str | None, str | None]] = {}
        self.finished: set[str] = set()
        self.said, self.said_at, self.stop, self.clock = None, -1e9, threading.Event(), time.monotonic
        self.ticker = threading.Thread(target=self._tick, name="report-progress", daemon=True)

    def __enter__(self) -> Progress:
        if self.on:
            self.ticker.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        if self.ticker.is_alive():
            self.ticker.join()
        if self.on and self.inline:
            self.bar.set_postfix_str("", refresh=False)  # the bar's last line: the count alone

    def tell(self, name: str, section: str | None = None, cell: str | None = None) -> None:
        with self.lock:
            if name not in self.finished:  # a worker's late event does not bring a notebook back
                self.running[name] = (self.running.get(name, (self.clock(),))[0], section, cell)
        self.show()

    def event(self, event) -> None:
        """A Dask event `(time, {"name", "section", "cell"})` from a worker (`tell_driver`)."""
        msg = event[1] if isinstance(event, (tuple, list)) and len(event) == 2 else None
        if isinstance(msg, dict) and isinstance(msg.get("name"), str):
            self.tell(msg["name"], msg.get("section"), msg.get("cell"))

    def done(self, name: str) -> None:
        with self.lock:
            self.finished.add(name)
            self.running.pop(name, None)
        self.show()

    def text(self, now: float | None = None) -> str:
        now = self.clock() if now is None else now
        with self.lock:
            running = sorted(self.running.items(), key=lambda item: item[1][0])
        return " | ".join(f"{name} {_clock(now - start)}" + (f", cell {cell}" if cell else ", starting")
                          + (f": {_cut(section)}" if section else "") for name, (start, section, cell) in running)

    def _tick(self) -> None:
        while not self.stop.wait(1.0):
            self.show()

    def show(self) -> None:
        if not self.on:
            return
        now = self.clock()
        text = self.text(now)
        if self.inline:
            self.bar.set_postfix_str(text, refresh=True)
            return
        with self.lock:
            what = [(name, section) for name, (_, section, _) in self.running.items()]
        if what and (now - self.said_at >= self.HEARTBEAT or (what != self.said and now - self.said_at >= self.QUIET)):
            self.said, self.said_at = what, now
            self.bar.write(f"{self.bar.desc.rstrip(': ')} {self.bar.n}/{self.bar.total}: running {text}",
                           file=sys.stderr)
