"""Training-step times of the packed-bit notebook (Memory Efficient Mixed Precision Optimizers, Lewandowski &
Kosson): paired spreads, per-round records, the device time beside the wall time, and the workloads timed."""

import pytest
import torch

from workbench.data import synthetic_images
from workbench.experiments.packed_bit_optimizers import (
    paired_ratio,
    round_times,
    rounds_ratio,
    speed_workload,
    step_time_by_format,
)
from workbench.models import MLP


def _mlp():
    return MLP(sizes=(128, 128, 128, 10), activation="relu")


def test_paired_ratio_and_its_saved_form():
    times = {"x": [1.0, 2.0, 4.0], "base": [2.0, 2.0, 6.0]}
    ratio, lo, hi = paired_ratio(times, "x", "base")
    assert (ratio, lo, hi) == (1.0, 1.0, 2.0)
    rounds = round_times(times)
    assert list(rounds.columns) == ["name", "round", "seconds"] and len(rounds) == 6
    # the rounds re-pair from the saved table exactly as from the dict, whatever the row order
    assert rounds_ratio(rounds.iloc[::-1], "x", "base") == (ratio, lo, hi)
    assert rounds_ratio(rounds, "x", "missing") is None


def test_step_times_pair_fused_with_per_parameter_and_carry_spreads():
    gen = torch.Generator().manual_seed(0)
    batch = (torch.randn(4, 128, generator=gen), torch.randint(10, (4,), generator=gen))
    df = step_time_by_format(_mlp, batch, formats=["fp32", "amp", "fp16+8"], repeats=3, fused=True,
                             progress=False)
    assert list(df["format"]) == ["fp32", "amp", "fp16+8", "fp16+8 fused"]
    assert (df["speedup_vs_amp_lo"] <= df["speedup_vs_amp"] + 1e-12).all()
    assert (df["speedup_vs_amp"] <= df["speedup_vs_amp_hi"] + 1e-12).all()
    assert set(df.attrs["times"]) == set(df["format"])
    rounds = round_times(df.attrs["times"])
    assert set(rounds["name"]) == set(df["format"]) and set(rounds["round"]) == {0, 1, 2}


def test_step_times_carry_the_device_time_beside_the_wall_time(one_thread):
    gen = torch.Generator().manual_seed(0)
    batch = (torch.randn(4, 128, generator=gen), torch.randint(10, (4,), generator=gen))
    df = step_time_by_format(_mlp, batch, formats=["fp32", "fp16+8"], repeats=2, fused=True, workload="MLP 128",
                             progress=False)
    assert (df["kernel_s"] > 0).all() and (df["kernel_share"] == df["kernel_s"] / df["median_s"]).all()
    assert set(df["device"]) == {"cpu"} and set(df["workload"]) == {"MLP 128"} and set(df["batch"]) == {4}


def test_speed_workloads_are_table3s_resnet_or_a_task():
    model_fn, (x, y), text = speed_workload("resnet18", 3, seed=0)
    assert x.shape == (3, 3, 32, 32) and y.shape == (3,) and "ResNet-18" in text
    model = model_fn()
    assert sum(p.numel() for p in model.parameters()) > 11e6  # the paper's 64 channels: 11.2M parameters
    data = synthetic_images(10, shape=(1, 4, 4), num_classes=3, seed=0)
    task = (lambda: MLP(sizes=(16, 3)), data, data, "tiny task")
    fn, (x, _), text = speed_workload("task", 5, task=task)
    assert x.shape[0] == 5 and text == "tiny task" and fn is task[0]
    with pytest.raises(ValueError, match="must be one of"):
        speed_workload("vgg", 4)
    with pytest.raises(ValueError, match="needs task="):
        speed_workload("task", 4)
    with pytest.raises(ValueError, match="batch must be >= 1, got 0"):
        speed_workload("resnet18", 0)
