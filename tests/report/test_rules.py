"""Rules refuse thresholds that are not finite numbers and measured values that are not numbers, naming the
field; NaN as a measurement still means "not measured"."""

import math

import numpy as np
import pandas as pd
import pytest

from workbench.report import Claim, Ledger, Measured, Rule, at_least, at_most, between, judge, within


@pytest.mark.parametrize("make,field", [
    (lambda: at_most(math.nan), "at_most: target=nan"),
    (lambda: at_least(math.nan), "at_least: target=nan"),
    (lambda: at_least(math.inf), "at_least: target=inf"),
    (lambda: at_least(1.0, partly=math.nan), "at_least: partly=nan"),
    (lambda: at_most(1.0, refuted=-math.inf), "at_most: refuted=-inf"),
    (lambda: within(math.nan, rel=0.1), "within: target=nan"),
    (lambda: within(1.0, rel=math.nan), "within: rel=nan"),
    (lambda: within(1.0, rel=0.1, partly_rel=math.inf), "within: partly_rel=inf"),
    (lambda: between(0.0, math.nan), "between: high=nan"),
    (lambda: between(np.float64("nan"), 1.0), r"between: low=\S*nan\S*"),
    (lambda: Rule("at_most", math.nan), "at_most: target=nan"),
])
def test_non_finite_thresholds_are_refused_naming_the_field(make, field):
    with pytest.raises(ValueError, match=f"{field} is not a finite number"):
        make()


@pytest.mark.parametrize("make,field", [
    (lambda: at_most("0.5"), "at_most: target='0.5'"),
    (lambda: at_least(None), "at_least: target=None"),
    (lambda: within(1.0, rel="10%"), "within: rel='10%'"),
    (lambda: between(True, 2), "between: low=True"),
])
def test_non_numeric_thresholds_are_refused_naming_the_field(make, field):
    with pytest.raises(TypeError, match=f"{field} is not a number"):
        make()


def test_non_numeric_measured_values_are_refused_naming_the_field():
    row = dict(paper=1, unit="x", scale="s", device="cpu", rule=at_most(1.0))
    ledger = Ledger()
    for bad in ("fast", True, [1.0], {"a": 1}):
        with pytest.raises(TypeError, match=r"'speed': measured=.* is not a number"):
            ledger.add("speed", measured=bad, **row)
    with pytest.raises(TypeError, match=r"'speed': spread=.* is not a number"):
        ledger.add("speed", measured=1.0, spread=("a", 2), **row)
    with pytest.raises(ValueError, match=r"'speed': spread=.* not NaN"):
        ledger.add("speed", measured=1.0, spread=(math.nan, 2), **row)
    with pytest.raises(TypeError, match="measured='fast' is not a number"):
        at_most(1.0).verdict("fast")
    assert not ledger.rows
    # NaN and None still mean "not measured in this run"; numpy numbers are numbers
    ledger.add("speed", measured=math.nan, **row)
    ledger.add("speed", measured=np.float32(0.5), spread=(np.float64(0.4), 0.6), **row)
    assert [r["verdict"] for r in ledger.rows] == ["not run at this scale", "reproduced"]


def test_judge_names_the_claim_whose_measure_returned_text():
    claim = Claim("speed-up", unit="x", paper=2.0, rule=at_least(2.0), measure=lambda r, p: Measured("n/a"))
    with pytest.raises(TypeError, match="'speed-up': the value its measure returned='n/a' is not a number"):
        judge([claim], {"r": pd.DataFrame()}, {}, device="cpu", device_class="cpu", verdicts=True)
