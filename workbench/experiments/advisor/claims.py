"""The advisor notebook's rows: our own targets (issue 19; no paper makes these claims), judged from the
suite's records ("candidates": every candidate predicted and run; "decisions": one per model).

Peak errors are (predicted - measured) / measured against `AllocatorMeter` (the CPU allocator's own
running total, which shares no counting rule with the plan); time errors against the median of real steps.
"""

from __future__ import annotations

from collections.abc import Mapping

from workbench.report import Claim, Ledger, Measured, Records, at_most, between, judge, record_frame

__all__ = ["CLAIMS", "ledger"]

PLANNING_PARAMETERS = 100e6  # the planning-time target is stated for a 100M-parameter model


def _scale(records: Records, params: Mapping) -> str:
    df = record_frame(records, "candidates")
    models = ", ".join(dict.fromkeys(df["model"])) if df is not None else "?"
    return (f"{models}; batch {params.get('batch_size', '?')}, width x{params.get('width', '?')}, "
            f"{params.get('image_size', '?')} px; {0 if df is None else len(df)} candidates run")


def _error(column: str, how: str):
    def measure(records: Records, params: Mapping) -> Measured | None:
        df = record_frame(records, "candidates")
        if df is None:
            return None
        errors = df[column].abs()
        value = float(errors.median() if how == "median" else errors.max())
        return Measured(value, spread=(float(errors.quantile(0.25)), float(errors.quantile(0.75)))
                        if how == "median" else None, scale=_scale(records, params))
    return measure


def _decisions(column: str, reduce: str):
    def measure(records: Records, params: Mapping) -> Measured | None:
        df = record_frame(records, "decisions")
        if df is None or column not in df:
            return None
        values = df[column].dropna()
        if not len(values):
            return Measured(None, scale="no decision had a fitting candidate")
        if reduce == "count_false":
            value = float((~values.astype(bool)).sum())
        elif reduce == "max":
            value = float(values.max())
            lo, hi = f"{column}_lo", f"{column}_hi"
            if lo in df and hi in df:  # the worst decision's spread over its paired rounds
                worst = df.loc[values.idxmax()]
                return Measured(value, spread=(float(worst[lo]), float(worst[hi])), scale=_scale(records, params))
        else:  # the decision farthest from exactly one
            value = float(values.loc[(values - 1).abs().idxmax()])
        return Measured(value, scale=_scale(records, params))
    return measure


def _planning(records: Records, params: Mapping) -> Measured | None:
    df = record_frame(records, "planning")
    if df is None:  # no model built for the target: the suite's own planning times
        df = record_frame(records, "decisions")
    if df is None or "parameters" not in df:
        return None
    big = df[df["parameters"] >= PLANNING_PARAMETERS]
    if not len(big):
        return Measured(None, scale=f"largest model {int(df['parameters'].max()):,} parameters (< 100M): "
                                    f"{float(df['planning_seconds'].max()):.1f} s to plan it")
    row = big.loc[big["planning_seconds"].idxmax()]
    return Measured(float(row["planning_seconds"]), scale=f"{row['model']}, {int(row['parameters']):,} parameters"
                    + (f", batch {int(row['batch_size'])}, {int(row['candidates'])} candidates"
                       if "candidates" in big else ""))


CLAIMS = (
    Claim("Predicted peak within 5% of the allocator, median over the suite and every candidate",
          unit="|error| (fraction)", paper="goal: <= 0.05", measure=_error("peak_error", "median"),
          rule=at_most(0.05), source="target",
          definition="|predicted - measured| / measured peak, measured by AllocatorMeter over build + two steps"),
    Claim("Predicted peak within 10% of the allocator, worst over the suite and every candidate",
          unit="|error| (fraction)", paper="goal: <= 0.10", measure=_error("peak_error", "max"),
          rule=at_most(0.10), source="target", definition="as above, the largest"),
    Claim("Predicted step time within 15%, median over the suite and every candidate", unit="|error| (fraction)",
          paper="goal: <= 0.15", measure=_error("time_error", "median"), rule=at_most(0.15), source="target",
          definition="|predicted - measured| / measured seconds per step, median of real steps after a warm-up"),
    Claim("Verification runs over the budget", unit="runs", paper="goal: 0",
          measure=_decisions("within_budget", "count_false"), rule=at_most(0), source="target",
          definition="decisions whose one verification run measured a peak above the budget"),
    Claim("Regret of the choice against the fastest candidate that fits, worst decision", unit="fraction",
          paper="goal: <= 0.05", measure=_decisions("regret", "max"), rule=at_most(0.05), source="target",
          definition="step time of the choice / that of the fastest candidate whose measured peak fits "
                     "budget x (1 - margin), minus 1: the two re-timed side by side, median of paired rounds"),
    Claim("Exactly one verification per decision", unit="verifications", paper="goal: 1",
          measure=_decisions("verifications", "one"), rule=between(1, 1), source="target",
          definition="real verification runs per decision (each model of the suite)"),
    Claim("Planning a 100M-parameter model takes under 60 s on CPU", unit="seconds", paper="goal: <= 60",
          measure=_planning, rule=at_most(60), source="target", made_on="cpu",
          definition="wall time of advise() (traces, calibration, timing) for a model of >= 100M parameters"),
)


def ledger(records: Mapping, params: Mapping, *, device: str, device_class: str, verdicts: bool) -> Ledger:
    """The advisor notebook's ledger from its records ("candidates", "decisions")."""
    return judge(CLAIMS, records, params, device=device, device_class=device_class, verdicts=verdicts)
