"""OpTorch's data flow: encoding capacity (the float64 trap), encoded sizes, selective batch sampling, loaders."""

from __future__ import annotations

import matplotlib
import torch
from matplotlib.figure import Figure

from workbench.data import ImageSet
from workbench.experiments.optorch import (
    capacity_at,
    exact_capacity,
    experiment_capacity,
    experiment_encoded_bytes,
    experiment_loaders,
    experiment_sbs,
    plot_capacity,
    plot_loader_throughput,
)

matplotlib.use("Agg")


def test_capacity_finds_the_float64_trap() -> None:
    df = experiment_capacity(17, image_size=2)
    # a float64 holds integers exactly only up to 2**53: 6 uint8 images (Algorithm 4: 7), never 16 or 32
    assert exact_capacity(df) == {"float32": 3, "float64": 6, "float64-7bit": 7, "int64": 8}
    at16 = capacity_at(df, (16,)).set_index("scheme")
    assert at16.max_abs_error["float64"] > 0 and at16.exact_fraction["float64"] < 1
    assert isinstance(plot_capacity(df), Figure)


def test_encoded_bytes_int64_is_the_uint8_batch() -> None:
    df = experiment_encoded_bytes(16, image_size=8).set_index("form")
    assert df.size_vs_uint8["int64"] == 1.0 and df.saving_vs_float32["int64"] == 4.0
    assert df.saving_vs_float32["float32 normalised (B)"] == 1.0
    assert df.saving_vs_float32[["float64", "float64-7bit", "int64"]].max() == 4.0


def test_sbs_through_encoding() -> None:
    g = torch.Generator().manual_seed(0)
    data = ImageSet(torch.randint(0, 256, (60, 1, 6, 6), dtype=torch.uint8, generator=g),
                    torch.arange(60) % 10, 10, "tiny")
    weights = [0.05] * 10
    weights[3], weights[8] = 0.3, 0.3
    batches, shares = experiment_sbs(data, weights, batch_size=16, num_batches=5)
    assert (batches.max_diff_vs_unencoded == 0).all()
    assert (shares.abs_error <= 1 / 80 + 1e-12).all() and (shares.abs_error_examples <= 1 + 1e-9).all()
    assert batches[[f"class {c}" for c in range(10)]].sum(axis=1).eq(16).all()


def test_loaders_rows() -> None:
    df = experiment_loaders(64, image_size=4, epochs=1, workers=[0])
    assert (df.images_per_s > 0).all() and (df.images == 64).all()
    assert isinstance(plot_loader_throughput(df), Figure)
