"""The OpTorch claims judged at the paper's sizes (workbench/experiments/optorch/claim_measures.py) on hand-made
records: Fig 10 and Fig 8 read the plan where the records hold one, with the planner's ratio error at a size that
runs here as the spread (a verdict the error could change reads "inconclusive"); the mixed-precision accuracy row
reads its seeds' paired differences, so noise beyond the tolerance reads "inconclusive"."""

from __future__ import annotations

import pandas as pd
import pytest

from workbench.experiments.optorch import claims

from claim_rows import claim_row
from test_optorch_claims import _fig9, _fig10, _sc


def _row(prefix: str, records: dict, device_class: str = "cpu") -> dict:
    return claim_row(claims, prefix, records, device_class=device_class)


def _planned(ratios: dict[str, float], *, error: float | None = 0.0, model: str = "resnet50") -> dict:
    """Fig 10 planned at 16 images 512x512 (ratios by pipeline) and, unless `error` is None, its check at 16x16
    with the same ratio error for every pipeline."""
    rows = [{"model": model, "pipeline": p, "ratio_vs_B": r, "planned_peak_bytes": r * 1e9} for p, r in
            {"B": 1.0, **ratios}.items()]
    records = {"fig10_planned_memory": pd.DataFrame(rows).assign(
        batch=16, image_size=512, width=1.0, stem="imagenet", planner="CalcGraph plan")}
    if error is not None:
        records["fig10_plan_check"] = pd.DataFrame(
            [{"model": model, "pipeline": p, "ratio_error": 0.0 if p == "B" else error, "batch": 16,
              "image_size": 16, "stem": "cifar"} for p in {"B": 1.0, **ratios}])
    return records


@pytest.mark.parametrize("ratio, error, verdict", [
    (0.52, 0.0, "reproduced"), (0.52, 0.03, "reproduced"), (0.4, 0.0, "better than claimed"),
    (0.42, -0.1, "inconclusive"), (0.8, 0.0, "partly"), (0.9, 0.0, "not reproduced"), (0.9, None, "not reproduced")])
def test_fig10_rows_read_the_plan_at_the_papers_size(ratio, error, verdict):
    records = {**_fig10(M_P=1.45), **_planned({"M-P": ratio}, error=error)}  # the toy run's 1.45 is not read
    row = _row("M-P halves ResNet-50 memory", records)
    assert row["verdict"] == verdict and row["measured"] == ratio
    assert "512x512" in row["scale"] and "planned" in row["scale"]
    assert ("not checked" in row["scale"]) == (error is None)
    if error:
        assert row["spread"] == pytest.approx(tuple(sorted((ratio, ratio / (1 + error)))))


def test_fig10_planned_without_the_pipeline_is_not_judged():
    row = _row("ResNet-50 with S-C and M-P", _planned({"M-P": 0.5}))
    assert row["verdict"] == "not run at this scale" and row["scale"] == "pipeline not planned"


def test_fig10_best_model_reads_the_lowest_plan():
    records = _planned({"E-D+S-C": 0.3})
    other = _planned({"E-D+S-C": 0.09}, model="resnet18")
    for key in records:
        records[key] = pd.concat([records[key], other[key]], ignore_index=True)
    row = _row("E-D+S-C uses up to 10x less memory", records)
    assert row["verdict"] == "reproduced" and row["measured"] == 0.09 and "resnet18" in row["scale"]


def _fig8_planned(paper_ratio: float, here_error: float) -> dict:
    rows = [{"size": size, "variant": v, "batch": 16, "image_size": px, "planned_ratio": r,
             "ratio_error": 0.0 if v == "B" else e}
            for size, px, r, e in (("paper", 512, paper_ratio, None), ("here", 64, 0.45, here_error))
            for v in ("B", "S-C optimal")]
    df = pd.DataFrame(rows)
    df.loc[df.variant == "B", "planned_ratio"] = 1.0
    return {"fig8_planned": df.assign(model="resnet18", width=1.0, stem="imagenet", planner="CalcGraph plan",
                                      candidates=1, profiled_at="16 images 64x64")}


@pytest.mark.parametrize("ratio, error, verdict", [
    (0.29, 0.0, "reproduced"), (0.25, 0.0, "better than claimed"), (0.45, 0.0, "partly"),
    (0.6, -0.19, "not reproduced"), (0.31, -0.19, "inconclusive")])
def test_fig8_reads_the_plan_at_the_papers_size(ratio, error, verdict):
    row = _row("S-C cuts ResNet-18 memory", {**_sc(opt_ratio=0.2), **_fig8_planned(ratio, error)})
    assert row["verdict"] == verdict and row["measured"] == ratio and "512x512" in row["scale"]


def test_fig8_without_a_plan_reads_the_run():
    row = _row("S-C cuts ResNet-18 memory", _sc(opt_ratio=0.3))
    assert row["verdict"] == "reproduced" and row["measured"] == 0.3 and "64x64" in row["scale"]


def _seeds(b: list[float], mp: list[float]) -> dict:
    rows = [{"seed": s, "pipeline": p, "test_acc": a} for p, accs in (("B", b), ("M-P", mp))
            for s, a in enumerate(accs)]
    return {**_fig9(acc={"M-P": mp[0], "B": b[0]}), "fig9_seeds": pd.DataFrame(rows)}


@pytest.mark.parametrize("b, mp, verdict, measured, spread", [
    ([0.90, 0.91, 0.92], [0.905, 0.912, 0.921], "reproduced", 0.002, (0.001, 0.005)),
    ([0.90, 0.91, 0.92], [0.92, 0.93, 0.94], "partly", 0.02, (0.02, 0.02)),
    ([0.90, 0.91, 0.92], [0.85, 0.86, 0.87], "not reproduced", 0.05, (0.05, 0.05)),
    ([0.28, 0.30, 0.25], [0.208, 0.35, 0.27], "inconclusive", 0.02, (0.0, 0.072))])
def test_mixed_precision_accuracy_carries_its_seed_noise(b, mp, verdict, measured, spread):
    row = _row("M-P keeps the baseline's accuracy", _seeds(b, mp))
    assert row["verdict"] == verdict and row["measured"] == pytest.approx(measured)
    assert row["spread"] == pytest.approx(spread) and "3 seeds" in row["scale"]


def test_mixed_precision_accuracy_with_one_seed_has_no_spread():
    records = _seeds([0.28], [0.208])
    row = _row("M-P keeps the baseline's accuracy", records)
    assert row["verdict"] == "not reproduced" and row["spread"] is None
