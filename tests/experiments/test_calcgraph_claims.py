"""Claims of "CalcGraph: taming the high costs of deep learning using models" (2022): every rule of
`workbench.experiments.calcgraph.claims` on hand-made records, one case per verdict it can give, at
the boundaries; and a ledger of what the experiment functions really record has a row for every claim."""

import pandas as pd
import pytest
from claim_rows import claim_row

from workbench.experiments import calcgraph as cgx
from workbench.experiments.calcgraph import claims as cgc
from workbench.experiments.calcgraph.claims import CLAIMS, NOT_COMPARABLE, PAPER_HEAP_BYTES, ledger
from workbench.report import CHECK

PARAMS = {"resnet_width": 0.125, "image_size": 16, "cost_repeats": 3}
TRACKER, ALLOCATOR = cgx.METERS["cpu"], cgx.METERS["cuda"]
RULE = 1 - 1e-9  # just inside a boundary, against float rounding


def _claim(prefix: str):
    found = [c for c in CLAIMS if c.text.startswith(prefix)]
    assert len(found) == 1, f"{prefix!r} names {len(found)} claims"
    return found[0]


def verdict(prefix: str, records: dict, *, device_class: str = "cpu", verdicts: bool = True) -> str:
    claim = _claim(prefix)
    rows = ledger(records, PARAMS, device="test", device_class=device_class, verdicts=verdicts).rows
    return rows[CLAIMS.index(claim)]["verdict"]


def measured(prefix: str, records: dict) -> float | None:
    rows = ledger(records, PARAMS, device="test", device_class="cpu", verdicts=True).rows
    return rows[CLAIMS.index(_claim(prefix))]["measured"]


def _errors(errors, meter):
    return {"prediction_error": pd.DataFrame({"model": "mlp", "batch_size": range(1, len(errors) + 1),
                                              "error": errors, "meter": meter})}


# ---------------------------------------------------------------------------------------------
# Sections 3.2 and 4.3


KNOWN = "The memory a training step needs is known before execution"
CONSISTENT = "Consistency, not evidence: the plan's peak"
CUDA_TARGET = "Prediction within 5% on CUDA"


def _allocator_errors(errors, tracker_errors=None, allocator="cpu allocator (torch.profiler)"):
    tracker_errors = tracker_errors if tracker_errors is not None else [0.0] * len(errors)
    return {"prediction_error": pd.DataFrame({
        "model": "mlp", "batch_size": range(1, len(errors) + 1), "error": tracker_errors, "meter": TRACKER,
        "allocator_error": errors, "allocator": allocator})}


def test_known_before_execution_is_judged_only_against_the_allocator():
    # at_most(0.01, partly=0.05) on the worst |error|; the sign of an error does not matter
    cases = {0.01: "reproduced", -0.05: "partly", 0.0501: "not reproduced"}
    for error, expected in cases.items():
        # records from before the allocator column: the CUDA rows' error (the caching allocator)
        assert verdict(KNOWN, _errors([0.0, error], ALLOCATOR), device_class="gpu") == expected
        # on CPU too, against AllocatorMeter's count (the c10 allocator): never the tracker's column
        assert verdict(KNOWN, _allocator_errors([0.0, error], tracker_errors=[0.0, 0.0])) == expected
    assert verdict(KNOWN, _allocator_errors([0.0, 0.0], tracker_errors=[0.3, 0.3])) == "reproduced"
    assert measured(KNOWN, _allocator_errors([0.02, -0.3])) == pytest.approx(0.3)
    # a CPU run measured only by the tracker (its counting rule is the plan's): never a verdict on the paper
    tracked = _errors([0.0, 0.2], TRACKER)
    assert verdict(KNOWN, tracked) == "not run at this scale"
    assert verdict(KNOWN, {}) == "not run at this scale"
    # ... the consistency row reads the tracker rows, and is a check: one counting rule, so no evidence (issue 44)
    assert [verdict(CONSISTENT, _errors([e], TRACKER)) for e in (0.01, 0.06)] == [CHECK, CHECK]
    assert measured(CONSISTENT, _errors([0.0, -0.06], TRACKER)) == pytest.approx(0.06)
    assert measured(CONSISTENT, _errors([0.0], ALLOCATOR)) is None
    assert _claim(CONSISTENT).source == "check" and _claim(KNOWN).source == "paper"


def test_cuda_target_reads_allocator_rows_only():
    assert [verdict(CUDA_TARGET, _errors([e], ALLOCATOR), device_class="gpu") for e in (0.05, 0.1, 0.11)] == [
        "reproduced", "partly", "not reproduced"]
    assert verdict(CUDA_TARGET, _errors([0.0], TRACKER)) == "not run at this scale"


HEAP = "CalcHeap for batch 10,000"


def _heap(static_total, batch=10_000):
    zones = ["forward", "gradient", "optimizer", "workspace"]
    return {"calcheap": pd.DataFrame({"zone": zones, "batch_size": batch, "static_bytes": [static_total, 0, 0, 0],
                                      "peak_bytes": [static_total / 2, 0, 0, 0]})}


def test_calcheap_is_not_comparable_with_another_implementations_layout():
    # the paper's 83 MB is its own executable's layout: whatever our layout sums to, the row reads not comparable
    # (issue 44: 54.8 MB read "better than claimed"), keeping the measurement and saying why in its rule
    lo, hi = 0.75 * PAPER_HEAP_BYTES, 1.25 * PAPER_HEAP_BYTES
    for total in (lo * 0.99, lo / RULE, hi * RULE, hi * 1.51):
        row = claim_row(cgc, HEAP, _heap(total), device_class="cpu")
        assert row["verdict"] == NOT_COMPARABLE and row["measured"] == total
        assert "not comparable: the paper's 83 MB is the heap of its own compiled executable" in row["rule"]
    # the paper's quantity is for batch 10,000 only; the static layout, not the dynamic peak, is measured
    assert verdict(HEAP, _heap(70e6, batch=512)) == "not run at this scale"
    assert verdict(HEAP, _heap(70e6), verdicts=False) == "not run at this scale"
    assert measured(HEAP, _heap(70e6)) == 70e6


# ---------------------------------------------------------------------------------------------
# Figs 9 and 10


def test_fig9_identical_curves_are_a_check():
    acc = pd.DataFrame({"round": [1, 2, 1, 2], "framework": ["calcgraph heap"] * 2 + ["pytorch"] * 2,
                        "train_accuracy": [0.1, 0.5, 0.1, 0.5], "test_accuracy": [0.1, 0.4, 0.1, 0.4],
                        "max_abs_weight_diff": 0.0, "data": "digits", "n_train": 8, "batch_size": 8})
    assert _claim("Same initial values").source == "check"
    assert verdict("Same initial values", {"accuracy": acc}) == CHECK
    assert measured("Same initial values", {"accuracy": acc}) == 0.0


def _single(memory_ratio=1.0, time_ratio=1.0, lo=None, hi=None):
    heap_s = time_ratio * 0.01
    return {"single_model": pd.DataFrame({
        "framework": ["calcgraph heap", "pytorch"], "measured_peak_bytes": [memory_ratio * 1e6, 1e6],
        "round_median_s": [heap_s, 0.01], "round_min_s": [lo * 0.01 if lo else heap_s, 0.01],
        "round_max_s": [hi * 0.01 if hi else heap_s, 0.01], "data": "digits", "n_train": 8, "batch_size": 8,
        "rounds": 2})}


def test_fig10_memory_is_not_comparable_with_the_papers_process_memory():
    # the paper measured process and GPU memory; a tensor peak in one PyTorch process cannot show that saving
    less = "A single model uses less memory"
    for ratio in (0.5, 1.0, 1.06):
        for device_class in ("cpu", "gpu"):
            row = claim_row(cgc, less, _single(memory_ratio=ratio), device_class=device_class)
            assert row["verdict"] == NOT_COMPARABLE and row["measured"] == pytest.approx(ratio)
            assert "process main memory and GPU memory" in row["rule"]
    assert verdict(less, {}) == "not run at this scale"
    assert verdict(less, _single(), verdicts=False) == "not run at this scale"


def test_fig10_time_was_measured_on_a_gpu():
    faster = "A single model is faster than PyTorch"
    assert _claim(faster).made_on == "gpu"
    assert verdict(faster, _single(time_ratio=0.5)) == "other device"
    # at_most(1.0, partly=1.1) on a GPU
    assert [verdict(faster, _single(time_ratio=r), device_class="gpu") for r in (1.0, 1.1, 1.11)] == [
        "reproduced", "partly", "not reproduced"]
    assert verdict(faster, _single(time_ratio=0.95, lo=0.9, hi=1.05), device_class="gpu") == "inconclusive"


# ---------------------------------------------------------------------------------------------
# Fig 11


def _many(cells):
    """cells: (models, rounds, speedup[, min, max])."""
    rows = []
    for cell in cells:
        m, r, s = cell[:3]
        lo, hi = cell[3:] if len(cell) == 5 else (s, s)
        rows.append({"models": m, "rounds": r, "complexity": m * r, "run": True, "switching_s": 1.0,
                     "plain_s": s, "speedup": s, "speedup_min": lo, "speedup_max": hi, "n_train": 8,
                     "batch_size": 8, "data": "digits"})
    rows.append({"models": 1000, "rounds": 30, "complexity": 30000, "run": False, "n_train": 8, "batch_size": 8,
                 "data": "digits"})
    return {"many_models": pd.DataFrame(rows)}


META = "Training many models is faster than PyTorch in the meta-learning area"
TREND = "Gains over PyTorch are largest at low total complexity"
SWITCH = "Switching is at least 3x faster"


def test_fig11_faster_than_pytorch_in_the_meta_learning_cells():
    assert _claim(META).made_on == "gpu"
    # at_least(1.0) on the geometric mean over cells with 10-30 rounds; the 1-round cell does not count
    records = _many([(1, 1, 0.5), (1, 10, 2.0), (10, 30, 0.5)])
    assert measured(META, records) == pytest.approx(1.0)
    assert verdict(META, records, device_class="gpu") == "reproduced"
    assert verdict(META, records) == "other device"
    assert verdict(META, _many([(1, 10, 0.99), (1, 1, 5.0)]), device_class="gpu") == "not reproduced"
    assert verdict(META, _many([(1, 10, 1.05, 0.9, 1.2)]), device_class="gpu") == "inconclusive"
    assert verdict(META, _many([(1, 1, 2.0)]), device_class="gpu") == "not run at this scale"


def test_fig11_trend_needs_a_gain_at_low_complexity():
    assert _claim(TREND).made_on == "gpu"
    # gains (1 - 1/speedup) 0.5 at low, 0.2 at high: reproduced
    assert verdict(TREND, _many([(1, 1, 2.0), (100, 10, 1.25)]), device_class="gpu") == "reproduced"
    # every speedup below 1, the loss smaller at low complexity: no gain, so no trend of gains
    assert verdict(TREND, _many([(1, 1, 0.97), (100, 10, 0.93)]), device_class="gpu") == "not reproduced"
    # a gain at low complexity and a loss at high: reproduced
    assert verdict(TREND, _many([(1, 1, 1.1), (100, 10, 0.8)]), device_class="gpu") == "reproduced"
    assert verdict(TREND, _many([(1, 1, 1.1, 0.9, 1.3), (100, 10, 1.0)]), device_class="gpu") == "inconclusive"
    assert verdict(TREND, _many([(1, 1, 2.0)]), device_class="gpu") == "not run at this scale"
    assert verdict(TREND, _many([(1, 1, 2.0), (100, 10, 1.25)])) == "other device"


def test_switching_target_at_1000_models_one_round():
    # at_least(3.0, partly=1.5), judged on any device
    assert [verdict(SWITCH, _many([(1000, 1, s)])) for s in (3.0, 1.5, 1.49)] == [
        "reproduced", "partly", "not reproduced"]
    assert verdict(SWITCH, _many([(1000, 1, 3.1, 2.9, 3.3)])) == "inconclusive"
    assert verdict(SWITCH, _many([(10, 1, 5.0)])) == "not run at this scale"


# ---------------------------------------------------------------------------------------------
# Fig 12 and the peers


MORE = "More models fit in parallel with CalcGraph than with plain PyTorch"


def _parallel(rows):
    """rows: (mode, budget MiB, planned, layout trial, pytorch)."""
    return {"parallel": pd.DataFrame([{"mode": m, "budget_bytes": b * 2**20, "batch_size": 16, "planned_models": p,
                                       "trial_models": t, "pytorch_models": q} for m, b, p, t, q in rows])}


def test_fig12_more_models_is_not_comparable_with_the_papers_processes():
    # CalcGraph's best count minus PyTorch's best, worst budget: shown, but the paper counted processes on a GPU
    for rows, diff in (([("loop", 4, 4, 4, 3), ("loop", 8, 9, 9, 8)], 1), ([("loop", 4, 2, 2, 3)], -1)):
        row = claim_row(cgc, MORE, _parallel(rows), device_class="cpu")
        assert row["verdict"] == NOT_COMPARABLE and row["measured"] == diff
        assert "each model in its own process" in row["rule"]
    # each side at its best mode: vmap's lower count does not count against CalcGraph
    same = _parallel([("loop", 4, 3, 3, 3), ("vmap", 4, 2, 2, 3)])
    assert measured(MORE, same) == 0
    assert verdict(MORE, {}) == "not run at this scale"
    capped = _parallel([("loop", 4, 9, 8, 8)])
    capped["parallel"]["capped"] = True  # a trial search stopped at its limit: no verdict on lower bounds
    assert verdict(MORE, capped) == "not run at this scale"


def test_fig12_plan_against_its_own_layout_is_a_check():
    claim = "How many models fit is known in advance"
    assert _claim(claim).source == "check"
    assert verdict(claim, _parallel([("loop", 4, 3, 3, 3)])) == CHECK
    assert measured(claim, _parallel([("loop", 4, 3, 3, 3), ("vmap", 4, 2, 3, 3)])) == pytest.approx(2 / 3)


def _peers(plan, truth):
    return {"peers": pd.DataFrame({"method": ["calcgraph (plan)", "trial bisection (guard)"],
                                   "max_batch": [plan, truth], "trials": [0, 12], "model": "mlp",
                                   "budget_bytes": 2**20})}


def test_max_batch_consistency_is_a_check():
    claim = "Consistency, not evidence: the plan's max batch"
    assert _claim(claim).source == "check" and "one counting rule" in _claim(claim).text
    assert [verdict(claim, _peers(p, 100)) for p in (100, 98)] == [CHECK, CHECK]
    assert measured(claim, _peers(98, 100)) == pytest.approx(0.98)
    assert verdict("Trial runs needed", _peers(100, 100)) == CHECK


def test_not_run_rows_and_toy_scales():
    records = {**_errors([0.0], ALLOCATOR), **_heap(70e6), **_single(), **_many([(1, 10, 2.0), (1, 1, 2.0)]),
               **_parallel([("loop", 4, 4, 4, 3)]), **_peers(100, 100)}
    rows = ledger(records, PARAMS, device="test", device_class="gpu", verdicts=False).rows
    for claim, row in zip(CLAIMS, rows, strict=True):
        if claim.not_run:
            assert row["verdict"] == "not run"
        elif claim.source == "check":
            assert row["verdict"] == CHECK
        else:
            assert row["verdict"] == "not run at this scale"
    texts = " ".join(c.text for c in CLAIMS if c.not_run)
    assert "247 MB" in texts and "193 MB" in texts and texts.count("TensorFlow") >= 5
    assert all(c.definition for c in CLAIMS if c.source != "check")


def test_ledger_of_real_records_has_a_row_for_every_claim():
    data = cgx.load_data(32, 16, source="digits")
    small = {k: (v[:16] if hasattr(v, "shape") else v) for k, v in data.items()}
    records = {
        "prediction_error": cgx.prediction_error(["mlp"], [1, 2]),
        "calcheap": cgx.calcheap_layout(),
        "peers": cgx.max_batch_peers("mlp", 1.3 * 2**20, start_batch=16, peers=[]),
        "accuracy": cgx.accuracy_curves(data, rounds=1, batch_size=32),
        "single_model": cgx.single_model_cost(data, rounds=1, batch_size=32, repeats=1),
        "many_models": cgx.multi_model_times(small, n_models=[1, 2], rounds=[1, 10], batch_size=16),
        "parallel": cgx.parallel_models([1.3 * 2**20], batch_size=8, modes=["loop"]),
    }
    params = {"resnet_width": 0.125, "image_size": 16, "cost_repeats": 1}
    judged = ledger(records, params, device="cpu", device_class="cpu", verdicts=True)
    assert [r["claim"] for r in judged.rows] == [c.text for c in CLAIMS]
    by = {r["claim"]: r for r in judged.rows}
    assert by[_claim(CONSISTENT).text]["verdict"] == CHECK
    assert by[_claim(HEAP).text]["measured"] > 31_360_000  # the batch of 10,000 images alone
    assert by[_claim(META).text]["verdict"] == "other device"
    assert by[_claim(MORE).text]["measured"] is not None


def _zoo(errors, held_out=None):
    return {"zoo": pd.DataFrame({"model": [f"m{i}" for i in range(len(errors))], "batch_size": 12,
                                 "error": errors, "uncalibrated_error": [-0.5] * len(errors),
                                 "held_out": [True] * len(errors) if held_out is None else held_out})}


@pytest.mark.parametrize(("errors", "verdict"), [
    ([0.0, 0.049, -0.019], "reproduced"), ([0.0, -0.03], "not reproduced"), ([0.06, 0.0], "not reproduced"),
])
def test_the_zoo_target_is_two_sided(errors, verdict):
    from workbench.experiments.calcgraph import claims

    row = claim_row(claims, "Calibrated plan within 5%", _zoo(errors), device_class="cpu")
    assert row["verdict"] == verdict and row["source"] == "target"
    assert claim_row(claims, "Calibrated plan within 5%", _zoo(errors), device_class="gpu")["verdict"] == "other device"


def test_the_zoo_target_judges_only_batches_calibration_never_ran():
    from workbench.experiments.calcgraph import claims

    fitted_there = _zoo([0.0, 0.2, -0.01], held_out=[True, False, True])  # +20% where calibration ran: not judged
    row = claim_row(claims, "Calibrated plan within 5%", fitted_there, device_class="cpu")
    assert row["verdict"] == "reproduced" and row["measured"] == pytest.approx(-0.01)
    none_held_out = _zoo([0.0], held_out=[False])
    assert claim_row(claims, "Calibrated plan within 5%", none_held_out, device_class="cpu")["measured"] is None
