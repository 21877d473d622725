"""The suite's regret: the choice and the fastest fitting candidate re-timed side by side (paired rounds),
zero when they are the same program."""

import math

from workbench.experiments.advisor import suite


def test_regret_is_paired_and_zero_for_the_same_candidate(one_thread):
    run, decisions, advices = suite.evaluate(["mlp"], batch_size=4, width=0.125, image_size=16, budget_quantile=1.0,
                                             repeats=1, min_run_time=0.01, progress=False, sample=3, seed=5,
                                             candidates=lambda c: c.precision == "fp32")
    table = advices["mlp"].table  # three of its candidates run, drawn by the seed alone
    assert len(run) == 3 and (run["sampled_from"] == len(table)).all() and set(run["config"]) <= set(table["config"])
    row = decisions.iloc[0]
    assert row["regret_lo"] <= row["regret"] <= row["regret_hi"]
    advice = advices["mlp"]
    configs = list(advice.table["config"])
    assert suite.paired_regret(advice, configs[0], configs[0], rounds=3) == (0.0, 0.0, 0.0)
    value, lo, hi = suite.paired_regret(advice, configs[0], configs[-1], rounds=5)
    assert all(math.isfinite(x) and x > -1 for x in (value, lo, hi)) and lo <= value <= hi
