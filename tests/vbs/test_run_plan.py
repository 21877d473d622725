"""workbench.vbs.run_plan: everything `vbs.run` does, from its first allocation to its return (shape
pass, execution, first-batch check), within the plan's predicted peak (+5%; the check within its
own prediction, `RunResult.predicted_call_bytes`) and never over the budget the plan was made for,
the request included as it is handed over; or a refusal before anything is allocated. Measured by
the allocator's running total over the whole call (`AllocatorMeter`), with the request allocated
inside the meter."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from workbench import vbs
from workbench.measure import AllocatorMeter
from workbench.models.densenet import densenet_bc

pytestmark = pytest.mark.usefixtures("one_thread")

SLACK = 1.05  # the issue's tolerance on the predicted peak; the budget itself has none


def issue_cnn() -> nn.Module:
    """Issue 47's plain 9-layer CNN for 64x64 inputs."""
    return nn.Sequential(
        nn.Conv2d(3, 24, 5, padding=2), nn.ReLU(), nn.Conv2d(24, 48, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(48, 12, 1), nn.ReLU(), nn.Conv2d(12, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(64, 16, 1), nn.Flatten(), nn.Linear(4096, 10)).eval()


class Scratch(nn.Module):
    """A CNN written here from scratch, its own forward: a stem, a residual block whose sum is
    followed by a ReLU, a two-branch concatenation, pooling and a classifier."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 16, 3, padding=1)
        self.body = nn.Sequential(nn.Conv2d(16, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                                  nn.Conv2d(16, 16, 3, padding=1))
        self.wide = nn.Conv2d(16, 24, 1)
        self.narrow = nn.Sequential(nn.MaxPool2d(3, 1, 1), nn.Conv2d(16, 8, 1))
        self.head = nn.Linear(32, 7)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.stem(x))
        x = F.relu(self.body(x) + x)
        x = torch.cat([self.wide(x), self.narrow(x)], 1)
        x = F.max_pool2d(x, 2)
        return self.head(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def whole_call(model: nn.Module, plan: vbs.Plan, x: torch.Tensor, *, check: bool):
    """(peak bytes of the allocator over the request's allocation and the whole `vbs.run`, its
    result or the UnexecutablePlan it raised)."""
    with torch.no_grad(), AllocatorMeter() as meter:
        request = x.clone() if plan.request == "kept" else [x[k:k + 1].clone() for k in range(x.shape[0])]
        try:
            result = vbs.run(model, plan, request, check=check, measure_memory=False)
        except vbs.UnexecutablePlan as refusal:
            result = refusal
        del request
    return meter.peak_bytes, result


def assert_within(model: nn.Module, plan: vbs.Plan, x: torch.Tensor, *, check: bool) -> float:
    peak, result = whole_call(model, plan, x, check=check)
    assert isinstance(result, vbs.RunResult), result
    with torch.no_grad():
        torch.testing.assert_close(result.outputs, model(x), rtol=1e-4, atol=1e-4)
    budget = plan.memory * plan.unit_bytes
    assert peak <= budget, (plan, peak, budget)
    # the plan's prediction for the execution; a check above it (one sample through the model beside
    # the request and the outputs) is predicted too, and may use what the budget leaves
    assert peak <= SLACK * result.predicted_call_bytes, (plan, peak, result.predicted_call_bytes)
    assert result.predicted_call_bytes <= budget
    if not check:
        assert peak <= SLACK * plan.peak_bytes, (plan, peak, plan.peak_bytes)
    return peak / result.predicted_call_bytes


@pytest.fixture(scope="module")
def issue():
    torch.manual_seed(0)
    model, x = issue_cnn(), torch.randn(12, 3, 64, 64)
    with torch.no_grad():
        torch.set_num_threads(1)
        tables = vbs.measure_layers(model, x[0], 12, repeats=1, warmup=1, min_run_time=0.0)
    return model, x, tables


def test_the_issue_repro_stays_within_its_budget_or_is_refused_before_it_starts(issue):
    """The issue: a plan at 1.1x the smallest budget, run on a tensor the caller keeps, peaked at
    1.157x the plan (the request, counted by the plan as freed sample by sample, stayed allocated).
    Now that plan is refused before anything is allocated, naming the bytes; the plan for a kept
    request, and the paper's plan with the request handed over, both stay within."""
    model, x, tables = issue
    low = vbs.smallest_budget(tables, batch=12)
    p = vbs.plan(tables, memory=int(1.1 * low), batch=12)
    assert p.request == "pieces"
    with torch.no_grad(), AllocatorMeter() as meter:
        kept = x.clone()
        try:
            result = vbs.run(model, p, kept, check=False, measure_memory=False)
        except vbs.UnexecutablePlan as refusal:
            result = refusal
        del kept
    request = x.numel() * x.element_size()
    if isinstance(result, vbs.UnexecutablePlan):
        assert meter.peak_bytes - request < 1024  # refused before allocating anything of its own (fake shapes)
        assert f"{p.peak_bytes:,} bytes" in str(result) and "request='kept'" in str(result)
    else:
        assert meter.peak_bytes <= min(SLACK * p.peak_bytes, int(1.1 * low))
    # the same request handed over sample by sample, as the plan counts it
    assert_within(model, p, x, check=False)
    # a plan for the request the caller keeps, at 1.1x its own smallest budget
    low_kept = vbs.smallest_budget(tables, batch=12, request="kept")
    kept_plan = vbs.plan(tables, memory=int(1.1 * low_kept), batch=12, request="kept")
    assert kept_plan.request == "kept" and kept_plan.peak_bytes <= int(1.1 * low_kept)
    for check in (False, True):
        assert_within(model, kept_plan, x, check=check)


@pytest.mark.parametrize("net", ["scratch", "densenet"])
def test_cnns_outside_the_test_set_stay_within(net):
    """A CNN written here and a DenseNet-BC (neither in the other tests): the DP's, FBS's and
    Greedy-VBS's plans for both hand-overs at three budgets, checked and not."""
    torch.manual_seed(1)
    model = Scratch().eval() if net == "scratch" else densenet_bc(10, 6, 10).eval()
    x = torch.randn(5, 3, 32, 32)
    tables = vbs.measure_layers(model, x[0], 5, repeats=1, warmup=1, min_run_time=0.0)
    ratios, refused = [], 0
    for request in vbs.REQUESTS:
        low = vbs.smallest_budget(tables, batch=5, request=request)
        for scale in (1.0, 1.3, 2.0):
            memory = int(scale * low)
            plans = [vbs.plan(tables, memory=memory, batch=5, request=request)]
            for make in (vbs.fbs, vbs.greedy_vbs):
                try:
                    plans.append(make(tables, memory=memory, batch=5, request=request))
                except ValueError:
                    pass
            for p, check in ((p, check) for p in plans for check in (False, True)):
                peak, result = whole_call(model, p, x, check=check)
                if isinstance(result, vbs.UnexecutablePlan):  # only the check may not fit a plan's budget
                    assert check and "first-batch check" in str(result), result
                    assert peak - x.numel() * x.element_size() < 1024
                    refused += 1
                    continue
                ratios.append(assert_within(model, p, x, check=check))
    assert max(ratios) > 0.85 and refused <= len(ratios) // 4  # close, not padded; most checks fit


def test_the_shapes_are_read_without_allocating(issue):
    model, x, tables = issue
    p = vbs.plan(tables, memory=vbs.smallest_budget(tables, batch=12, request="kept"), batch=12, request="kept")
    ex = vbs.Executor(model, p, check=False)
    with torch.no_grad(), AllocatorMeter() as meter:
        ex.prepare(x)
    assert meter.peak_bytes < 1024 and ex.executed_peak <= p.peak_bytes
    # at its smallest budget, the plan leaves no room for the check's sample beside the outputs
    with pytest.raises(vbs.UnexecutablePlan, match=r"first-batch check .* needs comparison [\d,]+ bytes"):
        vbs.Executor(model, p).prepare(x)


def test_measure_memory_counts_the_request_the_caller_keeps(issue):
    model, x, tables = issue
    p = vbs.plan(tables, memory=2 * vbs.smallest_budget(tables, batch=12, request="kept"), batch=12, request="kept")
    result = vbs.run(model, p, x)
    assert result.checked and result.input_bytes == x.numel() * x.element_size()
    assert result.input_bytes < result.peak_bytes <= p.peak_bytes and result.memory_ratio > 0.9
    with pytest.raises(ValueError, match="a list of samples is consumed by its first"):
        vbs.run(model, p, [x[k:k + 1].clone() for k in range(12)])


class Gate(nn.Module):
    """Reads a value (`.item()`), which fake tensors cannot: the shapes need one real sample."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * x.new_ones(()).item()


def test_a_model_fake_tensors_cannot_run_is_shaped_by_one_counted_sample():
    torch.manual_seed(2)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), Gate(), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                          nn.Linear(8 * 8 * 8, 4)).eval()
    x = torch.randn(4, 3, 16, 16)
    tables = vbs.measure_layers(model, x[0], 4, repeats=1, warmup=1, min_run_time=0.0)
    low = vbs.smallest_budget(tables, batch=4, request="kept")
    p = vbs.plan(tables, memory=2 * low, batch=4, request="kept")
    for check in (False, True):
        assert_within(model, p, x, check=check)
    bare = vbs.Plan.from_json(p.to_json().replace(f'"check": {p.check}', '"check": 0'))
    with pytest.raises(vbs.UnexecutablePlan, match="cannot be read with fake tensors.*does not carry Plan.check"):
        vbs.run(model, bare, x, check=False, measure_memory=False)
