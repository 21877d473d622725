"""Fig 3's update throughput of the packed-bit notebook: format-name configs, the bytes counted per step,
the bandwidth-share ratio the ledger reads, and the figures' toy-scale mark (Memory Efficient Mixed
Precision Optimizers, Lewandowski & Kosson)."""

import matplotlib.pyplot as plt
import pytest

from workbench.experiments.packed_bit_optimizers import plot_throughput, step_throughput, throughput_share_ratio


def test_throughput_takes_format_names_and_gives_the_share_ratio(one_thread):
    df = step_throughput(numel=4096, n_tensors=2, configs=["bf16+8", ("bf16", 16)], repeats=2, compile=False,
                         progress=False, bandwidth=1e9)
    assert list(df["method"]) == ["torch AdamW fused (fp32)", "Packed AdamW bf16+8 fused eager",
                                  "Packed AdamW bf16+16 fused eager"]
    assert list(df["bytes_per_param"]) == [28.0, 2 + 2 + 2 + 2 + 16, 2 + 2 + 2 + 4 + 16]
    # a 4096-value step takes microseconds: each timed sample runs many steps in a row
    assert df["calls_per_sample"].nunique() == 1 and df["calls_per_sample"].iloc[0] > 1
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


def test_compiled_too_times_the_compiled_step_beside_the_kernel(one_thread):
    # the hand-written kernel's gain over the torch.compile'd step of the same format, in the same run
    from workbench.optim import cpu_kernel
    from workbench.optim.fused import compile_available

    if not (cpu_kernel.available() and compile_available("cpu")):
        pytest.skip("needs the C++ kernel and torch.compile on CPU")
    df = step_throughput(numel=4096, n_tensors=2, configs=["bf16+8"], repeats=2, progress=False, bandwidth=1e9,
                         compiled_too=True)
    assert list(df["method"]) == ["torch AdamW fused (fp32)", "Packed AdamW bf16+8 fused cpu kernel",
                                  "Packed AdamW bf16+8 fused compiled"]
    assert df["median_s"].notna().all()
