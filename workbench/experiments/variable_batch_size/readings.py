"""How the VBS ledger reads its paper-size rows and the prediction-agreement targets from the notebook's records
(Choudhury et al., Section IV: Fig 7's caption, Figs 8-9, Table III). The claims themselves are data in `claims`.

At the paper's size only (issue 44): the batch sizes of Fig 7's caption and Fig 9, Greedy-VBS's feasibility at
tight memory and Table III's unused memory are those of 224x224 inputs at full width, each layer counted with
its working space (cuDNN's: the paper's conv1 is 10.7 MB at batch 1). At a reduced size the request (3 channels,
not scaled by the width) and the working space take other shares of the budget (at 64 px, width x0.25, the CPU
ran a fixed batch of 5 where the H100 at 224 px ran 2), so these rows read "not run at this scale" there, with
what the 224x224 shapes alone give beside them (`paper_scale`, no working space: context, not a verdict), and
a run at the paper's size judges them (the gpu profile; the claims are made_on="gpu", as Fig 2's are).

Spreads are repeat noise, never dispersion across settings: the agreement rows' spread is the least and largest
over rounds of the median over budgets (`budgets._round_noise`), where the minimum and maximum over budgets
were given before.
"""

from __future__ import annotations

from collections.abc import Mapping

import pandas as pd

from workbench.report import Measured, Records, finite, record_frame

from .budgets import TIGHT_MB
from .gains import PAPER_BUDGET_MB
from .tables import PAPER_IMAGE_SIZE

__all__ = ["PAPER_REQUEST", "at_paper_scale", "fig7_batch", "greedy_infeasible", "fig9", "table_iii", "agreement"]

PAPER_REQUEST = 12  # Section IV: "In all these experiments, the input request size is set to 12"


def scale_text(params: Mapping) -> str:
    return (f"{params.get('image_size')}x{params.get('image_size')} images, width x{params.get('width')}, "
            f"request {params.get('request')}, tables: {params.get('layer_statistic')} of "
            f"{params.get('layer_repeats')} runs")


def at_paper_scale(params: Mapping) -> bool:
    """Whether the notebook ran the networks at the paper's 224x224 and full width."""
    return params.get("image_size") == PAPER_IMAGE_SIZE and params.get("width") == 1.0


def _not_at_224(params: Mapping, shapes: str = "") -> Measured:
    return Measured(None, scale=(
        f"not run at the paper's size: measured at {params.get('image_size')} px, width x{params.get('width')}, "
        f"where the request and the working space take other shares of the budget; the paper counts each layer's "
        f"working space (cuDNN's) at 224x224, which only a run at that size measures (the gpu profile)"
        + (f"; shapes alone at 224x224, full width (no working space): {shapes}" if shapes else "")))


def _near(df: pd.DataFrame, mb: float) -> pd.DataFrame:
    """Rows at the swept budget within 1 MB (paper-equivalent) of `mb`, or none."""
    if df.empty:
        return df
    best = (df.paper_mb - mb).abs().min()
    return df[(df.paper_mb - mb).abs() == best] if best <= 1.0 else df.iloc[:0]


def _shape_batch(records: Records, network: str, mb: float) -> str:
    """What `paper_scale`'s shape tables give FBS at `mb` paper-equivalent MB, or ''."""
    df = record_frame(records, "paper_scale")
    rows = None if df is None else _near(df[(df.network == network) & (df.method == "fbs")], mb)
    if rows is None or rows.empty:
        return ""
    row = rows.iloc[0]
    return f"FBS batch {int(row.max_batch)}" if row.feasible else "FBS cannot serve the request"


def fig7_batch(mb: float, method: str):
    def measure(records: Records, params: Mapping) -> Measured | None:
        df = record_frame(records, "sweep")
        if df is None or params.get("request") != PAPER_REQUEST:
            return None
        if not at_paper_scale(params):
            return _not_at_224(params, _shape_batch(records, "resnet50", mb) if method == "fbs" else "")
        rows = _near(df[(df.network == "resnet50") & (df.request == PAPER_REQUEST)], mb)
        rows = rows[rows.method == method]
        if rows.empty:
            return None
        row = rows.iloc[0]
        note = "" if row.feasible else f"; {method.upper()} cannot serve the request (0)"
        return Measured(float(row.max_batch) if row.feasible else 0.0,
                        scale=f"ResNet-50 at {row.paper_mb:.1f} paper-equivalent MB ({row.ratio:.2f} x floor){note}; "
                              f"{scale_text(params)}")
    return measure


def greedy_infeasible(records: Records, params: Mapping) -> Measured | None:
    df = record_frame(records, "requests")
    if df is None:
        return None
    if not at_paper_scale(params):
        shapes = record_frame(records, "paper_scale")
        tight = None if shapes is None else shapes[(shapes.network == "googlenet") & (shapes.method == "greedy")
                                                   & (shapes.paper_mb < TIGHT_MB)]
        said = "" if tight is None or tight.empty else (
            f"Greedy-VBS infeasible at {int((~tight.feasible.astype(bool)).sum())} of {len(tight)} budgets < "
            f"{TIGHT_MB:g} MB, request {int(tight.request.iloc[0])}")
        return _not_at_224(params, said)
    big = df[(df.request == df.request.max()) & (df.paper_mb < TIGHT_MB)]
    return Measured(float((~big.greedy_feasible.astype(bool)).mean()) if len(big) else None,
                    scale=f"GoogLeNet, request {int(df.request.max())}, {len(big)} tight budgets; {scale_text(params)}")


def _at_20mb(records: Records, name: str, params: Mapping) -> pd.DataFrame | None:
    df = record_frame(records, name)
    if df is None or params.get("request") != PAPER_REQUEST or set(df.network) != {"googlenet"}:
        return None
    return df if abs(float(df.paper_mb.iloc[0]) - PAPER_BUDGET_MB) <= 1.0 else None


def fig9(what: str):
    def measure(records: Records, params: Mapping) -> Measured | None:
        df = _at_20mb(records, "layer_batches", params)
        if df is None:
            return None
        if not at_paper_scale(params):
            return _not_at_224(params, _shape_batch(records, "googlenet", PAPER_BUDGET_MB) if what == "fbs" else "")
        scale = f"GoogLeNet at {df.paper_mb.iloc[0]:.1f} paper-equivalent MB; {scale_text(params)}"
        if what == "fbs":
            return Measured(finite(df.fbs_batch.iloc[0]), scale=scale)
        if what == "inception_5b":
            row = df[df.name == "inception_5b"]
            return Measured(float(row.max_batch.iloc[0]), scale=scale) if len(row) else None
        ranks = df[["need_bytes_per_sample", "max_batch"]].rank()
        rho = ranks.need_bytes_per_sample.corr(ranks.max_batch)
        return Measured(finite(rho), scale=f"{len(df)} main-path layers; {scale}")
    return measure


def table_iii(method: str):
    def measure(records: Records, params: Mapping) -> Measured | None:
        df = _at_20mb(records, "table_iii", params)
        if df is None:
            return None
        if not at_paper_scale(params):
            shapes = record_frame(records, "paper_scale_unused") if method == "fbs" else None
            listed = None if shapes is None else shapes[shapes.paper_fbs_unused_fraction.notna()]
            return _not_at_224(params, "" if listed is None or listed.empty else (
                f"FBS leaves {listed.fbs_unused_fraction.mean():.1%} of the budget unused (mean over the "
                f"{len(listed)} layers Table III lists)"))
        rows = df[df[f"paper_{method}_unused_fraction"].notna()]
        return Measured(finite(rows[f"{method}_unused_fraction"].mean()) if len(rows) else None,
                        scale=f"GoogLeNet at {df.paper_mb.iloc[0]:.1f} paper-equivalent MB, mean over the "
                              f"{len(rows)} layers Table III lists; {scale_text(params)}")
    return measure


def agreement(column: str):
    """The DP's executed / predicted `column` from the "agreement" record: the memory ratio's maximum over budgets
    (no spread: one measured peak per plan), a time ratio's median over budgets with its repeat noise as spread
    (the least and largest over rounds of that median); a record without the noise gives no spread, never the
    dispersion over budgets."""
    def measure(records: Records, params: Mapping) -> Measured | None:
        df = record_frame(records, "agreement")
        if df is None or "vbs" not in set(df.method) or f"{column}_max" not in df:
            return None
        row = df.set_index("method").loc["vbs"]
        memory = column.startswith("memory")
        value = finite(row[f"{column}_{'max' if memory else 'median'}"])
        lo, hi = (finite(row.get(f"{column}_rounds_{end}")) for end in ("lo", "hi"))
        noisy = not memory and value is not None and lo is not None and hi is not None and int(
            row.get("noise_rounds", 0)) > 1
        extra = (f", {int(row.over_budget)} over their budget, {int(row.refused)} refused by the executor"
                 if memory and "refused" in row else "")
        if noisy:
            extra += (f"; spread: least to largest over {int(row.noise_rounds)} rounds of the median over budgets "
                      f"(repeat noise); over budgets it ranges {finite(row[f'{column}_min']):.2f}-"
                      f"{finite(row[f'{column}_max']):.2f} (settings, not noise)")
        return Measured(value, spread=(lo, hi) if noisy else None,
                        scale=f"{int(row.points)} budgets{extra}; {scale_text(params)}")
    return measure
