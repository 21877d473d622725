"""Fig 3's update throughput of the packed-bit notebook: format-name configs, the step timed as a training
loop runs it (new gradient tensors each step) with the kernel alone beside it, the two independent timings,
the bytes counted per step, the bandwidth-share ratio the ledger reads, and the figures' toy-scale mark
(Memory Efficient Mixed Precision Optimizers, Lewandowski & Kosson)."""

import importlib.util

import matplotlib.pyplot as plt
import pytest
import torch

from workbench.experiments.packed_bit_optimizers import plot_throughput, step_throughput, throughput_share_ratio
from workbench.experiments.packed_bit_optimizers.cpu_throughput import bytes_per_param
from workbench.experiments.packed_bit_optimizers.throughput import steps_in_a_row, training_step
from workbench.optim import PackedAdamW


def test_throughput_takes_format_names_and_gives_the_share_ratio(one_thread):
    df = step_throughput(numel=4096, n_tensors=2, configs=["bf16+8", ("bf16", 16)], repeats=2, compile=False,
                         progress=False, bandwidth=1e9)
    steps = ["torch AdamW fused (fp32)", "Packed AdamW bf16+8 fused eager", "Packed AdamW bf16+16 fused eager"]
    assert list(df["method"]) == steps + [f"{m} (kernel alone)" for m in steps[1:]]
    assert list(df["timed"]) == ["step"] * 3 + ["kernel"] * 2
    assert list(df["bytes_per_param"]) == [28.0, 2 + 2 + 2 + 2 + 16, 2 + 2 + 2 + 4 + 16] + [24.0, 26.0]
    # a 4096-value step takes microseconds: each timed sample runs many steps in a row
    assert df["calls_per_sample"].nunique() == 1 and df["calls_per_sample"].iloc[0] > 1
    # both timings, each with its spread and bandwidth fraction
    for column in ("median_s", "ratio_lo", "ratio_hi", "bandwidth_fraction", "inarow_median_s", "ratio_inarow_lo",
                   "ratio_inarow_hi", "bandwidth_fraction_inarow"):
        assert df[column].notna().all() and (df[column] > 0).all(), column
    assert (df["ratio_inarow_lo"] <= df["ratio_inarow"]).all() and (df["ratio_inarow"] <= df["ratio_inarow_hi"]).all()
    assert df["ratio_paired"].iloc[0] == df["ratio_inarow"].iloc[0] == 1.0
    value, lo, hi = throughput_share_ratio(df, "Packed AdamW bf16+8 fused eager")
    row = df.iloc[1]
    # bytes/s over torch's bytes/s = steps/s ratio x bytes ratio
    assert value == pytest.approx(row["ratio_median_vs_torch_fused"] * 24 / 28)
    assert lo == pytest.approx(row["ratio_lo"] * 24 / 28) and hi == pytest.approx(row["ratio_hi"] * 24 / 28)
    assert throughput_share_ratio(df, "no such method") is None
    with pytest.raises(ValueError, match="packed format"):
        step_throughput(numel=64, n_tensors=1, configs=["fp32"], repeats=1, progress=False, bandwidth=1e9)
    fig = plot_throughput(df, note="toy scale: not evidence")
    assert "toy scale: not evidence" in fig.get_suptitle()
    assert plot_throughput(df).get_suptitle() == ""
    plt.close("all")


def test_a_training_step_hands_the_optimizer_new_gradient_tensors_each_step():
    opt, step = training_step(lambda ps: PackedAdamW(ps, extra_bits=8, fused=True), [40, 24], torch.bfloat16,
                              torch.device("cpu"))
    params = opt.param_groups[0]["params"]
    seen = []
    for _ in range(3):
        step()
        seen.append([p.grad.data_ptr() for p in params])
    assert seen[0] != seen[1] and seen[0] == seen[2]  # two sets made beforehand, alternated
    assert all(opt.state[p]["step"] == 3 for p in params)
    times = steps_in_a_row(step, 4, 3, torch.device("cpu"))
    assert len(times) == 3 and all(t > 0 for t in times)


def test_compiled_too_times_the_compiled_step_beside_the_kernel(one_thread):
    # the hand-written kernel's gain over the torch.compile'd step of the same format, in the same run
    from workbench.optim import cpu_kernel
    from workbench.optim.fused import compile_available

    if not (cpu_kernel.available() and compile_available("cpu")):
        pytest.skip("needs the C++ kernel and torch.compile on CPU")
    df = step_throughput(numel=4096, n_tensors=2, configs=["bf16+8"], repeats=2, progress=False, bandwidth=1e9,
                         compiled_too=True)
    assert list(df["method"]) == ["torch AdamW fused (fp32)", "Packed AdamW bf16+8 fused cpu kernel",
                                  "Packed AdamW bf16+8 fused compiled",
                                  "Packed AdamW bf16+8 fused cpu kernel (kernel alone)",
                                  "Packed AdamW bf16+8 fused compiled (kernel alone)"]
    assert df["median_s"].notna().all()


def test_the_cpu_table_times_the_optimizer_step_beside_the_kernel(one_thread):
    from workbench.experiments.packed_bit_optimizers.cpu_throughput import kernel_throughput
    from workbench.experiments.packed_bit_optimizers.throughput import _config
    from workbench.optim import cpu_kernel

    if not cpu_kernel.available():
        pytest.skip("needs the C++ kernel")
    df = kernel_throughput(numel=4096, threads=1, repeats=3, compiled=False, n_tensors=2,
                           formats=[(torch.bfloat16, 8, False, torch.float32)])
    assert list(df["method"]) == ["torch AdamW fused (fp32)", "step bf16+8 (cpu kernel)", "kernel bf16+8"]
    assert (df["ratio"] > 0).all() and (df["ratio_lo"] <= df["ratio_hi"]).all() and df["load_before"].notna().all()
    # a notebook profile names bf16 moments in the format's text
    assert _config("bf16+8 bf16 states")[1] == {"state_dtype": torch.bfloat16}
    # and the master rounding (issue 46: nearest's step timed beside truncation's)
    assert _config("bf16+8 nearest bf16 states")[1] == {"master_rounding": "nearest", "state_dtype": torch.bfloat16}
    assert _config("bf16+8")[1] == {}
    assert _config("bf16+8 int8 states")[1] == {"state_dtype": torch.int8}


def test_the_command_times_each_tensor_count_and_names_flashoptim_cuda_only_on_a_cpu(tmp_path, one_thread):
    """Issue 46: the kernels part's tables in 64 and in 512 tensors (here 2 and 4), the CSV written after each, and
    FlashOptim's own format a row that says it needs CUDA, never a gap."""
    import pandas as pd

    from workbench.experiments.packed_bit_optimizers import throughput

    csv = tmp_path / "k.csv"
    throughput.main(["--sizes", "4096", "--tensors", "2", "4", "--threads", "1", "--repeats", "2", "--configs",
                     "bf16+8", "--peers", "--no-backward", "--csv", str(csv)])
    df = pd.read_csv(csv)
    assert sorted(set(df["n_tensors"])) == [2, 4]
    assert (df.groupby("n_tensors")["method"].apply(list).apply(len) == len(df) // 2).all()
    flash = df[df["method"].str.startswith("FlashOptim")]
    if importlib.util.find_spec("flashoptim") is not None and not torch.cuda.is_available():
        assert len(flash) == 2 and flash["method"].str.contains("[unavailable: CUDA only (", regex=False).all()
        assert flash["median_s"].isna().all() and (flash["bytes_per_param"] == 12.25).all()


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_bytes_moved_count_the_moments_the_optimizer_holds(state_dtype):
    """The analytic bytes per parameter (bandwidth fractions, the int8 target's definition) against the state a
    PackedAdamW step leaves: weights r/w and gradient read (6), then every state tensor read and written."""
    p = torch.nn.Parameter(torch.randn(4096).to(torch.bfloat16))
    p.grad = torch.randn(4096).to(torch.bfloat16)
    opt = PackedAdamW([p], extra_bits=8, state_dtype=state_dtype, fused=True)
    opt.step()
    held = sum(v.untyped_storage().nbytes() for v in opt.state[p].values() if isinstance(v, torch.Tensor))
    assert bytes_per_param(8, False, state_dtype) == 6 + 2 * held / p.numel()
