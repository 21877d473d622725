"""Programs shared between candidates (issue 37, planning time): packed widths and state dtypes traced once and
equal to the byte to tracing each, optimal checkpoint plans that equal the plain or uniform one not traced again."""

import torch
from torch import nn

from workbench.advisor import Config, advise
from workbench.advisor.plans import Plans, _compile
from workbench.advisor.workload import Workload


def mlp() -> nn.Module:
    return nn.Sequential(*(m for _ in range(4) for m in (nn.Linear(24, 24), nn.ReLU())), nn.Linear(24, 5))


# each program (step in backward or not, checkpoints or not) with the traced variant and the two farthest from it
PACKED = [Config("bf16", k, state, sib, ckpt) for sib in (False, True) for ckpt in ("none", "uniform")
          for k, state in ((0, "fp32"), (0, "bf16"), (16, "bf16"))]


def test_packed_variants_share_one_trace_and_equal_tracing_each():
    work = Workload.of(mlp, torch.randn(6, 24), torch.randint(0, 5, (6,)), None, "adamw", 1e-3, torch.device("cpu"))
    plans = Plans(work, PACKED)
    for cfg in [c for c in PACKED if (c.extra_bits, c.state_dtype) != (0, "fp32")]:  # not the traced ones
        own = _compile(work, cfg, None)
        for size in (1, 6, 50):
            assert plans.plan(cfg).peak(size) == own.required_bytes(size), (cfg.name, size)
    assert plans.programs == 4  # step in backward or not, checkpoints or not
    # the plain program at batches 2, 3 and 4 and at 1 (asked above), each variant at 3 (`calcgraph.derive`): where
    # the plain program's batch 1 is on its line, its variants' is on theirs (the peaks at 1 above equal their own)
    assert plans.traces == 4 + 3


def test_an_optimal_plan_equal_to_the_plain_or_uniform_one_reuses_its_trace():
    x, y = torch.randn(64, 24), torch.randint(0, 5, (64,))
    advice = advise(mlp, (x, y), memory_budget=2**40, calibrate=False, min_run_time=0.01,
                    candidates=[Config(checkpoint=c) for c in ("none", "uniform", "optimal")])
    plans = advice._plans
    assert plans.programs == 2 and not any(c for _, _, c in advice._segments["fp32, checkpoint optimal"])
    table = advice.table.set_index("config")
    assert table.loc["fp32, checkpoint optimal", "predicted_peak_bytes"] == table.loc["fp32", "predicted_peak_bytes"]
    advice.rebudget(table.loc["fp32, checkpoint uniform", "predicted_peak_bytes"] / (1 - advice.margin))
    segments = advice._segments["fp32, checkpoint optimal"]
    known = segments == plans.uniform or not any(c for _, _, c in segments)
    assert plans.programs == (2 if known else 3)


def test_a_programs_peaks_are_remembered_once_for_every_candidate_and_forgotten_on_recalibration():
    work = Workload.of(mlp, torch.randn(6, 24), torch.randint(0, 5, (6,)), None, "adamw", 1e-3, torch.device("cpu"))
    plans = Plans(work, [Config(), Config(state_dtype="fp32")])
    first, other = plans.plan(Config()), plans.plan(Config(state_dtype="fp32"))  # two candidates, one program
    assert first.graph is other.graph
    before = first.graph.evaluations
    assert [first.peak(b) for b in (2, 6, 50)] == [first.graph.required_bytes(b) + first.offset for b in (2, 6, 50)]
    other.peak(6), other.fits(50, 2**40)  # the same program's peaks: not evaluated again
    assert first.graph.evaluations == before + 6
    plans.forget_peaks()  # what `Advice.verify` does after recalibrating a graph
    first.peak(6)
    assert first.graph.evaluations == before + 7


def test_the_largest_batch_search_traces_batch_one_only_where_the_users_batch_does_not_fit():
    from workbench.calcgraph import search_max

    x, y = torch.randn(6, 24), torch.randint(0, 5, (6,))
    advice = advise(mlp, (x, y), memory_budget=2**40, calibrate=False, min_run_time=0.01,
                    candidates=[Config(), Config(step_in_backward=True)])
    assert not any(hasattr(graph, "_one") for graph in advice._plans._graphs.values())  # batch 1 never traced
    cap = advice.memory_budget * (1 - advice.margin)
    for name, answer in zip(advice.table["config"], advice.table["max_batch"], strict=True):
        assert answer == search_max(lambda b, p=advice._by_name[name]: p.fits(b, cap), 6, limit=2**20)[0]
    fp32 = advice.table.set_index("config").loc["fp32", "predicted_peak_bytes"]
    held = {name: advice._by_name[name].held_bytes(6) for name in advice.table["config"]}
    assert all(0 < held[name] < advice._by_name[name].peak(2) for name in held)  # below the peaks it bounds
    advice.rebudget(0.9 * min(held.values()))  # less than the weights, gradients and state every batch holds
    assert (advice.table["max_batch"] == 0).all()
    assert not any(hasattr(graph, "_one") for graph in advice._plans._graphs.values())
    advice.rebudget(fp32 * 0.9)  # nothing fits at batch 6: the searches go down, through batch 1 where 2 fails
    cap = advice.memory_budget * (1 - advice.margin)
    assert not advice.table["fits"].any() and (advice.table["max_batch"] < 6).all()
    answers = dict(zip(advice.table["config"], advice.table["max_batch"], strict=True))
    for name, answer in answers.items():
        assert hasattr(advice._by_name[name].graph, "_one") == (answer < 2 and held[name] <= cap), name
        assert answer == search_max(lambda b, p=advice._by_name[name]: p.fits(b, cap), 6, limit=2**20)[0], name
    assert sorted(answers.values()) == [0, 4]


def test_a_batch_that_is_not_a_power_of_two_is_calibrated_one_past_a_power_of_two():
    """Issue 48: kernels can take more at a batch that does not fill their tiles (oneDNN's AMX matmul at odd batches).
    The calibration runs one past the power of two below the user's batch (the batch that pads most in its
    octave), or the next octave's where that is the batch itself. (A batch above 8 is also checked at itself,
    min(16, batch): issue 44's in-sample check, not this probe.)"""
    work = Workload.of(mlp, torch.randn(6, 24), torch.randint(0, 5, (6,)), None, "adamw", 1e-3, torch.device("cpu"))
    for batch_size, probe in ((4, None), (3, 5), (12, 9), (17, 33)):
        plans = Plans(work, [Config()])
        plans.calibrate(Config(), batch_size)
        ran = plans.plan(Config()).graph.calibrated_batches
        held = probe != batch_size and probe in ran if probe else all(b & (b - 1) == 0 for b in ran)
        assert held, (batch_size, ran)


def test_programs_traced_ahead_in_groups_equal_those_traced_here(monkeypatch):
    """`Plans.trace_ahead` hands each worker every program of a precision at one batch (they share its dispatch
    cache): the traces it brings back are those traced in this process, and one a worker failed is traced here."""
    import os

    import numpy as np

    from workbench.advisor import plans as plans_module
    from workbench.calcgraph.forked import ENV

    work = Workload.of(mlp, torch.randn(6, 24), torch.randint(0, 5, (6,)), None, "adamw", 1e-3, torch.device("cpu"))
    grid = [Config(p, 8 if p == "bf16" else None, step_in_backward=sib, checkpoint=ckpt) for p in ("fp32", "bf16")
            for sib in (False, True) for ckpt in ("none", "uniform")]
    uniform = [(0, 4, True), (4, 9, True)]
    parent, traced = os.getpid(), plans_module._trace_program

    def failing_in_workers(work, key, size, steps):
        if os.getpid() != parent and key[0].checkpoint == "uniform" and key[0].precision == "bf16":
            raise RuntimeError("a worker's trace failed")
        return traced(work, key, size, steps)
    monkeypatch.setattr(plans_module, "_trace_program", failing_in_workers)
    monkeypatch.setenv(ENV, "2")
    ahead = Plans(work, grid, uniform=uniform)
    ahead.trace_ahead([(c, None) for c in grid])
    made = {(key[0].name, size) for key, sizes in ahead._ahead.items() for size in sizes}
    assert made == {(c.name, s) for c in grid for s in ((2, 3, 4) if c.name in ("fp32", "bf16+8") else (3,))
                    if not (c.checkpoint == "uniform" and c.precision == "bf16")}
    monkeypatch.setenv(ENV, "1")
    here = Plans(work, grid, uniform=uniform)
    for cfg in grid:
        a, b = ahead.graph(cfg), here.graph(cfg)  # the failed ones traced here, now
        assert a._exact.keys() == b._exact.keys(), cfg.name
        for size in a._exact:
            assert a._exact[size].signature == b._exact[size].signature, (cfg.name, size)
            np.testing.assert_array_equal(a._exact[size].sizes, b._exact[size].sizes)
