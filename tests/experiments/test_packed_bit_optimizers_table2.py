"""Table 2 at the paper's architecture (transformers' T5 from flan-T5 large's configuration, random weights) and the
device's used memory beside the tensor peak, of the packed-bit notebook (Lewandowski & Kosson, section 4)."""

import math
import warnings

import matplotlib.pyplot as plt
import pytest
import torch

import workbench.experiments.packed_bit_optimizers.table2 as table2
from tests.conftest import requires_cuda
from workbench.experiments.packed_bit_optimizers import (
    DEVICE_COLUMNS,
    T5Classifier,
    device_memory_by_format,
    flan_t5_config,
    fused_backward,
    make_model,
    memory_by_format,
    parse_format,
    planned_fused_backward,
    plot_fused_backward,
    t5_available,
    used_memory,
)
from workbench.experiments.packed_bit_optimizers.peers import FLASH, FLASH_PLAIN, make_peer, peer_label, peer_peak
from workbench.measure import MemoryMeter
from workbench.models import MLP

needs_t5 = pytest.mark.skipif(not t5_available(), reason="Table 2's T5 needs transformers (pip install transformers)")


@needs_t5
def test_the_config_is_flan_t5_large_and_scales_proportionally():
    large = flan_t5_config()
    assert (large.d_model, large.num_layers, large.num_decoder_layers, large.num_heads, large.d_kv) == (
        1024, 24, 24, 16, 64)
    assert (large.d_ff, large.vocab_size, large.feed_forward_proj, large.dropout_rate) == (2816, 32128, "gated-gelu",
                                                                                           0.1)
    with torch.device("meta"):  # shapes only: 750M parameters, no memory
        params = sum(p.numel() for p in T5Classifier(large).parameters())
    assert params == pytest.approx(751.3e6, rel=1e-3)  # flan-T5 large's 783M less its 32.9M LM head, plus the head
    small = flan_t5_config(256, 4)
    assert (small.num_heads, small.d_ff, small.vocab_size) == (4, 704, round(32128 / 4 / 6))


@needs_t5
@pytest.mark.parametrize("kw, match", [({"d_model": 100}, "multiple of 64 .*, got 100"),
                                       ({"layers": 0}, "layers >= 1")])
def test_bad_configs_are_refused(kw, match):
    with pytest.raises(ValueError, match=match):
        flan_t5_config(**kw)


def test_without_transformers_the_refusal_names_the_install(monkeypatch):
    monkeypatch.setattr(table2, "t5_available", lambda: False)
    with pytest.raises(ImportError, match="pip install transformers"):
        fused_backward(d_model=64, layers=1, batch=2, seq=4, steps=1, repeats=1, progress=False)


@needs_t5
def test_fused_backward_records_the_ceiling_kernel_time_and_device_columns(one_thread):
    df = fused_backward(d_model=64, layers=1, batch=2, seq=8, steps=1, repeats=2, progress=False, peers=())
    assert list(df["step_in_backward"]) == [False, True]
    base, sib = df.iloc[0], df.iloc[1]
    assert sib["peak_bytes"] < base["peak_bytes"] and sib["peak_phase"] in {"forward", "backward", "end"}
    assert sib["time_ratio_lo"] <= sib["time_ratio"] <= sib["time_ratio_hi"]
    # one step: the optimizer state is created at the step, where every gradient is live
    assert base["peak_phase"] == "step" and base["ceiling"] == base["peak_gradients"] / base["peak_bytes"] > 0.1
    assert (df["ceiling"] == base["ceiling"]).all() and (df["kernel_s"] > 0).all()
    assert all(math.isnan(v) for c in DEVICE_COLUMNS for v in df[c])  # CUDA only
    assert df["model"].iloc[0].startswith("T5 d_model 64, 1+1 layers")
    config = flan_t5_config(64, 1)
    tokens = table2._token_batches(config.vocab_size, 3, 5, 2, seed=0)
    assert all((t[:, -1] == 1).all() and (t[:, :-1] >= 2).all() for t, _ in tokens)
    logits = T5Classifier(config).eval()(tokens[0][0])
    assert logits.shape == (3, 2)


def test_device_memory_by_format_adds_the_devices_reading_to_the_tensor_peak(one_thread):
    gen = torch.Generator().manual_seed(0)
    batches = [(torch.randn(2, 16, generator=gen), torch.randint(4, (2,), generator=gen))]

    def mlp():
        torch.manual_seed(0)
        return MLP(sizes=(16, 16, 4), activation="relu")

    memory_by_format(mlp, batches, formats=["fp16+8"], progress=False)  # the process's first run holds 4 B more
    df = device_memory_by_format(mlp, batches, formats=["amp", "fp16+8"], progress=False)
    plain = memory_by_format(mlp, batches, formats=["amp", "fp16+8"], progress=False)
    assert list(df["peak_bytes"]) == list(plain["peak_bytes"]) and list(df["ratio_vs_amp"]) == list(
        plain["ratio_vs_amp"])
    assert df[list(DEVICE_COLUMNS)].isna().all().all()
    with used_memory("cpu") as reading:
        pass
    assert set(reading) == set(DEVICE_COLUMNS) and all(math.isnan(v) for v in reading.values())


@requires_cuda
def test_cuda_used_memory_is_context_plus_the_allocators_peak_reserve():
    with used_memory("cuda") as reading:
        x = torch.empty(64 * 2**20, dtype=torch.uint8, device="cuda")
        del x
    assert reading["reserved_peak_bytes"] >= 64 * 2**20 and reading["context_bytes"] > 0
    assert reading["device_peak_bytes"] == reading["context_bytes"] + reading["reserved_peak_bytes"]
    assert reading["device_used_after_bytes"] >= reading["context_bytes"]


def test_without_transformers_the_notebook_shows_table2_as_not_run():
    """The notebook's Table 2 cell passes an empty frame where transformers is absent: a figure that says why,
    and rows that are not measured (never a verdict)."""
    import pandas as pd

    from workbench.experiments.packed_bit_optimizers import claims, plot_fused_backward

    fig = plot_fused_backward(pd.DataFrame())
    assert any("needs transformers" in t.get_text() for t in fig.texts)
    rows = claims.ledger({"fused_backward": pd.DataFrame(), "fused_backward_plan": pd.DataFrame()}, {},
                         device="cpu", device_class="cpu", verdicts=True).rows
    table2 = [r for r in rows if "(Table 2" in r["claim"]]
    assert len(table2) == 4 and all(r["verdict"] == "not run at this scale" for r in table2)


def _flash_plain_peak(model_fn, batches, *, in_backward: bool, optimizer: str) -> int:
    """The peak of FlashOptim's CPU path written out with its own API around MemoryMeter (parameters added from
    their sizes, as measure_peak counts them), not through the peer helpers."""
    import flashoptim

    torch.manual_seed(0)
    model = make_model(model_fn, parse_format("bf16"), "cpu")
    cls, extra = (flashoptim.FlashSGD, {"momentum": 0.9}) if optimizer == "sgd" else (flashoptim.FlashAdamW, {})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        opt = cls(model.parameters(), lr=1e-3, weight_decay=0.0, quantize=False, master_weight_bits=None,
                  fused=False, **extra)
    release = flashoptim.enable_gradient_release(model, opt) if in_backward else None
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    with MemoryMeter("cpu") as meter:
        for x, y in batches:
            torch.nn.functional.cross_entropy(model(x).float(), y).backward()
            if release is None:
                opt.step()
                opt.zero_grad(set_to_none=True)
    if release is not None:
        release.remove()
    return params + meter.peak_bytes


@needs_t5
def test_flashoptim_rows_beside_table_2_cuda_only_on_a_cpu_and_its_cpu_path_measured(one_thread):
    pytest.importorskip("flashoptim")
    df = fused_backward(d_model=64, layers=1, batch=2, seq=8, steps=1, repeats=2, progress=False,
                        peers=(FLASH, FLASH_PLAIN))
    assert list(df["format"]) == ["fp32", "fp32", FLASH, FLASH, FLASH_PLAIN, FLASH_PLAIN]
    flash = df[df["format"] == FLASH]
    assert not flash["available"].any() and flash["note"].str.startswith("unavailable: CUDA only").all()
    assert flash["peak_bytes"].isna().all() and flash["step_s"].isna().all()
    plain = df[df["format"] == FLASH_PLAIN].reset_index(drop=True)
    assert plain["available"].all() and list(plain["step_in_backward"]) == [False, True]
    # its own gradient release frees the gradients: the in-backward peak holds fewer of them, and is lower
    assert plain.loc[1, "peak_gradients"] < plain.loc[0, "peak_gradients"]
    assert plain.loc[1, "peak_bytes"] < plain.loc[0, "peak_bytes"] and plain.loc[0, "peak_ratio"] == 1.0
    assert plain.loc[1, "time_ratio_lo"] <= plain.loc[1, "time_ratio"] <= plain.loc[1, "time_ratio_hi"]
    fig = plot_fused_backward(df)
    assert "not run: " + FLASH in fig.get_suptitle() and len(fig.axes[0].patches) == 4
    plt.close(fig)


@needs_t5
def test_the_peer_rows_peak_is_the_peak_of_its_own_loop(one_thread):
    pytest.importorskip("flashoptim")
    config = flan_t5_config(64, 1)
    batches = table2._token_batches(config.vocab_size, 2, 8, 2, seed=0)

    def model_fn():
        torch.manual_seed(0)
        return T5Classifier(config)

    for sib in (False, True):
        row = peer_peak(FLASH_PLAIN, model_fn, batches, in_backward=sib, lr=1e-3)
        assert row["peak_bytes"] == _flash_plain_peak(model_fn, batches, in_backward=sib, optimizer="adamw")


def test_table_3_peers_run_their_sgd_form_and_say_why_not(one_thread):
    pytest.importorskip("flashoptim")
    gen = torch.Generator().manual_seed(0)
    batches = [(torch.randn(2, 16, generator=gen), torch.randint(4, (2,), generator=gen)) for _ in range(2)]

    def mlp():
        torch.manual_seed(0)
        return MLP(sizes=(16, 16, 4), activation="relu")

    df = device_memory_by_format(mlp, batches, formats=["amp"], progress=False,
                                 peers=[FLASH, FLASH_PLAIN, "optimi bf16 + Kahan"], in_backward=(False,))
    rows = df.set_index("format")
    assert list(df["format"]) == ["amp", peer_label(FLASH, "sgd"), peer_label(FLASH_PLAIN, "sgd"),
                                  "optimi bf16 + Kahan"]
    assert peer_label(FLASH, "sgd") == "FlashOptim FlashSGD (24-bit master, 8-bit momentum)"
    assert rows.loc[peer_label(FLASH, "sgd"), "note"].startswith("unavailable: CUDA only")
    assert rows.loc["optimi bf16 + Kahan", "note"] == "optimi: only its AdamW is set up here"
    plain = rows.loc[peer_label(FLASH_PLAIN, "sgd")]
    params = sum(p.numel() for p in mlp().parameters())
    # its CPU path keeps the momentum at the weights' precision: 2 bytes a parameter, nothing else
    assert plain["available"] and plain["peak_optimizer_state"] == 2 * params
    assert plain["peak_bytes"] == _flash_plain_peak(mlp, batches, in_backward=False, optimizer="sgd")
    assert isinstance(make_peer("torch fp32", mlp().parameters(), lr=0.1, optimizer="sgd"), torch.optim.SGD)


@needs_t5
def test_table_2_planned_at_a_size_is_what_the_run_at_that_size_measures(one_thread):
    df = planned_fused_backward(d_model=64, layers=1, batch=2, seq=8, check=(64, 1, 2, 8))
    assert list(zip(df["size"], df["program"], strict=True)) == [("paper", "ordinary"), ("paper", "in backward"),
                                                   ("paper", "ordinary, gradients kept"), ("check", "ordinary"),
                                                   ("check", "in backward")]
    run = fused_backward(d_model=64, layers=1, batch=2, seq=8, steps=2, repeats=1, progress=False, peers=())
    check = df[df["size"] == "check"]
    for sib in (False, True):  # the plan of the program against MemoryMeter's run of Table 2's own code
        planned = check[check["step_in_backward"] == sib]["planned_bytes"].iloc[0]
        measured = run[run["step_in_backward"] == sib]["peak_bytes"].iloc[0]
        assert planned == pytest.approx(measured, rel=1e-3)
    # and against the allocator's own count of the same program run for real, kernels' scratch included
    assert (check["plan_error"] == check["planned_bytes"] / check["allocator_bytes"] - 1).all()
    assert check["plan_error"].between(-0.05, 0.05).all() and df[df["size"] == "paper"]["allocator_bytes"].isna().all()
    paper = df[df["size"] == "paper"].set_index("program")
    params = sum(p.numel() for p in T5Classifier(flan_t5_config(64, 1)).parameters())
    # gradients kept between steps: every fp32 gradient is alive at the peak, which they raise
    assert paper.loc["ordinary, gradients kept", "gradients_at_peak"] == 4 * params == paper["params"].iloc[0] * 4
    assert paper.loc["ordinary, gradients kept", "planned_bytes"] > paper.loc["ordinary", "planned_bytes"]
    with pytest.raises(ValueError, match="need d_model, layers, batch, seq >= 1"):
        planned_fused_backward(batch=0)
    with pytest.raises(ValueError, match=r"check: \(d_model, layers, batch, seq\), each >= 1, got \(64, 1, 2\)"):
        planned_fused_backward(check=(64, 1, 2))
