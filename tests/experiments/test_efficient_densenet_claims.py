"""The efficient DenseNet claims (workbench/experiments/efficient_densenet/claims.py) on hand-made records:
one case per verdict each rule can give, at the boundaries; GPU claims on a CPU; host-bound GPU timings;
records that are absent; and the ledger of records the experiment functions really produce, re-judged from
results.json."""

from __future__ import annotations

import json
import math

import pandas as pd
import pytest

import workbench.experiments.efficient_densenet as bench
from workbench.experiments.efficient_densenet import claims
from workbench.report import CHECK, save_results
from workbench.timing import HOST_BOUND

from claim_rows import claim_row, claim_text

TEXTS = [c.text for c in claims.CLAIMS]


def _text(prefix: str) -> str:
    return claim_text(claims, prefix)


def _verdict(prefix: str, records: dict, device_class: str = "gpu", verdicts: bool = True) -> dict:
    return claim_row(claims, prefix, records, device_class=device_class, verdicts=verdicts)


# ---------------------------------------------------------------------------------------------
# Hand-made records: only the columns the claims read


def _memory(peaks: dict[tuple[str, int], float], params: int = 1000) -> pd.DataFrame:
    return pd.DataFrame([{"form": f, "depth": d, "activation_peak_bytes": b, "total_bytes": b + 8 * params,
                          "params": params, "growth_rate": 12, "batch_size": 2, "image_size": 32}
                         for (f, d), b in peaks.items()])


def _fits(**exponents: float) -> dict:
    fits = pd.DataFrame([{"form": f, "local_exponent": e} for f, e in exponents.items()])
    return {"fits": fits, "memory": _memory({("naive", 16): 1.0, ("naive", 40): 2.0})}


def _budget(ratio: float, capped: bool, *, params_ratio: float = 6.0, depth: int = claims.NAIVE_BEST_DEPTH,
            value: str = bench.STEP_BYTES) -> dict:
    """Budget records at the naive step at `depth` (parameters included unless `value` says otherwise): shared
    (max buffer) `ratio` times as deep, `params_ratio` times the parameters of the deepest naive model."""
    base = {"budget_depth": depth, "budget_bytes": 2**20, "value": value, "step_batch_size": 64}
    budget = pd.DataFrame([
        {**base, "form": "luatorch", "depth_ratio": 1.0, "limited_by_sweep": False, "deepest_depth": depth,
         "params_at_deepest": 1000},
        {**base, "form": "shared_max", "depth_ratio": ratio, "limited_by_sweep": capped,
         "deepest_depth": int(depth * ratio), "params_at_deepest": int(1000 * params_ratio)}])
    return {"budget": budget, "memory": _memory({("luatorch", depth): 2.0**20})}


def _at_scale(form: str, depth: float, params: float, capped: bool = False) -> dict:
    row = {"form": form, "deepest_depth": depth, "params": params, "capped": capped, "batch_size": 64,
           "budget_bytes": 12 * 2**30}
    return {"at_scale": pd.DataFrame([row]), "memory": _memory({("naive", 16): 1.0})}


def _counts(*rows: tuple[int, int, int]) -> dict:
    return {"param_counts": pd.DataFrame([{"depth": d, "growth_rate": k, "params": p, "network": "CIFAR",
                                           "block_config": [1, 2, 3]} for d, k, p in rows])}


def _timing(form: str, ratio: float, lo: float, hi: float, to: str = "naive", kernel_share: float = 0.9,
            device: str = "cuda") -> dict:
    """Timing records of `form` and `to`: each step 0.1 s, its kernels `kernel_share` of that (on `device`)."""
    common = {"depth": 100, "growth_rate": 12, "batch_size": 16, "image_size": 32, "rounds": 5, "median_s": 0.1,
              "kernel_s": 0.1 * kernel_share, "device": device}
    row = {"form": form, f"ratio_to_{to}": ratio, f"ratio_to_{to}_min": lo, f"ratio_to_{to}_max": hi, **common}
    return {"timing": pd.DataFrame([row, {"form": to, f"ratio_to_{to}": 1.0, f"ratio_to_{to}_min": 1.0,
                                          f"ratio_to_{to}_max": 1.0, **common}])}


def _bn(share: float, lo: float, hi: float, forward_kernel_share: float = 0.9, device: str = "cuda") -> dict:
    row = {"variant": "with BN", "bn_forward_share": share, "bn_forward_share_min": lo,
           "bn_forward_share_max": hi, "bn_share": 2 * share, "depth": 100, "growth_rate": 12, "batch_size": 16,
           "image_size": 32, "rounds": 5, "median_s": 0.1, "kernel_s": 0.09, "forward_median_s": 0.04,
           "forward_kernel_s": 0.04 * forward_kernel_share, "device": device}
    return {"bn_share": pd.DataFrame([row])}


def _conv(ratio: float, rounds: list[float], kernel_share: float = 0.9) -> dict:
    base = {"in_channels": 48, "out_channels": 12, "batch_size": 16, "image_size": 32, "median_s": 1e-3,
            "kernel_s": 1e-3 * kernel_share, "device": "cuda"}
    return {"conv": pd.DataFrame([
        {**base, "layout": "contiguous", "ratio_to_contiguous": 1.0, "round_ratios": [1.0] * len(rounds)},
        {**base, "layout": "non-contiguous", "ratio_to_contiguous": ratio, "round_ratios": rounds}])}


# ---------------------------------------------------------------------------------------------
# One case per verdict, per rule


@pytest.mark.parametrize("prefix, form, target", [("Naive DenseNet (LuaTorch", "luatorch", 2.0),
                                                  ("Naive DenseNet in PyTorch", "naive", 2.0),
                                                  ("Shared storage (one max-size", "shared_max", 1.0),
                                                  ("shared storage, resized", "shared", 1.0),
                                                  ("checkpoint (torch.utils.checkpoint): feature", "checkpoint", 1.0)])
@pytest.mark.parametrize("factor, verdict", [(1.0, "reproduced"), (1.1, "reproduced"), (0.9, "reproduced"),
                                             (1.35, "partly"), (0.7, "partly"), (1.4, "not reproduced"),
                                             (0.6, "not reproduced")])
def test_growth_exponents(prefix, form, target, factor, verdict) -> None:
    row = _verdict(prefix, _fits(**{form: target * factor}))
    assert row["verdict"] == verdict and row["measured"] == pytest.approx(target * factor)


def test_growth_exponent_absent_or_unfitted() -> None:
    assert _verdict("Naive DenseNet (LuaTorch", {})["verdict"] == "not run at this scale"
    assert _verdict("Naive DenseNet (LuaTorch", _fits(luatorch=math.nan))["verdict"] == "not run at this scale"


@pytest.mark.parametrize("ratio, verdict", [(10, "reproduced"), (8.5, "reproduced"), (11.5, "reproduced"),
                                            (13.16, "partly"), (6.0, "partly"), (16, "not reproduced"),
                                            (5.0, "not reproduced")])
def test_ten_times_the_memory(ratio, verdict) -> None:
    records = {"memory": _memory({("luatorch", 40): 1e6, ("luatorch", 160): ratio * 1e6})}
    row = _verdict("Naive (LuaTorch-style): 160", records)
    assert row["verdict"] == verdict and row["measured"] == pytest.approx(ratio)
    assert _verdict("Naive (LuaTorch-style): 160", {"memory": _memory({("luatorch", 40): 1e6})})["verdict"] == (
        "not run at this scale")


@pytest.mark.parametrize("fraction, verdict", [(0.22, "reproduced"), (0.19, "reproduced"), (0.25, "reproduced"),
                                               (0.15, "better than claimed"), (0.30, "partly"),
                                               (0.40, "not reproduced")])
def test_shared_storage_uses_22_percent(fraction, verdict) -> None:
    records = {"memory": _memory({("luatorch", 160): 1e8, ("shared_max", 160): fraction * 1e8,
                                  ("shared", 160): 0.9 * fraction * 1e8, ("naive", 160): 0.8e8})}
    row = _verdict("The 160-layer model with shared storage", records)
    assert row["verdict"] == verdict and row["measured"] == pytest.approx(fraction)
    assert row["unit"].startswith("fraction")  # shown as a percentage, like the paper's 22%


@pytest.mark.parametrize("ratio, verdict", [(0.9, "reproduced"), (1.0, "reproduced"), (1.01, "not reproduced")])
def test_per_block_buffers_target(ratio, verdict) -> None:
    records = {"memory": _memory({("shared_max", 160): 1e8, ("shared", 160): ratio * 1e8})}
    row = _verdict("Resizing the shared buffers", records)
    assert row["verdict"] == verdict and row["source"] == "target"


# at_least(2.5, partly=2.0): 340 layers is a model that fits, not the deepest, so the claim is a lower bound and a
# deeper result is the claim shown, never "better than claimed"; a row capped by the sweep (a lower bound itself)
# reads "reproduced" once the bound reaches 2.5, "inconclusive" below (issue 44)
@pytest.mark.parametrize("ratio, capped, verdict", [(2.5, False, "reproduced"), (3.1, False, "reproduced"),
                                                    (2.94, True, "reproduced"), (2.5, True, "reproduced"),
                                                    (2.2, True, "inconclusive"), (2.0, False, "partly"),
                                                    (1.99, False, "not reproduced"), (1.5, True, "inconclusive")])
def test_same_budget_depth_ratio(ratio, capped, verdict) -> None:
    row = _verdict("Same memory budget", _budget(ratio, capped))
    assert row["verdict"] == verdict
    assert ("+ (the sweep ends there: a lower bound)" in row["scale"]) == capped
    assert "weights + grads + momentum" in row["scale"] and "batch 64" in row["scale"]
    assert _verdict("Same memory budget", {"budget": pd.DataFrame()})["verdict"] == "not run at this scale"


@pytest.mark.parametrize("params_ratio, capped, verdict", [(6.0, False, "reproduced"), (7.2, True, "reproduced"),
                                                           (5.5, True, "inconclusive"), (4.8, False, "partly"),
                                                           (4.79, False, "not reproduced")])
def test_six_times_the_parameters_in_the_same_budget(params_ratio, capped, verdict) -> None:
    row = _verdict("... and has 6x as many parameters", _budget(2.5, capped, params_ratio=params_ratio))
    assert row["verdict"] == verdict and row["measured"] == pytest.approx(params_ratio)


def test_a_budget_without_parameters_is_not_the_papers() -> None:
    """A budget of feature maps alone (the old reading) leaves out what a deep model's parameters cost."""
    for prefix in ("Same memory budget", "... and has 6x as many parameters"):
        row = _verdict(prefix, _budget(3.0, False, value="activation_peak_bytes"))
        assert row["verdict"] == "not run at this scale" and "parameters left out" in row["scale"]


def test_with_state_adds_parameters_at_the_papers_batch() -> None:
    memory = _memory({("luatorch", 16): 2.0 * 2**20, ("shared_max", 16): 2**20}).assign(param_bytes=4000)
    step = bench.with_state(memory)
    assert list(step[bench.STEP_BYTES]) == pytest.approx([2.0 * 2**20 * 32 + 12000, 2**20 * 32 + 12000])
    budget = bench.memory_budget(step, 16, value=bench.STEP_BYTES)
    assert set(budget["value"]) == {bench.STEP_BYTES} and set(budget["step_batch_size"]) == {64}
    with pytest.raises(ValueError, match="batch_size=0"):
        bench.with_state(memory, batch_size=0)


def test_budget_rows_are_read_only_at_the_best_naive_depth() -> None:
    """340 / 2.5 = 136: at another budget (the old reading, the naive peak at 160) the rows are not measured."""
    assert claims.NAIVE_BEST_DEPTH == 136 == claims.EFFICIENT_DEPTH / 2.5
    for prefix in ("Same memory budget", "... and has 6x as many parameters"):
        assert _verdict(prefix, _budget(2.5, False, depth=160))["verdict"] == "not run at this scale"


@pytest.mark.parametrize("prefix, form, column, value, verdict", [
    ("Training a naive (LuaTorch) model", "luatorch", "deepest_depth", 208, "inconclusive"),
    ("Training a naive (LuaTorch) model", "luatorch", "deepest_depth", 150, "inconclusive"),
    ("Training a naive (LuaTorch) model", "luatorch", "deepest_depth", 100, "not reproduced"),
    ("Networks of 4M parameters", "naive", "params", 4.4e6, "inconclusive"),
    ("Networks of 4M parameters", "naive", "params", 1e6, "not reproduced"),
    ("The efficient PyTorch implementation trains", "shared_max", "deepest_depth", 1228, "inconclusive"),
    ("The efficient PyTorch implementation trains", "shared_max", "deepest_depth", 300, "not reproduced"),
    ("... with 13M parameters", "shared_max", "params", 82e6, "inconclusive"),
    ("... with 13M parameters", "shared_max", "params", 5e6, "not reproduced"),
])
def test_extrapolated_depths_are_upper_bounds(prefix, form, column, value, verdict) -> None:
    records = _at_scale(form, value, value)
    row = _verdict(prefix, records)
    assert row["verdict"] == verdict and row["measured"] == value
    assert row["spread"][0] == -math.inf and row["spread"][1] == value
    assert "never 'reproduced' until measured on a 12 GB GPU" in row["rule"]
    capped = _verdict(prefix, _at_scale(form, value, value, capped=True))
    assert capped["spread"] == (-math.inf, math.inf)
    if form == "shared_max":  # better="higher": the two ends of the spread read differently
        assert capped["verdict"] == "inconclusive"
    assert _verdict(prefix, _at_scale(form, math.nan, math.nan))["verdict"] == "not run at this scale"


def test_an_upper_bound_can_never_read_reproduced() -> None:
    """Even an estimate that lands on the claim is only a bound: every verdict below it is possible."""
    for prefix, form, _column, value in (("Training a naive (LuaTorch) model", "luatorch", "deepest_depth", 140),
                                        ("Networks of 4M parameters", "naive", "params", 4e6),
                                        ("The efficient PyTorch implementation trains", "shared_max",
                                         "deepest_depth", 500), ("... with 13M parameters", "shared_max", "params",
                                                                 13.5e6)):
        assert _verdict(prefix, _at_scale(form, value, value))["verdict"] == "inconclusive", prefix
    assert _verdict("Training a naive (LuaTorch) model", _at_scale("luatorch", 300, 4e6))["verdict"] == (
        "inconclusive")


def test_four_million_is_read_for_the_naive_form_with_shared_gradients() -> None:
    records = _at_scale("naive", 268, 4.43e6)
    records["at_scale"] = pd.concat([records["at_scale"], _at_scale("luatorch", 202, 2.64e6)["at_scale"]])
    row = _verdict("Networks of 4M parameters", records)
    assert row["measured"] == 4.43e6 and "LuaTorch-style naive (Section 5: 160 layers, 1.8M): 2,640,000" in row[
        "scale"]


def test_the_papers_ratios_at_one_naive_depth_are_a_check() -> None:
    row = _verdict("The paper's two ratios", _counts((340, 12, 6_909_322), (136, 12, 1_306_000)))
    assert row["verdict"] == CHECK and row["source"] == "check"
    assert row["measured"] == pytest.approx(6_909_322 / 1_306_000)


@pytest.mark.parametrize("prefix, depth, k, params", [
    ("A 40-layer", 40, 12, 176_122), ("A 160-layer", 160, 12, 1_739_002), ("A 161-layer", 161, 48, 28_681_000),
    ("A 264-layer ImageNet DenseNet-BC, k=48", 264, 48, 72_686_632)])
def test_parameter_counts_are_checks_not_paper_verdicts(prefix, depth, k, params) -> None:
    row = _verdict(prefix, _counts((depth, k, params)))
    assert row["verdict"] == CHECK and row["source"] == "check" and row["measured"] == params
    ledger = claims.ledger(_counts((depth, k, params)), {}, device="gpu", device_class="gpu", verdicts=True)
    tally = ledger.tally()  # paper rows only: checks are never tallied
    assert CHECK not in tally and sum(tally.values()) == sum(c.source == "paper" for c in claims.CLAIMS)


TIME = "shared storage, one max-size buffer (the paper's): 15-20%"


@pytest.mark.parametrize("ratio, lo, hi, verdict", [(1.17, 1.15, 1.20, "reproduced"),
                                                    (1.0, 0.95, 1.05, "better than claimed"),
                                                    (1.25, 1.22, 1.28, "partly"), (1.5, 1.4, 1.6, "not reproduced"),
                                                    (1.17, 1.0, 1.3, "inconclusive")])
def test_time_overhead_on_a_gpu(ratio, lo, hi, verdict) -> None:
    assert _verdict(TIME, _timing("shared_max", ratio, lo, hi))["verdict"] == verdict
    assert _verdict("checkpoint (torch.utils.checkpoint): time", _timing("checkpoint", ratio, lo, hi))[
        "verdict"] == verdict


def test_time_claims_on_a_cpu_read_other_device() -> None:
    row = _verdict(TIME, _timing("shared_max", 1.0, 0.56, 1.09), device_class="cpu")
    assert row["verdict"] == "other device" and row["measured"] == 1.0 and row["spread"] == (0.56, 1.09)
    assert _verdict(TIME, {}, device_class="cpu")["verdict"] == "not run at this scale"
    assert _verdict(TIME, _timing("shared_max", 1.0, 0.9, 1.1), device_class="cpu",
                    verdicts=False)["verdict"] == "not run at this scale"


@pytest.mark.parametrize("ratio, lo, hi, verdict", [(0.85, 0.84, 0.88, "reproduced"), (1.0, 1.0, 1.0, "reproduced"),
                                                    (1.03, 1.01, 1.04, "partly"), (1.2, 1.1, 1.3, "not reproduced"),
                                                    (0.98, 0.9, 1.1, "inconclusive")])
def test_shared_no_slower_than_checkpoint_on_any_device(ratio, lo, hi, verdict) -> None:
    for device_class in ("cpu", "gpu"):
        row = _verdict("Shared storage is no slower", _timing("shared", ratio, lo, hi, to="checkpoint"),
                       device_class=device_class)
        assert row["verdict"] == verdict


@pytest.mark.parametrize("share, lo, hi, verdict", [(0.05, 0.045, 0.055, "reproduced"),
                                                    (0.07, 0.07, 0.07, "reproduced"),
                                                    (0.02, 0.01, 0.025, "better than claimed"),
                                                    (0.09, 0.08, 0.1, "partly"), (0.3, 0.28, 0.31, "not reproduced"),
                                                    (0.05, 0.01, 0.2, "inconclusive")])
def test_batch_norm_share(share, lo, hi, verdict) -> None:
    assert _verdict("Batch normalization is roughly 5%", _bn(share, lo, hi))["verdict"] == verdict
    cpu = _verdict("Batch normalization is roughly 5%", _bn(share, lo, hi), device_class="cpu")
    assert cpu["verdict"] == "other device" and cpu["measured"] == share


def test_batch_norm_share_needs_the_forward_share() -> None:
    old = _bn(0.3, 0.28, 0.31)["bn_share"].drop(columns=["bn_forward_share"])  # a results.json from before
    assert _verdict("Batch normalization is roughly 5%", {"bn_share": old})["verdict"] == "not run at this scale"


@pytest.mark.parametrize("ratio, rounds, verdict", [(1.4, [1.4, 1.4, 1.4], "reproduced"),
                                                    (1.3, [1.3, 1.3, 1.3], "reproduced"),
                                                    (1.6, [1.6, 1.6, 1.6], "partly"), (1.2, [1.2, 1.2, 1.2], "partly"),
                                                    (1.16, [1.16, 1.16, 1.16], "not reproduced"),
                                                    (1.4, [1.0, 1.4, 1.45], "inconclusive")])
def test_non_contiguous_convolution(ratio, rounds, verdict) -> None:
    assert _verdict("Non-contiguous convolution", _conv(ratio, rounds))["verdict"] == verdict
    cpu = _verdict("Non-contiguous convolution", _conv(ratio, rounds), device_class="cpu")
    assert cpu["verdict"] == "other device"


@pytest.mark.parametrize("prefix, records", [
    (TIME, lambda share: _timing("shared_max", 1.17, 1.15, 1.2, kernel_share=share)),
    ("checkpoint (torch.utils.checkpoint): time", lambda share: _timing("checkpoint", 1.17, 1.15, 1.2,
                                                                          kernel_share=share)),
    ("Shared storage is no slower", lambda share: _timing("shared", 0.9, 0.85, 0.95, to="checkpoint",
                                                          kernel_share=share)),
    ("Batch normalization is roughly 5%", lambda share: _bn(0.05, 0.045, 0.055, forward_kernel_share=share)),
    ("Non-contiguous convolution", lambda share: _conv(1.4, [1.4, 1.4, 1.4], kernel_share=share)),
])
def test_gpu_timings_whose_kernels_fill_under_half_the_wall_time_are_host_bound(prefix, records) -> None:
    assert _verdict(prefix, records(0.5))["verdict"] in ("reproduced", "better than claimed")
    host = _verdict(prefix, records(0.49))
    assert host["verdict"] == HOST_BOUND and "host-bound" in host["rule"]
    assert _verdict(prefix, records(0.1), verdicts=False)["verdict"] == "not run at this scale"


def test_host_bound_is_cuda_only() -> None:
    cpu_records = _timing("shared", 0.9, 0.85, 0.95, to="checkpoint", kernel_share=0.1, device="cpu")
    assert _verdict("Shared storage is no slower", cpu_records, device_class="cpu")["verdict"] == "reproduced"
    assert _verdict(TIME, _timing("shared_max", 1.17, 1.15, 1.2, kernel_share=0.1),
                    device_class="cpu")["verdict"] == "other device"
    old = _timing("shared_max", 1.17, 1.15, 1.2)["timing"].drop(columns=["kernel_s"])  # a results.json from before
    assert _verdict(TIME, {"timing": old})["verdict"] == "reproduced"


@pytest.mark.parametrize("diff, verdict", [(0.0, "reproduced"), (1e-4, "reproduced"), (1e-3, "not reproduced")])
def test_parity_target(diff, verdict) -> None:
    parity = pd.DataFrame([{"form": "naive", "max_rel_grad_diff": 0.0, "depth": 16, "growth_rate": 12,
                            "batch_size": 4}, {"form": "shared", "max_rel_grad_diff": diff, "depth": 16,
                                               "growth_rate": 12, "batch_size": 4}])
    assert _verdict("The efficient forms compute", {"parity": parity}, device_class="cpu")["verdict"] == verdict


def test_same_parameters_is_a_check() -> None:
    row = _verdict("Every memory form has the same", {"memory": _memory({("naive", 16): 1.0, ("shared", 16): 0.5})})
    assert row["verdict"] == CHECK and row["measured"] == 1 and row["source"] == "check"


def test_not_run_rows_and_toy_scales() -> None:
    not_run = [c.text for c in claims.CLAIMS if c.not_run]
    assert len(not_run) == 6
    ledger = claims.ledger({}, {}, device="cpu", device_class="cpu", verdicts=False)
    assert len(ledger.rows) == len(claims.CLAIMS)
    for row in ledger.rows:
        expected = "not run" if row["claim"] in not_run else (
            CHECK if row["source"] == "check" else "not run at this scale")
        assert row["verdict"] == expected, row["claim"]


def test_claims_are_well_formed() -> None:
    assert len(set(TEXTS)) == len(TEXTS)
    gpu = {c.text for c in claims.CLAIMS if c.made_on == "gpu"}
    assert gpu == {_text(TIME), _text("checkpoint (torch.utils.checkpoint): time"),
                   _text("Batch normalization is roughly 5%"), _text("Non-contiguous convolution")}
    for c in claims.CLAIMS:
        assert c.made_on in ("any", "gpu")
        assert c.not_run or c.definition or c.source == "check", c.text
        if c.source == "target":
            assert "ours" in str(c.paper), f"{c.text}: a target's paper column must not read as the paper's"


# ---------------------------------------------------------------------------------------------
# The records the experiment functions really produce


@pytest.fixture(scope="module")
def real_records() -> dict:
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        kw = dict(growth_rate=4, device="cpu", progress=False)
        memory = bench.memory_vs_depth([10, 16, 22], batch_size=1, image_size=8, **kw)
        return {
            "parity": bench.parity(10, growth_rate=4, batch_size=2, image_size=8),
            "memory": memory, "fits": bench.fit_growth_exponents(memory),
            "budget": bench.memory_budget(bench.with_state(memory), 16, value=bench.STEP_BYTES),
            "at_scale": bench.extrapolate_to_budget(memory),
            "timing": bench.time_per_minibatch(10, forms=("naive", "checkpoint", "shared", "shared_max"),
                                               batch_size=2, image_size=8, rounds=2, warmup=0, **kw),
            "bn_share": bench.bn_time_share(10, batch_size=2, image_size=8, rounds=2, warmup=0, **kw),
            "conv": bench.conv_contiguity([4, 8], out_channels=4, batch_size=2, image_size=8, repeats=2,
                                          device="cpu", progress=False),
            "param_counts": bench.parameter_counts(bench.PAPER_MODELS),
        }
    finally:
        torch.set_num_threads(threads)


def test_real_records_give_a_row_for_every_claim(real_records) -> None:
    ledger = claims.ledger(real_records, {}, device="cpu", device_class="cpu", verdicts=True)
    assert [r["claim"] for r in ledger.rows] == TEXTS
    by_text = {r["claim"]: r for r in ledger.rows}
    # measured at these sizes: exponents, extrapolations, counts, times, parity, the checks (the budget rows
    # only at the paper's budget, the naive peak at 136 layers)
    for prefix in ("Naive DenseNet (LuaTorch", "Training a naive (LuaTorch) model", "A 161-layer",
                   "The paper's two ratios", TIME, "Batch normalization", "Non-contiguous",
                   "The efficient forms compute", "Every memory form"):
        assert by_text[_text(prefix)]["measured"] is not None, prefix
    # the paper's depths (40, 160) are not in a toy sweep
    assert by_text[_text("Naive (LuaTorch-style): 160")]["verdict"] == "not run at this scale"
    assert by_text[_text(TIME)]["verdict"] == "other device"


def test_results_json_alone_rejudges_the_claims(real_records, tmp_path) -> None:
    ledger = claims.ledger(real_records, {}, device="cpu", device_class="cpu", verdicts=True)
    path = save_results("efficient_densenet", output_dir=tmp_path, parameters={}, records=real_records,
                        ledger=ledger, device="cpu")
    saved = json.loads(path.read_text())
    records = {k: pd.DataFrame(v) for k, v in saved["records"].items()}
    again = claims.ledger(records, saved["parameters"], device="cpu", device_class="cpu", verdicts=True)
    assert [r["verdict"] for r in again.rows] == [r["verdict"] for r in ledger.rows]
    for a, b in zip(again.rows, ledger.rows, strict=True):
        assert a["measured"] == pytest.approx(b["measured"]) if isinstance(b["measured"], float) else (
            a["measured"] == b["measured"]), a["claim"]
