"""CalcGraph's model compiler (`plan_training`, Section 3.2 of "CalcGraph: taming the high costs of deep
learning using models", 2022): the plan against MemoryMeter, the zones, Algorithm 1 and bad input."""

import pytest
import torch
from torch import nn

from workbench.calcgraph import ZONES, BudgetGuard, measure_required_bytes, plan_training, search_max
from workbench.models import MLP, resnet18
from tests.conftest import requires_cuda


def cnn() -> nn.Module:
    return nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                         nn.Linear(4 * 6 * 6, 10))


CASES = {  # name: (factory, per-example shape, batch sizes)
    "mlp": (MLP, (1, 28, 28), (1, 64, 256)),
    "cnn": (cnn, (1, 12, 12), (1, 16)),
    "resnet18": (lambda: resnet18(10, width=8), (3, 16, 16), (1, 3)),
}


@pytest.fixture(scope="module")
def graphs():
    return {name: plan_training(build, shape, calibrate=False) for name, (build, shape, _) in CASES.items()}


def test_compile_is_gone_and_plan_training_is_the_name():
    import workbench.calcgraph as calcgraph

    assert "compile" not in calcgraph.__all__ and not hasattr(calcgraph, "compile")
    assert "plan_training" in calcgraph.__all__


@pytest.mark.parametrize("name", CASES)
def test_prediction_within_one_percent_of_memory_meter(graphs, name):
    build, shape, sizes = CASES[name]
    graph = graphs[name]
    assert graph.affine and graph.nonaffine.empty
    for b in sizes:
        measured = measure_required_bytes(build, shape, b)
        predicted = graph.required_bytes(b)
        # NOTE: the plan also counts the scalars torch.tensor() makes from Python numbers
        # (Adam's step, BatchNorm's counter), which reach no aten allocation op in eager mode.
        torch.testing.assert_close(float(predicted), float(measured), rtol=0.01, atol=0)


def test_zones_sum_to_the_peak(graphs):
    graph = graphs["mlp"]
    zones = graph.zones(64)
    assert set(zones["zone"].astype(str)) <= set(ZONES)
    assert zones.loc[zones["live_at_peak"], "bytes"].sum() == graph.required_bytes(64)
    per_zone = graph.zone_bytes(64).set_index("zone")
    params = sum(p.numel() * 4 for p in MLP().parameters())
    assert per_zone.loc["optimizer", "bytes_at_peak"] == 2 * params + 4 * 6  # exp_avg, exp_avg_sq, six steps
    assert per_zone["bytes_at_peak"].sum() == graph.required_bytes(64)
    # a static layout (every variable at its own offset) needs at least the dynamic peak
    assert per_zone["bytes_allocated_in_step"].sum() == zones["bytes"].sum() >= graph.required_bytes(64)


def test_max_batch_size_is_the_largest_that_fits(graphs):
    graph = graphs["mlp"]
    budget = 3.0e6
    with pytest.warns(UserWarning, match="not calibrated"):  # margin 0 covers tensors only
        b = graph.max_batch_size(budget)
    assert graph.required_bytes(b) <= budget < graph.required_bytes(b + 1)
    with_margin = graph.max_batch_size(budget, margin=0.2)
    assert with_margin < b
    assert graph.required_bytes(with_margin) <= 0.8 * budget < graph.required_bytes(with_margin + 1)


def test_max_batch_size_refuses_a_budget_below_batch_one(graphs):
    graph = graphs["mlp"]
    need = graph.required_bytes(1)
    with pytest.raises(ValueError, match=f"batch size 1 needs {need} bytes"):
        graph.max_batch_size(need - 1, margin=0.0)
    with pytest.raises(ValueError, match="margin"):
        graph.max_batch_size(1e9, margin=1.0)


def test_plan_agrees_with_a_real_run_under_the_guard(graphs):
    graph = graphs["mlp"]
    budget = 2.0e6
    b = graph.max_batch_size(budget, margin=0.0)  # the guard counts tensors as the plan does

    def runs(batch):
        guard = BudgetGuard(budget)
        try:
            with guard:
                measure_required_bytes(MLP, (1, 28, 28), batch)
            return True
        except torch.OutOfMemoryError:
            return False
        finally:
            guard.close()

    assert [runs(b), runs(b + 1)] == [True, False]


def test_search_max_matches_a_linear_scan():
    for limit in (1, 7, 100, 1000):
        for guess in (1, 3, 50, 5000):
            found, calls = search_max(lambda n, limit=limit: n <= limit, guess)
            assert found == limit and calls < 40
    assert search_max(lambda n: False, 10) == (0, 4)  # 10, 5, 2, 1
    asked = []
    assert search_max(lambda n: asked.append(n) or n <= 3, 4)[0] == 3 and 1 not in asked  # 1 only where 2 fails


def test_bad_input_is_refused_early():
    with pytest.raises(ValueError, match="sample_input"):
        plan_training(MLP, torch.zeros(5))
    with pytest.raises(ValueError, match="optimizer"):
        plan_training(MLP, (1, 28, 28), optimizer="lamb")
    with pytest.raises(TypeError, match="model"):
        plan_training(3, (1, 28, 28))
    with pytest.raises(ValueError, match="batch_size"):
        plan_training(MLP, (1, 28, 28)).required_bytes(0)


@requires_cuda
def test_cuda_prediction_within_five_percent():
    from workbench.calcgraph import cuda_memory_budget

    for name in ("mlp", "resnet18"):
        build, shape, sizes = CASES[name]
        graph = plan_training(build, shape, device="cuda")
        for b in sizes:
            torch.cuda.empty_cache()
            measured = measure_required_bytes(build, shape, b, device="cuda")
            torch.testing.assert_close(float(graph.required_bytes(b)), float(measured), rtol=0.05, atol=0)
    with cuda_memory_budget(2**20) as fraction:
        assert 0 < fraction <= 1
        with pytest.raises(torch.OutOfMemoryError):
            torch.empty(2**24, device="cuda")
