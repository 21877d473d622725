"""variable_batch_size.gains: the paper's throughput gain (Section IV: % reduction of per-image time),
Table II, Fig 8's comparisons, Fig 9 and Table III."""

import numpy as np
import pandas as pd
import pytest

import workbench.experiments.variable_batch_size as exp
from workbench import vbs


def _sweep(times: dict, *, budget=10, request=12, ratio=1.0, rounds=None) -> list[dict]:
    rows = []
    for method, t in times.items():
        row = {"network": "g", "request": request, "budget_units": budget, "ratio": ratio, "paper_mb": 15 * ratio,
               "budget_bytes": budget * 1024, "method": method, "feasible": t is not None,
               "time_per_image_s": np.nan if t is None else t, "max_batch": 2}
        if rounds is not None:
            row["rounds"] = rounds.get(method)
        rows.append(row)
    return rows


def test_gain_is_the_percentage_reduction_of_per_image_time():
    gain = exp.gains(pd.DataFrame(_sweep({"vbs": 1.0, "fbs": 2.0, "greedy": 4.0}))).iloc[0]
    assert gain.gain_vs_fbs_pct == pytest.approx(50.0) and gain.speedup_vs_fbs == pytest.approx(2.0)
    assert gain.gain_vs_greedy_pct == pytest.approx(75.0) and gain.greedy_vs_fbs_pct == pytest.approx(-100.0)
    assert gain.fastest == "vbs" and gain.fbs_batch == 2
    greedy_wins = exp.gains(pd.DataFrame(_sweep({"vbs": 1.0, "fbs": 1.0, "greedy": 0.5}))).iloc[0]
    assert greedy_wins.fastest == "greedy" and greedy_wins.gain_vs_greedy_pct == pytest.approx(-100.0)
    tie = exp.gains(pd.DataFrame(_sweep({"vbs": 1.0, "fbs": 1.0, "greedy": None}))).iloc[0]
    assert tie.fastest == "vbs" and not tie.greedy_feasible and np.isnan(tie.gain_vs_greedy_pct)
    assert exp.gains(pd.DataFrame(_sweep({"vbs": None, "fbs": 1.0, "greedy": 1.0}))).empty


def test_executed_gains_pair_the_rounds():
    rounds = {"vbs": [1.0, 1.0, 2.0], "fbs": [2.0, 4.0, 2.0], "greedy": [1.0, 1.0, 1.0]}
    gain = exp.gains(pd.DataFrame(_sweep({"vbs": 1.0, "fbs": 2.0, "greedy": 1.0}, rounds=rounds))).iloc[0]
    assert gain.executed_gain_vs_fbs_pct == pytest.approx(50.0)   # per round: 50, 75, 0
    assert (gain.executed_gain_vs_fbs_lo, gain.executed_gain_vs_fbs_hi) == pytest.approx((0.0, 75.0))
    assert gain.executed_gain_vs_greedy_lo == pytest.approx(-100.0)


def test_table_ii_takes_the_largest_gain_in_each_range():
    rows = []
    for k, (ratio, t_fbs) in enumerate(((1.0, 2.0), (1.67, 4.0), (2.67, 1.25), (3.0, 1.1))):
        rounds = {"vbs": [1.0, 1.0], "fbs": [t_fbs, t_fbs * 0.9], "greedy": None}
        rows += _sweep({"vbs": 1.0, "fbs": t_fbs, "greedy": None}, budget=k, ratio=ratio, rounds=rounds)
    table = exp.table_ii(exp.gains(pd.DataFrame(rows)), request=12).iloc[0]
    assert table.predicted_tight_pct == pytest.approx(75.0) and table.points_tight == 2
    assert table.predicted_loose_pct == pytest.approx(20.0) and table.points_loose == 2
    assert table.predicted_tight_speedup == pytest.approx(4.0)
    assert table.executed_tight_pct == pytest.approx((75.0 + 100 * (1 - 1 / 3.6)) / 2)
    assert table.executed_tight_lo < table.executed_tight_pct < table.executed_tight_hi
    assert np.isnan(table.paper_tight_pct)  # "g" is not a network of Table II
    assert exp.TABLE_II["googlenet"] == (60.25, 36.55)


def synthetic(B: int = 12) -> vbs.LayerProfile:
    b = np.arange(1, B + 1)
    size = np.array([48, 64, 32, 16, 8, 4]) * 1024
    t = 1e-3 / (1 + 0.5 * (b - 1)) * np.ones((5, 1))
    return vbs.LayerProfile(t, size[:-1, None] * b, size[1:, None] * b, np.zeros((5, B)),
                            names=["conv1", "pool1", "inception_3a", "inception_5b", "classifier"])


def test_fig9_and_table_iii():
    tables = synthetic()
    sweep = exp.budget_sweep({"googlenet": tables}, requests=[12], ratios=[1.0, 1.33, 2.0])
    fig9 = exp.layer_batches(sweep, tables, network="googlenet", ratio=1.33, request=12)
    assert list(fig9.name) == tables.names and (fig9.batches.map(sum) == 12).all()
    assert (fig9.max_batch == fig9.batches.map(max)).all()
    assert fig9.need_bytes_per_sample.tolist() == [(48 + 64) * 1024, 96 * 1024, 48 * 1024, 24 * 1024, 12 * 1024]
    assert fig9.paper_mb.iloc[0] == pytest.approx(15 * 1.33, abs=1.0) and fig9.fbs_batch.iloc[0] >= 1
    assert fig9.max_batch.iloc[-1] > fig9.max_batch.iloc[1]  # small late layers run larger batches
    t3 = exp.table_iii(sweep, network="googlenet", ratio=1.33, request=12)
    assert list(t3.name) == tables.names and (t3.budget_bytes == t3.budget_bytes.iloc[0]).all()
    assert (t3.vbs_unused_fraction >= 0).all() and (t3.fbs_unused_fraction <= 1).all()
    assert np.allclose(t3.vbs_unused_fraction, t3.vbs_unused_bytes / t3.budget_bytes)
    assert (t3.fbs_batches.map(max) == fig9.fbs_batch.iloc[0]).all()
    paper = t3.set_index("name")
    assert paper.loc["conv1", "paper_fbs_unused_fraction"] == pytest.approx(9.29 / 20)
    assert paper.loc["inception_5b", "paper_vbs_unused_fraction"] == pytest.approx(6.9 / 20)
    no_fbs = sweep[sweep.method != "fbs"]
    assert exp.table_iii(no_fbs, network="googlenet", ratio=1.33, request=12).empty
    assert np.isnan(exp.layer_batches(no_fbs, tables, network="googlenet", ratio=1.33, request=12).fbs_batch.iloc[0])


def test_unused_memory_needs_plans_of_one_budget():
    tables = synthetic(4).coarsen(1024)
    a = vbs.dp(tables, memory=400, batch=4)
    b = vbs.fbs(tables, memory=300, batch=4)
    with pytest.raises(ValueError, match="same network and budget"):
        exp.unused_memory(a, b)
