"""OpTorch's paper-scale plans (workbench/experiments/optorch/paper_scale.py): the planned step is the measured one
(the plan at a size that runs equals the tensor meter's peak, and the allocator's check sits beside it), and the
notebook's calls with nothing to plan give empty frames."""

from __future__ import annotations

import pandas as pd
import pytest
import torch

from workbench.data import ImageSet
from workbench.experiments.optorch import (
    accuracy_over_seeds, experiment_paper_scale, experiment_pipeline_memory, experiment_planned_memory,
    experiment_planned_sc, experiment_time_accuracy, plan_check,
)

TINY = {"batch": 4, "image_size": 8, "width": 1 / 16, "stem": "cifar"}


def test_the_plan_counts_what_the_meter_measures(one_thread):
    pipelines = ("B", "E-D", "M-P", "S-C", "M-P+S-C")
    planned = experiment_planned_memory(("resnet18",), pipelines, **TINY)
    measured = experiment_pipeline_memory(("resnet18",), pipelines=pipelines, allocator=True, progress=False, **TINY)
    check = plan_check(measured, planned)
    assert list(check.pipeline) == list(pipelines) and planned.affine.all()
    by = check.set_index("pipeline")
    # the same step under the same counting rule: equal to the byte without autocast and checkpoints; a
    # checkpointed segment adds the CPU generator's state it keeps, which the plan counts and the meter cannot see
    # (`measure.cpu_rng_state_as_op`); autocast's copies within 1%
    assert (by.planned_peak_bytes[["B", "E-D"]] == by.peak_bytes[["B", "E-D"]]).all(), check
    rng = torch.get_rng_state().numel()
    extra = by.planned_peak_bytes["S-C"] - by.peak_bytes["S-C"]
    assert extra >= 0 and extra % rng == 0, check
    assert by.error_vs_meter["M-P"] == pytest.approx(0, abs=0.01)
    assert (check.allocator_peak_bytes > 0).all()
    expected = check.planned_ratio / check.allocator_ratio - 1
    assert check.ratio_error.to_numpy() == pytest.approx(expected.to_numpy())
    assert check.loc[check.pipeline == "B", "ratio_error"].item() == 0


def test_a_plan_at_a_size_no_run_could_take_costs_no_memory():
    planned = experiment_planned_memory(("resnet50",), ("B", "S-C"), batch=64, image_size=1024)
    assert planned.planned_peak_bytes.min() > 2**34  # tens of GB, planned under fake tensors
    assert 0 < planned.set_index("pipeline").ratio_vs_B["S-C"] < 1


def test_fig8_planned_keeps_the_least_plan_and_checks_it_here(one_thread):
    df = experiment_planned_sc("resnet18", batch=4, image_size=32, here_batch=2, here_image_size=16, width=1 / 16,
                               budgets=1)
    by = df.set_index(["size", "variant"])
    assert set(by.index) == {(s, v) for s in ("paper", "here") for v in ("B", "S-C optimal")}
    here = by.loc["here"]
    assert here.planned_peak_bytes["B"] == here.peak_bytes["B"]  # the plan counts as the meter
    extra = here.planned_peak_bytes["S-C optimal"] - here.peak_bytes["S-C optimal"]
    assert extra >= 0 and extra % torch.get_rng_state().numel() == 0
    assert here.allocator_ratio["B"] == 1 and by.loc[("paper", "B"), "planned_ratio"] == 1
    assert pd.isna(by.loc[("paper", "S-C optimal"), "allocator_peak_bytes"])
    assert df.candidates.iloc[0] >= 1


def test_nothing_to_plan_gives_empty_frames():
    planned, check, fig8 = experiment_paper_scale(pd.DataFrame(), (), ("B",), fig8_model=None)
    assert planned.empty and check.empty and fig8.empty


def _digits() -> tuple[ImageSet, ImageSet]:
    g = torch.Generator().manual_seed(0)
    data = ImageSet(torch.randint(0, 256, (40, 1, 8, 8), dtype=torch.uint8, generator=g), torch.arange(40) % 10,
                    10, "tiny")
    return data.split(0.25, seed=0)


def test_accuracy_over_seeds_repeats_b_and_mp(one_thread):
    train, test = _digits()
    args = {"width": 1 / 16, "epochs": 1, "batch_size": 10, "seed": 0}
    main = experiment_time_accuracy(train, test, pipelines=("B", "M-P", "S-C"), progress=False, **args)
    seeds = accuracy_over_seeds(main, train, test, [3], **args)
    assert sorted(zip(seeds.seed, seeds.pipeline, strict=True)) == [(0, "B"), (0, "M-P"), (3, "B"), (3, "M-P")]
    first = main.groupby("pipeline").tail(1).set_index("pipeline").test_acc
    assert seeds[seeds.seed == 0].set_index("pipeline").test_acc.to_dict() == {k: first[k] for k in ("B", "M-P")}
    with pytest.raises(ValueError, match="differ from the main run's seed 0"):
        accuracy_over_seeds(main, train, test, [0], **args)
