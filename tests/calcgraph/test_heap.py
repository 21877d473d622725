"""CalcHeap (Sections 3.1 and 3.3 of "CalcGraph: taming the high costs of deep learning using models",
2022): heap-bound training is bit-exact and stays in its zones; model switching resumes bit-exactly."""

import pytest
import torch
import torch.nn.functional as F

from workbench.calcgraph import Heap, make_optimizer
from workbench.models import MLP


def _heap_step(heap, model, opt, x, y):
    heap.zero_grad()
    F.cross_entropy(model(x), y).backward()
    opt.step()


def test_heap_bound_training_is_bit_exact_and_stays_in_the_zones(mlp_heap_graph, plain, same):
    x, y = torch.randn(32, 1, 28, 28), torch.randint(10, (32,))
    torch.manual_seed(3)
    model = MLP()
    opt = make_optimizer("adam", model.parameters())
    heap = Heap(mlp_heap_graph).bind(model, opt)
    ptrs = {z: (t.data_ptr(), t.data_ptr() + t.numel()) for z, t in heap.zones.items()}
    for _ in range(3):
        _heap_step(heap, model, opt, x, y)
    same(model, plain(3, x, y, 3))

    def inside(t, zone):
        lo, hi = ptrs[zone]
        return lo <= t.data_ptr() < hi

    for p in model.parameters():
        assert inside(p, "forward") and inside(p.grad, "gradient")
        assert all(inside(v, "optimizer") for v in opt.state[p].values())


def test_switched_out_model_resumes_bit_exactly(mlp_heap_graph, plain, same):
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
    same(model, plain(5, x, y, 3))
    heap.load(saved_b)
    torch.manual_seed(9)
    b_ref = MLP()
    opt_b = torch.optim.Adam(b_ref.parameters(), lr=5e-3, foreach=False)
    F.cross_entropy(b_ref(x), y).backward()
    opt_b.step()
    same(model, b_ref)


def test_reinit_equals_a_freshly_built_model(mlp_heap_graph, same):
    model = MLP()
    heap = Heap(mlp_heap_graph).bind(model, make_optimizer("adam", model.parameters()))
    heap.reinit(11)
    torch.manual_seed(11)
    same(model, MLP())


def test_heap_refuses_a_model_that_does_not_match_the_plan(mlp_heap_graph):
    other = MLP((784, 32, 10))
    with pytest.raises(ValueError, match="parameters"):
        Heap(mlp_heap_graph).bind(other, make_optimizer("adam", other.parameters()))
    with pytest.raises(TypeError, match="CompiledGraph from calcgraph.plan_training"):
        Heap(MLP())
