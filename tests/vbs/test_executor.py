"""workbench.vbs.executor: every plan (DP, FBS, Greedy-VBS) run on the real model equals model(x)."""

import numpy as np
import pytest
import torch
from torch import nn

from vbs_custom_nets import CUSTOM

from workbench import vbs
from workbench.models import googlenet, squeezenet1_0

pytestmark = pytest.mark.usefixtures("one_thread")


def synthetic_tables(model: nn.Module, B: int, seed: int) -> vbs.LayerProfile:
    """Random tables with the model's stage structure: any schedule a planner picks must execute."""
    rng = np.random.default_rng(seed)
    b = np.arange(1, B + 1)

    def chain(n: int, first_in: bool = True) -> vbs.LayerProfile:
        size = rng.integers(1, 5, n + 1)
        inp = size[:-1, None] * b
        if not first_in and n:
            inp[0] = 0
        t = rng.uniform(1, 2, (n, B)) / (1 + rng.uniform(0, 1, (n, 1)) * (b - 1))
        return vbs.LayerProfile(t, inp, size[1:, None] * b, rng.integers(0, 5, (n, B)))

    stages = vbs.stages_of(model)
    main = chain(len(stages))
    main.names = [s.name for s in stages]
    main.branches = {i: [chain(len(br), False) for br in s.branches] for i, s in enumerate(stages) if s.is_branch}
    main.merge = {i: stages[i].merge for i in main.branches}
    for i in main.branches:
        main.ws[i] = 0
    main.__post_init__()
    return main


def _plans(tables: vbs.LayerProfile, batch: int) -> dict[str, vbs.Plan]:
    low = vbs.Planner(tables, memory=vbs.fbs_peak(tables, batch=batch, size=1)).smallest_feasible(batch)
    mid = (low + vbs.fbs_peak(tables, batch=batch, size=batch)) // 2
    out = {"vbs_tight": vbs.dp(tables, memory=low, batch=batch), "vbs_mid": vbs.dp(tables, memory=mid, batch=batch),
           "fbs": vbs.fbs(tables, memory=mid, batch=batch), "best": vbs.plan(tables, memory=mid, batch=batch)}
    try:
        out["greedy"] = vbs.greedy_vbs(tables, memory=mid, batch=batch)
    except ValueError:
        pass
    return out


@pytest.mark.parametrize("net", ["linear", "branched", "resnet18"])
def test_executor_equals_the_model(net, nets):
    model = nets[net]()
    batch = 5
    x = torch.randn(batch, 3, 8, 8)
    with torch.no_grad():
        want = model(x)
    for seed in range(2):
        plans = _plans(synthetic_tables(model, batch, seed), batch)
        assert any(len(bs) > 1 for p in plans.values() for bs in p.layer_batches.values())
        for name, p in plans.items():
            # NOTE: synthetic tables, not this model's sizes: its memory is not what they predict
            result = vbs.run(model, vbs.Plan.from_json(p.to_json()), x, measure_memory=name == "vbs_mid",
                             check_memory=False)
            torch.testing.assert_close(result.outputs, want, msg=name)
            assert result.seconds > 0 and result.predicted_peak_bytes == p.peak_bytes
            if name == "vbs_mid":
                assert result.peak_bytes > result.input_bytes > 0


def test_executor_on_measured_tables(nets):
    model = nets["branched"]()
    tables = vbs.measure_layers(model, torch.randn(3, 8, 8), 4, repeats=1, warmup=0).coarsen(64)
    x = torch.randn(4, 3, 8, 8)
    # a tensor the caller keeps: its plan counts the request whole (the paper's frees each sample)
    memory = vbs.fbs_peak(tables, batch=4, size=2) + int(tables.inp[0, 3])
    p = vbs.plan(tables, memory=memory, batch=4, request="kept")
    result = vbs.run(model, p, x)
    with torch.no_grad():
        torch.testing.assert_close(result.outputs, model(x))
    assert result.peak_bytes > 0 and result.time_ratio > 0 and result.memory_ratio > 0


@pytest.mark.parametrize("factory", [googlenet, squeezenet1_0])
def test_plans_execute_on_the_branched_models(factory):
    model = factory(5, width=0.125).eval()
    tables = vbs.measure_layers(model, torch.randn(3, 32, 32), [1, 4], repeats=1, warmup=0).coarsen(1024)
    memory = vbs.fbs_peak(tables, batch=4, size=2) + int(tables.inp[0, 3])
    p = vbs.dp(tables, memory=memory, batch=4, request="kept")
    x = torch.randn(4, 3, 32, 32)
    result = vbs.run(model, p, x, measure_memory=False)
    with torch.no_grad():
        torch.testing.assert_close(result.outputs, model(x))
    assert p.time_per_sample <= vbs.fbs(tables, memory=p.memory, batch=4, request="kept").time_per_sample


def test_executor_rejects_a_plan_for_another_model(nets):
    tables = synthetic_tables(nets["linear"](), 2, 0)
    p = vbs.dp(tables, memory=vbs.fbs_peak(tables, batch=2, size=2), batch=2)
    with pytest.raises(ValueError, match="plan was made for layers"):
        vbs.Executor(nets["branched"](), p)
    with pytest.raises(ValueError, match="request of 2"):
        vbs.Executor(nets["linear"](), p)(torch.randn(3, 3, 8, 8))
    with pytest.raises(TypeError, match="Plan"):
        vbs.Executor(nets["linear"](), "plan")


# --- never silently wrong ---------------------------------------------------------------------


class BatchMix(nn.Module):
    """Subtracts the batch mean: a sample's output depends on the other samples of its phase."""

    def forward(self, x):
        return x - x.mean(0, keepdim=True)


class Scale(nn.Module):
    """Multiplies by a Python float, which torch.fx fixes when it traces."""

    def __init__(self) -> None:
        super().__init__()
        self.factor = 1.0

    def forward(self, x):
        return x * self.factor


def _phased(model: nn.Module, batch: int = 5, size: int = 2) -> vbs.Plan:
    """Every layer in phases of `size` (the last one the remainder)."""
    return vbs.fixed_batch_plan(synthetic_tables(model, batch, 0), batch=batch, size=size)


@pytest.mark.parametrize("net", list(CUSTOM))
def test_custom_forwards_run_correctly(net):
    """The look-alike block (body/shortcut/relu, another forward) and a user's own models: every
    plan's outputs equal model(x)."""
    model = CUSTOM[net]()
    x = torch.randn(5, 3, 8, 8)
    with torch.no_grad():
        want = model(x)
    tables = synthetic_tables(model, 5, 1)
    for p in [*_plans(tables, 5).values(), _phased(model)]:
        result = vbs.run(model, p, x, measure_memory=False, check_memory=False)
        assert result.checked
        torch.testing.assert_close(result.outputs, want)


def test_a_stage_that_mixes_samples_is_refused_by_name():
    model = nn.Sequential(nn.Conv2d(3, 4, 1), BatchMix(), nn.Flatten(), nn.Linear(4 * 64, 2)).eval()
    x = torch.randn(5, 3, 8, 8)
    p = _phased(model)
    with pytest.raises(vbs.ExecutionMismatch, match=r"stage 1 '1' gives other outputs in phases of \[2, 2, 1\]"):
        vbs.run(model, p, x, check_memory=False)
    ex = vbs.Executor(model, p, check_memory=False)
    with pytest.raises(vbs.ExecutionMismatch, match="No outputs are returned"):
        ex(x)
    # only an explicit opt-out returns the (different) outputs
    unchecked = vbs.run(model, p, x, check=False, measure_memory=False, check_memory=False)
    assert not unchecked.checked
    with torch.no_grad():
        assert not torch.allclose(unchecked.outputs, model(x))
    # the check compares every sample with the model's forward on it alone (within the plan's memory,
    # where a forward of the whole request is not): even a plan of whole-request phases is refused,
    # since VBS needs outputs that do not depend on the rest of the batch
    whole = vbs.fixed_batch_plan(synthetic_tables(model, 5, 0), batch=5, size=5)
    with pytest.raises(vbs.ExecutionMismatch, match=r"stage 1 '1' gives other outputs for one sample alone"):
        vbs.run(model, whole, x, check_memory=False, measure_memory=False)


def test_a_trace_that_no_longer_matches_the_forward_is_refused():
    model = nn.Sequential(nn.Conv2d(3, 4, 1), Scale(), nn.Flatten()).eval()
    ex = vbs.Executor(model, _phased(model), check_memory=False)
    model[1].factor = 2.0  # the stages were traced with 1.0
    with pytest.raises(vbs.ExecutionMismatch, match="torch.fx's trace of Sequential does not compute"):
        ex(torch.randn(5, 3, 4, 4))


def test_a_stage_that_departs_from_the_forward_is_named(nets):
    model = nets["linear"]()
    ex = vbs.Executor(model, _phased(model), check_memory=False)
    ex.stages[2].module = nn.Sequential(nn.MaxPool2d(2), nn.Identity())  # "5": was a MaxPool2d(2) alone...
    ex.stages[3].module = nn.Sequential(nn.Conv2d(32, 4, 1), nn.ReLU())  # "6": other weights
    with pytest.raises(vbs.ExecutionMismatch, match="stage 3 '6' does not reproduce its part of Sequential"):
        ex(torch.randn(5, 3, 8, 8))


def test_the_check_costs_one_forward_of_each_sample_on_the_first_batch_only(nets):
    model = nets["resnet18"]()
    calls = []
    model.register_forward_hook(lambda module, args, out: calls.append(args[0].shape[0]))
    x = torch.randn(5, 3, 8, 8)
    ex = vbs.Executor(model, _phased(model), check_memory=False)
    first = ex(x)
    assert calls == [1] * 5 and ex.checked
    torch.testing.assert_close(ex(x), first)
    assert len(calls) == 5
    vbs.run(model, _phased(model), x, check_memory=False)
    assert len(calls) == 10
    vbs.run(model, _phased(model), x, check=False, check_memory=False)
    assert len(calls) == 10


def test_inputs_changed_in_place_are_checked_against_the_original():
    model = nn.Sequential(nn.ReLU(inplace=True), nn.Conv2d(3, 4, 1)).eval()  # the first layer writes into x
    x = torch.randn(5, 3, 4, 4)
    want = model(x.clone())
    result = vbs.run(model, _phased(model), x, measure_memory=False, check_memory=False)
    torch.testing.assert_close(result.outputs, want)


def test_tolerances_follow_the_dtype_and_the_output_scale():
    assert vbs.tolerances(torch.zeros(3)) == (1.3e-6, 1e-5)
    rtol, atol = vbs.tolerances(torch.full((3,), 100.0))
    assert rtol == 1.3e-6 and atol == pytest.approx(1.3e-4)
    assert vbs.tolerances(torch.zeros(3, dtype=torch.float16))[0] == 1e-3
    assert vbs.tolerances(torch.zeros(3, dtype=torch.bfloat16))[0] == 1.6e-2


@pytest.mark.parametrize("net", ["branched", "resnet18"])
def test_the_least_memory_plan_executes(net, nets):
    model = nets[net]()
    tables = synthetic_tables(model, 4, 2)
    p = vbs.least_memory_plan(tables, batch=4)
    x = torch.randn(4, 3, 8, 8)
    with torch.no_grad():
        torch.testing.assert_close(vbs.run(model, p, x, measure_memory=False, check_memory=False).outputs, model(x))
