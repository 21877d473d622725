"""The claims ledger: two-sided rules, better than claimed, spread, sources, toy scales, checks."""

import json

import numpy as np
import pandas as pd
import pytest
import torch

from workbench.report import (
    CHECK, Claim, Ledger, Measured, at_least, at_most, between, device_class, format_value, judge, ledger_html, tally,
    within,
)


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
    page = ledger_html(ledger.rows)
    assert page.index("Paper claims") < page.index("Our targets") < page.index("Checks")

    toy = Ledger(verdicts=False)
    toy.add("paper claim", paper=2, measured=0.1, rule=at_least(2), **row)
    assert toy.rows[0]["verdict"] == "not run at this scale"


def test_a_gpu_claim_measured_on_a_cpu_reads_other_device_never_refuted():
    row = dict(unit="x", scale="s", device="cpu")
    cpu = Ledger(device_class="cpu")
    cpu.add("AMP is 1.75x faster", paper=1.75, measured=0.4, rule=within(1.75, rel=0.1, refuted=1.0, better="higher"),
            made_on="gpu", **row)
    cpu.add("CPU-made claim", paper=1.0, measured=0.4, rule=at_least(1.0), made_on="cpu", **row)
    cpu.add("GPU claim not measured", paper=1.0, measured=None, rule=at_least(1.0), made_on="gpu", **row)
    assert [r["verdict"] for r in cpu.rows] == ["other device", "not reproduced", "not run at this scale"]
    assert cpu.rows[0]["measured"] == 0.4 and "made on GPU" in cpu.rows[0]["rule"]
    gpu = Ledger(device_class="gpu")
    gpu.add("AMP is 1.75x faster", paper=1.75, measured=0.4, rule=within(1.75, rel=0.1, refuted=1.0, better="higher"),
            made_on="gpu", **row)
    assert gpu.rows[0]["verdict"] == "refuted"
    toy = Ledger(verdicts=False, device_class="cpu")
    toy.add("AMP", paper=1.75, measured=0.4, rule=at_least(1.0), made_on="gpu", **row)
    assert toy.rows[0]["verdict"] == "not run at this scale"
    with pytest.raises(ValueError, match="made_on"):
        cpu.add("x", paper=1, measured=1, rule=at_least(1), made_on="tpu", **row)
    with pytest.raises(ValueError, match="device_class"):
        Ledger(device_class="cuda")
    assert device_class("cuda:0") == device_class(torch.device("cuda")) == "gpu"
    assert device_class("cpu") == device_class(torch.device("mps")) == "cpu"


def _frames():
    return {"speed": pd.DataFrame({"method": ["a", "b"], "ratio": [1.2, 0.7], "lo": [1.1, 0.6], "hi": [1.3, 0.8]})}


def _ratio(method):
    def measure(records, params):
        if "speed" not in records:
            return None
        row = records["speed"].set_index("method").loc[method]
        return Measured(row.ratio, spread=(row.lo, row.hi), scale=f"batch {params['batch']}")
    return measure


def test_judge_turns_claims_and_records_into_rows():
    claims = [
        Claim("a is faster", unit="x", paper=1.0, measure=_ratio("a"), rule=at_least(1.0), definition="t_b / t_a"),
        Claim("b is faster on a GPU", unit="x", paper=1.0, measure=_ratio("b"), rule=at_least(1.0), made_on="gpu"),
        Claim("our goal", unit="x", paper=1.0, measure=_ratio("b"), rule=at_least(0.5), source="target"),
        Claim("same bits", unit="max diff", measure=lambda r, p: Measured(0.0), source="check", why="identical"),
        Claim("TensorFlow figure", unit="MB", paper=193, not_run="TensorFlow is not installed"),
    ]
    ledger = judge(claims, _frames(), {"batch": 8}, device="this CPU", device_class="cpu", verdicts=True)
    frame = ledger.to_frame()
    assert list(frame.verdict) == ["reproduced", "other device", "reproduced", CHECK, "not run"]
    assert frame.scale[0] == "batch 8" and frame.spread[0] == (1.1, 1.3) and frame.device[0] == "this CPU"
    assert ledger.tally() == {"reproduced": 1, "other device": 1, "not run": 1}
    # Nothing measured: every judged row reads "not run at this scale", and says it was not measured.
    empty = judge(claims, {}, {"batch": 8}, device="cpu", device_class="cpu", verdicts=True).to_frame()
    assert list(empty.verdict[:3]) == ["not run at this scale"] * 3
    assert empty.scale[0] == "not measured in this run"


def test_claims_are_checked_when_written():
    with pytest.raises(ValueError, match="rule"):
        Claim("no rule", unit="x", measure=_ratio("a"))
    with pytest.raises(ValueError, match="measure"):
        Claim("nothing", unit="x", rule=at_least(1))
    with pytest.raises(ValueError, match="why"):
        Claim("check", unit="x", measure=_ratio("a"), source="check")
    with pytest.raises(ValueError, match="source"):
        Claim("ours", unit="x", measure=_ratio("a"), rule=at_least(1), source="ours")
    with pytest.raises(TypeError, match="Measured"):
        judge([Claim("bad", unit="x", measure=lambda r, p: 1.0, rule=at_least(1))], {}, {}, device="cpu",
              device_class="cpu", verdicts=True)


def test_values_are_shown_in_readable_units():
    assert format_value(83e6, "bytes (plan)") == "79.2 MiB"
    assert format_value(3 * 2**30, "bytes") == "3 GiB"
    assert format_value(0.543, "fraction of AMP peak saved") == "54.3%"
    assert format_value(242.8, "% reduction") == "243"
    assert format_value(1234567.0) == "1,234,567"
    assert format_value(0.000123) == "0.000123"
    assert format_value(None) == format_value(float("nan")) == "—"
    assert format_value((0.9, 1.1), "x") == "[0.9, 1.1]"
    page = ledger_html([{"claim": "c" * 300, "source": "paper", "paper": 83e6, "measured": float("nan"),
                         "spread": None, "unit": "bytes", "scale": "s", "device": "cpu", "verdict": "other device",
                         "rule": "r"}])
    assert "c" * 300 in page and "79.2 MiB" in page and "None" not in page and "nan" not in page
    assert "verdict-other-device" in page and "e+" not in page


def test_a_notebook_ledger_shows_open_spreads_as_the_index_does():
    """A spread open at one end (DenseNet's depth search: (-inf, 208)) read `[-inf, 208]` in the notebook while
    the index page, from results.json (where it is null), read `[—, 208]`: both read `[—, 208]` now."""
    from workbench.report.results import _jsonable

    ledger = Ledger()
    ledger.add("depth", paper=200, measured=208, spread=(float("-inf"), 208), unit="layers", scale="s", device="cpu",
               rule=at_least(200))
    ledger.add("ratio", paper=2, measured=3, spread=(3, np.inf), unit="x", scale="s", device="cpu", rule=at_least(2))
    notebook, index = ledger_html(ledger.rows), ledger_html(json.loads(json.dumps(_jsonable(ledger.rows))))
    assert notebook == index and "[—, 208]" in notebook and "[3, —]" in notebook and "inf" not in notebook
    assert format_value(float("inf")) == format_value(np.float32("-inf")) == "—"


def test_a_spread_that_holds_the_whole_band_is_inconclusive():
    rule = within(160, rel=0.1)  # band [144, 176], no better side
    assert rule.verdict(300, spread=(float("-inf"), 300)) == "inconclusive"
    assert rule.verdict(100, spread=(90, 200)) == "inconclusive"
    assert rule.verdict(100, spread=(90, 110)) == "not reproduced"
    assert between(0.15, 0.20, partly_rel=0.5).verdict(0.5, spread=(0.01, 0.6)) == "inconclusive"
    assert at_least(2, partly=1).verdict(0.5, spread=(0.4, 0.9)) == "not reproduced"


def test_rules_describe_themselves_without_scientific_notation():
    assert within(83e6, rel=0.25).describe() == "reproduced if within 25% of 83,000,000"
    assert between(1.3e7, 1.4e7).describe() == "reproduced if in [13,000,000, 14,000,000]"
    assert at_most(0.0001, partly=0.001).describe() == "reproduced if measured <= 0.0001; partly if <= 0.001"


def test_tables_show_missing_and_non_finite_values_as_the_ledger_does():
    """pandas prints NaN, None, inf and -inf raw (17 NaN on the optorch report page); `table` shows "—" in the
    HTML JupyterLab and the reports render and in the plain text, and leaves the frame as it was."""
    from workbench.report import table

    frame = pd.DataFrame({"budget_bytes": [39944, 75880], "predicted_peak_bytes": [np.nan, 75880.0],
                          "ratio": [np.inf, 1.5], "plan": [None, "(0, 9)"], "fits": [None, True]})
    shown = table(frame)
    html_text, text = shown._repr_html_(), repr(shown)
    for rendered in (html_text, text):
        assert "NaN" not in rendered and "inf" not in rendered and "None" not in rendered
        assert rendered.count("—") == 4 and "75880" in rendered and "1.5" in rendered and "(0, 9)" in rendered
    assert "<table" in html_text and shown.frame is frame and np.isinf(frame.ratio[0]) and frame.fits[0] is None
    with pytest.raises(TypeError, match="table needs a pandas DataFrame, got list"):
        table([1, 2])


def test_table_formats_floats_and_still_shows_missing_values_as_the_ledger_does():
    """A Styler's "{:+.1%}" prints +nan% and +inf% (the calcgraph zoo table); `table`'s float_format formats
    the numbers only, in both renderings, and a bad format is refused before anything is shown."""
    from workbench.report import table

    frame = pd.DataFrame({("error", 3): [0.0123, np.nan], ("error", 12): [-np.inf, -0.004], "runs": [2, 3]})
    shown = table(frame, float_format="{:+.1%}")
    for rendered in (shown._repr_html_(), repr(shown)):
        assert "nan" not in rendered.lower() and "inf" not in rendered
        assert rendered.count("—") == 2 and "+1.2%" in rendered and "-0.4%" in rendered
    with pytest.raises(ValueError, match=r"float_format must be a format string .* got '\{:d\}'"):
        table(frame, float_format="{:d}")


def test_every_verdict_has_its_colour_and_the_gates_verdicts_are_known():
    """One palette for notebook and index: each verdict's class is in VERDICT_CSS (checks and 'not run'
    rows are uncoloured on purpose), and the verdicts other modules write are in VERDICTS."""
    from workbench.experiments.packed_bit_optimizers.table_claims import NOT_COMPARABLE
    from workbench.report.ledger import VERDICT_CSS, VERDICTS, verdict_class
    from workbench.timing import HOST_BOUND

    assert {HOST_BOUND, NOT_COMPARABLE} <= set(VERDICTS)
    assert verdict_class(HOST_BOUND) == "verdict-inconclusive-host-bound"
    for verdict in VERDICTS:
        if not verdict.startswith("not run"):
            assert "." + verdict_class(verdict) + "{" in VERDICT_CSS.replace(",", "{"), verdict
