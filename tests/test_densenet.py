"""DenseNet-BC memory forms (Pleiss et al. 2017): the checkpointed and shared-storage forms are
switches on the naive baseline and must match it (outputs, gradients, BN running statistics)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from workbench.experiments.efficient_densenet import (
    conv_contiguity, deepest_within_budget, fit_growth_exponents, memory_vs_depth,
    plot_memory_vs_depth, time_per_minibatch,
)
from workbench.models.densenet import FORMS, IMAGENET_BLOCKS, DenseNet, bc_depths, densenet_bc


def _run(model: DenseNet, x: torch.Tensor, *, steps: int = 1):
    """`steps` training (or eval) steps on x; returns output, input grad, grads, state dict."""
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        xg = x.clone().requires_grad_(True)
        out = model(xg)
        weights = torch.linspace(-1, 1, out.numel(), dtype=out.dtype, device=out.device).view_as(out)
        (out * weights).sum().backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    return out.detach(), xg.grad, grads, {k: v.clone() for k, v in model.state_dict().items()}


def _randomize_bn(model: DenseNet) -> DenseNet:
    """Non-trivial BN statistics and affine terms: at the defaults (mean 0, var 1, bias 0) an
    exactly-zero conv output stays exactly 0 through eval-mode BN and sits on the ReLU kink."""
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.running_mean.uniform_(-0.5, 0.5)
                m.running_var.uniform_(0.5, 2.0)
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.3, 0.3)
    return model


def _forms_from(base: DenseNet, **kwargs) -> dict[str, DenseNet]:
    models = {}
    for form in FORMS:
        m = DenseNet(memory=form, **kwargs).to(next(base.parameters()).dtype)
        m.load_state_dict(base.state_dict())
        models[form] = m
    return models


def _assert_same(results: dict, **tol) -> None:
    ref = results["naive"]
    for form in FORMS[1:]:
        got = results[form]
        torch.testing.assert_close(got[0], ref[0], **tol, msg=f"{form}: output")
        torch.testing.assert_close(got[1], ref[1], **tol, msg=f"{form}: input grad")
        torch.testing.assert_close(got[2], ref[2], **tol, msg=f"{form}: parameter grads")
        torch.testing.assert_close(got[3], ref[3], **tol, msg=f"{form}: state (BN stats)")


@pytest.mark.parametrize("train", [True, False])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_forms_match_naive(train: bool, dtype: torch.dtype) -> None:
    kwargs = dict(growth_rate=4, block_config=(2, 3), num_classes=5)
    torch.manual_seed(0)
    base = _randomize_bn(DenseNet(**kwargs).to(dtype))
    x = torch.randn(3, 3, 8, 8, dtype=dtype)
    results = {}
    for form, model in _forms_from(base, **kwargs).items():
        results[form] = _run(model.train(train), x, steps=2)
    tol = {} if dtype == torch.float64 else dict(rtol=1e-4, atol=1e-5)
    _assert_same(results, **tol)


def test_running_stats_advance_once_per_step() -> None:
    torch.manual_seed(0)
    x = torch.randn(4, 3, 8, 8)
    for form in FORMS:
        torch.manual_seed(0)
        model = densenet_bc(10, 4, 3, memory=form).train()
        before = model.blocks[0].layers[0].norm1.running_mean.clone()
        _run(model, x, steps=3)
        norm = model.blocks[0].layers[0].norm1
        assert int(norm.num_batches_tracked) == 3, form
        # three momentum-0.1 updates towards the same batch mean (no optimizer step, so the
        # stem output is the same each time): 1 - 0.9**3 of the way, not 1 - 0.9**6
        with torch.no_grad():
            batch_mean = model.stem(x).mean(dim=(0, 2, 3))
        expected = before + (1 - 0.9**3) * (batch_mean - before)
        torch.testing.assert_close(norm.running_mean, expected, rtol=1e-4, atol=1e-5)


@settings(max_examples=8, deadline=None)
@given(growth=st.integers(1, 5), blocks=st.lists(st.integers(1, 3), min_size=1, max_size=3),
       bottleneck=st.booleans(), batch=st.integers(2, 3), size=st.sampled_from([4, 6, 8]),
       train=st.booleans(), small=st.booleans())
def test_forms_match_naive_property(growth, blocks, bottleneck, batch, size, train,
                                    small) -> None:
    size = size if small else 4 * size
    if 2 ** (len(blocks) - 1) > size // (1 if small else 4):
        blocks = blocks[:1]
    kwargs = dict(growth_rate=growth, block_config=tuple(blocks), bottleneck=bottleneck,
                  num_classes=3, small_inputs=small, compression=0.5 if bottleneck else 1.0)
    base = _randomize_bn(DenseNet(**kwargs).double())
    x = torch.randn(batch, 3, size, size, dtype=torch.float64)
    results = {f: _run(m.train(train), x) for f, m in _forms_from(base, **kwargs).items()}
    _assert_same(results)


@pytest.mark.parametrize("train", [True, False])
def test_shared_function_gradcheck(train: bool) -> None:
    torch.manual_seed(0)
    model = _randomize_bn(DenseNet(2, (3,), num_classes=2, memory="shared").double())
    model.train(train)
    x = torch.randn(2, 3, 4, 4, dtype=torch.float64, requires_grad=True)
    layer = model.blocks[0].layers[1]  # the Function's own inputs: two features, BN, conv
    params = [layer.norm1.weight, layer.norm1.bias, layer.conv1.weight]

    def f(inp, *ps):
        return model(inp)

    assert torch.autograd.gradcheck(f, (x, *params), eps=1e-6, atol=1e-5, fast_mode=True)


def test_state_dicts_interchangeable_and_memory_switch() -> None:
    keys = {f: list(densenet_bc(16, memory=f).state_dict()) for f in FORMS}
    assert keys["naive"] == keys["checkpoint"] == keys["shared"]
    model = densenet_bc(16, 4, 3)
    model.memory = "shared"
    assert {layer.memory for b in model.blocks for layer in b.layers} == {"shared"}


def test_architecture_matches_published_sizes() -> None:
    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    assert count(densenet_bc(121, 32, 1000)) == 7_978_856  # torchvision densenet121
    model = densenet_bc(100, 12, 10)
    assert model.depth == 100 and model.block_config == (16, 16, 16)
    assert 0.7e6 < count(model) < 0.85e6  # Huang et al.: DenseNet-BC L=100, k=12: 0.8M
    assert 1.6e6 < count(densenet_bc(160, 12, 10)) < 1.9e6  # paper Section 5: 1.8M
    assert densenet_bc(169, 32, 1000).block_config == IMAGENET_BLOCKS[169]
    assert bc_depths(40) == [10, 16, 22, 28, 34, 40]


@pytest.mark.parametrize("call, match", [
    (lambda: densenet_bc(17), "depth=17"),
    (lambda: densenet_bc(100, memory="fast"), "memory='fast'"),
    (lambda: DenseNet(0), "growth_rate=0"),
    (lambda: DenseNet(12, ()), "block_config"),
    (lambda: DenseNet(12, (2,), compression=1.5), "compression=1.5"),
    (lambda: setattr(densenet_bc(10), "memory", "x"), "memory='x'"),
    (lambda: memory_vs_depth([10], forms=("quick",)), "forms="),
])
def test_bad_input_raises_with_value(call, match) -> None:
    with pytest.raises(ValueError, match=match):
        call()


def test_memory_near_linear_for_efficient_forms(one_thread) -> None:
    df = memory_vs_depth([16, 28, 40, 58], forms=("naive", "checkpoint", "shared"), batch_size=2,
                         image_size=16, device="cpu", progress=False)
    fits = fit_growth_exponents(df).set_index("form")
    for form in ("checkpoint", "shared"):
        assert fits.loc[form, "exponent"] < 1.2, fits
        assert fits.loc[form, "local_exponent"] < 1.2, fits
    assert fits.loc["naive", "exponent"] > fits.loc["shared", "exponent"] + 0.3, fits
    deepest = df[df["depth"] == 58].set_index("form")["activation_peak_bytes"]
    assert deepest["shared"] < 0.6 * deepest["naive"]
    assert deepest["checkpoint"] < 0.6 * deepest["naive"]
    budget = deepest_within_budget(df, float(deepest["shared"])).set_index("form")
    assert budget.loc["shared", "deepest_depth"] == 58
    assert budget.loc["shared", "limited_by_sweep"]
    assert budget.loc["naive", "deepest_depth"] < 58


def test_fit_growth_exponents_recovers_known_powers() -> None:
    depths = [10, 40, 100, 250]
    df = [{"form": f, "depth": d, "activation_peak_bytes": 3.0 * d**p}
          for f, p in (("naive", 2.0), ("shared", 1.0)) for d in depths]
    import pandas as pd

    fits = fit_growth_exponents(pd.DataFrame(df)).set_index("form")
    assert math.isclose(fits.loc["naive", "exponent"], 2.0)
    assert math.isclose(fits.loc["shared", "local_exponent"], 1.0)


def test_time_per_minibatch_reports_paired_ratios(one_thread) -> None:
    df = time_per_minibatch(10, batch_size=2, image_size=8, rounds=2, warmup=0, device="cpu",
                            progress=False).set_index("form")
    assert set(df.index) == {"naive", "checkpoint", "shared"}
    assert df.loc["naive", "ratio_to_naive"] == 1.0
    assert (df["median_s"] > 0).all() and (df["min_s"] <= df["max_s"]).all()
    for ref in ("naive", "checkpoint"):
        lo, mid, hi = (df[f"ratio_to_{ref}{s}"] for s in ("_min", "", "_max"))
        assert ((lo <= mid) & (mid <= hi)).all()


def test_no_grad_inference_matches() -> None:
    torch.manual_seed(0)
    base = densenet_bc(16, 4, 3).eval()
    x = torch.randn(2, 3, 8, 8)
    with torch.no_grad():
        ref = base(x)
        for form in FORMS[1:]:
            base.memory = form
            torch.testing.assert_close(base(x), ref)
    assert F.softmax(ref, 1).shape == (2, 3)


def test_shared_form_runs_under_autocast() -> None:
    torch.manual_seed(0)
    base = densenet_bc(16, 4, 5)
    x = torch.randn(2, 3, 8, 8)

    def grads(form: str, autocast: bool) -> torch.Tensor:
        model = densenet_bc(16, 4, 5, memory=form)
        model.load_state_dict(base.state_dict())
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = model(x)
        out.float().square().sum().backward()
        assert all(p.grad.dtype == torch.float32 for p in model.parameters())
        return torch.cat([p.grad.flatten() for p in model.parameters()])

    ref = grads("naive", False)
    err = {f: ((grads(f, True) - ref).norm() / ref.norm()).item() for f in ("naive", "shared")}
    # shared computes conv1 in float32 where naive uses bfloat16: no further from float32
    assert err["shared"] <= 1.5 * err["naive"], err


def test_conv_contiguity_and_budget_edges() -> None:
    df = conv_contiguity((4, 8), batch_size=2, image_size=8, repeats=1, device="cpu",
                         progress=False)
    assert set(df["layout"]) == {"contiguous", "non-contiguous"}
    assert (df[df["layout"] == "contiguous"]["ratio_to_contiguous"] == 1.0).all()
    import pandas as pd

    mem = pd.DataFrame([{"form": f, "depth": d, "params": d, "activation_peak_bytes": b}
                        for f, d, b in (("naive", 10, 5.0), ("naive", 16, 9.0),
                                        ("shared", 10, 3.0), ("shared", 16, 4.0))])
    out = deepest_within_budget(mem, 4.0).set_index("form")
    assert math.isnan(out.loc["naive", "deepest_depth"])
    assert out.loc["shared", "deepest_depth"] == 16 and out.loc["shared", "limited_by_sweep"]
    with pytest.raises(ValueError, match="budget_bytes=0"):
        deepest_within_budget(mem, 0)


def test_plots_label_axes() -> None:
    import matplotlib

    matplotlib.use("Agg")
    df = memory_vs_depth([10, 16], forms=("naive", "shared"), batch_size=1, image_size=8, device="cpu",
                         progress=False)
    fig = plot_memory_vs_depth(df, fit_growth_exponents(df))
    assert all(ax.get_xlabel() and "MiB" in ax.get_ylabel() for ax in fig.axes)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none here)")
def test_forms_match_naive_on_cuda() -> None:
    kwargs = dict(growth_rate=4, block_config=(2, 3), num_classes=5)
    torch.manual_seed(0)
    base = _randomize_bn(DenseNet(**kwargs)).double()
    x = torch.randn(3, 3, 8, 8, dtype=torch.float64)
    results = {f: _run(m.cuda().train(), x.cuda(), steps=2)
               for f, m in _forms_from(base, **kwargs).items()}
    _assert_same(results)
    df = memory_vs_depth([16, 28, 40], forms=("naive", "shared"), batch_size=32, image_size=32,
                         device="cuda", progress=False)
    fits = fit_growth_exponents(df).set_index("form")
    assert fits.loc["shared", "local_exponent"] < 1.25, fits
    assert fits.loc["naive", "local_exponent"] > fits.loc["shared", "local_exponent"] + 0.2, fits


def test_out_of_memory_is_recorded_and_deeper_models_skipped(monkeypatch) -> None:
    import workbench.experiments.efficient_densenet.memory as bench

    real = bench.MemoryMeter

    class FailingMeter(real):  # naive "runs out of memory" from depth 16 on
        def __enter__(self):
            if self._fail:
                raise torch.OutOfMemoryError("simulated")
            return super().__enter__()

    calls = []

    def step_memory(depth, form, **kw):
        calls.append((depth, form))
        FailingMeter._fail = form == "naive" and depth >= 16
        return real_step(depth, form, **kw)

    real_step = bench.step_memory
    monkeypatch.setattr(bench, "MemoryMeter", FailingMeter)
    monkeypatch.setattr(bench, "step_memory", step_memory)
    df = bench.memory_vs_depth([10, 16, 22], forms=("naive", "shared"), batch_size=1,
                               image_size=8, device="cpu", progress=False)
    assert ((22, "naive") not in calls) and ((22, "shared") in calls)
    naive = df[df["form"] == "naive"].set_index("depth")
    assert list(naive["oom"]) == [False, True, True]
    assert naive["activation_peak_bytes"].iloc[1:].isna().all()
    fits = fit_growth_exponents(df).set_index("form")
    assert math.isnan(fits.loc["naive", "exponent"]) and fits.loc["shared", "points"] == 3
    budget = deepest_within_budget(df, 1e12).set_index("form")
    assert budget.loc["naive", "deepest_depth"] == 10
    assert not budget.loc["naive", "limited_by_sweep"]
