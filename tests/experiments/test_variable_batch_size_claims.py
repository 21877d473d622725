"""The claims of Choudhury et al. as data: hand-made records, one case per verdict each rule can give
(at its boundaries), and the ledger of what the experiment functions really produce."""

import math

import numpy as np
import pandas as pd
import pytest
import torch

import workbench.experiments.variable_batch_size as exp
from workbench.experiments.variable_batch_size import claims
from workbench.experiments.variable_batch_size.claims import CLAIMS
from workbench.report import CHECK, Measured

PARAMS = {"image_size": 64, "width": 0.25, "request": 12, "layer_statistic": "min", "layer_repeats": 5,
          "exec_repeats": 3}
PAPER_SCALE = {**PARAMS, "image_size": 224, "width": 1.0}


def claim(start: str):
    found = [c for c in CLAIMS if c.text.startswith(start)]
    assert len(found) == 1, f"{start!r} matches {len(found)} claims"
    return found[0]


def verdict(c, records, params=PARAMS, device_class="gpu", verdicts=True) -> str:
    return claims.judge([c], records, params, device="dev", device_class=device_class, verdicts=verdicts).rows[0][
        "verdict"]


def measured(c, records, params=PARAMS):
    got = c.measure(records, params)
    return None if got is None else got.value


# --- Fig 1 and Fig 2 --------------------------------------------------------------------------


def _time_vs_batch(last: float) -> dict:
    return {"time_vs_batch": pd.DataFrame({"network": ["resnet50"] * 3, "batch": [1, 2, 3],
                                           "relative_to_batch_1": [1.0, 0.9, last]})}


def test_fig1_time_falls_with_batch():
    c = claim("ResNet-50's per-image time falls")
    assert c.made_on == "gpu"
    assert verdict(c, _time_vs_batch(0.5)) == "reproduced"
    assert verdict(c, _time_vs_batch(1.0)) == "reproduced"  # boundary
    assert verdict(c, _time_vs_batch(1.01)) == "not reproduced"
    assert verdict(c, _time_vs_batch(0.5), device_class="cpu") == "other device"
    assert verdict(c, {}) == "not run at this scale"
    assert verdict(c, _time_vs_batch(0.5), verdicts=False) == "not run at this scale"


def _layer_memory(conv1: float = 10.7, res2a: float = 2.3, least: float = 1.07, network: str = "resnet50",
                  kinds: bool = True) -> dict:
    """ResNet-50's layer groups at batch 1 (MiB): conv1, the pool after it, res2a_branch2a (layer1_0's
    body), a smaller convolution and the classifier, which is no convolution and smaller still."""
    names = ["conv1", "maxpool", "layer1_0.body", "layer4_0.body.3", "fc"]
    totals = [conv1, 5.8, res2a, least, 0.01]
    df = pd.DataFrame({"network": [network] * 5, "name": names, "total_bytes": [t * 2**20 for t in totals]})
    if kinds:
        df["kind"] = ["Conv2d", "MaxPool2d", "Conv2d", "Conv2d", "Linear"]
    return {"layer_memory": df}


def test_fig2_reads_the_layers_the_paper_names_at_its_scale_only():
    conv1, res2a = claim("ResNet-50's conv1 needs 10.7 MB"), claim("ResNet-50's res2a_branch2a needs about 2.3 MB")
    least = claim("ResNet-50's least memory-hungry convolution layer")
    assert conv1.made_on == res2a.made_on == least.made_on == "gpu"
    records = _layer_memory()
    assert [measured(c, records, PAPER_SCALE) for c in (conv1, res2a, least)] == pytest.approx([10.7, 2.3, 1.07])
    assert all(verdict(c, records, PAPER_SCALE) == "reproduced" for c in (conv1, res2a, least))
    # each row names the layer it measured: conv1 is conv1 even where another layer is larger
    big = _layer_memory(conv1=6.7, least=1.7)
    big["layer_memory"].loc[3, "total_bytes"] = 11.0 * 2**20
    assert measured(conv1, big, PAPER_SCALE) == pytest.approx(6.7)
    assert "conv1" in conv1.measure(big, PAPER_SCALE).scale
    assert "layer1_0.body" in res2a.measure(records, PAPER_SCALE).scale
    got = least.measure(_layer_memory(least=1.71), PAPER_SCALE)  # the classifier (0.01) is no convolution
    assert got.value == pytest.approx(1.71) and "layer4_0.body.3" in got.scale
    # two-sided: within 25%, partly within a further 50% of the band's edge, either side
    assert verdict(conv1, _layer_memory(conv1=10.7 * 1.25), PAPER_SCALE) == "reproduced"
    assert verdict(conv1, _layer_memory(conv1=10.7 * 1.25 * 1.4), PAPER_SCALE) == "partly"
    assert verdict(conv1, _layer_memory(conv1=6.7), PAPER_SCALE) == "partly"
    assert verdict(conv1, _layer_memory(conv1=3.6), PAPER_SCALE) == "not reproduced"
    assert verdict(res2a, _layer_memory(res2a=5.0), PAPER_SCALE) == "not reproduced"
    assert verdict(least, _layer_memory(least=1.71), PAPER_SCALE) == "partly"
    assert verdict(least, _layer_memory(least=4.0), PAPER_SCALE) == "not reproduced"
    assert verdict(conv1, records, PAPER_SCALE, device_class="cpu") == "other device"
    # any other scale, another network, a record without the layer or without kinds: not measured
    assert verdict(conv1, records, PARAMS) == "not run at this scale"
    assert verdict(conv1, records, {**PAPER_SCALE, "width": 0.5}) == "not run at this scale"
    assert verdict(conv1, _layer_memory(network="googlenet"), PAPER_SCALE) == "not run at this scale"
    gone = _layer_memory()
    gone["layer_memory"] = gone["layer_memory"][gone["layer_memory"].name != "layer1_0.body"]
    assert verdict(res2a, gone, PAPER_SCALE) == "not run at this scale"
    assert verdict(least, _layer_memory(kinds=False), PAPER_SCALE) == "not run at this scale"


# --- Table II, the shrinking gains and Fig 7 ---------------------------------------------------


def _table_ii(tight: float, loose: float = 1.0, lo=None, hi=None, network: str = "googlenet",
              within_tight: int = 3) -> dict:
    lo = tight if lo is None else lo
    hi = tight if hi is None else hi
    return {"table_ii": pd.DataFrame([{
        "network": network, "points_tight": 3, "points_loose": 2, "within_tight": within_tight, "within_loose": 2,
        "executed_tight_pct": tight,
        "executed_tight_lo": lo, "executed_tight_hi": hi, "executed_loose_pct": loose,
        "executed_loose_lo": loose, "executed_loose_hi": loose}])}


def test_table_ii_gain_uses_the_papers_definition_and_is_two_sided():
    c = claim("GoogLeNet: throughput gain over FBS, memory < 30 MB")
    assert c.paper == 60.25 and c.made_on == "gpu" and "reduction" in c.unit
    assert verdict(c, _table_ii(60.25)) == "reproduced"
    assert verdict(c, _table_ii(60.25 * 0.75 + 0.01)) == "reproduced"
    assert verdict(c, _table_ii(60.25 * 1.25 + 2, lo=75.4, hi=78)) == "better than claimed"
    assert verdict(c, _table_ii(35.0)) == "partly"
    assert verdict(c, _table_ii(10.0)) == "not reproduced"
    assert verdict(c, _table_ii(60.25, lo=40.0, hi=62.0)) == "inconclusive"  # the paired rounds straddle
    assert verdict(c, _table_ii(60.25, lo=40.0, hi=62.0), {**PARAMS, "exec_repeats": 1}) == "reproduced"
    assert verdict(c, _table_ii(60.25), device_class="cpu") == "other device"
    assert verdict(c, _table_ii(60.25, network="resnet50")) == "not run at this scale"
    assert verdict(c, {}) == "not run at this scale"
    # the gain is a reduction of time: what the old ratio t_FBS / t_VBS - 1 called 242.8% is 70.8%
    assert float(exp.reduction_pct(3.428, 1.0)) == pytest.approx(70.8, abs=0.1)
    assert float(exp.reduction_pct(1.0, 5.0)) == pytest.approx(-400.0)
    assert all(float(exp.reduction_pct(1.0, t)) < 100 for t in (1e-9, 0.5))
    loose = claim("MobileNet-v1: throughput gain over FBS, memory > 35 MB")
    assert loose.paper == 1.61 and measured(loose, _table_ii(5.0, 1.6, network="mobilenet_v1")) == 1.6


def test_table_ii_counts_only_budgets_where_both_plans_stayed_within_them():
    c = claim("GoogLeNet: throughput gain over FBS, memory < 30 MB")
    assert "2 of 3 budgets" in c.measure(_table_ii(60.0, within_tight=2), PARAMS).scale
    # none stayed within: table_ii leaves the executed gain empty, and nothing is judged
    assert verdict(c, _table_ii(np.nan, within_tight=0)) == "not run at this scale"
    sweep = pd.DataFrame([
        {"network": "googlenet", "request": 12, "budget_units": u, "ratio": 1.0, "paper_mb": 20.0,
         "budget_bytes": 100, "method": m, "feasible": True, "time_per_image_s": t, "max_batch": 2,
         "executed_peak_bytes": peak, "within_budget": peak <= 100, "rounds": [t] * 3}
        for u, over in ((1, False), (2, True))
        for m, t, peak in (("vbs", 1.0, 120 if over else 90), ("fbs", 3.0, 95), ("greedy", 2.0, 99))])
    gain = exp.gains(sweep)
    assert list(gain.within_budget_vs_fbs) == [True, False]
    assert gain.executed_gain_vs_fbs_pct.notna().tolist() == [True, False]  # over its budget: not a gain
    row = exp.table_ii(gain).iloc[0]
    assert (row.points_tight, row.within_tight) == (2, 1) and row.executed_tight_pct == pytest.approx(200 / 3)


def test_gains_shrink_as_memory_grows():
    c = claim("Gains shrink as memory grows")
    assert c.made_on == "gpu" and "14.6" in c.paper
    assert verdict(c, _table_ii(40.0, 20.0)) == "reproduced"
    assert verdict(c, _table_ii(20.0, 20.0)) == "reproduced"  # boundary
    assert verdict(c, _table_ii(10.0, 20.0)) == "not reproduced"
    assert verdict(c, _table_ii(40.0, 20.0), device_class="cpu") == "other device"


def _gains(executed: list[float], lo=None, hi=None, predicted=None) -> dict:
    n = len(executed)
    return {"gains": pd.DataFrame({
        "network": ["googlenet"] * n, "request": [12] * n, "budget_units": range(n), "fbs_feasible": [True] * n,
        "gain_vs_fbs_pct": predicted or [5.0] * n, "executed_gain_vs_fbs_pct": executed,
        "executed_gain_vs_fbs_lo": lo or [g - 1 for g in executed], "executed_gain_vs_fbs_hi": hi or
        [g + 1 for g in executed], "fastest": ["vbs"] * n})}


def test_fig7_vbs_faster_than_fbs_where_plans_differ():
    c = claim("VBS is faster than FBS at every budget")
    assert c.made_on == "gpu"
    assert verdict(c, _gains([5, 6, 7, 8])) == "reproduced"
    assert verdict(c, _gains([5, 6, 7, -8])) == "partly"  # 0.75, the boundary
    assert verdict(c, _gains([5, -6, 7, -8])) == "not reproduced"
    assert verdict(c, _gains([5, 6, 7, 8], lo=[-1, -1, 4, 7])) == "inconclusive"
    assert verdict(c, _gains([5, 6, 7, 8]), device_class="cpu") == "other device"
    # points where the DP's plan is FBS's are left out: nothing left, nothing measured
    assert verdict(c, _gains([5, -6], predicted=[0.0, 0.0])) == "not run at this scale"


def _sweep(vbs25=6, fbs25=1.0, vbs30=8, fbs30=2.0, request=12, fbs_feasible=True) -> dict:
    rows = []
    for mb, v, f in ((15.0, 2, 1), (25.05, vbs25, fbs25), (30.0, vbs30, fbs30)):
        rows.append({"network": "resnet50", "request": request, "paper_mb": mb, "ratio": mb / 15, "method": "vbs",
                     "feasible": True, "max_batch": v, "max_abs_diff": 0.0})
        rows.append({"network": "resnet50", "request": request, "paper_mb": mb, "ratio": mb / 15, "method": "fbs",
                     "feasible": fbs_feasible, "max_batch": f if fbs_feasible else np.nan, "max_abs_diff": 0.0})
    return {"sweep": pd.DataFrame(rows)}


def _shapes(fbs25=2.0, fbs30=3.0, greedy=(False, False, False)) -> dict:
    """`paper_scale_sweep`'s record: ResNet-50's FBS batch at 25 and 30 MB, GoogLeNet's Greedy-VBS at 15-25 MB."""
    rows = [{"network": "resnet50", "method": "fbs", "paper_mb": mb, "feasible": True, "max_batch": b,
             "request": 12} for mb, b in ((25.0, fbs25), (30.0, fbs30))]
    rows += [{"network": "googlenet", "method": m, "paper_mb": mb, "feasible": ok, "max_batch": 2.0 if ok else np.nan,
              "request": 12} for mb, ok in zip((15.0, 20.2, 24.8), greedy, strict=True) for m in ("greedy",)]
    rows += [{"network": "googlenet", "method": "fbs", "paper_mb": 20.2, "feasible": True, "max_batch": 2.0,
              "request": 12}]
    return {"paper_scale": pd.DataFrame(rows)}


def test_fig7_caption_batch_sizes():
    v25, f25 = claim("ResNet-50 at 25 MB: VBS"), claim("ResNet-50 at 25 MB: FBS")
    v30, f30 = claim("ResNet-50 at 30 MB: VBS"), claim("ResNet-50 at 30 MB: FBS")
    assert (v25.paper, f25.paper, v30.paper, f30.paper) == (6, 1, 8, 2)
    # the caption's batches count cuDNN's working space at 224x224, full width: judged only there, on a GPU
    assert all(c.made_on == "gpu" for c in (v25, f25, v30, f30))
    records = _sweep()
    assert [verdict(c, records, PAPER_SCALE) for c in (v25, f25, v30, f30)] == ["reproduced"] * 4
    assert verdict(v25, _sweep(vbs25=7), PAPER_SCALE) == "reproduced"  # 7.2 is the band's top
    assert verdict(v25, _sweep(vbs25=4), PAPER_SCALE) == "partly"
    assert verdict(v25, _sweep(vbs25=12), PAPER_SCALE) == "not reproduced"
    assert verdict(f30, _sweep(fbs30=1), PAPER_SCALE) == "partly"
    assert verdict(f30, _sweep(fbs30=4), PAPER_SCALE) == "not reproduced"
    assert measured(f25, _sweep(fbs_feasible=False), PAPER_SCALE) == 0.0  # FBS cannot serve the request at all
    assert verdict(f25, _sweep(fbs_feasible=False), PAPER_SCALE) == "not reproduced"
    assert verdict(f25, records, PAPER_SCALE, device_class="cpu") == "other device"
    assert verdict(v25, _sweep(), {**PAPER_SCALE, "request": 4}) == "not run at this scale"
    far = _sweep()
    far["sweep"] = far["sweep"][far["sweep"].paper_mb != 25.05]
    assert verdict(v25, far, PAPER_SCALE) == "not run at this scale"  # no swept budget within 1 MB of 25 MB
    # issue 44: at 64 px, width x0.25 (the CPU gave FBS 5 at 30 MB where the H100 at 224 px gave 2) not judged,
    # on any device; what the 224x224 shapes alone give is said beside the row, not judged
    for c in (v25, f25, v30, f30):
        assert verdict(c, {**records, **_shapes()}, PARAMS, device_class="gpu") == "not run at this scale"
    got = f30.measure({**records, **_shapes()}, PARAMS)
    assert got.value is None and "not run at the paper's size" in got.scale
    assert "shapes alone at 224x224, full width (no working space): FBS batch 3" in got.scale
    assert "shapes alone" not in v30.measure({**records, **_shapes()}, PARAMS).scale
    assert "shapes alone" not in f30.measure(records, PARAMS).scale


# --- Fig 8 ------------------------------------------------------------------------------------


def _requests(rows: list[tuple]) -> dict:
    cols = ["request", "paper_mb", "fbs_feasible", "fbs_batch", "greedy_feasible", "gain_vs_greedy_pct",
            "greedy_vs_fbs_pct"]
    df = pd.DataFrame(rows, columns=cols)
    return {"requests": df.assign(network="googlenet", gain_vs_fbs_pct=1.0, fastest="vbs")}


def test_fig8_vbs_against_greedy():
    c = claim("VBS is faster than Greedy-VBS wherever")
    assert c.made_on == "gpu"  # predicted from the profiled layer times: a speed claim of the paper's GPU
    rows = [(6, 20, True, 1, True, g, 0.0) for g in (1.0, 2.0, 0.0, 3.0, 4.0)]
    assert verdict(c, _requests(rows)) == "reproduced"
    assert verdict(c, _requests(rows), device_class="cpu") == "other device"
    rows[0] = (6, 20, True, 1, True, -1.0, 0.0)
    assert verdict(c, _requests(rows)) == "partly"  # 0.8, the boundary
    rows[1] = (6, 20, True, 1, True, -1.0, 0.0)
    assert verdict(c, _requests(rows)) == "not reproduced"
    assert verdict(c, _requests(rows), device_class="cpu") == "other device"
    assert verdict(c, _requests([(6, 20, True, 1, False, np.nan, np.nan)])) == "not run at this scale"


def test_fig8_greedy_infeasible_at_tight_memory_for_the_largest_request():
    c = claim("Greedy-VBS is infeasible at tight memory")
    assert c.made_on == "gpu"
    tight = [(12, mb, True, 1, False, np.nan, np.nan) for mb in (15, 20, 25, 28)]
    assert verdict(c, _requests([*tight, (6, 15, True, 1, True, 1.0, 1.0)]), PAPER_SCALE) == "reproduced"
    assert verdict(c, _requests(tight), PAPER_SCALE, device_class="cpu") == "other device"
    assert verdict(c, _requests(tight), PARAMS) == "not run at this scale"  # 64 px: not the paper's regime
    got = c.measure({**_requests(tight), **_shapes(greedy=(False, True, False))}, PARAMS)
    assert got.value is None and "Greedy-VBS infeasible at 2 of 3 budgets < 30 MB, request 12" in got.scale
    tight[0] = (12, 15, True, 1, True, 1.0, 1.0)
    assert verdict(c, _requests(tight), PAPER_SCALE) == "reproduced"  # 0.75, the boundary
    tight[1] = (12, 20, True, 1, True, 1.0, 1.0)
    assert verdict(c, _requests(tight), PAPER_SCALE) == "partly"
    tight[2] = (12, 25, True, 1, True, 1.0, 1.0)
    assert verdict(c, _requests(tight), PAPER_SCALE) == "not reproduced"


def test_fig8_greedy_beats_fbs_at_large_memory_or_small_requests():
    c = claim("Greedy-VBS beats FBS at large memory")
    assert c.made_on == "gpu"
    rows = [(6, 20, True, 2, True, 1.0, 5.0), (6, 25, True, 3, True, 1.0, 5.0), (12, 38, True, 6, True, 1.0, 5.0),
            (12, 40, True, 8, True, 1.0, 5.0),
            (12, 20, True, 1, True, 1.0, -9.0),   # tight and large request: outside the claim
            (6, 40, True, 6, True, 0.0, 0.0)]     # FBS runs the whole request: a tie by construction
    assert measured(c, _requests(rows)) == 1.0
    assert verdict(c, _requests(rows)) == "reproduced"
    rows[0] = (6, 20, True, 2, True, 1.0, -2.0)
    assert verdict(c, _requests(rows)) == "reproduced"  # 0.75, the boundary
    rows[1] = (6, 25, True, 3, True, 1.0, 0.0)
    assert verdict(c, _requests(rows)) == "partly"
    rows[2] = (12, 38, True, 6, True, 1.0, -1.0)
    assert verdict(c, _requests(rows)) == "not reproduced"
    assert verdict(c, _requests(rows), device_class="cpu") == "other device"


# --- Fig 9 and Table III ------------------------------------------------------------------------


def _fig9(fbs_batch=2.0, inception_5b=8, needs=(5, 4, 3, 2, 1), paper_mb=19.9) -> dict:
    names = ["conv1", "pool1", "inception_3a", "inception_5b", "classifier"]
    batches = [2, 3, 4, inception_5b, 12]
    return {"layer_batches": pd.DataFrame({
        "name": names, "max_batch": batches, "need_bytes_per_sample": list(needs), "batches": [[b] for b in batches],
        "network": "googlenet", "request": 12, "paper_mb": paper_mb, "fbs_batch": fbs_batch})}


def test_fig9_batch_sizes():
    fbs, i5b, rank = claim("GoogLeNet at 20 MB: FBS runs 2"), claim("GoogLeNet at 20 MB: VBS runs inception_5b"), \
        claim("Layers needing more memory")
    assert fbs.made_on == i5b.made_on == rank.made_on == "gpu"
    at = PAPER_SCALE
    assert verdict(fbs, _fig9(), at) == "reproduced"
    assert verdict(fbs, _fig9(), at, device_class="cpu") == "other device"
    assert verdict(fbs, _fig9(fbs_batch=1.0), at) == "partly"
    assert verdict(fbs, _fig9(fbs_batch=4.0), at) == "not reproduced"
    assert verdict(fbs, _fig9(fbs_batch=np.nan), at) == "not run at this scale"
    assert verdict(i5b, _fig9(), at) == "reproduced"
    assert verdict(i5b, _fig9(inception_5b=12), at) == "partly"
    assert verdict(i5b, _fig9(inception_5b=3), at) == "not reproduced"
    assert measured(rank, _fig9(), at) == pytest.approx(-1.0)
    assert verdict(rank, _fig9(), at) == "reproduced"
    assert verdict(rank, _fig9(needs=(5, 1, 3, 2, 4)), at) == "partly"      # rho = -0.1
    assert verdict(rank, _fig9(needs=(1, 2, 3, 4, 5)), at) == "not reproduced"
    # only at the paper's 20 MB, request 12, and 224x224 at full width
    assert verdict(fbs, _fig9(paper_mb=15.0), at) == "not run at this scale"
    assert verdict(fbs, _fig9(), {**at, "request": 3}) == "not run at this scale"
    for c in (fbs, i5b, rank):
        assert verdict(c, _fig9(), PARAMS) == "not run at this scale"
    assert "FBS batch 2" in fbs.measure({**_fig9(), **_shapes()}, PARAMS).scale


def _table_iii(fbs: float, vbs: float, paper_mb=20.0) -> dict:
    names = ["conv1", "pool1", "inception_4a"]
    return {"table_iii": pd.DataFrame({
        "name": names, "fbs_unused_fraction": [fbs, fbs, 0.0], "vbs_unused_fraction": [vbs, vbs, 0.9],
        "paper_fbs_unused_fraction": [0.46, 0.65, np.nan], "paper_vbs_unused_fraction": [0.015, 0.0, np.nan],
        "network": "googlenet", "request": 12, "paper_mb": paper_mb})}


def test_table_iii_unused_memory():
    f, v = claim("GoogLeNet at 20 MB: FBS leaves"), claim("GoogLeNet at 20 MB: VBS leaves")
    assert f.paper == pytest.approx(0.776, abs=1e-3) and v.paper == pytest.approx(0.0998, abs=1e-3)
    assert f.made_on == v.made_on == "gpu"
    at = PAPER_SCALE
    assert measured(f, _table_iii(0.7, 0.1), at) == pytest.approx(0.7)  # the layers Table III lists only
    assert verdict(f, _table_iii(0.7, 0.1), at) == "reproduced"
    assert verdict(f, _table_iii(0.7, 0.1), at, device_class="cpu") == "other device"
    assert verdict(f, _table_iii(0.45, 0.1), at) == "partly"
    assert verdict(f, _table_iii(0.1, 0.1), at) == "not reproduced"
    assert verdict(v, _table_iii(0.7, 0.1), at) == "reproduced"
    assert verdict(v, _table_iii(0.7, 0.01), at) == "better than claimed"
    assert verdict(v, _table_iii(0.7, 0.18), at) == "partly"
    assert verdict(v, _table_iii(0.7, 0.5), at) == "not reproduced"
    assert verdict(v, _table_iii(0.7, 0.1, paper_mb=25.0), at) == "not run at this scale"
    assert verdict(f, _table_iii(0.7, 0.1), PARAMS) == verdict(v, _table_iii(0.7, 0.1), PARAMS) == \
        "not run at this scale"
    unused = pd.DataFrame({"name": ["conv1", "pool1", "norm2"], "fbs_unused_fraction": [0.2, 0.4, 0.0],
                           "paper_fbs_unused_fraction": [0.46, 0.65, np.nan]})
    got = f.measure({**_table_iii(0.7, 0.1), "paper_scale_unused": unused}, PARAMS)
    assert got.value is None and "FBS leaves 30.0% of the budget unused (mean over the 2 layers" in got.scale


# --- targets, checks, not run -------------------------------------------------------------------


def _agreement(ratio: float, lo: float, hi: float, vs_fbs: float = 1.0, memory: float = 1.0, *,
               budgets: tuple[float, float] = (0.5, 2.5), rounds: int = 3) -> dict:
    """`lo`, `hi`: the repeat noise of the time ratio (over rounds); `budgets`: its range over budgets."""
    return {"agreement": pd.DataFrame([{
        "method": "vbs", "points": 6, "time_ratio_median": ratio, "time_ratio_min": budgets[0],
        "time_ratio_max": budgets[1], "time_ratio_rounds_lo": lo, "time_ratio_rounds_hi": hi, "noise_rounds": rounds,
        "time_ratio_vs_fbs_median": vs_fbs, "time_ratio_vs_fbs_min": budgets[0], "time_ratio_vs_fbs_max": budgets[1],
        "time_ratio_vs_fbs_rounds_lo": vs_fbs, "time_ratio_vs_fbs_rounds_hi": vs_fbs,
        "memory_ratio_max": memory, "memory_ratio_min": memory, "over_budget": int(memory > 1), "refused": 0}])}


def test_targets():
    planner = claim("Planner:")
    assert planner.source == "target" and "our target" in planner.paper
    timing = pd.DataFrame([{"layers": 60, "batch": 16, "memory_units": 64, "cpu_s": c, "cpu_min_s": lo,
                            "cpu_max_s": hi, "median_s": c} for c, lo, hi in [(0.4, 0.3, 0.5)]])
    assert verdict(planner, {"planner_timing": timing}, device_class="cpu") == "reproduced"
    timing.loc[0, ["cpu_s", "cpu_min_s", "cpu_max_s"]] = 0.9, 0.8, 1.2
    assert verdict(planner, {"planner_timing": timing}) == "inconclusive"
    timing.loc[0, ["cpu_s", "cpu_min_s", "cpu_max_s"]] = 1.5, 1.4, 1.6
    assert verdict(planner, {"planner_timing": timing}) == "partly"
    timing.loc[0, ["cpu_s", "cpu_min_s", "cpu_max_s"]] = 3.0, 2.9, 3.1
    assert verdict(planner, {"planner_timing": timing}) == "not reproduced"
    time_ratio = claim("Executed time of VBS plans")
    assert verdict(time_ratio, _agreement(1.1, 1.0, 1.2), device_class="cpu") == "reproduced"
    assert verdict(time_ratio, _agreement(1.1, 1.0, 1.3)) == "inconclusive"  # the repeat noise straddles 1.25
    assert verdict(time_ratio, _agreement(2.0, 1.9, 2.1)) == "not reproduced"
    # issue 44: a median of 1.55 over budgets whose rounds all agree is outside the band: the range over budgets
    # (0.5-2.5, settings) is no uncertainty and leaves it "not reproduced"
    assert verdict(time_ratio, _agreement(1.55, 1.5, 1.6, budgets=(0.5, 2.5))) == "not reproduced"
    got = time_ratio.measure(_agreement(1.55, 1.5, 1.6), PARAMS)
    assert got.spread == (1.5, 1.6) and "repeat noise" in got.scale and "0.50-2.50 (settings, not noise)" in got.scale
    # one round, or a results.json of before the noise was recorded: no spread at all (never the budgets' range)
    assert time_ratio.measure(_agreement(1.55, 1.5, 1.6, rounds=1), PARAMS).spread is None
    old = _agreement(1.55, 1.5, 1.6)
    old["agreement"] = old["agreement"].drop(columns=["time_ratio_rounds_lo", "time_ratio_rounds_hi"])
    assert time_ratio.measure(old, PARAMS).spread is None and verdict(time_ratio, old) == "not reproduced"
    phases = claim("VBS's extra phases")
    assert verdict(phases, _agreement(1, 1, 1, vs_fbs=1.05)) == "reproduced"
    assert verdict(phases, _agreement(1, 1, 1, vs_fbs=1.2)) == "partly"
    assert verdict(phases, _agreement(1, 1, 1, vs_fbs=1.5)) == "not reproduced"
    memory = claim("Measured peak memory of VBS plans")
    assert "request included" in memory.unit
    assert verdict(memory, _agreement(1, 1, 1, memory=0.97), device_class="cpu") == "reproduced"
    assert verdict(memory, _agreement(1, 1, 1, memory=1.0)) == "reproduced"  # boundary
    assert verdict(memory, _agreement(1, 1, 1, memory=1.01)) == "not reproduced"
    assert "1 over their budget, 0 refused" in memory.measure(_agreement(1, 1, 1, memory=1.2), PARAMS).scale
    old = _agreement(1, 1, 1)  # a results.json of before: the ratio without the request
    old["agreement"] = old["agreement"].drop(columns=["memory_ratio_max"])
    assert verdict(memory, old) == "not run at this scale"
    assert all(c.source == "target" and "our target" in c.paper for c in (planner, time_ratio, phases, memory))


def test_checks_and_rows_not_run():
    worked = {"worked_example": exp.worked_example()}
    want = Measured("10 vs 12", scale="3 layers, memory 7, request 2")
    assert claim("Worked example").measure(worked, PARAMS) == want
    assert verdict(claim("Worked example"), worked) == CHECK
    fastest = claim("vbs.plan() returns the fastest")
    records = _gains([1.0, 2.0])
    records["gains"].loc[1, "fastest"] = "greedy"
    assert measured(fastest, records) == "DP 1, FBS 0, Greedy-VBS 1 of 2"
    assert verdict(fastest, records, verdicts=False) == CHECK
    assert measured(claim("DP never slower than FBS"), _gains([1.0, 2.0], predicted=[0.0, 3.0])) == 0.0
    assert measured(claim("Executed plans return"), _sweep()) == 0.0
    c3d = claim("C3D video inference")
    assert c3d.not_run and verdict(c3d, {}) == "not run"
    assert all(c.source == "check" for c in CLAIMS if c.why)
    texts = [c.text for c in CLAIMS]
    assert len(texts) == len(set(texts))


# --- the ledger of what the experiments really produce -------------------------------------------


@pytest.fixture(scope="module")
def tiny_records():
    """Every record the notebook passes, from the experiment functions at a tiny scale (seconds)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        models, layers = exp.measure_networks(["googlenet", "resnet50"], image_size=32, width=0.125, max_batch=3,
                                              repeats=1)
        sweep = exp.budget_sweep(layers, requests=[3], ratios=[1.0, 1.33, 2.67])
        executed = exp.execute_sweep(models, sweep, image_size=32, repeats=2)
        gain = exp.gains(executed)
        sweep8 = exp.budget_sweep({"googlenet": layers["googlenet"]}, requests=[2, 3], ratios=[1.0, 2.67],
                                  floor_batch=3)
        return {"worked_example": exp.worked_example(), "time_vs_batch": exp.time_vs_batch(layers),
                "layer_memory": exp.layer_memory(layers["resnet50"], network="resnet50"),
                "sweep": executed.drop(columns=["plan_json", "rounds"]), "gains": gain,
                "table_ii": exp.table_ii(gain, request=3), "requests": exp.gains(sweep8),
                "layer_batches": exp.layer_batches(sweep, layers["googlenet"], network="googlenet", ratio=1.33,
                                                   request=3),
                "table_iii": exp.table_iii(sweep, network="googlenet", ratio=1.33, request=3),
                "agreement": exp.agreement(executed), "planner_timing": exp.planner_timing(
                    layers=[15], memory_units=[16], repeats=1), "layer_tables": exp.tables_frame(layers)}
    finally:
        torch.set_num_threads(threads)


def test_ledger_of_real_records_has_a_row_for_every_claim(tiny_records):
    params = {**PARAMS, "image_size": 32, "width": 0.125, "request": 3, "exec_repeats": 2}
    ledger = claims.ledger(tiny_records, params, device="cpu", device_class="cpu", verdicts=False)
    frame = ledger.to_frame()
    assert list(frame.claim) == [c.text for c in CLAIMS]
    paper = frame[frame.source == "paper"]
    assert set(paper.verdict) <= {"not run at this scale", "not run"}
    judged = claims.ledger(tiny_records, params, device="cpu", device_class="cpu", verdicts=True).to_frame()
    for c, row in zip(CLAIMS, judged.itertuples(), strict=True):
        if c.made_on == "gpu" and row.measured is not None and not c.not_run:
            assert row.verdict == "other device", c.text
    measured_rows = judged[judged.measured.notna()]
    assert {"Executed plans return the model's outputs", "Worked example: VBS 10 vs FBS 12 per image (Section III)"} \
        <= set(measured_rows.claim)
    predicted = tiny_records["gains"].gain_vs_fbs_pct.dropna()
    assert len(predicted) and (predicted >= -1e-9).all() and (predicted < 100).all()
    assert not math.isnan(judged.set_index("claim").loc["Executed plans return the model's outputs", "measured"])
