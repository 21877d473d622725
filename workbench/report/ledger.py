"""The claims ledger: claims as data, judged by rules (`rules`) into rows, and their table.

A notebook's claims live in `workbench/experiments/<name>/claims.py` as a list of `Claim`s: the text, where
it comes from (`paper`, our own `target`, or a `check` that cannot fail), the paper's value and its
definition, the function that reads the measured value (and spread) from the notebook's records, the rule,
and the kind of device the claim was made on. `judge` turns records into a `Ledger`; each verdict is
computed, never typed, and a claim made on a GPU is judged only on a GPU (elsewhere: `other device`).
"""

from __future__ import annotations

import html
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from .rules import Rule, _number, as_number, as_spread, at_least, at_most, between, within

__all__ = [
    "VERDICTS", "CHECK", "SOURCES", "DEVICE_CLASSES", "Rule", "at_least", "at_most", "within", "between",
    "Ledger", "tally", "tally_text", "Claim", "Measured", "Records", "judge",
    "record_frame", "finite", "device_class", "format_value", "ledger_html", "verdict_class", "VERDICT_CSS",
]

# Verdicts of paper claims and targets, best first; "inconclusive" when the spread straddles a threshold;
# "other device" when a claim made on one kind of hardware (a GPU speed-up) was measured on another.
# "not comparable" when the run cannot show the claimed effect at all (a like-with-like baseline saves as much,
# or the quantity the claim is about is absent at this peak); "inconclusive: host-bound" when a GPU timing is
# mostly host overhead (workbench.timing.host_bound).
VERDICTS = (
    "better than claimed", "reproduced", "partly", "not reproduced", "refuted", "inconclusive",
    "inconclusive: host-bound", "not comparable", "other device", "not run at this scale", "not run",
)
CHECK = "exact by construction"  # a row that cannot fail: shown, never tallied
SOURCES = ("paper", "target", "check")
DEVICE_CLASSES = ("any", "cpu", "gpu")  # the kind of hardware a claim was made on



def device_class(device) -> str:
    """The kind of hardware a torch device (or its type string) is: "gpu" for CUDA, else "cpu"."""
    kind = getattr(device, "type", None) or str(device).split(":")[0]
    return "gpu" if kind == "cuda" else "cpu"


def _check_source(source: str, allowed=("paper", "target")) -> None:
    if source not in allowed:
        raise ValueError(f"source must be one of {list(allowed)}, got {source!r}")


def _check_claim(claim: str) -> None:
    if not isinstance(claim, str) or not claim.strip():
        raise ValueError(f"claim must be the claim's text (a non-empty str), got {claim!r}")


def _check_made_on(made_on: str) -> None:
    if made_on not in DEVICE_CLASSES:
        raise ValueError(f"made_on must be one of {list(DEVICE_CLASSES)}, got {made_on!r}")


class Ledger:
    """Rows of claims checked by measurement: paper claims, our own targets, and checks.

    `verdicts=False` (toy scales: the smoke profile, small interactive defaults) records every row
    with the verdict "not run at this scale", so a toy run never reads as evidence. `device_class`
    ("cpu" or "gpu") is the hardware the measurements ran on: a claim `made_on` other hardware is shown
    with its measurement and the verdict "other device", never judged.
    """

    COLUMNS = ["claim", "source", "paper", "measured", "spread", "unit", "scale", "device", "verdict", "rule"]

    def __init__(self, *, verdicts: bool = True, device_class: str = "cpu") -> None:
        if device_class not in ("cpu", "gpu"):
            raise ValueError(f"device_class must be 'cpu' or 'gpu', got {device_class!r}")
        self.verdicts = bool(verdicts)
        self.device_class = device_class
        self.rows: list[dict] = []

    def add(
        self, claim: str, *, paper: float | str, measured: float | None, unit: str, scale: str,
        device: str, rule: Rule, source: str = "paper", spread: tuple[float, float] | None = None,
        made_on: str = "any",
    ) -> None:
        """A paper claim (`source="paper"`) or a goal of ours (`source="target"`), judged by `rule`."""
        _check_claim(claim)
        if not isinstance(rule, Rule):
            raise TypeError(f"rule must come from at_least/at_most/within/between, got {rule!r}")
        _check_source(source)
        _check_made_on(made_on)
        measured = None if measured is None else as_number(measured, f"{claim!r}: measured")
        if spread is not None:
            spread = as_spread(spread, f"{claim!r}: spread")
        text = rule.describe() + ("; inconclusive if the spread crosses a threshold" if spread else "")
        if not self.verdicts:
            verdict = "not run at this scale"
        elif made_on not in ("any", self.device_class) and measured is not None:
            verdict = "other device"
            text = f"claim made on {made_on.upper()}, measured on {self.device_class.upper()}: not judged; {text}"
        else:
            verdict = rule.verdict(measured, spread)
        self._append(claim, source, paper, measured, spread, unit, scale, device, verdict, text)

    def check(self, claim: str, *, measured: float | str, unit: str, scale: str, device: str, why: str) -> None:
        """A row that cannot fail (equal by construction): shown for completeness, never tallied."""
        _check_claim(claim)
        self._append(claim, "check", "—", measured, None, unit, scale, device, CHECK, why)

    def not_run(self, claim: str, *, paper: float | str, reason: str, unit: str = "", scale: str = "",
                device: str = "", source: str = "paper") -> None:
        """A paper claim (or a target of ours) this notebook does not measure, with the reason."""
        _check_claim(claim)
        _check_source(source)
        self._append(claim, source, paper, None, None, unit, scale, device, "not run", reason)

    def _append(self, claim, source, paper, measured, spread, unit, scale, device, verdict, rule) -> None:
        self.rows.append({
            "claim": claim, "source": source, "paper": paper, "measured": measured, "spread": spread,
            "unit": unit, "scale": scale, "device": str(device), "verdict": verdict, "rule": rule,
        })

    def to_frame(self) -> pd.DataFrame:
        return pd.DataFrame(self.rows, columns=self.COLUMNS)

    def tally(self) -> dict[str, int]:
        """Verdict counts over paper claims only."""
        return tally(self.rows)

    def _repr_html_(self) -> str:
        return ledger_html(self.rows)


def tally(claims: list[dict]) -> dict[str, int]:
    """Verdict counts of the paper rows in `claims` (targets and checks are shown apart)."""
    counts: dict[str, int] = {}
    for c in claims:
        if c.get("source", "paper") == "paper":
            verdict = c.get("verdict")  # text, as a ledger writes it; a damaged results.json may hold anything
            verdict = verdict if verdict is None or isinstance(verdict, str) else str(verdict)
            counts[verdict] = counts.get(verdict, 0) + 1
    return counts


# How the two verdicts that are no verdict read in a count: "7 not run at this scale, 7 not run" read as one count
# said twice (issue 43).
_UNJUDGED = {"not run at this scale": "measured too small to judge", "not run": "not measured by this notebook"}


def tally_text(claims: list[dict]) -> str:
    """The paper claims' verdicts counted in words, judged ones first: "14 paper claims: 5 reproduced, 2 partly,
    7 not measured by this notebook"; "—" without paper claims."""
    counts = tally(claims)
    if not counts:
        return "—"
    rank = {v: i for i, v in enumerate(VERDICTS)}  # the unjudged last, in VERDICTS' order; the judged by count
    ordered = sorted(counts.items(), key=lambda kv: (kv[0] in _UNJUDGED, 0 if kv[0] in _UNJUDGED else -kv[1],
                                                     rank.get(kv[0], len(rank)), str(kv[0])))
    words = ", ".join(f"{n} {_UNJUDGED.get(v, v)}" for v, n in ordered)
    total = sum(counts.values())
    return f"{total} paper claim{'s' if total != 1 else ''}: {words}"


# ---------------------------------------------------------------------------------------------
# Claims as data


@dataclass(frozen=True)
class Measured:
    """What a claim's `measure` read from the records: the value, its spread (lo, hi) and the scale."""

    value: float | str | None
    spread: tuple[float, float] | None = None
    scale: str = ""


Records = Mapping[str, pd.DataFrame]


def record_frame(records: Records, name: str) -> pd.DataFrame | None:
    """The record `name` when this run saved it with at least one row, else None (a claim's `measure`
    then returns None: not measured in this run)."""
    df = records.get(name)
    return df if isinstance(df, pd.DataFrame) and len(df) else None


def finite(value) -> float | None:
    """`value` as a float, or None when it is missing or NaN (JSON stores NaN as null)."""
    if value is None:
        return None
    value = float(value)
    return None if math.isnan(value) else value


MeasureFn = Callable[[Records, Mapping], "Measured | None"]


@dataclass(frozen=True)
class Claim:
    """One row of a notebook's ledger, as data.

    `measure(records, params)` reads the measured value from the notebook's records (DataFrames by
    name) and parameters; it returns None when this run did not measure it ("not run at this scale").
    `definition` is how the paper defines the quantity (the measured value must use it); `made_on` is
    the hardware the claim was made on ("gpu" claims are judged only on a GPU). A claim this notebook
    never measures gives `not_run` (the reason) instead of `measure`; a `check` (cannot fail by
    construction) gives `why` instead of a rule.
    """

    text: str
    unit: str
    paper: float | str = "—"
    measure: MeasureFn | None = None
    rule: Rule | None = None
    source: str = "paper"
    definition: str = ""
    made_on: str = "any"
    not_run: str = ""
    why: str = ""
    tags: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        _check_source(self.source, SOURCES)
        _check_made_on(self.made_on)
        if self.not_run:
            if self.source == "check":
                raise ValueError(f"{self.text!r}: a check is always run; not_run is for paper claims and targets")
            return
        if self.measure is None:
            raise ValueError(f"{self.text!r}: give measure (a function of records and params) or not_run")
        if self.source == "check":
            if not self.why or self.rule is not None:
                raise ValueError(f"{self.text!r}: a check gives why (the reason it cannot fail) and no rule")
        elif not isinstance(self.rule, Rule):
            raise ValueError(f"{self.text!r}: a {self.source} claim needs a rule (at_least/at_most/within/between)")


def judge(
    claims: Sequence[Claim], records: Records, params: Mapping, *, device: str, device_class: str,
    verdicts: bool, scale: str = "",
) -> Ledger:
    """The ledger of `claims` on `records`: each claim's measured value, judged by its rule.

    `device` names the hardware for the rows; `device_class` ("cpu" or "gpu") decides which claims
    are judged; `scale` is the default scale text where a measurement gives none.
    """
    ledger = Ledger(verdicts=verdicts, device_class=device_class)
    for claim in claims:
        if claim.not_run:
            ledger.not_run(claim.text, paper=claim.paper, reason=claim.not_run, unit=claim.unit,
                           source=claim.source)
            continue
        try:
            got = claim.measure(records, params)
        except (KeyError, IndexError, AttributeError, TypeError, ValueError) as exc:
            text = f"{claim.text!r}: its measure failed on these records: {type(exc).__name__}: {exc}"
            same = type(exc) in (KeyError, IndexError, AttributeError, TypeError, ValueError)
            raise (type(exc)(text) if same else ValueError(text)) from exc
        if got is not None and not isinstance(got, Measured):
            raise TypeError(f"{claim.text!r}: measure must return Measured or None, got {type(got).__name__}")
        where = (got.scale if got is not None and got.scale else scale) or "not measured in this run"
        if claim.source == "check":
            value = None if got is None else got.value
            ledger.check(claim.text, measured=value, unit=claim.unit, scale=where, device=device, why=claim.why)
            continue
        value = None if got is None or got.value is None else as_number(
            got.value, f"{claim.text!r}: the value its measure returned")
        ledger.add(claim.text, paper=claim.paper, measured=value, unit=claim.unit, scale=where, device=device,
                   rule=claim.rule, source=claim.source, spread=None if got is None else got.spread,
                   made_on=claim.made_on)
    return ledger


# ---------------------------------------------------------------------------------------------
# Showing values and ledgers


def format_value(value, unit: str = "", *, _depth: int = 0) -> str:
    """A ledger value as a reader wants it: bytes in KiB/MiB/GiB, fractions as %, no None/NaN/inf/1e+06.

    Values come back from results.json files, so anything JSON holds is shown: lists nested past 8
    levels as "[...]", integers too large for a float in scientific notation. A value that is not a finite
    number (None, NaN, an open end of a spread at -inf or inf) reads "—", as results.json records it (None),
    so a notebook's ledger and the index page show the same row."""
    if value is None or (isinstance(value, (float, np.floating)) and not math.isfinite(value)):
        return "—"
    if isinstance(value, (list, tuple)):
        if _depth >= 8:
            return "[...]"
        return "[" + ", ".join(format_value(v, unit, _depth=_depth + 1) for v in value) + "]"
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        return str(value)
    try:
        value = float(value)
    except OverflowError:  # an integer past 1.8e308
        digits = str(abs(int(value)))
        return f"{'-' if value < 0 else ''}{digits[0]}.{digits[1:3]}e{len(digits) - 1}"
    words = unit.lower() if isinstance(unit, str) else ""
    if words.startswith("bytes") or words.startswith("peak bytes (") or words.startswith("byte"):
        size = abs(value)
        for div, name in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
            if size >= div:
                return f"{value / div:.3g} {name}".replace("e+", "e")
        return f"{value:.0f} B"
    if words.startswith("fraction"):
        return _number(100 * value) + "%"
    return _number(value)


class Table:
    """A DataFrame as a notebook shows it: every missing or non-finite value reads "—" (see `table`)."""

    def __init__(self, frame: pd.DataFrame, *, float_format: str | None = None) -> None:
        if not isinstance(frame, pd.DataFrame):
            raise TypeError(f"table needs a pandas DataFrame, got {type(frame).__name__}")
        if float_format is not None:
            try:
                float_format.format(0.5)
            except (AttributeError, IndexError, KeyError, ValueError) as error:
                raise ValueError(f"float_format must be a format string for one float such as '{{:+.1%}}', "
                                 f"got {float_format!r} ({error})") from None
        self.frame = frame
        self.float_format = float_format

    def _render(self, method: str, **kwargs) -> str:
        # NOTE: pandas has no display option for how NaN reads (DataFrame._repr_html_ passes na_rep="NaN"
        # itself), so the frame is rendered here, with pandas' own display options for its size.
        shown = self.frame.replace([np.inf, -np.inf], np.nan)
        for column in shown.columns:  # pandas prints None in an object column as "None"
            if pd.api.types.is_object_dtype(shown[column]):
                shown[column] = shown[column].where(shown[column].notna(), np.nan)
        if self.float_format is not None:  # pandas applies it to the numbers only: missing ones stay na_rep
            kwargs["float_format"] = self.float_format.format
        return getattr(shown, method)(na_rep="—", max_rows=pd.get_option("display.max_rows"),
                                      max_cols=pd.get_option("display.max_columns"),
                                      show_dimensions=pd.get_option("display.show_dimensions"), **kwargs)

    def _repr_html_(self) -> str:
        return self._render("to_html", notebook=True)

    def __repr__(self) -> str:
        return self._render("to_string", line_width=pd.get_option("display.width"))


def table(frame: pd.DataFrame, *, float_format: str | None = None) -> Table:
    """`frame` shown as the ledger shows values: NaN, None, inf and -inf read "—" (pandas prints them raw),
    in JupyterLab and in the report's HTML alike; `float_format` (e.g. "{:+.1%}") formats its float columns
    (a Styler's format prints NaN and inf raw). For a cell's last line or `display(table(df))`; the frame
    itself is not changed (`table(df).frame is df`)."""
    return Table(frame, float_format=float_format)


_LEDGER_PARTS = (
    ("paper", "Paper claims", "the tally counts these"),
    ("target", "Our targets", "goals of ours, not claims of the paper"),
    ("check", "Checks", "rows that cannot fail by construction, shown for completeness"),
)
_SHOWN = [c for c in Ledger.COLUMNS if c != "source"]


def ledger_html(claims: list[dict]) -> str:
    """One table each for paper claims, our targets and checks, verdicts coloured (CSS classes
    `verdict-<verdict>`), values formatted by `format_value`."""
    if not claims:
        return "<p>No claims recorded.</p>"
    parts = []
    for source, title, note in _LEDGER_PARTS:
        chosen = [c for c in claims if c.get("source", "paper") == source]
        if not chosen:
            continue
        rows = []
        for c in chosen:
            cls = verdict_class(c.get("verdict", ""))
            unit = str(c.get("unit") or "")
            cells = []
            for k in _SHOWN:
                value = c.get(k)
                text = format_value(value, unit) if k in ("paper", "measured", "spread") else format_value(value)
                cells.append(f"<td>{html.escape(text)}</td>")
            rows.append(f'<tr class="{html.escape(cls)}">{"".join(cells)}</tr>')
        head = "".join(f"<th>{k}</th>" for k in _SHOWN)
        parts.append(f"<h3>{title}</h3><p class='note'>{note}</p><div class='workbench-ledger'><table><tr>{head}</tr>"
                     f"{''.join(rows)}</table></div>")
    return _LEDGER_CSS + "".join(parts)


def verdict_class(verdict) -> str:
    """The CSS class of a verdict: `verdict-` and its words joined by hyphens ("inconclusive: host-bound" ->
    `verdict-inconclusive-host-bound`)."""
    return "verdict-" + "-".join(re.findall(r"[a-z0-9]+", str(verdict).lower()))


# One palette for the ledger in a notebook's own HTML and on the index pages.
VERDICT_CSS = (
    ".verdict-reproduced{background:#e3f6e3}.verdict-better-than-claimed{background:#dcecff}"
    ".verdict-partly,.verdict-inconclusive,.verdict-inconclusive-host-bound{background:#fff6d6}"
    ".verdict-not-reproduced,.verdict-refuted{background:#fde2e2}"
    ".verdict-other-device,.verdict-not-comparable{background:#eeeeee}"
)
# NOTE: in JupyterLab an output wider than the notebook was cut at its right edge (issue 43): the ledger's long
# texts wrap, so its nine columns fit the width, and what still does not fit scrolls inside its own box.
LEDGER_LAYOUT_CSS = (
    ".workbench-ledger{overflow-x:auto;max-width:100%}"
    ".workbench-ledger table{table-layout:auto;width:100%;margin-left:0}"
    ".workbench-ledger td,.workbench-ledger th{white-space:normal;overflow-wrap:anywhere;text-align:left;"
    "vertical-align:top;min-width:3em}"
)
_LEDGER_CSS = f"<style>{VERDICT_CSS}{LEDGER_LAYOUT_CSS}</style>"
