"""The advisor's figures: predicted step time against predicted peak, one point per candidate (the Pareto
figure), and every candidate's prediction against its real run. Pure functions of a record; a figure made
where the notebook gives no verdicts (`verdicts` False: toy sizes) says so on itself."""

from __future__ import annotations

import matplotlib.pyplot as plt
import pandas as pd

from workbench.report.marks import TOY_SCALE, marked

__all__ = ["TOY_SCALE", "plot_pareto", "plot_prediction"]


def plot_pareto(table: pd.DataFrame, *, budget: float, choice: str | None, verified: dict | None = None,
                title: str = "", verdicts: bool = True, reduced: str = "") -> plt.Figure:
    """Each candidate at (predicted peak, predicted step time); the budget as a line; the choice marked,
    with its verified peak and time beside the prediction when `verified` is given. `reduced` describes
    models smaller than published (`_marked`)."""
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    fits = table["fits"].astype(bool)
    for mask, color, label in ((fits, "tab:blue", "fits"), (~fits, "tab:gray", "over budget")):
        ax.scatter(table.loc[mask, "predicted_peak_bytes"] / 2**20, table.loc[mask, "predicted_step_seconds"] * 1e3,
                   color=color, label=label, s=25)
    ax.axvline(budget / 2**20, color="tab:red", linestyle="--", label="budget")
    if choice is not None:
        row = table[table["config"] == choice].iloc[0]
        ax.scatter([row["predicted_peak_bytes"] / 2**20], [row["predicted_step_seconds"] * 1e3], marker="*", s=220,
                   color="tab:orange", label=f"choice: {choice} (predicted)", zorder=3)
        if verified is not None:
            ax.scatter([verified["measured_peak_bytes"] / 2**20], [verified["measured_step_seconds"] * 1e3],
                       marker="X", s=120, color="black", label="choice, verified", zorder=3)
    ax.set_xlabel("peak memory (MiB)")
    ax.set_ylabel("step time (ms)")
    ax.set_title(title or "Every candidate, predicted")
    ax.legend(fontsize=8)
    return marked(fig, verdicts, reduced=reduced)


def plot_prediction(candidates: pd.DataFrame, *, verdicts: bool = True, reduced: str = "") -> plt.Figure:
    """Predicted against measured peak and step time for every candidate of the suite (`reduced`: `_marked`)."""
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, (pred, real, unit, scale) in zip(axes, (
            ("predicted_peak_bytes", "measured_peak_bytes", "MiB", 2**-20),
            ("predicted_step_seconds", "measured_step_seconds", "ms", 1e3)), strict=True):
        for model, group in candidates.groupby("model", sort=False):
            ax.scatter(group[real] * scale, group[pred] * scale, label=model, s=18)
        top = float(max(candidates[real].max(), candidates[pred].max()) * scale)
        ax.plot([0, top], [0, top], color="black", linewidth=0.8, label="exact")
        ax.set_xlabel(f"measured ({unit})")
        ax.set_ylabel(f"predicted ({unit})")
        ax.set_title("peak memory" if unit == "MiB" else "step time")
    axes[0].legend(fontsize=8)
    return marked(fig, verdicts, reduced=reduced)
