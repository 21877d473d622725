"""The ledger and its rules against the issue 23 probe battery: spreads of the wrong length, empty claims, huge
integers, and results.json rows damaged on disk (list verdicts, 10**400) that crashed the index pages."""

from __future__ import annotations

import json

import pytest

from workbench.report import Claim, Ledger, at_most, format_value, judge, ledger_html, tally, write_index


def add(**kw):
    Ledger().add(**{"claim": "c", "paper": 1, "measured": 1.0, "unit": "x", "scale": "s", "device": "cpu",
                    "rule": at_most(2), **kw})


@pytest.mark.parametrize("kw, needle", [
    ({"spread": (1.0,)}, r"'c': spread=\(1.0,\) must be two numbers"),
    ({"spread": (1.0, 2.0, 3.0)}, "must be two numbers"), ({"spread": 1.0}, "'c': spread=1.0 must be two numbers"),
    ({"spread": "ab"}, "spread='ab'"), ({"claim": None}, "claim must be the claim's text"),
    ({"claim": " "}, "claim must be the claim's text"),
    ({"measured": 10**400}, "'c': measured=1000.*too large for a float"),
])
def test_ledger_add_refuses_naming_the_field(kw, needle):
    with pytest.raises(ValueError, match=needle):
        add(**kw)


def test_rules_refuse_huge_thresholds_and_short_spreads():
    with pytest.raises(ValueError, match="at_most: target=1000.*too large for a float"):
        at_most(10**400)
    with pytest.raises(ValueError, match="spread"):
        at_most(2).verdict(1.0, (1.0,))
    assert at_most(2).verdict(1.0, (3.0, 0.5)) == "inconclusive"  # either order still reads as (low, high)


def test_judge_names_the_claim_whose_measure_fails():
    claim = Claim("peak ratio", "x", measure=lambda records, params: records["missing"], rule=at_most(1))
    with pytest.raises(KeyError, match="'peak ratio': its measure failed on these records: KeyError: 'missing'"):
        judge([claim], {}, {}, device="cpu", device_class="cpu", verdicts=True)


def test_values_read_back_from_results_json_always_format():
    assert format_value(10**400) == "1.00e400" and format_value(-(10**400), "bytes") == "-1.00e400"
    assert format_value(5, None) == "5"
    deep: list = []
    for _ in range(5000):
        deep = [deep]
    assert format_value(deep).count("[...]") == 1
    assert tally([{"verdict": ["x"]}, {"verdict": "reproduced"}, {"verdict": {"a": 1}}]) == {
        "['x']": 1, "reproduced": 1, "{'a': 1}": 1}
    page = ledger_html([{"claim": "<b>", "verdict": ["x"], "unit": {"a": 1}, "measured": 10**400}])
    assert "&lt;b&gt;" in page and "1.00e400" in page


def test_index_lists_a_report_whose_results_json_is_damaged(tmp_path):
    """write_index over a results.json with a list verdict and a 10**400 measurement (probe verdict-list,
    huge-int-measured) raised TypeError/OverflowError; it lists the report."""
    folder = tmp_path / "smoke" / "tiny"
    folder.mkdir(parents=True)
    (folder / "run.json").write_text(json.dumps({"status": "ok", "profile": "smoke"}))
    row = {"claim": "c1", "source": "paper", "paper": 1, "unit": "x", "verdict": ["reproduced"]}
    text = json.dumps({"claims": [row, {**row, "claim": "c2", "verdict": "reproduced"}]})
    (folder / "results.json").write_text(text.replace('"paper": 1', '"measured": 1' + "0" * 400, 1))
    write_index(tmp_path)
    page = (tmp_path / "smoke" / "index.html").read_text()
    assert 'id="tiny"' in page and "1.00e400" in page and "c2" in page
