"""workbench.vbs: the DP of Choudhury et al. (Section III), its baselines, the executor and plans."""

import math

import numpy as np
import pytest
import torch
from torch import nn

from workbench import vbs
from workbench.models import resnet18


pytestmark = pytest.mark.usefixtures("one_thread")


def worked_example() -> vbs.Profile:
    """Section III, "Illustration with an example": 3 layers, in = out = b, ws = b, 4b, b."""
    return vbs.Profile(time=[[4, 3]] * 3, inp=[[1, 2]] * 3, out=[[1, 2]] * 3, ws=[[1, 2], [4, 8], [1, 2]])


def test_worked_example():
    prof = worked_example()
    p = vbs.plan(prof, memory=7, batch=2)
    assert p.layer_batches == {"L1": [2], "L2": [1, 1], "L3": [2]}
    assert p.time_per_sample == pytest.approx(10.0)
    assert p.peak <= 7
    base = vbs.fbs(prof, memory=7, batch=2)
    assert base.layer_batches == {"L1": [1, 1], "L2": [1, 1], "L3": [1, 1]}
    assert base.time_per_sample == pytest.approx(12.0)
    greedy = vbs.greedy_vbs(prof, memory=7, batch=2)
    assert greedy.time_per_sample == pytest.approx(10.0)
    # with 12 units, batch 2 fits everywhere: 3 per sample per layer
    assert vbs.plan(prof, memory=12, batch=2).time_per_sample == pytest.approx(9.0)


def test_infeasible_budgets_name_the_smallest_feasible_one():
    prof = worked_example()
    with pytest.raises(ValueError, match="smallest feasible budget is 7 units"):
        vbs.plan(prof, memory=6, batch=2)
    with pytest.raises(ValueError, match="FBS is infeasible"):
        vbs.fbs(prof, memory=6, batch=2)
    with pytest.raises(ValueError, match="Greedy-VBS is infeasible"):
        vbs.greedy_vbs(prof, memory=5, batch=2)
    planner = vbs.Planner(prof, memory=12)
    assert planner.smallest_feasible(2) == 7
    curve = planner.curve(2)
    assert np.all(np.isinf(curve[:7])) and curve[7] == pytest.approx(10.0)
    assert np.all(np.diff(curve[7:]) <= 1e-12)  # more memory never hurts


def test_bad_input():
    prof = worked_example()
    with pytest.raises(ValueError, match="batch must be an int in 1..2"):
        vbs.plan(prof, memory=7, batch=3)
    with pytest.raises(ValueError, match="memory must be an int >= 0"):
        vbs.plan(prof, memory=-1, batch=1)
    with pytest.raises(ValueError, match="must have shape"):
        vbs.Profile(time=[[1, 1]], inp=[[1]], out=[[1, 1]], ws=[[1, 1]])
    with pytest.raises(ValueError, match="whole memory units"):
        vbs.Profile(time=[[1.0]], inp=[[0.5]], out=[[1]], ws=[[1]])
    with pytest.raises(ValueError, match="exceeds"):
        vbs.Planner(prof, memory=10**9)
    with pytest.raises(TypeError):
        vbs.plan("profile", memory=7, batch=1)


def random_linear(rng, n: int, B: int) -> tuple[vbs.Profile, np.ndarray]:
    """A linear chain whose activations are linear in b (sizes a[l] per sample at boundary l)."""
    a = rng.integers(1, 4, n + 1)
    b = np.arange(1, B + 1)
    time = rng.uniform(1.0, 2.0, (n, B)) * (1.0 - 0.5 * rng.uniform(0, 1, (n, 1)) * (b - 1) / B)
    ws = rng.integers(0, 6, (n, B))
    return vbs.Profile(time, a[:-1, None] * b, a[1:, None] * b, ws), a


def _opt_trees(i, j, b):
    if i > j or b == 0:
        yield ()
        return
    for b1 in range(1, b + 1):
        for first in _exact_trees(i, j, b1):
            for rest in _opt_trees(i, j, b - b1):
                yield first + rest


def _exact_trees(i, j, b):
    for k in range(i, j + 1):
        for left in _opt_trees(i, k - 1, b):
            for right in _opt_trees(k + 1, j, b):
                yield left + ((k, b),) + right


def exhaustive(prof: vbs.Profile, a: np.ndarray, memory: int, batch: int) -> float:
    """Best time per sample over every nested phase schedule, memory checked by simulation."""
    n, best = prof.n_layers, math.inf
    for schedule in set(_opt_trees(0, n - 1, batch)):
        pending = [batch] + [0] * n
        peak = seconds = 0
        for k, q in schedule:
            peak = max(peak, sum(int(x) * c for x, c in zip(a, pending, strict=True))
                       + prof.ws[k, q - 1] + a[k + 1] * q)
            seconds += q * prof.time[k, q - 1]
            pending[k] -= q
            pending[k + 1] += q
        if peak <= memory:
            best = min(best, seconds / batch)
    return best


@pytest.mark.parametrize("seed", range(12))
def test_dp_equals_exhaustive_search_on_small_instances(seed):
    rng = np.random.default_rng(seed)
    n, B = int(rng.integers(2, 4)), int(rng.integers(2, 5))
    prof, a = random_linear(rng, n, B)
    low = vbs.fbs_peak(prof, batch=B, size=1)
    for memory in (low - 1, low, low + 3, low + 8, low + 20):
        want = exhaustive(prof, a, memory, B)
        try:
            got = vbs.plan(prof, memory=memory, batch=B)
        except ValueError:
            assert math.isinf(want)
            continue
        assert got.time_per_sample == pytest.approx(want, rel=1e-9)
        assert got.peak <= memory


def random_branched(rng, B: int) -> vbs.Profile:
    b = np.arange(1, B + 1)

    def chain(n: int, branch: bool = False) -> vbs.Profile:
        sizes = rng.integers(1, 4, n + 1)
        inp = sizes[:-1, None] * b
        if branch and n:
            inp[0] = 0
        t = rng.uniform(1.0, 2.0, (n, B)) / (1 + 0.3 * rng.uniform(0, 1, (n, 1)) * (b - 1))
        return vbs.Profile(t, inp, sizes[1:, None] * b, rng.integers(0, 4, (n, B)))

    main = chain(5)
    main.ws[2] = 0
    main.branches = {2: [chain(2, True), chain(1, True), chain(0, True)]}
    main.merge = {2: "cat"}
    main.__post_init__()
    return main


@pytest.mark.parametrize("seed", range(8))
def test_dp_is_never_worse_than_fbs_and_respects_memory(seed):
    rng = np.random.default_rng(100 + seed)
    B = int(rng.integers(3, 7))
    prof = random_branched(rng, B) if seed % 2 else random_linear(rng, int(rng.integers(3, 8)), B)[0]
    low = vbs.fbs_peak(prof, batch=B, size=1)
    for memory in range(low, low + 40, 5):
        dp = vbs.plan(prof, memory=memory, batch=B)
        base = vbs.fbs(prof, memory=memory, batch=B)
        assert dp.time_per_sample <= base.time_per_sample * (1 + 1e-12)
        assert dp.peak <= memory and base.peak <= memory
        assert all(sum(bs) == B for bs in dp.layer_batches.values())


def test_branched_steps_hold_the_group_input_and_output():
    rng = np.random.default_rng(7)
    prof = random_branched(rng, 4)
    p = vbs.plan(prof, memory=vbs.fbs_peak(prof, batch=4, size=2), batch=4)
    for step in (s for s in p.steps if s.layer == 2):
        group = int(prof.inp[2, step.batch - 1] + prof.out[2, step.batch - 1])
        assert step.used == group and len(step.branches) == 3
        assert sum(s.batch for s in step.branches[0] if s.layer == 1) == step.batch
        assert all(s.reserved >= step.reserved + group for br in step.branches for s in br)
        assert step.branches[2] == ()


def test_plan_json_round_trip_and_frame():
    rng = np.random.default_rng(3)
    prof = random_branched(rng, 4)
    p = vbs.plan(prof, memory=vbs.fbs_peak(prof, batch=4, size=2) + 2, batch=4)
    again = vbs.Plan.from_json(p.to_json())
    assert again.steps == p.steps and again.layer_batches == p.layer_batches
    assert again.time_per_sample == p.time_per_sample and again.peak == p.peak
    frame = p.to_frame()
    assert list(frame["name"]) == prof.names
    assert (frame["unused_units"] >= 0).all()
    assert frame["seconds"].sum() == pytest.approx(p.time_per_sample * p.batch)
    assert vbs.Profile.from_dict(prof.to_dict()).to_frame().equals(prof.to_frame())


def test_coarsen_rounds_up():
    prof = vbs.Profile(time=[[1.0, 1.0]], inp=[[1000, 2000]], out=[[1500, 3000]], ws=[[0, 10]])
    c = prof.coarsen(1024)
    assert c.unit_bytes == 1024
    assert c.inp.tolist() == [[1, 2]] and c.out.tolist() == [[2, 3]] and c.ws.tolist() == [[0, 1]]
    with pytest.raises(ValueError, match="multiple"):
        c.coarsen(1500)


# ---------------------------------------------------------------------------------------------
# Measured profiles and the executor on real models


class Inceptionish(nn.Module):
    def __init__(self, cin: int) -> None:
        super().__init__()
        self.merge = "cat"
        self.branches = nn.ModuleList([
            nn.Sequential(nn.Conv2d(cin, 4, 1), nn.ReLU(inplace=True)),
            nn.Sequential(nn.Conv2d(cin, 3, 1), nn.ReLU(inplace=True), nn.Conv2d(3, 5, 3, padding=1)),
            nn.Sequential(nn.MaxPool2d(3, 1, 1), nn.Conv2d(cin, 2, 1)),
        ])

    def forward(self, x):
        return torch.cat([b(x) for b in self.branches], 1)


def linear_net() -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(inplace=True),
        nn.Conv2d(8, 32, 3, padding=1), nn.ReLU(inplace=True), nn.MaxPool2d(2),
        nn.Conv2d(32, 4, 1), nn.ReLU(inplace=True), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 5),
    ).eval()


def branched_net() -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(3, 6, 3, padding=1), nn.ReLU(inplace=True), Inceptionish(6),
                         nn.MaxPool2d(2), Inceptionish(11), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(11, 3)).eval()


@pytest.mark.parametrize("make", [linear_net, branched_net, lambda: resnet18(4, width=4).eval()])
def test_stages_reproduce_the_forward_pass(make):
    model = make()
    x = torch.randn(3, 3, 16, 16)
    with torch.no_grad():
        torch.testing.assert_close(vbs.run_stages(vbs.stages_of(model), x), model(x))


def test_stage_structure():
    stages = vbs.stages_of(linear_net())
    assert [s.name for s in stages] == ["0", "3", "5", "6", "8", "10"]  # conv+bn+relu, conv+relu, ...
    res = vbs.stages_of(resnet18(4, width=4))
    blocks = [s for s in res if s.is_branch]
    assert len(blocks) == 8 and all(s.merge == "add" for s in blocks)
    assert len(blocks[0].branches[1]) == 0 and len(blocks[2].branches[1]) == 1  # identity / projection


def test_profile_measures_activation_bytes():
    model = branched_net()
    prof = vbs.profile(model, torch.randn(3, 8, 8), [1, 3], repeats=1, warmup=0)
    assert prof.max_batch == 3 and prof.n_layers == len(vbs.stages_of(model))
    per_sample = 3 * 8 * 8 * 4
    assert prof.inp[0].tolist() == [per_sample, 2 * per_sample, 3 * per_sample]  # interpolated at b=2
    assert prof.out[0, 0] == 6 * 8 * 8 * 4 and prof.inp[1, 0] == prof.out[0, 0]
    assert prof.is_special(1) and len(prof.branches[1]) == 3
    assert all(p.inp[0].sum() == 0 for p in prof.branches[1])  # the group's input, already held
    assert prof.out[1, 0] == (4 + 5 + 2) * 8 * 8 * 4  # the merged output
    assert prof.ws[1].sum() == 0 and np.all(prof.time[0] > 0)
    assert np.all(prof.branches[1][1].time > 0) and prof.branches[1][1].inp[1, 0] == 3 * 8 * 8 * 4


def synthetic_profile(model: nn.Module, B: int, seed: int) -> vbs.Profile:
    """Random tables with the model's stage structure: any schedule the DP picks must execute."""
    rng = np.random.default_rng(seed)
    b = np.arange(1, B + 1)

    def chain(n: int, first_in: bool = True) -> vbs.Profile:
        size = rng.integers(1, 5, n + 1)
        inp = size[:-1, None] * b
        if not first_in and n:
            inp[0] = 0
        t = rng.uniform(1, 2, (n, B)) / (1 + rng.uniform(0, 1, (n, 1)) * (b - 1))
        return vbs.Profile(t, inp, size[1:, None] * b, rng.integers(0, 5, (n, B)))

    stages = vbs.stages_of(model)
    main = chain(len(stages))
    main.names = [s.name for s in stages]
    main.branches = {i: [chain(len(br), False) for br in s.branches] for i, s in enumerate(stages) if s.is_branch}
    main.merge = {i: stages[i].merge for i in main.branches}
    for i in main.branches:
        main.ws[i] = 0
    main.__post_init__()
    return main


def _plans(prof: vbs.Profile, batch: int) -> dict[str, vbs.Plan]:
    low = vbs.Planner(prof, memory=vbs.fbs_peak(prof, batch=batch, size=1)).smallest_feasible(batch)
    mid = (low + vbs.fbs_peak(prof, batch=batch, size=batch)) // 2
    out = {"vbs_tight": vbs.plan(prof, memory=low, batch=batch), "vbs_mid": vbs.plan(prof, memory=mid, batch=batch),
           "fbs": vbs.fbs(prof, memory=mid, batch=batch)}
    try:
        out["greedy"] = vbs.greedy_vbs(prof, memory=mid, batch=batch)
    except ValueError:
        pass
    return out


@pytest.mark.parametrize("make", [linear_net, branched_net, lambda: resnet18(4, width=4).eval()])
def test_executor_equals_the_model(make):
    model = make()
    batch = 5
    x = torch.randn(batch, 3, 8, 8)
    with torch.no_grad():
        want = model(x)
    for seed in range(2):
        plans = _plans(synthetic_profile(model, batch, seed), batch)
        assert any(len(bs) > 1 for p in plans.values() for bs in p.layer_batches.values())
        for name, p in plans.items():
            result = vbs.run(model, vbs.Plan.from_json(p.to_json()), x, measure_memory=name == "vbs_mid")
            torch.testing.assert_close(result.outputs, want, msg=name)
            assert result.seconds > 0 and result.predicted_peak_bytes == p.peak_bytes
            if name == "vbs_mid":
                assert result.peak_bytes > result.input_bytes > 0


def test_executor_on_a_measured_profile():
    model = branched_net()
    prof = vbs.profile(model, torch.randn(3, 8, 8), 4, repeats=1, warmup=0).coarsen(64)
    x = torch.randn(4, 3, 8, 8)
    p = vbs.plan(prof, memory=vbs.fbs_peak(prof, batch=4, size=2), batch=4)
    result = vbs.run(model, p, x)
    with torch.no_grad():
        torch.testing.assert_close(result.outputs, model(x))
    assert result.peak_bytes > 0 and result.time_ratio > 0


def test_executor_rejects_a_plan_for_another_model():
    prof = synthetic_profile(linear_net(), 2, 0)
    p = vbs.plan(prof, memory=vbs.fbs_peak(prof, batch=2, size=2), batch=2)
    with pytest.raises(ValueError, match="plan was made for layers"):
        vbs.Executor(branched_net(), p)
    with pytest.raises(ValueError, match="request of 2"):
        vbs.Executor(linear_net(), p)(torch.randn(3, 3, 8, 8))
