"""Measures of the OpTorch claims judged at the paper's own sizes (``paper_scale``'s plans) and with their repeat
noise (``pipelines.accuracy_over_seeds``): records -> ``Measured``, used by ``claims``.

A planned ratio carries the planner's own uncertainty: where the same model and pipelines ran here under the
allocator (``plan_check``), the plan's ratio error there is carried to the paper's size, and the spread runs from
the plan to the plan corrected by that error. The accuracy rows' spread is the seeds' range of paired differences.
"""

from __future__ import annotations

from collections.abc import Mapping

import pandas as pd

from workbench.report import Measured, Records, record_frame

__all__ = ["planned_fig10", "planned_fig8", "seed_gap"]


def _width(value) -> str:
    return f"x{float(value):g}"


def _spread(ratio: float, error: float | None) -> tuple[float, float] | None:
    if error is None or pd.isna(error) or error <= -1:
        return None
    corrected = ratio / (1 + error)
    return min(ratio, corrected), max(ratio, corrected)


def _checked(error: float | None, here: str) -> str:
    if error is None or pd.isna(error):
        return "; the planner was not checked on this model at a size that runs here"
    return (f"; planner checked on the same model and pipelines at {here} here: its ratio {error:+.1%} off the "
            f"allocator's (spread: the plan, and the plan corrected by that error)")


def planned_fig10(records: Records, pipeline: str, model: str | None) -> Measured | None:
    """Fig 10's planned ratio against B of `pipeline` for `model` (None: the lowest over the models planned), or
    None where no plan was recorded."""
    df = record_frame(records, "fig10_planned_memory")
    if df is None:
        return None
    rows = df[(df.pipeline == pipeline) & ((df.model == model) if model else True)]
    if rows.empty:
        return Measured(None, scale="pipeline not planned")
    best = rows.loc[rows.ratio_vs_B.idxmin()]
    check = record_frame(records, "fig10_plan_check")
    error, here = None, ""
    if check is not None:
        same = check[(check.model == best.model) & (check.pipeline == pipeline)]
        if len(same):
            c = same.iloc[0]
            error, here = float(c.ratio_error), f"{c.batch} images {c.image_size}x{c.image_size} ({c.stem} stem)"
    where = best.model if model else f"best of {', '.join(dict.fromkeys(df.model))}: {best.model}"
    scale = (f"{where}, {best.batch} images {best.image_size}x{best.image_size}, width {_width(best.width)}, "
             f"{best.stem} stem: planned ({best.planner}; M-P as CPU autocast, bf16)" + _checked(error, here))
    return Measured(float(best.ratio_vs_B), spread=_spread(float(best.ratio_vs_B), error), scale=scale)


def planned_fig8(records: Records) -> Measured | None:
    """Fig 8's planned ratio (the best checkpoint plan over B) at the paper's size, or None where not planned."""
    df = record_frame(records, "fig8_planned")
    if df is None:
        return None
    by = df.set_index(["size", "variant"])
    paper, here = by.loc[("paper", "S-C optimal")], by.loc[("here", "S-C optimal")]
    error = float(here.ratio_error)
    which = ("the optimal planner's least-peak plan" if int(paper.candidates) == 1
             else f"the least of {paper.candidates} plans of the optimal planner")
    scale = (f"{paper.model} (width {_width(paper.width)}, {paper.stem} stem), {paper.batch} images "
             f"{paper.image_size}x{paper.image_size}: planned ({paper.planner}), {which} on a real profile at "
             f"{paper.profiled_at}"
             + _checked(error, f"{here.batch} images {here.image_size}x{here.image_size}"))
    return Measured(float(paper.planned_ratio), spread=_spread(float(paper.planned_ratio), error), scale=scale)


def seed_gap(records: Records, params: Mapping, pipeline: str, scale: str) -> Measured | None:
    """|test acc(`pipeline`) - test acc(B)| over the seeds of ``fig9_seeds``: the median paired difference, spread
    over the range the seeds' differences cover (|d| over [min d, max d]); None without repeats."""
    df = record_frame(records, "fig9_seeds")
    if df is None or df.seed.nunique() < 2:
        return None
    acc = df.pivot_table(index="seed", columns="pipeline", values="test_acc")
    if pipeline not in acc or "B" not in acc:
        return None
    d = (acc[pipeline] - acc["B"]).dropna()
    lo, hi = float(d.min()), float(d.max())
    low = 0.0 if lo <= 0 <= hi else min(abs(lo), abs(hi))
    return Measured(abs(float(d.median())), spread=(low, max(abs(lo), abs(hi))),
                    scale=f"{scale}; {len(d)} seeds ({', '.join(str(s) for s in d.index)}): the median paired "
                          f"difference, spread over the seeds' paired differences")
