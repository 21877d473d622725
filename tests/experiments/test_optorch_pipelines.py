"""OpTorch pipelines (Fig 9, Fig 10): each switch against the baseline, on networks from workbench.models.build."""

from __future__ import annotations

import matplotlib
import pytest
import torch
from matplotlib.figure import Figure

from workbench.data import ImageSet, normalize
from workbench.data.encode import encode
from workbench.devices import seed_everything
from workbench.experiments.optorch import (
    PIPELINES,
    Pipeline,
    experiment_pipeline_memory,
    experiment_time_accuracy,
    measure_step,
    plot_pipeline_memory,
    plot_time_accuracy,
    prepare,
    time_accuracy_summary,
)
from workbench.models import build

matplotlib.use("Agg")
NARROW = 4 / 64  # stage width 4: the multiplier build() takes


def test_the_six_pipelines() -> None:
    assert list(PIPELINES) == ["B", "E-D", "M-P", "S-C", "E-D+S-C", "M-P+S-C", "E-D+M-P+S-C"]
    assert PIPELINES["E-D+M-P+S-C"] == Pipeline(True, True, True)


def test_prepare_switches_match_baseline() -> None:
    images = torch.randint(0, 256, (4, 3, 8, 8), dtype=torch.uint8)
    seed_everything(0)
    base = build("resnet18", width=NARROW)
    ref = base(normalize(images))
    for name in ("E-D", "S-C", "E-D+S-C"):
        model, dtype, scaler = prepare(base, PIPELINES[name], device="cpu")
        assert dtype is None and scaler is None
        x = encode(images, scheme="int64") if PIPELINES[name].encode else normalize(images)
        torch.testing.assert_close(model(x), ref)
    _, dtype, scaler = prepare(base, PIPELINES["M-P"], device="cpu")
    assert dtype == torch.bfloat16 and scaler is None


def test_width_is_the_multiplier_of_build_and_unknown_models_are_refused() -> None:
    # width 4/64 is the narrow ResNet the old integer width 4 built: stage widths 4, 8, 16, 32
    assert build("resnet18", width=NARROW).fc.in_features == 32
    with pytest.raises(ValueError, match="resnet18"):
        experiment_pipeline_memory(("vgg16",), batch=2, image_size=8, width=NARROW, progress=False)


def _tiny_set() -> tuple[ImageSet, ImageSet]:
    g = torch.Generator().manual_seed(0)
    data = ImageSet(torch.randint(0, 256, (24, 1, 8, 8), dtype=torch.uint8, generator=g),
                    torch.arange(24) % 3, 3, "tiny")
    return data.split(0.25, seed=0)


def test_time_accuracy_same_batches_give_same_training(one_thread) -> None:
    train, test = _tiny_set()
    df = experiment_time_accuracy(train, test, width=NARROW, epochs=2, batch_size=6,
                                  pipelines=("B", "E-D", "S-C", "E-D+S-C", "M-P"), progress=False)
    # the baseline augments and normalises per batch in the training thread, E-D in its thread:
    # the same random flips and crops, so the losses match exactly
    assert df.augment.all()
    assert len(df) == 10 and {"test_acc", "robust_cum_seconds", "median_step_s"} <= set(df.columns)
    assert {"dataset", "image_shape", "train_images", "test_images", "threads", "cores"} <= set(df.columns)
    assert df.dataset.iloc[0] == "tiny" and df.image_shape.iloc[0] == "1x8x8" and df.test_images.iloc[0] == 6
    loss = df.pivot(index="epoch", columns="pipeline", values="loss")
    # exact encoding and exact recomputation leave training unchanged
    for name in ("E-D", "S-C", "E-D+S-C"):
        torch.testing.assert_close(torch.tensor(loss[name].values), torch.tensor(loss["B"].values))
    summary = time_accuracy_summary(df)
    assert list(summary.pipeline) == ["B", "E-D", "S-C", "E-D+S-C", "M-P"] and (summary.epoch == 2).all()
    b = summary.set_index("pipeline").loc["B"]
    assert b.time_ratio_vs_B == 1.0 and b.min_step_ratio_vs_B == 1.0
    assert isinstance(plot_time_accuracy(df), Figure)


def test_pipeline_memory_rows_and_checkpoint_saves(one_thread) -> None:
    df = experiment_pipeline_memory(("resnet18",), batch=8, image_size=16, width=8 / 64,
                                    pipelines=("B", "S-C", "E-D"), progress=False)
    peaks = df.set_index("pipeline").peak_bytes
    assert df.set_index("pipeline").ratio_vs_B["B"] == 1.0
    assert peaks["S-C"] < peaks["B"]
    assert (df.stem == "cifar").all() and (df.width == 0.125).all()
    assert isinstance(plot_pipeline_memory(df), Figure)


def test_measure_step_counts_the_input_alike() -> None:
    """B's float batch and E-D's encoded batch both cross inside the measured region."""
    images = torch.randint(0, 256, (8, 3, 8, 8), dtype=torch.uint8)
    labels = torch.arange(8) % 10
    seed_everything(0)
    base = build("resnet18", width=NARROW)
    peaks = {}
    for name in ("B", "E-D"):
        model, _, _ = prepare(base, PIPELINES[name], device="cpu")
        peaks[name], _ = measure_step(model, images, labels, PIPELINES[name], device="cpu")
    # E-D holds the same float batch as B, plus at most its encoded words (uint8-sized)
    assert 0 <= peaks["E-D"] - peaks["B"] <= encode(images, scheme="int64").nbytes
