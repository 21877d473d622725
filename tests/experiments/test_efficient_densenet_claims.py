"""The efficient DenseNet claims (workbench/experiments/efficient_densenet/claims.py) on hand-made records:
one case per verdict each rule can give, at the boundaries; GPU claims on a CPU; records that are absent;
and the ledger of records the experiment functions really produce, re-judged from results.json."""

from __future__ import annotations

import json
import math

import pandas as pd
import pytest

import workbench.experiments.efficient_densenet as bench
from workbench.experiments.efficient_densenet import claims
from workbench.report import CHECK, save_results

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


def _budget(ratio: float, capped: bool) -> dict:
    budget = pd.DataFrame([{"form": "shared_max", "depth_ratio": ratio, "limited_by_sweep": capped,
                            "budget_depth": 100, "budget_bytes": 2**20, "deepest_depth": int(100 * ratio)}])
    return {"budget": budget, "memory": _memory({("luatorch", 100): 2.0**20})}


def _at_scale(form: str, depth: float, params: float, capped: bool = False) -> dict:
    row = {"form": form, "deepest_depth": depth, "params": params, "capped": capped, "batch_size": 64,
           "budget_bytes": 12 * 2**30}
    return {"at_scale": pd.DataFrame([row]), "memory": _memory({("naive", 16): 1.0})}


def _counts(*rows: tuple[int, int, int]) -> dict:
    return {"param_counts": pd.DataFrame([{"depth": d, "growth_rate": k, "params": p, "network": "CIFAR",
                                           "block_config": [1, 2, 3]} for d, k, p in rows])}


def _timing(form: str, ratio: float, lo: float, hi: float, to: str = "naive") -> dict:
    row = {"form": form, f"ratio_to_{to}": ratio, f"ratio_to_{to}_min": lo, f"ratio_to_{to}_max": hi,
           "depth": 100, "growth_rate": 12, "batch_size": 16, "image_size": 32, "rounds": 5}
    return {"timing": pd.DataFrame([row])}


def _bn(share: float, lo: float, hi: float) -> dict:
    row = {"variant": "with BN", "bn_forward_share": share, "bn_forward_share_min": lo,
           "bn_forward_share_max": hi, "bn_share": 2 * share, "depth": 100, "growth_rate": 12, "batch_size": 16,
           "image_size": 32, "rounds": 5}
    return {"bn_share": pd.DataFrame([row])}


def _conv(ratio: float, rounds: list[float]) -> dict:
    base = {"in_channels": 48, "out_channels": 12, "batch_size": 16, "image_size": 32}
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


@pytest.mark.parametrize("ratio, capped, verdict", [(2.125, False, "reproduced"), (1.92, False, "reproduced"),
                                                    (2.125, True, "inconclusive"), (3.1, True, "better than claimed"),
                                                    (3.1, False, "better than claimed"), (1.7, False, "partly"),
                                                    (1.0, False, "not reproduced")])
def test_same_budget_depth_ratio(ratio, capped, verdict) -> None:
    row = _verdict("Same memory budget", _budget(ratio, capped))
    assert row["verdict"] == verdict
    assert ("+;" in row["scale"]) == capped
    assert _verdict("Same memory budget", {"budget": pd.DataFrame()})["verdict"] == "not run at this scale"


@pytest.mark.parametrize("prefix, form, column, value, verdict", [
    ("Training a naive (LuaTorch) model", "luatorch", "deepest_depth", 208, "inconclusive"),
    ("Training a naive (LuaTorch) model", "luatorch", "deepest_depth", 150, "inconclusive"),
    ("Training a naive (LuaTorch) model", "luatorch", "deepest_depth", 100, "not reproduced"),
    ("Networks of 4M parameters", "luatorch", "params", 2.79e6, "inconclusive"),
    ("Networks of 4M parameters", "luatorch", "params", 1e6, "not reproduced"),
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
    capped = _verdict(prefix, _at_scale(form, value, value, capped=True))
    assert capped["spread"] == (-math.inf, math.inf)
    if form == "shared_max":  # better="higher": the two ends of the spread read differently
        assert capped["verdict"] == "inconclusive"
    assert _verdict(prefix, _at_scale(form, math.nan, math.nan))["verdict"] == "not run at this scale"


def test_an_upper_bound_above_the_band_is_inconclusive() -> None:
    assert _verdict("Training a naive (LuaTorch) model", _at_scale("luatorch", 300, 4e6))["verdict"] == (
        "inconclusive")


def test_extrapolation_names_pytorch_naive_beside_luatorch() -> None:
    records = _at_scale("luatorch", 208, 2.79e6)
    records["at_scale"] = pd.concat([records["at_scale"], _at_scale("naive", 262, 4.4e6)["at_scale"]])
    assert "PyTorch naive: 4,400,000" in _verdict("Networks of 4M parameters", records)["scale"]


@pytest.mark.parametrize("deep, verdict", [(6 * 1_739_002, "reproduced"), (5 * 1_739_002, "partly"),
                                           (6_909_322, "not reproduced")])
def test_six_times_the_parameters(deep, verdict) -> None:
    row = _verdict("The 340-layer efficient model", _counts((340, 12, deep), (160, 12, 1_739_002)))
    assert row["verdict"] == verdict


@pytest.mark.parametrize("prefix, depth, k, params, verdict", [
    ("A 40-layer", 40, 12, 176_122, "partly"), ("A 40-layer", 40, 12, 160_000, "reproduced"),
    ("A 40-layer", 40, 12, 250_000, "not reproduced"), ("A 160-layer", 160, 12, 1_739_002, "reproduced"),
    ("A 161-layer", 161, 48, 28_681_000, "reproduced"), ("A 264-layer ImageNet DenseNet-BC, k=48", 264, 48,
                                                         72_686_632, "reproduced"),
])
def test_parameter_counts(prefix, depth, k, params, verdict) -> None:
    assert _verdict(prefix, _counts((depth, k, params)))["verdict"] == verdict
    assert _verdict(prefix, {})["verdict"] == "not run at this scale"


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
            "budget": bench.memory_budget(memory, 16), "at_scale": bench.extrapolate_to_budget(memory),
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
    # measured at these sizes: exponents, budget, extrapolations, counts, times, parity, the check
    for prefix in ("Naive DenseNet (LuaTorch", "Same memory budget", "Training a naive (LuaTorch) model",
                   "A 161-layer", TIME, "Batch normalization", "Non-contiguous", "The efficient forms compute",
                   "Every memory form"):
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
