"""The claims ledger: two-sided rules, better than claimed, spread, sources, toy scales, checks."""

import pytest

from workbench.report import Ledger, _ledger_html, at_least, at_most, between, tally, within


def test_within_is_two_sided_and_names_a_better_result():
    rule = within(0.15, rel=0.2, partly_rel=0.5, better="lower")  # band [0.12, 0.18]
    assert [rule.verdict(v) for v in (0.15, 0.18, 0.10, 0.20, 0.30)] == [
        "reproduced", "reproduced", "better than claimed", "partly", "not reproduced"]
    # Without a better side, missing on either side is a miss.
    assert within(1.0, rel=0.1).verdict(1.5) == within(1.0, rel=0.1).verdict(0.5) == "not reproduced"


def test_between_a_stated_range():
    # "15-20% overhead": measuring no overhead is not a reproduction, it is better than claimed.
    rule = between(0.15, 0.20, better="lower", partly_rel=0.5, refuted=0.5)
    assert rule.verdict(0.0) == "better than claimed"
    assert rule.verdict(0.17) == "reproduced"
    assert rule.verdict(0.25) == "partly"
    assert rule.verdict(0.40) == "not reproduced"
    assert rule.verdict(0.60) == "refuted"
    assert "[0.15, 0.2]" in rule.describe()
    with pytest.raises(ValueError, match="low <= high"):
        between(2, 1)
    with pytest.raises(ValueError, match="better"):
        within(1, rel=0.1, better="up")


def test_spread_that_straddles_a_threshold_is_inconclusive():
    rule = at_most(1.25)
    assert rule.verdict(1.2, spread=(1.1, 1.3)) == "inconclusive"
    assert rule.verdict(1.2, spread=(1.1, 1.24)) == "reproduced"
    assert at_least(2).verdict(3, spread=(2.5, 3.5)) == "reproduced"


def test_sources_checks_and_toy_scales():
    ledger = Ledger()
    row = dict(unit="x", scale="s", device="cpu")
    ledger.add("paper claim", paper=2, measured=3, rule=at_least(2), **row)
    ledger.add("our goal", paper="—", measured=0.1, rule=at_most(0.5), source="target", **row)
    ledger.add("noisy", paper=1, measured=1.0, rule=at_most(1.0), spread=(0.9, 1.1), **row)
    ledger.check("same accuracy", measured=1.0, why="identical computation", **row)
    ledger.not_run("GPU figure", paper=3.0, reason="needs a GPU")
    assert [r["verdict"] for r in ledger.rows] == [
        "reproduced", "reproduced", "inconclusive", "exact by construction", "not run"]
    assert ledger.tally() == {"reproduced": 1, "inconclusive": 1, "not run": 1}
    assert tally(ledger.rows) == ledger.tally()
    with pytest.raises(ValueError, match="source"):
        ledger.add("x", paper=1, measured=1, rule=at_least(1), source="ours", **row)
    page = _ledger_html(ledger.rows)
    assert page.index("Paper claims") < page.index("Our targets") < page.index("Checks")

    toy = Ledger(verdicts=False)
    toy.add("paper claim", paper=2, measured=0.1, rule=at_least(2), **row)
    assert toy.rows[0]["verdict"] == "not run at this scale"
