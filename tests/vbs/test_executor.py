"""workbench.vbs.executor: every plan (DP, FBS, Greedy-VBS) run on the real model equals model(x)."""

import numpy as np
import pytest
import torch
from torch import nn

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
            result = vbs.run(model, vbs.Plan.from_json(p.to_json()), x, measure_memory=name == "vbs_mid")
            torch.testing.assert_close(result.outputs, want, msg=name)
            assert result.seconds > 0 and result.predicted_peak_bytes == p.peak_bytes
            if name == "vbs_mid":
                assert result.peak_bytes > result.input_bytes > 0


def test_executor_on_measured_tables(nets):
    model = nets["branched"]()
    tables = vbs.measure_layers(model, torch.randn(3, 8, 8), 4, repeats=1, warmup=0).coarsen(64)
    x = torch.randn(4, 3, 8, 8)
    p = vbs.plan(tables, memory=vbs.fbs_peak(tables, batch=4, size=2), batch=4)
    result = vbs.run(model, p, x)
    with torch.no_grad():
        torch.testing.assert_close(result.outputs, model(x))
    assert result.peak_bytes > 0 and result.time_ratio > 0 and result.memory_ratio > 0


@pytest.mark.parametrize("factory", [googlenet, squeezenet1_0])
def test_plans_execute_on_the_branched_models(factory):
    model = factory(5, width=0.125).eval()
    tables = vbs.measure_layers(model, torch.randn(3, 32, 32), [1, 4], repeats=1, warmup=0).coarsen(1024)
    p = vbs.dp(tables, memory=vbs.fbs_peak(tables, batch=4, size=2), batch=4)
    x = torch.randn(4, 3, 32, 32)
    result = vbs.run(model, p, x, measure_memory=False)
    with torch.no_grad():
        torch.testing.assert_close(result.outputs, model(x))
    assert p.time_per_sample <= vbs.fbs(tables, memory=p.memory, batch=4).time_per_sample


def test_executor_rejects_a_plan_for_another_model(nets):
    tables = synthetic_tables(nets["linear"](), 2, 0)
    p = vbs.dp(tables, memory=vbs.fbs_peak(tables, batch=2, size=2), batch=2)
    with pytest.raises(ValueError, match="plan was made for layers"):
        vbs.Executor(nets["branched"](), p)
    with pytest.raises(ValueError, match="request of 2"):
        vbs.Executor(nets["linear"](), p)(torch.randn(3, 3, 8, 8))
    with pytest.raises(TypeError, match="Plan"):
        vbs.Executor(nets["linear"](), "plan")
