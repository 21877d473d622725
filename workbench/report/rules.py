"""Rules that turn a measured value into a verdict: `at_least`, `at_most`, `within`, `between`.

A rule is data with a stated meaning (`describe()`): one-sided for claims a paper states as bounds,
two-sided where it gives a value or a range, so a result better than claimed is its own verdict. Every
threshold is a finite number and every measured value a number (or None/NaN: not measured); anything
else is refused with the field it came in.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

__all__ = ["Rule", "at_least", "at_most", "within", "between", "as_number", "as_spread"]

KINDS = ("at_least", "at_most", "within", "between")
_THRESHOLDS = ("target", "upper", "partly", "refuted", "rel", "partly_rel")


def as_number(value, what: str) -> float:
    """`value` as a float; TypeError naming `what` and the value when it is not a number (text, a bool)."""
    if isinstance(value, (bool, np.bool_, str, bytes)) or not hasattr(type(value), "__float__"):
        raise TypeError(f"{what}={_short(value)} is not a number")
    try:
        return float(value)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"{what}={_short(value)} is not a number ({exc})") from None
    except OverflowError:
        raise ValueError(f"{what}={_short(value)} is too large for a float") from None


def as_spread(value, what: str) -> tuple[float, float]:
    """A spread as (low, high) floats from two numbers in either order; refused naming `what` otherwise."""
    if isinstance(value, (str, bytes)) or not hasattr(value, "__len__") or len(value) != 2:
        raise ValueError(f"{what}={_short(value)} must be two numbers (low, high)")
    ends = [as_number(v, what) for v in value]
    if any(math.isnan(v) for v in ends):
        raise ValueError(f"{what}={_short(value)} must be two numbers (low, high), not NaN")
    return min(ends), max(ends)


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:60] + f"... ({len(text)} characters)"


def _threshold(kind: str, field: str, value) -> float | None:
    """A rule's threshold as a finite float (None stays None where the field is optional); refused naming
    the field otherwise."""
    if value is None and field not in ("target", "low", "high", "rel"):
        return None
    number = as_number(value, f"{kind}: {field}")
    if not math.isfinite(number):
        raise ValueError(f"{kind}: {field}={value!r} is not a finite number; a rule judges against finite "
                         f"thresholds only")
    return number


@dataclass(frozen=True)
class Rule:
    """How a measured value becomes a verdict; `describe()` is printed beside every row.

    One-sided (`at_least`, `at_most`) for claims the paper states as bounds; two-sided (`within` a
    stated value, `between` a stated range) where the paper gives a number, so a result better than
    claimed is its own verdict instead of passing silently.
    """

    kind: str  # "at_least", "at_most", "within" or "between"
    target: float  # the bound, the stated value, or the low end of a range
    upper: float | None = None  # the high end of a range (between)
    partly: float | None = None  # one-sided: the weaker bound that still reads "partly"
    refuted: float | None = None  # any kind: beyond this on the worse side reads "refuted"
    rel: float | None = None  # within: relative tolerance for "reproduced"
    partly_rel: float | None = None  # two-sided: relative distance on the worse side for "partly"
    better: str | None = None  # two-sided: "higher" or "lower" is the better direction

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {list(KINDS)}, got {self.kind!r}")
        for name in _THRESHOLDS:
            if name == "target" or getattr(self, name) is not None:
                _threshold(self.kind, name, getattr(self, name))

    def _worse_than(self, measured: float, bound: float) -> bool:
        """True if `measured` lies beyond `bound` on the worse side."""
        higher_is_better = self.kind == "at_least" or self.better == "higher"
        return measured < bound if higher_is_better else measured > bound

    def _two_sided(self, measured: float) -> str:
        lo, hi = (self.target, self.upper) if self.kind == "between" else (self.target, self.target)
        if self.kind == "within":
            slack = self.rel * abs(self.target)
            lo, hi = lo - slack, hi + slack
        if lo <= measured <= hi:
            return "reproduced"
        above = measured > hi
        if self.better is not None and above == (self.better == "higher"):
            return "better than claimed"
        edge = hi if above else lo
        if self.partly_rel is not None and abs(measured - edge) <= self.partly_rel * abs(edge):
            return "partly"
        if self.refuted is not None and self.better is not None and self._worse_than(measured, self.refuted):
            return "refuted"
        return "not reproduced"

    def _one_sided(self, measured: float) -> str:
        if not self._worse_than(measured, self.target):
            return "reproduced"
        if self.partly is not None and not self._worse_than(measured, self.partly):
            return "partly"
        if self.refuted is not None and self._worse_than(measured, self.refuted):
            return "refuted"
        return "not reproduced"

    def verdict(self, measured: float | None, spread: tuple[float, float] | None = None) -> str:
        """The verdict for `measured`; with a `spread` (lo, hi) that changes it, "inconclusive"."""
        if measured is None:
            return "not run at this scale"
        measured = as_number(measured, "measured")
        if math.isnan(measured):
            return "not run at this scale"
        judge = self._one_sided if self.kind in ("at_least", "at_most") else self._two_sided
        verdict = judge(measured)
        if spread is None:
            return verdict
        lo, hi = as_spread(spread, "spread")
        # Every verdict region the spread touches: its ends and each threshold inside it (a spread can hold
        # the whole "reproduced" band while both its ends fall outside, on either side).
        points = [lo, hi, *(t for t in self._thresholds() if lo <= t <= hi)]
        if any(judge(v) != verdict for v in points):
            return "inconclusive"
        return verdict

    def _thresholds(self) -> list[float]:
        """The values where this rule's verdict can change."""
        points = [self.target, self.upper, self.partly, self.refuted]
        if self.kind == "within":
            slack = self.rel * abs(self.target)
            points += [self.target - slack, self.target + slack]
        lo, hi = (self.target, self.upper) if self.kind == "between" else (self.target, self.target)
        if self.kind == "within":
            lo, hi = lo - self.rel * abs(self.target), hi + self.rel * abs(self.target)
        if self.partly_rel is not None:
            points += [lo - self.partly_rel * abs(lo), hi + self.partly_rel * abs(hi)]
        return [float(p) for p in points if p is not None and math.isfinite(p)]

    def describe(self) -> str:
        if self.kind in ("at_least", "at_most"):
            op, worse = (">=", "<") if self.kind == "at_least" else ("<=", ">")
            text = f"reproduced if measured {op} {_number(self.target)}"
            if self.partly is not None:
                text += f"; partly if {op} {_number(self.partly)}"
        else:
            text = (f"reproduced if within {self.rel:.0%} of {_number(self.target)}" if self.kind == "within"
                    else f"reproduced if in [{_number(self.target)}, {_number(self.upper)}]")
            if self.better is not None:
                text += f"; better than claimed if {self.better}"
            if self.partly_rel is not None:
                text += f"; partly if worse by at most {self.partly_rel:.0%}"
            worse = "<" if self.better == "higher" else ">"
        if self.refuted is not None:
            text += f"; refuted if {worse} {_number(self.refuted)}"
        return text


def at_least(target: float, *, partly: float | None = None, refuted: float | None = None) -> Rule:
    """A claim stated as a lower bound: reproduced at or above `target`, partly at or above `partly`,
    refuted below `refuted`, otherwise not reproduced."""
    target, partly, refuted = (_threshold("at_least", k, v) for k, v in
                               (("target", target), ("partly", partly), ("refuted", refuted)))
    if partly is not None and partly > target:
        raise ValueError(f"partly ({partly}) must be <= target ({target}) for at_least")
    return Rule("at_least", target, partly=partly, refuted=refuted)


def at_most(target: float, *, partly: float | None = None, refuted: float | None = None) -> Rule:
    """A claim stated as an upper bound: reproduced at or below `target`, partly at or below `partly`,
    refuted above `refuted`, otherwise not reproduced."""
    target, partly, refuted = (_threshold("at_most", k, v) for k, v in
                               (("target", target), ("partly", partly), ("refuted", refuted)))
    if partly is not None and partly < target:
        raise ValueError(f"partly ({partly}) must be >= target ({target}) for at_most")
    return Rule("at_most", target, partly=partly, refuted=refuted)


def _check_better(better: str | None) -> None:
    if better not in (None, "higher", "lower"):
        raise ValueError(f"better must be 'higher', 'lower' or None, got {better!r}")


def within(
    target: float, *, rel: float, partly_rel: float | None = None, better: str | None = None,
    refuted: float | None = None,
) -> Rule:
    """A value the paper states: reproduced within `rel` (relative) of `target`; outside it on the
    `better` side "better than claimed"; on the worse side partly within a further `partly_rel` of
    the band's edge, refuted beyond `refuted`."""
    target, rel, partly_rel, refuted = (_threshold("within", k, v) for k, v in (
        ("target", target), ("rel", rel), ("partly_rel", partly_rel), ("refuted", refuted)))
    if rel <= 0 or (partly_rel is not None and partly_rel <= 0):
        raise ValueError(f"need rel > 0 and partly_rel > 0, got rel={rel}, partly_rel={partly_rel}")
    _check_better(better)
    return Rule("within", target, rel=rel, partly_rel=partly_rel, better=better, refuted=refuted)


def between(
    low: float, high: float, *, better: str | None = None, partly_rel: float | None = None,
    refuted: float | None = None,
) -> Rule:
    """A range the paper states: reproduced inside [low, high]; outside it on the `better` side
    "better than claimed"; on the worse side partly within `partly_rel` of the nearer end."""
    low, high, partly_rel, refuted = (_threshold("between", k, v) for k, v in (
        ("low", low), ("high", high), ("partly_rel", partly_rel), ("refuted", refuted)))
    if not low <= high:
        raise ValueError(f"need low <= high, got low={low}, high={high}")
    _check_better(better)
    return Rule("between", low, upper=high, better=better, partly_rel=partly_rel, refuted=refuted)


def _number(value: float) -> str:
    """A float without scientific notation: thousands separated, three significant digits below that."""
    if value == 0 or not math.isfinite(value):
        return "0" if value == 0 else str(value)
    if abs(value) >= 1000:
        return f"{value:,.0f}"
    return np.format_float_positional(value, precision=3, fractional=False, trim="-")
