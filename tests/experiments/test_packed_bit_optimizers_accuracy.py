"""Accuracy by format over seeds, fp8+k emulation, paired gaps and the addition-error study of the
packed-bit notebook (Memory Efficient Mixed Precision Optimizers, Lewandowski & Kosson)."""

import pandas as pd
import pytest
import torch

from workbench.data import synthetic_images
from workbench.experiments.packed_bit_optimizers import (
    accuracy_by_format,
    addition_error,
    fp8_extra_bits,
    load_task,
    paired_gap,
    truncate_significand,
    truncate_to_e5m2,
)
from workbench.models import MLP


def test_accuracy_memory_counts_the_state_it_used_to_miss():
    data = synthetic_images(64, shape=(1, 4, 4), num_classes=3, seed=0)
    train_set, test_set = data.split(0.25, seed=0)

    def model_fn():
        return MLP(sizes=(16, 64, 64, 3), activation="relu")

    df = accuracy_by_format(model_fn, train_set, test_set, formats=["fp32"], epochs=1, lr=0.01, batch_size=8,
                            seeds=[0, 1], task="tiny MLP", progress=False)
    assert list(df["seed"]) == [0, 1] and df["peak_bytes"].iloc[1] != df["peak_bytes"].iloc[1]  # NaN: first seed only
    assert set(df["task"]) == {"tiny MLP"}
    params = int(df["params"].iloc[0])
    # parameters + gradients + SGD momentum = 12 B/param at least (it measured about 8 before)
    assert df["peak_bytes"].iloc[0] >= 12 * params


def test_load_task_digits_is_the_same_split_as_before():
    model_fn, train_set, test_set, desc = load_task("digits", hidden=8, seed=0)
    assert (len(train_set), len(test_set)) == (1438, 359) and desc == "MLP 64-8-8-10 on digits (1438 train)"
    assert model_fn()(train_set.images[:2].float().flatten(1)).shape == (2, 10)
    hard = load_task("synthetic", hidden=8, n=50, size=4, seed=0)
    assert len(hard[1]) == 40 and "synthetic" in hard[3]
    with pytest.raises(ValueError, match="dataset"):
        load_task("imagenet")
    with pytest.raises(ValueError, match="model"):
        load_task("digits", model="vgg")


def test_fp8_emulation_keeps_k_more_bits():
    x = torch.tensor([1.0, 1.2, -3.7, 65504.0, 1e-3]).half()
    torch.testing.assert_close(truncate_significand(x, 10), x)
    torch.testing.assert_close(truncate_significand(x, 2), truncate_to_e5m2(x))
    six = truncate_significand(x, 6).float()
    assert ((six - x.float()).abs() <= (truncate_to_e5m2(x).float() - x.float()).abs()).all()
    assert (fp8_extra_bits("fp8"), fp8_extra_bits("fp8+4"), fp8_extra_bits("fp16+8")) == (0, 4, None)
    with pytest.raises(ValueError, match="0..8"):
        fp8_extra_bits("fp8+9")
    with pytest.raises(ValueError, match="0..10"):
        truncate_significand(x, 11)
    with pytest.raises(TypeError, match="float16"):
        truncate_significand(x.float(), 2)


def test_paired_gap():
    df = pd.DataFrame({"regime": "r", "seed": [0, 0, 1, 1], "format": ["a", "b", "a", "b"],
                       "test_acc": [0.90, 0.85, 0.80, 0.82]})
    mean, lo, hi = paired_gap(df, "r", "a", "b")
    torch.testing.assert_close(torch.tensor([mean, lo, hi]), torch.tensor([1.5, -2.0, 5.0]), rtol=0, atol=1e-9)
    assert paired_gap(df, "r", "a", "b", absolute=True)[1] == pytest.approx(2.0)
    with pytest.raises(ValueError, match="no format"):
        paired_gap(df, "r", "a", "c")


def test_e5m2_truncation_and_addition_error_shape():
    x = torch.tensor([1.0, 1.2, -3.7, 65504.0]).half()
    t = truncate_to_e5m2(x)
    torch.testing.assert_close(t.float(), torch.tensor([1.0, 1.0, -3.5, 57344.0]))
    df = addition_error(sizes=[100], n_ops=[1, 50], width=256)
    assert set(df["format"]) == {"fp16", "fp16+8", "fp16+8 SR", "fp16+8 nearest"} and (df["rel_error"] >= 0).all()
    many = df[(df["panel"] == "many ops") & (df["ops"] == 50)].set_index("format")["rel_error"]
    assert many["fp16+8"] < many["fp16"]  # extra bits stop the error from accumulating
    assert many["fp16+8 nearest"] < many["fp16+8"]  # the remainder kept signed: the visible value rounded to nearest
    one = df[df["panel"] == "one op"].set_index("format")["rel_error"]
    assert one["fp16+8 nearest"] == pytest.approx(one["fp16"], rel=1e-6)  # one addition: the sum rounded to nearest


def test_nearest_packed_addition_is_the_fp16_sum_rounded_to_nearest():
    """One `x += y` in fp16+8 nearest from an exact fp16 x shows the sum rounded to nearest (within half an fp16 ulp;
    a tie may go the other way from fp16's own sum, which rounds ties to even); its master (fp16 value plus the
    signed remainder) is the sum to within the 8 extra bits, half truncation's worst error."""
    from workbench.experiments.packed_bit_optimizers.accuracy import _add_packed
    from workbench.optim.split_merge import merge_values

    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(4096, generator=gen).half(), torch.randn(4096, generator=gen).half()
    exact = x.double() + y.double()
    ulp = torch.ldexp(torch.ones(4096, dtype=torch.float64), torch.frexp(exact)[1] - 11)  # the sum's fp16 ulp
    errors = {}
    for rounding in ("nearest", "truncate"):
        half, bits = _add_packed(x, torch.zeros(4096, dtype=torch.int32), y, 8, rounding, gen)
        seen = ((half.double() - exact).abs() / ulp).max().item()
        assert seen <= 0.5 if rounding == "nearest" else seen < 1.0, (rounding, seen)
        master = merge_values(half, bits, extra_bits=8, nearest=rounding == "nearest")
        errors[rounding] = ((master.double() - exact).abs() / ulp).max().item()
    assert errors["nearest"] <= 2**-9 and errors["truncate"] <= 2**-8
    assert errors["nearest"] < 0.75 * errors["truncate"]
