"""How the CalcGraph ledger reads Figs 11 and 12 and the max-batch peers from the notebook's records ("many_models",
"parallel", "peers"): each function returns a `Measured` (value, spread from paired repeats, scale) or None where this
run did not measure it. The claims themselves are data in `claims`.

Paper: "CalcGraph: taming the high costs of deep learning using models" (2022), Sections 4.4-4.5.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import pandas as pd

from workbench.report import Measured, Records, record_frame

from .peers import PLAN, TRUTH

__all__ = ["many_scale", "meta_learning_speedup", "trend", "switch_target", "more_models", "plan_vs_layout",
           "max_batch", "plan_trials"]

_MLP = "MLP 784-64-64-10, Adam"


def _mib(values) -> str:
    return "[" + ", ".join(f"{v / 2**20:g}" for v in values) + "] MiB"


def _geomean(values) -> float:
    values = [float(v) for v in values]
    return math.exp(sum(math.log(v) for v in values) / len(values))


def _spread(lo: float, hi: float) -> tuple[float, float] | None:
    return None if lo == hi else (lo, hi)

# ---------------------------------------------------------------------------------------------
# Fig 11: many models


def _ran(records: Records) -> pd.DataFrame | None:
    df = record_frame(records, "many_models")
    if df is None or "speedup" not in df:
        return None
    ran = df[df["run"].astype(bool) & df["speedup"].notna()]
    return ran if len(ran) else None


def many_scale(ran: pd.DataFrame) -> str:
    row = ran.iloc[0]
    return f"{_MLP}, {row.get('data', '?')} {row.get('n_train', '?')} train, one full-batch step per round"


def meta_learning_speedup(records: Records, params: Mapping) -> Measured | None:
    ran = _ran(records)
    cells = None if ran is None else ran[ran["rounds"].between(10, 30)]
    if cells is None or not len(cells):
        return None
    value = _geomean(cells["speedup"])
    return Measured(value, spread=_spread(_geomean(cells["speedup_min"]), _geomean(cells["speedup_max"])), scale=(
        f"{many_scale(cells)}; cells (models x rounds) "
        f"{[f'{int(m)}x{int(r)}' for m, r in zip(cells['models'], cells['rounds'], strict=True)]}"))


def _gain(speedup) -> float:
    """Fraction of PyTorch's time saved: 1 - t_switching / t_plain (at most 1)."""
    return 1.0 - 1.0 / float(speedup)


def trend(records: Records, params: Mapping) -> Measured | None:
    ran = _ran(records)
    if ran is None or ran["complexity"].nunique() < 2:
        return None
    low, high = ran[ran["complexity"] == ran["complexity"].min()], ran[ran["complexity"] == ran["complexity"].max()]

    def measured(low_speedups, high_speedups) -> float:
        # a loss at high complexity counts as no gain: the low end must itself be a gain to win
        return _gain(_geomean(low_speedups)) - max(_gain(_geomean(high_speedups)), 0.0)

    value = measured(low["speedup"], high["speedup"])
    spread = _spread(measured(low["speedup_min"], high["speedup_max"]),
                     measured(low["speedup_max"], high["speedup_min"]))
    return Measured(value, spread=spread, scale=(
        f"{many_scale(ran)}; speedup {_geomean(low['speedup']):.3g} at {int(low['complexity'].iloc[0])} "
        f"model-rounds, {_geomean(high['speedup']):.3g} at {int(high['complexity'].iloc[0])}"))


def switch_target(records: Records, params: Mapping) -> Measured | None:
    ran = _ran(records)
    cell = None if ran is None else ran[(ran["models"] == 1000) & (ran["rounds"] == 1)]
    if cell is None or not len(cell):
        return Measured(None, scale="1000 models x 1 round not run in this profile")
    row = cell.iloc[0]
    return Measured(row["speedup"], spread=_spread(row["speedup_min"], row["speedup_max"]), scale=many_scale(cell))


# ---------------------------------------------------------------------------------------------
# Fig 12 and the max-batch peers


def _parallel(records: Records) -> pd.DataFrame | None:
    df = record_frame(records, "parallel")
    return df if df is not None and "pytorch_models" in df else None


def _parallel_scale(df: pd.DataFrame) -> str:
    return (f"{_MLP}, batch {int(df['batch_size'].iloc[0])}, budgets {_mib(sorted(set(df['budget_bytes'])))}, "
            f"modes {list(dict.fromkeys(df['mode']))}, budget guard on CPU")


def more_models(records: Records, params: Mapping) -> Measured | None:
    df = _parallel(records)
    if df is None:
        return None
    if "capped" in df and df["capped"].astype(bool).any():
        return Measured(None, scale=f"{_parallel_scale(df)}; a trial search reached its limit: counts are lower bounds")
    best = df.groupby("budget_bytes")[["planned_models", "pytorch_models"]].max()
    return Measured(float((best["planned_models"] - best["pytorch_models"]).min()), scale=(
        f"{_parallel_scale(df)}; CalcGraph {best['planned_models'].tolist()} vs plain PyTorch "
        f"{best['pytorch_models'].tolist()} models"))


def plan_vs_layout(records: Records, params: Mapping) -> Measured | None:
    df = _parallel(records)
    if df is None or not (df["trial_models"] > 0).all():
        return None
    return Measured(float((df["planned_models"] / df["trial_models"]).min()), scale=_parallel_scale(df))


def _peers(records: Records) -> tuple[pd.Series, pd.Series, str] | None:
    df = record_frame(records, "peers")
    if df is None:
        return None
    by = df.set_index("method")
    scale = f"{df['model'].iloc[0]}, budget {_mib([df['budget_bytes'].iloc[0]])}" if "model" in df else ""
    return by.loc[PLAN], by.loc[TRUTH], scale


def max_batch(records: Records, params: Mapping) -> Measured | None:
    got = _peers(records)
    if got is None or not got[1]["max_batch"]:
        return None
    plan, truth, scale = got
    return Measured(float(plan["max_batch"]) / float(truth["max_batch"]), scale=scale)


def plan_trials(records: Records, params: Mapping) -> Measured | None:
    got = _peers(records)
    return None if got is None else Measured(int(got[0]["trials"]), scale=got[2])
