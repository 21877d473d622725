"""The suite's timing: the run candidates and the choice timed in the same rounds, the regret paired round by round
against every fitting candidate, the repeat noise from the same rounds."""

import math

import pytest

from workbench.advisor.steptime import StepTime
from workbench.experiments.advisor import suite


def _timed(*rounds: float) -> StepTime:
    return StepTime(sorted(rounds)[len(rounds) // 2], len(rounds), len(rounds), 0, rounds=rounds)


def test_regret_is_the_worst_paired_median_over_every_fitting_candidate():
    times = {"choice": _timed(1.0, 2.0, 1.0, 2.0, 1.0), "a": _timed(1.0, 2.0, 1.0, 2.0, 1.0),
             # slower than the choice in the medians, but faster in every round it shares with it
             "b": _timed(0.9, 1.8, 0.9, 1.8, 0.9), "unfit": _timed(0.1, 0.1, 0.1, 0.1, 0.1)}
    regret, lo, hi, against = suite.paired_regret(times, "choice", ["a", "b", "choice"])
    assert against == "b" and regret == pytest.approx(1 / 0.9 - 1) and lo == pytest.approx(regret) == hi
    assert suite.paired_regret(times, "choice", ["choice"]) == (0.0, 0.0, 0.0, "choice")  # the only one fitting
    assert all(math.isnan(x) for x in suite.paired_regret(times, "choice", [])[:3])  # none fits
    # a candidate faster in half the rounds and slower in the other half: the quartiles straddle 0
    times["c"] = _timed(0.8, 2.4, 0.8, 2.4, 1.0)
    regret, lo, hi, against = suite.paired_regret(times, "choice", ["c"])
    assert lo < 0 < hi and lo <= regret <= hi


def test_repeat_error_compares_the_later_rounds_with_the_earlier():
    assert suite.repeat_error(_timed(1.0, 1.0, 1.0, 1.2, 1.2, 1.2)) == pytest.approx(0.2)
    assert suite.repeat_error(_timed(1.0, 2.0, 1.0, 1.0, 2.0)) == pytest.approx(0.0)  # the middle round left out
    assert math.isnan(suite.repeat_error(_timed(1.0, 1.1, 1.2)))  # too few rounds to split


def test_the_suite_times_its_run_candidates_and_the_choice_in_the_same_rounds(one_thread):
    run, decisions, advices = suite.evaluate(["mlp"], batch_size=4, width=0.125, image_size=16, budget_quantile=1.0,
                                             repeats=1, min_run_time=0.01, progress=False, sample=3, seed=5,
                                             candidates=lambda c: c.precision == "fp32")
    table = advices["mlp"].table  # three of its candidates run, drawn by the seed alone
    assert len(run) == 3 and (run["sampled_from"] == len(table)).all() and set(run["config"]) <= set(table["config"])
    assert (run["measured_step_seconds"] > 0).all() and run["repeat_error"].notna().all()
    row = decisions.iloc[0]
    assert row["regret_lo"] <= row["regret"] <= row["regret_hi"]
    fitting = run[run["measured_peak_bytes"] <= row["budget_bytes"] * (1 - advices["mlp"].margin)]
    assert row["fitting_timed"] == len(fitting)
    assert row["regret_against"] in set(fitting["config"]) | {row["choice_after"]}
