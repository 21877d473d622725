"""CalcGraph ("CalcGraph: taming the high costs of deep learning using models", 2022): the plan
against MemoryMeter, Algorithm 1, the budget guard, heap binding and model switching."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from workbench.calcgraph import (
    ZONES, BudgetGuard, Heap, compile, make_optimizer, measure_required_bytes, search_max, train_many,
)
from workbench.models import MLP, resnet18


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
    return {name: compile(build, shape) for name, (build, shape, _) in CASES.items()}


@pytest.fixture(scope="module")
def mlp_heap_graph():
    return compile(MLP, (1, 28, 28), persistent_grads=True)


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
    per_zone = graph.zone_bytes(64).set_index("zone")["bytes_at_peak"]
    params = sum(p.numel() * 4 for p in MLP().parameters())
    assert per_zone["optimizer"] == 2 * params + 4 * 6  # exp_avg, exp_avg_sq, six float32 steps
    assert per_zone.sum() == graph.required_bytes(64)


def test_max_batch_size_is_the_largest_that_fits(graphs):
    graph = graphs["mlp"]
    budget = 3.0e6
    b = graph.max_batch_size(budget)
    assert graph.required_bytes(b) <= budget < graph.required_bytes(b + 1)
    with_margin = graph.max_batch_size(budget, margin=0.2)
    assert with_margin < b
    assert graph.required_bytes(with_margin) <= 0.8 * budget < graph.required_bytes(with_margin + 1)


def test_max_batch_size_refuses_a_budget_below_batch_one(graphs):
    graph = graphs["mlp"]
    need = graph.required_bytes(1)
    with pytest.raises(ValueError, match=f"batch size 1 needs {need} bytes"):
        graph.max_batch_size(need - 1)
    with pytest.raises(ValueError, match="margin"):
        graph.max_batch_size(1e9, margin=1.0)


def test_plan_agrees_with_a_real_run_under_the_guard(graphs):
    graph = graphs["mlp"]
    budget = 2.0e6
    b = graph.max_batch_size(budget)

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
    assert search_max(lambda n: False, 10) == (0, 1)


def test_guard_raises_an_out_of_memory_error_that_peers_recognise():
    guard = BudgetGuard(1000)
    with pytest.raises(torch.OutOfMemoryError, match="DefaultCPUAllocator: can't allocate memory"):
        with guard:
            torch.zeros(100)  # 400 bytes fit
            torch.zeros(1000)  # 4000 bytes do not
    assert guard.refusals == 1
    with pytest.raises(ValueError, match="budget_bytes"):
        BudgetGuard(0)
    accelerate = pytest.importorskip("accelerate.utils.memory")
    try:
        with BudgetGuard(10):
            torch.zeros(10)
    except torch.OutOfMemoryError as err:
        assert accelerate.should_reduce_batch_size(err)


def _plain(seed, x, y, steps):
    torch.manual_seed(seed)
    model = MLP()
    opt = make_optimizer("adam", model.parameters())
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        opt.step()
    return model


def _heap_step(heap, model, opt, x, y):
    heap.zero_grad()
    F.cross_entropy(model(x), y).backward()
    opt.step()


def _assert_same(a: nn.Module, b: nn.Module):
    for p, q in zip(a.state_dict().values(), b.state_dict().values(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0)


def test_heap_bound_training_is_bit_exact_and_stays_in_the_zones(mlp_heap_graph):
    x, y = torch.randn(32, 1, 28, 28), torch.randint(10, (32,))
    torch.manual_seed(3)
    model = MLP()
    opt = make_optimizer("adam", model.parameters())
    heap = Heap(mlp_heap_graph).bind(model, opt)
    ptrs = {z: (t.data_ptr(), t.data_ptr() + t.numel()) for z, t in heap.zones.items()}
    for _ in range(3):
        _heap_step(heap, model, opt, x, y)
    _assert_same(model, _plain(3, x, y, 3))

    def inside(t, zone):
        lo, hi = ptrs[zone]
        return lo <= t.data_ptr() < hi

    for p in model.parameters():
        assert inside(p, "forward") and inside(p.grad, "gradient")
        assert all(inside(v, "optimizer") for v in opt.state[p].values())


def test_switched_out_model_resumes_bit_exactly(mlp_heap_graph):
    x, y = torch.randn(16, 1, 28, 28), torch.randint(10, (16,))
    torch.manual_seed(5)
    model = MLP()
    opt = make_optimizer("adam", model.parameters())
    heap = Heap(mlp_heap_graph).bind(model, opt)
    _heap_step(heap, model, opt, x, y)
    _heap_step(heap, model, opt, x, y)
    saved_a = heap.save()
    heap.reinit(9, lr=5e-3)  # model B, another learning rate
    _heap_step(heap, model, opt, x, y)
    saved_b = heap.save()
    heap.load(saved_a)
    assert opt.param_groups[0]["lr"] == 1e-3
    _heap_step(heap, model, opt, x, y)
    _assert_same(model, _plain(5, x, y, 3))
    heap.load(saved_b)
    torch.manual_seed(9)
    b_ref = MLP()
    opt_b = torch.optim.Adam(b_ref.parameters(), lr=5e-3, foreach=False)
    F.cross_entropy(b_ref(x), y).backward()
    opt_b.step()
    _assert_same(model, b_ref)


def test_reinit_equals_a_freshly_built_model(mlp_heap_graph):
    model = MLP()
    heap = Heap(mlp_heap_graph).bind(model, make_optimizer("adam", model.parameters()))
    heap.reinit(11)
    torch.manual_seed(11)
    _assert_same(model, MLP())


def test_heap_refuses_a_model_that_does_not_match_the_plan(mlp_heap_graph):
    other = MLP((784, 32, 10))
    with pytest.raises(ValueError, match="parameters"):
        Heap(mlp_heap_graph).bind(other, make_optimizer("adam", other.parameters()))
    with pytest.raises(TypeError, match="CompiledGraph"):
        Heap(MLP())


@pytest.mark.parametrize("mode", ["loop", "vmap"])
def test_train_many_matches_models_trained_one_by_one(mode):
    x, y = torch.randn(32, 1, 28, 28), torch.randint(10, (32,))
    result = train_many(MLP, (x, y), memory_budget=3.0e6, rounds=2, n_models=3, mode=mode, seed=20)
    assert 1 <= result.plan.models and result.plan.bytes_needed <= 3.0e6
    assert len(result.history) == 3 * 2
    tol = {"rtol": 0, "atol": 0} if mode == "loop" else {"rtol": 1e-4, "atol": 1e-5}
    for i in range(3):
        ref = _plain(20 + i, x, y, 2)
        for name, value in ref.state_dict().items():
            torch.testing.assert_close(result.states[i][name], value, **tol)


def test_bad_input_is_refused_early():
    with pytest.raises(ValueError, match="sample_input"):
        compile(MLP, torch.zeros(5))
    with pytest.raises(ValueError, match="optimizer"):
        compile(MLP, (1, 28, 28), optimizer="lamb")
    with pytest.raises(TypeError, match="model"):
        compile(3, (1, 28, 28))
    with pytest.raises(ValueError, match="batch_size"):
        compile(MLP, (1, 28, 28)).required_bytes(0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA is not available: the CUDA plan needs a GPU")
def test_cuda_prediction_within_five_percent():
    from workbench.calcgraph import cuda_memory_budget

    for name in ("mlp", "resnet18"):
        build, shape, sizes = CASES[name]
        graph = compile(build, shape, device="cuda")
        for b in sizes:
            torch.cuda.empty_cache()
            measured = measure_required_bytes(build, shape, b, device="cuda")
            torch.testing.assert_close(float(graph.required_bytes(b)), float(measured), rtol=0.05, atol=0)
    with cuda_memory_budget(2**20) as fraction:
        assert 0 < fraction <= 1
        with pytest.raises(torch.OutOfMemoryError):
            torch.empty(2**24, device="cuda")
