"""The tour's targets judged from hand-made records: exact, off by a byte, not measured, toy scale; on CUDA the
tensor trace is judged and the caching allocator's rounding shown beside it."""

import pandas as pd
import pytest

from tests.conftest import requires_cuda
from workbench.experiments.tour import allocation_check, claims, training_step


def _records(peak=12_500_000, grad=400, param=400, *, device="cpu", allocator_peak=None, allocator_grad=None):
    """Tensor-trace figures `peak` and `grad`; the meter's own figures equal them on CPU, or are the allocator's."""
    allocation = pd.DataFrame([{"peak_bytes": allocator_peak or peak, "expected_peak_bytes": 12_500_000,
                                "end_bytes": 11_000_000, "expected_end_bytes": 11_000_000, "tensor_peak_bytes": peak,
                                "tensor_end_bytes": 11_000_000, "allocator_peak_bytes": allocator_peak or peak,
                                "device": device}])
    step = pd.DataFrame([{"model": "resnet18", "stem": "cifar", "batch_size": 2, "image_size": 32,
                          "grad_bytes": allocator_grad or grad, "tensor_grad_bytes": grad, "param_bytes": param,
                          "device": device}])
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


def test_cuda_judges_the_tensor_trace_and_shows_the_allocator_rounding():
    # the H100 run: the allocator read 480 B over 12.5 MB and 2,231,512 B over the gradients, the trace exact
    records = _records(param=44_726_568, grad=44_726_568, device="cuda", allocator_peak=12_500_480,
                       allocator_grad=46_958_080)
    ledger = claims.ledger(records, {}, device="H100", device_class="gpu", verdicts=True)
    assert [r["verdict"] for r in ledger.rows] == ["reproduced", "reproduced"]
    assert "12,500,480 B (+480 B against the tensor trace)" in ledger.rows[0]["scale"]
    assert "+2,231,512 B" in ledger.rows[1]["scale"] and "caching allocator" in ledger.rows[1]["scale"]
    off = _records(peak=12_500_512, grad=44_726_572, param=44_726_568, device="cuda")
    assert _verdicts(off) == ["not reproduced", "not reproduced"]


def test_records_without_the_tensor_trace_are_not_judged():
    old = _records()
    old = {k: v.drop(columns=[c for c in v if c.startswith("tensor_")]) for k, v in old.items()}
    assert _verdicts(old) == ["not run at this scale"] * 2


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
    assert step["tensor_grad_bytes"].iloc[0] == step["param_bytes"].iloc[0] == step["grad_bytes"].iloc[0]


@requires_cuda
def test_cuda_tensor_trace_is_exact_where_the_allocator_rounds():
    step, _ = training_step("resnet18", stem="cifar", batch_size=2, image_size=16, repeats=1, device="cuda")
    allocation = allocation_check("cuda")
    assert allocation["tensor_peak_bytes"].iloc[0] == 12_500_000 <= allocation["peak_bytes"].iloc[0]
    assert step["tensor_grad_bytes"].iloc[0] == step["param_bytes"].iloc[0] <= step["grad_bytes"].iloc[0]
    ledger = claims.ledger({"allocation": allocation, "step": step}, {}, device="cuda", device_class="gpu",
                           verdicts=True)
    assert [r["verdict"] for r in ledger.rows] == ["reproduced", "reproduced"]
