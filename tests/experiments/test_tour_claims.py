"""The tour's targets judged from hand-made records: exact, off by a byte, not measured, toy scale."""

import pandas as pd
import pytest

from workbench.experiments.tour import allocation_check, claims, training_step


def _records(peak=12_500_000, grad=400, param=400):
    allocation = pd.DataFrame([{"peak_bytes": peak, "expected_peak_bytes": 12_500_000, "end_bytes": 11_000_000,
                                "expected_end_bytes": 11_000_000}])
    step = pd.DataFrame([{"model": "resnet18", "stem": "cifar", "batch_size": 2, "image_size": 32,
                          "grad_bytes": grad, "param_bytes": param}])
    return {"allocation": allocation, "step": step}


def _verdicts(records, verdicts=True):
    frame = claims.ledger(records, {}, device="cpu", device_class="cpu", verdicts=verdicts).to_frame()
    return list(frame.verdict)


@pytest.mark.parametrize("records, expected", [
    (_records(), ["reproduced", "reproduced"]),
    (_records(peak=12_500_001, grad=401), ["not reproduced", "not reproduced"]),
    ({}, ["not run at this scale", "not run at this scale"]),
])
def test_targets_are_exact_and_can_fail(records, expected):
    assert _verdicts(records) == expected


def test_toy_scale_gives_no_verdict_and_rows_are_targets_not_paper_claims():
    assert _verdicts(_records(), verdicts=False) == ["not run at this scale"] * 2
    ledger = claims.ledger(_records(), {}, device="cpu", device_class="cpu", verdicts=True)
    assert ledger.tally() == {} and {r["source"] for r in ledger.rows} == {"target"}


def test_real_records_give_a_row_for_every_claim(one_thread):
    step, _ = training_step("resnet18", stem="cifar", batch_size=2, image_size=16, repeats=1, device="cpu")
    ledger = claims.ledger({"allocation": allocation_check("cpu"), "step": step}, {}, device="cpu",
                           device_class="cpu", verdicts=True)
    assert [r["claim"] for r in ledger.rows] == [c.text for c in claims.CLAIMS]
    assert [r["verdict"] for r in ledger.rows] == ["reproduced", "reproduced"]
