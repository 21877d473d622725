"""How a report reads (issue 43): claim counts said once, a ledger that fits JupyterLab's width, figures large
enough to read their legends, Fig 10's legend off its bars, DenseNet's log-log axes with a scale to read."""

from __future__ import annotations

import re
import struct

import matplotlib
import numpy as np
import pandas as pd
import pytest

from workbench.report import Ledger, at_least, ledger_html
from workbench.report.ledger import tally_text

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def _rows(verdicts: list[str]) -> list[dict]:
    return [{"claim": f"c{i}", "source": "paper", "verdict": v} for i, v in enumerate(verdicts)]


def test_claim_counts_read_once_and_say_what_each_count_is():
    text = tally_text(_rows(["not run at this scale"] * 7 + ["not run"] * 7))
    assert text == "14 paper claims: 7 measured too small to judge, 7 not measured by this notebook"
    text = tally_text(_rows(["not run", "reproduced", "partly", "reproduced"]) + [
        {"claim": "t", "source": "target", "verdict": "reproduced"}])
    assert text == "4 paper claims: 2 reproduced, 1 partly, 1 not measured by this notebook"
    assert tally_text([]) == "—" and tally_text(_rows(["refuted"])) == "1 paper claim: 1 refuted"


def test_the_index_counts_claims_in_those_words(tmp_path):
    from workbench.report.index import _tally_text

    assert _tally_text({"claims": _rows(["not run at this scale", "not run"])}) == (
        "2 paper claims: 1 measured too small to judge, 1 not measured by this notebook")
    assert _tally_text({"claims": "damaged"}) == "—"


def test_the_ledger_wraps_its_long_texts_and_scrolls_in_its_own_box():
    ledger = Ledger()
    ledger.add("a claim " * 30, paper=4, measured=5, unit="x", scale="s", device="cpu", rule=at_least(4))
    page = ledger_html(ledger.rows)
    assert "<div class='workbench-ledger'><table>" in page
    css = re.search(r"<style>(.*?)</style>", page).group(1)
    assert ".workbench-ledger{overflow-x:auto;max-width:100%}" in css
    assert re.search(r"\.workbench-ledger td[^{]*\{[^}]*white-space:normal;overflow-wrap:anywhere", css)


def _png_width(path) -> int:
    with open(path, "rb") as file:
        head = file.read(24)
    return struct.unpack(">I", head[16:20])[0]


def test_figures_are_saved_and_shown_large_enough_to_read(tmp_path):
    from workbench.report import index
    from workbench.report.results import FIGURE_DPI, write_results

    fig, ax = plt.subplots(figsize=(6, 3.8))
    ax.plot([1, 2], [1, 2], label="a legend")
    ax.legend(fontsize=8)
    write_results("tour", output_dir=tmp_path, parameters={}, records={}, ledger=Ledger(), figures={"f": fig})
    plt.close(fig)
    assert FIGURE_DPI >= 150 and _png_width(tmp_path / "f.png") >= 5 * 150  # tight: the margins cut
    shown = int(re.search(r"img\{width:(\d+)px", index._CSS).group(1))
    wide = int(re.search(r"img\.wide\{width:(\d+)px", index._CSS).group(1))
    assert shown >= 720 and wide >= 1300  # 8-point legend text at 720 px of 6 inches: 8 px high, was 5 at 480


def _boxes_overlap(a, b) -> bool:
    return a.x0 < b.x1 and b.x0 < a.x1 and a.y0 < b.y1 and b.y0 < a.y1


def test_fig10s_legend_covers_no_bar():
    from workbench.experiments import calcgraph as cgx

    fig = cgx.plot_single_model(pd.DataFrame({
        "framework": ["calcgraph heap", "pytorch"], "predicted_peak_bytes": [8e6, 9e6],
        "measured_peak_bytes": [8.5e6, 9.5e6],
        "round_median_s": [0.1, 0.1], "round_min_s": [0.09, 0.09], "round_max_s": [0.11, 0.11]}))
    try:
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()
        ax = fig.axes[0]
        legend = ax.get_legend().get_window_extent(renderer)
        bars = [p.get_window_extent(renderer) for p in ax.patches]
        assert bars and not any(_boxes_overlap(legend, bar) for bar in bars)
        assert not _boxes_overlap(legend, ax.get_window_extent(renderer))  # outside the axes altogether
        assert legend.y0 >= 0  # and still on the figure
    finally:
        plt.close(fig)


@pytest.mark.parametrize("depths", [[10, 16, 22], [16, 40, 64, 100, 136, 160, 220, 280, 340, 400]])
def test_densenet_log_log_axes_show_a_scale(depths):
    from workbench.experiments.efficient_densenet import plot_memory_vs_depth

    rows = [{"form": form, "depth": d, "activation_peak_bytes": scale * d ** 1.2 * 2**16, "growth_rate": 12,
             "batch_size": 2, "image_size": 32, "device": "cpu"} for form, scale in (("naive", 1.0), ("shared", 0.7))
            for d in depths]
    fig = plot_memory_vs_depth(pd.DataFrame(rows))
    try:
        fig.canvas.draw()
        ax = fig.axes[1]
        assert ax.get_xscale() == ax.get_yscale() == "log"
        for axis in (ax.xaxis, ax.yaxis):
            lo, hi = sorted(axis.get_view_interval())
            labels = [t.get_text() for t in axis.get_ticklabels() if t.get_text() and lo <= t.get_position()[
                axis is ax.yaxis] <= hi]
            assert len(labels) >= 3, (axis.axis_name, labels)
        xs = [t.get_position()[0] for t in ax.xaxis.get_ticklabels()]
        assert all(b / a >= 1.2 for a, b in zip(xs[:-1], xs[1:], strict=True)), xs  # labels that do not collide
        assert np.all(np.isin(xs, depths))
    finally:
        plt.close(fig)
