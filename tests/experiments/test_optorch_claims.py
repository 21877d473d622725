"""The OpTorch claims (workbench/experiments/optorch/claims.py) on hand-made records: one case per verdict each
rule can give, at its boundaries; the GPU time claims on a CPU; records that are absent; toy scales; and the
ledger of records the experiment functions really produce, judged again from results.json."""

from __future__ import annotations

import json

import pandas as pd
import pytest
import torch

import workbench.experiments.optorch as optorch
from workbench.data import ImageSet
from workbench.experiments.optorch import claims
from workbench.report import CHECK, save_results

from claim_rows import claim_row, claim_text

TEXTS = [c.text for c in claims.CLAIMS]


def _text(prefix: str) -> str:
    return claim_text(claims, prefix)


def _row(prefix: str, records: dict, device_class: str = "cpu", verdicts: bool = True) -> dict:
    return claim_row(claims, prefix, records, device_class=device_class, verdicts=verdicts)


def _verdict(prefix: str, records: dict, device_class: str = "cpu") -> str:
    return _row(prefix, records, device_class)["verdict"]


# ---------------------------------------------------------------------------------------------
# Hand-made records: only the columns the claims read

_SC_SCALE = {"model": "resnet18", "width": 1.0, "stem": "cifar", "batch": 16, "image_size": 64}


def _sc(opt_ratio=0.3, opt_time=(1.2, 1.1, 1.3), uniform_time=(1.16, 1.1, 1.2), blocks_ratio=0.35,
        errors=(0.0, 0.05, 0.05, 0.02)) -> dict:
    rows = []
    times = {"B": (1.0, 1.0, 1.0), "S-C uniform": uniform_time, "S-C optimal, block boundaries": (1.3, 1.2, 1.4),
             "S-C optimal": opt_time}
    peaks = {"B": 1.0, "S-C uniform": 0.5, "S-C optimal, block boundaries": blocks_ratio, "S-C optimal": opt_ratio}
    for (variant, (t, lo, hi)), error in zip(times.items(), errors, strict=True):
        rows.append({"variant": variant, "peak_bytes": peaks[variant] * 1000, "peak_ratio": peaks[variant],
                     "time_ratio": t, "time_ratio_lo": lo, "time_ratio_hi": hi, "prediction_error": error,
                     **_SC_SCALE})
    return {"sc_summary": pd.DataFrame(rows)}


def _fig10(**ratios: float) -> dict:
    """Pipeline ratios for ResNet-50 (names with '_' for '-' and '__' for '+': E_D__S_C is E-D+S-C)."""
    rows = [{"model": "resnet50", "pipeline": "B", "ratio_vs_B": 1.0}]
    rows += [{"model": "resnet50", "pipeline": k.replace("__", "+").replace("_", "-"), "ratio_vs_B": v}
             for k, v in ratios.items()]
    return {"fig10_pipeline_memory": pd.DataFrame(rows).assign(batch=16, image_size=16, width=1.0, stem="cifar")}


def _fig9(acc=None, time=None, fastest=None) -> dict:
    names = ["B", "E-D", "M-P", "S-C", "E-D+S-C", "M-P+S-C", "E-D+M-P+S-C"]
    acc, time, fastest = acc or {}, time or {}, fastest or {}
    rows = [{"pipeline": p, "test_acc": acc.get(p, 0.9), "time_ratio_vs_B": time.get(p, 1.0),
             "min_step_ratio_vs_B": fastest.get(p, time.get(p, 1.0)), "model": "resnet18", "width": 0.25,
             "dataset": "digits", "image_shape": "1x8x8", "train_images": 1437, "test_images": 359, "epoch": 3,
             "batch_size": 16, "augment": True, "threads": 2, "cores": 2} for p in names]
    return {"fig9_summary": pd.DataFrame(rows)}


def _capacity(exact_up_to: dict[str, int], tried: int = 32) -> dict:
    rows = [{"scheme": s, "per_element": k, "exact": k <= top} for s, top in exact_up_to.items()
            for k in range(1, tried + 1)]
    return {"encoding_capacity": pd.DataFrame(rows)}


def _bytes(saving: float) -> dict:
    forms = {"float32 normalised (B)": 1.0, "uint8": 4.0, "float64": 1.0, "float64-7bit": 1.0, "int64": saving}
    return {"encoded_bytes": pd.DataFrame([{"form": f, "saving_vs_float32": s, "size_vs_uint8": 4.0 / s}
                                           for f, s in forms.items()]).assign(images=16, image_shape="3x32x32")}


def _fig11(peaks: list[float], smallest: int) -> dict:
    """Measured peaks of boundaries 0 (none), 1, 2, ...; `smallest` is the bottleneck's boundary."""
    return {"fig11_checkpoint_position": pd.DataFrame({
        "boundary": range(len(peaks)), "measured_peak_bytes": peaks,
        "is_smallest": [b == smallest for b in range(len(peaks))], "prediction_error": 0.0,
        "batch": 2048, "widths": "256,128,64,8,64,128,256,256"})}


_PARETO = {"model": "resnet18", "width": 1.0, "batch": 16, "image_size": 16}


def _versus(*rows: tuple[bool, float, float, float, float]) -> dict:
    """(differ, predicted recompute ratio, time ratio, lo, hi) per budget, beside a planner front."""
    versus = pd.DataFrame(rows, columns=["differ", "predicted_recompute_ratio", "time_ratio", "time_ratio_lo",
                                         "time_ratio_hi"]).assign(budget_bytes=range(len(rows)))
    pareto = pd.DataFrame([{**_PARETO, "prediction_error": 0.01}])
    return {"planner_optimal_vs_uniform": versus, "planner_pareto": pareto}


def _peer(retained: float, time: tuple[float, float, float]) -> dict:
    comparison = pd.DataFrame([{"fraction": 0.5, "retained_ratio": retained, "time_ratio": time[0],
                                "time_ratio_lo": time[1], "time_ratio_hi": time[2]}])
    return {"peer_comparison": comparison, "peer": pd.DataFrame([{"scale": "autoencoder (8, 4, 8), batch 16"}])}


def _shares(worst_share_error: float, batch: int = 16, batches: int = 50) -> dict:
    df = pd.DataFrame({"asked_share": [0.5, 0.5], "abs_error": [worst_share_error, 0.0]})
    return {"selective_shares": df.assign(batch_size=batch, num_batches=batches)}


# ---------------------------------------------------------------------------------------------
# Fig 8 and the S-C targets

FIG8 = "S-C cuts ResNet-18 memory"


@pytest.mark.parametrize("ratio, verdict", [
    (2000 / 7000, "reproduced"), (0.314, "reproduced"), (0.258, "reproduced"), (0.25, "better than claimed"),
    (0.47, "partly"), (0.48, "not reproduced")])
def test_fig8_peak_ratio_is_two_sided(ratio, verdict):
    assert _verdict(FIG8, _sc(opt_ratio=ratio)) == verdict


def test_sc_time_is_a_gpu_claim_judged_only_on_a_gpu():
    text = "S-C takes more time than the baseline"
    cpu = _row(text, _sc(uniform_time=(3.0, 2.9, 3.1)))
    assert cpu["verdict"] == "other device" and cpu["measured"] == 3.0 and cpu["spread"] == (2.9, 3.1)
    for (t, lo, hi), verdict in [((1.158, 1.1, 1.2), "reproduced"), ((1.27, 1.27, 1.27), "reproduced"),
                                 ((1.0, 0.99, 1.01), "better than claimed"), ((1.6, 1.6, 1.6), "partly"),
                                 ((1.92, 1.92, 1.92), "not reproduced"), ((1.158, 1.0, 1.3), "inconclusive")]:
        assert _verdict(text, _sc(uniform_time=(t, lo, hi)), "gpu") == verdict, (t, lo, hi)
    assert _verdict(text, {}, "gpu") == "not run at this scale"


@pytest.mark.parametrize("ratio, verdict", [(0.35, "reproduced"), (0.5, "partly"), (0.51, "not reproduced")])
def test_sc_peak_target(ratio, verdict):
    row = _row("S-C activation peak <= 0.35x", _sc(opt_ratio=ratio))
    assert row["verdict"] == verdict and row["source"] == "target" and "ours" in row["paper"]


@pytest.mark.parametrize("time, verdict", [
    ((1.4, 1.3, 1.4), "reproduced"), ((1.6, 1.5, 1.6), "partly"), ((1.7, 1.65, 1.75), "not reproduced"),
    ((1.35, 1.3, 1.45), "inconclusive")])
def test_sc_time_target_is_judged_on_this_machine(time, verdict):
    assert _verdict("... at <= 1.4x the baseline's step time", _sc(opt_time=time)) == verdict


@pytest.mark.parametrize("opt, blocks, verdict", [(0.3, 0.3, "reproduced"), (0.3, 0.29, "not reproduced")])
def test_units_inside_blocks_target(opt, blocks, verdict):
    assert _verdict("Units inside residual blocks", _sc(opt_ratio=opt, blocks_ratio=blocks)) == verdict


@pytest.mark.parametrize("errors, under, worst", [
    ((0.0, 0.0, 0.0, 0.1), "reproduced", "reproduced"), ((0.0, -0.05, 0.0, 0.15), "partly", "partly"),
    ((0.0, -0.06, 0.0, 0.25), "not reproduced", "not reproduced")])
def test_prediction_targets(errors, under, worst):
    records = _sc(errors=errors)
    assert _verdict("Planner never under-predicts", records) == under
    assert _verdict("Planner predicts every plan's peak within 10%", records) == worst
    assert _verdict("Planner never under-predicts", {}) == "not run at this scale"


# ---------------------------------------------------------------------------------------------
# Fig 10


@pytest.mark.parametrize("ratio, verdict", [(0.5, "reproduced"), (0.6, "partly"), (0.61, "not reproduced")])
def test_sc_halves_resnet50_memory_bound(ratio, verdict):
    assert _verdict("S-C reduces ResNet-50 memory by more than 50%", _fig10(S_C=ratio)) == verdict


@pytest.mark.parametrize("prefix, key, paper", [
    ("ResNet-50 with S-C: 0.8 GB", "S_C", 0.4), ("M-P halves ResNet-50 memory", "M_P", 0.5),
    ("ResNet-50 with S-C and M-P", "M_P__S_C", 0.2)])
def test_fig10_text_values_are_two_sided(prefix, key, paper):
    hi = paper * 1.15
    for ratio, verdict in [(paper, "reproduced"), (hi, "reproduced"), (paper * 0.8, "better than claimed"),
                           (hi * 1.5, "partly"), (hi * 1.51, "not reproduced")]:
        assert _verdict(prefix, _fig10(**{key: ratio})) == verdict, (prefix, ratio)
    assert _verdict(prefix, _fig10(E_D=1.0)) == "not run at this scale"  # the pipeline was not measured


@pytest.mark.parametrize("ratio, verdict", [
    (0.1, "reproduced"), (0.12, "reproduced"), (0.05, "better than claimed"), (0.24, "partly"),
    (0.41, "not reproduced")])
def test_ed_sc_ten_times_less_memory_best_model(ratio, verdict):
    records = _fig10(E_D__S_C=ratio)
    worse = pd.DataFrame([{"model": "resnet18", "pipeline": "E-D+S-C", "ratio_vs_B": 0.9}])
    records["fig10_pipeline_memory"] = pd.concat([records["fig10_pipeline_memory"], worse], ignore_index=True)
    row = _row("E-D+S-C uses up to 10x less memory", records)
    assert row["verdict"] == verdict and row["measured"] == ratio and "resnet50" in row["scale"]


@pytest.mark.parametrize("ratio, verdict", [(0.95, "reproduced"), (0.99, "partly"), (1.0, "not reproduced")])
def test_ed_lowers_peak(ratio, verdict):
    assert _verdict("E-D lowers the peak memory", _fig10(E_D=ratio)) == verdict


@pytest.mark.parametrize("ratio, verdict", [
    (0.5, "reproduced"), (0.6, "reproduced"), (0.39, "better than claimed"), (0.89, "partly"),
    (0.91, "not reproduced")])
def test_about_fifty_percent(ratio, verdict):
    assert _verdict("OpTorch reduces memory to approximately 50%", _fig10(E_D__S_C=ratio)) == verdict


# ---------------------------------------------------------------------------------------------
# Encoding: the float64 trap stays a measured row that can fail


@pytest.mark.parametrize("saving, verdict", [
    (16, "reproduced"), (14.4, "reproduced"), (18, "better than claimed"), (10.8, "partly"),
    (10, "not reproduced"), (4, "refuted")])
def test_sixteen_x_memory_saving(saving, verdict):
    assert _verdict("E-D saves up to 16x memory", _bytes(saving)) == verdict


def test_int64_size_is_a_check():
    row = _row("int64 packing is exactly the size", _bytes(4.0))
    assert row["verdict"] == CHECK and row["measured"] == 1.0 and row["source"] == "check"


@pytest.mark.parametrize("prefix, scheme, claimed", [
    ("Algorithm 1 encodes 16", "float64", 16), ("Algorithm 4 encodes 32", "float64-7bit", 32)])
def test_capacity_claims_are_measured_and_refuted_below_the_claim(prefix, scheme, claimed):
    assert _verdict(prefix, _capacity({scheme: claimed}, tried=40)) == "reproduced"
    assert _verdict(prefix, _capacity({scheme: claimed + 1}, tried=40)) == "better than claimed"
    assert _verdict(prefix, _capacity({scheme: claimed - 1}, tried=40)) == "refuted"
    row = _row(prefix, _capacity({scheme: 6}, tried=17))  # the study saw it break before the claim
    assert row["verdict"] == "refuted" and row["measured"] == 6
    # a study too small to reach the claim that never saw the scheme fail cannot tell
    assert _verdict(prefix, _capacity({scheme: 8}, tried=8)) == "not run at this scale"


# ---------------------------------------------------------------------------------------------
# Fig 9: accuracy (any device) and time (made on a P100: judged only on a GPU)


def test_same_accuracy_rows_are_checks():
    for prefix in ("S-C reaches the same accuracy", "E-D+S-C: same accuracy"):
        row = _row(prefix, _fig9(acc={"S-C": 0.9, "E-D+S-C": 0.9}))
        assert row["verdict"] == CHECK and row["measured"] == 0.0


@pytest.mark.parametrize("acc, verdict", [
    (0.91 - 1e-9, "reproduced"), (0.93 - 1e-9, "partly"), (0.94, "not reproduced")])
def test_mixed_precision_accuracy(acc, verdict):
    row = _row("M-P keeps the baseline's accuracy", _fig9(acc={"M-P": acc}))
    assert row["verdict"] == verdict and row["measured"] == pytest.approx(acc - 0.9)


@pytest.mark.parametrize("prefix, pipeline, cases", [
    ("E-D reduces training time by at least 20%", "E-D",
     [(0.8, "reproduced"), (0.95, "partly"), (1.0, "not reproduced"), (1.06, "refuted")]),
    ("E-D+S-C: in less time than the baseline", "E-D+S-C",
     [(1.0, "reproduced"), (1.1, "partly"), (1.2, "not reproduced"), (1.3, "refuted")]),
    ("Mixed precision makes training run faster", "M-P",
     [(0.5, "reproduced"), (1.1, "partly"), (1.2, "not reproduced"), (1.3, "refuted")]),
])
def test_fig9_time_claims(prefix, pipeline, cases):
    for ratio, verdict in cases:
        assert _verdict(prefix, _fig9(time={pipeline: ratio}), "gpu") == verdict, ratio
        cpu = _row(prefix, _fig9(time={pipeline: ratio}))
        assert cpu["verdict"] == "other device" and cpu["measured"] == ratio
    # the two estimators (median steps, fastest step) disagree across the bound
    assert _verdict(prefix, _fig9(time={pipeline: 0.9}, fastest={pipeline: 1.05}), "gpu") == "inconclusive"
    assert _verdict(prefix, {}, "gpu") == "not run at this scale"


def test_mixed_precision_with_ed_sc_against_ed_sc():
    prefix = "M-P with E-D and S-C takes even less time"
    row = _row(prefix, _fig9(time={"E-D+S-C": 2.0, "E-D+M-P+S-C": 1.0}), "gpu")
    assert row["verdict"] == "reproduced" and row["measured"] == 0.5
    assert _verdict(prefix, _fig9(time={"E-D+S-C": 1.0, "E-D+M-P+S-C": 1.3}), "gpu") == "refuted"
    assert _verdict(prefix, _fig9(time={"E-D+S-C": 1.0, "E-D+M-P+S-C": 1.3})) == "other device"
    missing = _fig9()
    missing["fig9_summary"] = missing["fig9_summary"][missing["fig9_summary"].pipeline != "E-D+M-P+S-C"]
    assert _verdict(prefix, missing, "gpu") == "not run at this scale"


def test_claims_not_run_say_why():
    ledger = claims.ledger({}, {}, device="cpu", device_class="cpu", verdicts=True)
    not_run = [r for r in ledger.rows if r["verdict"] == "not run"]
    assert {r["claim"][:20] for r in not_run} == {"ResNet-50 reaches 93", "EfficientNet-B0..B7 ",
                                                  "Same accuracy as exi"}
    assert all(r["rule"] for r in not_run)


# ---------------------------------------------------------------------------------------------
# Fig 11, the planners, the peer, SBS


@pytest.mark.parametrize("peaks, verdict, rank", [
    ([10, 6, 5, 4, 5], "reproduced", 1), ([10, 6, 4, 5, 7], "partly", 2), ([10, 4, 5, 7, 6], "not reproduced", 4)])
def test_smallest_layer_checkpoint(peaks, verdict, rank):
    row = _row("The best single checkpoint sits at the smallest layer", _fig11(peaks, smallest=3))
    assert row["verdict"] == verdict and row["measured"] == rank


@pytest.mark.parametrize("rows, verdict", [
    ([(True, 0.8, 1.0, 0.95, 1.0)], "reproduced"), ([(True, 0.8, 1.1, 1.05, 1.1)], "partly"),
    ([(True, 0.8, 1.2, 1.15, 1.2)], "not reproduced"), ([(True, 0.8, 0.98, 0.9, 1.05)], "inconclusive"),
    ([(False, 1.0, 1.0, 1.0, 1.0)], "not run at this scale")])
def test_optimal_against_uniform_measured(rows, verdict):
    assert _verdict("optimal plan no slower than uniform where their plans differ", _versus(*rows)) == verdict


def test_optimal_against_uniform_predicted_is_a_check():
    row = _row("optimal plan no slower than uniform at the same budget", _versus((True, 0.5, 1, 1, 1),
                                                                                (False, 1.0, 1, 1, 1)))
    assert row["verdict"] == CHECK and row["measured"] == 1.0


@pytest.mark.parametrize("retained, time, verdicts", [
    (1.0, (1.0, 0.9, 1.0), ("reproduced", "reproduced")), (1.25, (1.25, 1.2, 1.25), ("partly", "partly")),
    (1.3, (1.3, 1.26, 1.3), ("not reproduced", "not reproduced")),
    (0.5, (1.1, 0.9, 1.2), ("reproduced", "inconclusive"))])
def test_peer_targets(retained, time, verdicts):
    records = _peer(retained, time)
    assert _verdict("Our planner retains no more than torch's", records) == verdicts[0]
    assert _verdict("... and steps no slower than torch's compiled step", records) == verdicts[1]


def test_peer_not_run():
    row = _row("Our planner retains no more than torch's", {"peer": pd.DataFrame()})
    assert row["verdict"] == "not run at this scale" and "peer not run" in row["scale"]


def test_selective_batch_sampling_shares_is_a_check():
    row = _row("SBS: each class gets its weight's share", _shares(1 / 800))
    assert row["verdict"] == CHECK and row["source"] == "check" and row["measured"] == pytest.approx(1.0)


def test_toy_scale_gives_no_verdicts():
    records = {**_sc(), **_fig10(S_C=0.4), **_fig9(), **_bytes(4.0), **_capacity({"float64": 6})}
    ledger = claims.ledger(records, {}, device="cpu", device_class="gpu", verdicts=False)
    paper = {r["verdict"] for r in ledger.rows if r["source"] != "check"}
    assert paper <= {"not run at this scale", "not run"}


# ---------------------------------------------------------------------------------------------
# The records the experiment functions really produce


def _real_records() -> dict:
    tiny = {"width": 4 / 64, "image_size": 8, "batch": 2}
    summary, trace, _ = optorch.experiment_sc_resnet(repeats=1, **tiny)
    g = torch.Generator().manual_seed(0)
    data = ImageSet(torch.randint(0, 256, (40, 1, 8, 8), dtype=torch.uint8, generator=g), torch.arange(40) % 10,
                    10, "tiny")
    train, test = data.split(0.25, seed=0)
    fig9 = optorch.experiment_time_accuracy(train, test, width=4 / 64, epochs=1, batch_size=10, progress=False)
    fig10 = optorch.experiment_pipeline_memory(("resnet18",), progress=False, **tiny)
    fig11 = optorch.experiment_checkpoint_position(widths=(16, 8, 2, 8, 16), batch=8)
    pareto = optorch.experiment_planner_pareto(budgets=2, repeats=1, progress=False, **tiny)
    capacity = optorch.experiment_capacity(8, image_size=2)
    batches, shares = optorch.experiment_sbs(train, [0.1] * 10, batch_size=10, num_batches=3)
    peer = pd.DataFrame()
    return {"sc_summary": summary.assign(kept=summary.kept.astype(str)), "fig8_trace": trace,
            "fig9_time_accuracy": fig9, "fig9_summary": optorch.time_accuracy_summary(fig9),
            "fig10_pipeline_memory": fig10, "fig11_checkpoint_position": fig11,
            "planner_pareto": pareto.assign(plan=pareto.plan.astype(str)),
            "planner_optimal_vs_uniform": optorch.optimal_vs_uniform(pareto), "peer": peer,
            "peer_comparison": optorch.peer_comparison(peer), "encoding_capacity": capacity,
            "encoded_bytes": optorch.experiment_encoded_bytes(16, image_size=4), "selective_batches": batches,
            "selective_shares": shares}


def test_real_records_give_a_row_for_every_claim_and_judge_the_same_from_results_json(one_thread, tmp_path):
    records = _real_records()
    ledger = claims.ledger(records, {}, device="cpu", device_class="cpu", verdicts=True)
    assert [r["claim"] for r in ledger.rows] == TEXTS
    by_text = {r["claim"]: r for r in ledger.rows}
    assert by_text[_text("Algorithm 1 encodes 16")]["verdict"] == "refuted"  # 6 exact, seen breaking at 7
    assert by_text[_text("E-D saves up to 16x")]["verdict"] == "refuted" and by_text[_text("E-D saves")][
        "measured"] == 4.0
    assert by_text[_text("S-C takes more time")]["verdict"] == "other device"
    assert by_text[_text("SBS through encoding")]["measured"] == 0.0
    # results.json alone judges the same ledger
    path = save_results("optorch", output_dir=tmp_path, parameters={}, records=records, ledger=ledger, device="cpu")
    saved = json.loads(path.read_text())
    again = claims.ledger({k: pd.DataFrame(v) for k, v in saved["records"].items()}, saved["parameters"],
                          device="cpu", device_class="cpu", verdicts=True)
    assert [(r["verdict"], r["scale"]) for r in again.rows] == [(r["verdict"], r["scale"]) for r in ledger.rows]
    for new, old in zip(again.rows, ledger.rows, strict=True):
        if isinstance(old["measured"], float):
            assert new["measured"] == pytest.approx(old["measured"], nan_ok=True), old["claim"]


def test_every_claim_is_data_with_a_definition():
    for claim in claims.CLAIMS:
        if claim.source != "check" and not claim.not_run:
            assert claim.definition, claim.text
    gpu = {c.text for c in claims.CLAIMS if c.made_on == "gpu"}
    assert gpu == {_text("S-C takes more time"), _text("E-D reduces training time"), _text("E-D+S-C: in less time"),
                   _text("M-P with E-D and S-C"), _text("Mixed precision makes training run faster")}
