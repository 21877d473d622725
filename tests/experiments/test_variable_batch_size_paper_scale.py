"""The memory-only rows at the paper's size from shapes alone (issue 44): the meta-tensor tables give exactly the
`in` and `out` bytes `vbs.measure_layers` measures on the real model, no working space, and the sweep of FBS and
Greedy-VBS on them at 224x224 costs seconds."""

import numpy as np
import pytest
import torch

import workbench.experiments.variable_batch_size as exp
from workbench import vbs


@pytest.mark.parametrize("network", ["resnet50", "googlenet"])
def test_shape_tables_equal_the_measured_inputs_and_outputs(network):
    torch.manual_seed(0)
    model = exp.build_network(network, width=0.125)
    measured = vbs.measure_layers(model, torch.randn(3, 32, 32), 3, repeats=1, warmup=0, min_run_time=0.0)
    with torch.device("meta"):
        meta = exp.build_network(network, width=0.125)
    shapes = exp.shape_tables(meta, image_size=32, max_batch=3)
    assert shapes.names == measured.names and set(shapes.branches) == set(measured.branches)
    np.testing.assert_array_equal(shapes.inp, measured.inp)
    np.testing.assert_array_equal(shapes.out, measured.out)
    for i, parts in shapes.branches.items():
        for mine, theirs in zip(parts, measured.branches[i], strict=True):
            assert mine.names == theirs.names
            np.testing.assert_array_equal(mine.inp, theirs.inp)
            np.testing.assert_array_equal(mine.out, theirs.out)
    assert not shapes.ws.any() and (shapes.time == 1).all() and shapes.merge == measured.merge
    with pytest.raises(ValueError, match="image_size must be >= 16"):
        exp.shape_tables(meta, image_size=8)


def test_paper_scale_sweep_at_224_full_width():
    sweep = exp.paper_scale_sweep(request=12, ratios=[1.0, 1.33, 2.0])
    assert set(sweep.method) == {"fbs", "greedy"} and set(sweep.network) == {"resnet50", "googlenet"}
    assert (sweep.image_size == 224).all() and (sweep.width == 1.0).all() and (sweep.source == exp.SHAPES).all()
    fbs = sweep[sweep.method == "fbs"]
    # FBS's batch never shrinks as the budget grows; a fitting plan holds at least one sample
    for _, g in fbs[fbs.feasible].groupby("network"):
        assert (np.diff(g.sort_values("budget_units").max_batch) >= 0).all() and (g.max_batch >= 1).all()
    unused = exp.fbs_unused(sweep, ratio=1.33, request=12)
    assert len(unused) and ((unused.fbs_unused_fraction >= 0) & (unused.fbs_unused_fraction < 1)).all()
    assert unused.paper_fbs_unused_fraction.notna().sum() == 10  # the ten layers Table III lists
    assert exp.fbs_unused(sweep, network="resnet50", ratio=1.0, request=12).empty  # FBS cannot serve it there
