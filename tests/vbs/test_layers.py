"""workbench.vbs.layers: the per-layer tables of Table I (LayerProfile) and measuring them."""

import numpy as np
import pytest
import torch

from workbench import vbs
from workbench.measure import AllocatorMeter
from workbench.measure import Timing

pytestmark = pytest.mark.usefixtures("one_thread")


def test_tables_are_checked_when_made():
    with pytest.raises(ValueError, match="must have shape"):
        vbs.LayerProfile(time=[[1, 1]], inp=[[1]], out=[[1, 1]], ws=[[1, 1]])
    with pytest.raises(ValueError, match="whole memory units"):
        vbs.LayerProfile(time=[[1.0]], inp=[[0.5]], out=[[1]], ws=[[1]])
    with pytest.raises(ValueError, match="finite and >= 0"):
        vbs.LayerProfile(time=[[-1.0]], inp=[[1]], out=[[1]], ws=[[1]])
    with pytest.raises(ValueError, match="names"):
        vbs.LayerProfile(time=[[1.0]], inp=[[1]], out=[[1]], ws=[[1]], names=["a", "b"])


def test_coarsen_rounds_up():
    tables = vbs.LayerProfile(time=[[1.0, 1.0]], inp=[[1000, 2000]], out=[[1500, 3000]], ws=[[0, 10]])
    c = tables.coarsen(1024)
    assert c.unit_bytes == 1024
    assert c.inp.tolist() == [[1, 2]] and c.out.tolist() == [[2, 3]] and c.ws.tolist() == [[0, 1]]
    with pytest.raises(ValueError, match="multiple"):
        c.coarsen(1500)


def test_dict_round_trip_and_frame(random_branched):
    tables = random_branched(np.random.default_rng(3), 4)
    again = vbs.LayerProfile.from_dict(tables.to_dict())
    assert again.to_frame().equals(tables.to_frame())
    assert again.branches.keys() == tables.branches.keys() and again.merge == tables.merge
    assert tables.uniform_time().shape == (4,)
    assert list(tables.to_frame().columns[-3:]) == ["in_bytes", "out_bytes", "ws_bytes"]


def test_measure_layers_reads_activation_bytes(nets):
    model = nets["branched"]()
    tables = vbs.measure_layers(model, torch.randn(3, 8, 8), [1, 3], repeats=1, warmup=0)
    assert tables.max_batch == 3 and tables.n_layers == len(vbs.stages_of(model))
    per_sample = 3 * 8 * 8 * 4
    assert tables.inp[0].tolist() == [per_sample, 2 * per_sample, 3 * per_sample]  # interpolated at b=2
    assert tables.out[0, 0] == 6 * 8 * 8 * 4 and tables.inp[1, 0] == tables.out[0, 0]
    assert tables.is_special(1) and len(tables.branches[1]) == 3
    assert all(p.inp[0].sum() == 0 for p in tables.branches[1])  # the group's input, already held
    assert tables.out[1, 0] == (4 + 5 + 2) * 8 * 8 * 4  # the merged output
    assert tables.ws[1].sum() == 0 and np.all(tables.time[0] > 0)
    assert np.all(tables.branches[1][1].time > 0) and tables.branches[1][1].inp[1, 0] == 3 * 8 * 8 * 4


def test_workspace_is_the_allocators_peak_beyond_the_output(nets):
    """ws is what the allocator hands out beyond the output while the layer runs, read per call from
    one profiled pass: equal to AllocatorMeter's reading of the same call (oneDNN's convolution
    scratch included, which no tensor tracker sees)."""
    model = nets["linear"]()
    x = torch.randn(2, 3, 16, 16)
    tables = vbs.measure_layers(model, x[0], 2, repeats=1, warmup=1)
    stages = vbs.stages_of(model)
    with torch.no_grad():
        for i, stage in enumerate(stages):
            with AllocatorMeter("cpu") as meter:
                y = stage(x)
            assert tables.ws[i, 1] == max(meter.peak_bytes - y.numel() * 4, 0), stage.name
            x = y
    assert tables.ws[1, 1] > 0  # the 8 -> 32 convolution's scratch


def test_every_batch_size_is_warmed_and_rounds_interleave_batch_sizes(nets, monkeypatch):
    """Each batch size gets a warm pass before anything is timed; each timing round visits every batch
    size once (order reversed every other round), so a burst of load cannot hit one batch size only."""
    import workbench.vbs.layers as layers_module

    events = []
    real_run = layers_module.run_stages
    real_time = layers_module.time_callable
    monkeypatch.setattr(layers_module, "run_stages", lambda st, x: events.append(("warm", x.shape[0])) or
                        real_run(st, x))

    def timed(fn, **kw):
        timing = real_time(fn, **kw)
        events.append(("time", None))
        return timing

    monkeypatch.setattr(layers_module, "time_callable", timed)
    monkeypatch.setattr(layers_module._Clock, "__call__", lambda self, key, fn, x, real=layers_module._Clock.__call__:
                        events.append(("layer", x.shape[0])) or real(self, key, fn, x))
    model = nets["linear"]()
    n = len(vbs.stages_of(model))
    vbs.measure_layers(model, torch.randn(3, 8, 8), [1, 2, 3], repeats=2, warmup=1, min_run_time=0)
    warm = [e[1] for e in events if e[0] == "warm"]
    first_time = next(i for i, e in enumerate(events) if e[0] == "time")
    assert warm == [1, 2, 3] and all(e[0] != "warm" for e in events[first_time:])
    order = [e[1] for e in events if e[0] == "layer"]
    assert order == [1] * n + [2] * n + [3] * n + [3] * n + [2] * n + [1] * n
    events.clear()
    vbs.measure_layers(model, torch.randn(3, 8, 8), 2, repeats=1, warmup=0)
    assert not any(e[0] == "warm" for e in events)


def test_a_slow_round_does_not_become_the_table(nets, monkeypatch):
    """One round 1000x slow (a burst of load, a first call) leaves the median of three rounds intact."""
    import workbench.vbs.layers as layers_module

    calls = {"n": 0}
    real = layers_module.time_callable

    def slow_first_round(fn, **kw):
        timing = real(fn, **kw)
        calls["n"] += 1
        if calls["n"] <= per_round:
            return Timing(1.0, 1.0, 1.0, [1.0])
        return timing

    model = nets["linear"]()
    per_round = 2 * len(vbs.stages_of(model))  # one round: every layer at b = 1 and b = 2
    monkeypatch.setattr(layers_module, "time_callable", slow_first_round)
    tables = vbs.measure_layers(model, torch.randn(3, 8, 8), 2, repeats=3, warmup=1, min_run_time=0)
    assert tables.time.max() < 0.1


def test_measure_layers_bad_arguments(nets):
    model = nets["linear"]()
    with pytest.raises(ValueError, match="batch_sizes"):
        vbs.measure_layers(model, torch.randn(3, 8, 8), [2, 3])
    with pytest.raises(ValueError, match="statistic"):
        vbs.measure_layers(model, torch.randn(3, 8, 8), 2, statistic="mean")
    with pytest.raises(TypeError, match="sample"):
        vbs.measure_layers(model, [1, 2, 3], 2)
    with pytest.raises(ValueError, match=r"repeats must be an int >= 1, got 2.5"):
        vbs.measure_layers(model, torch.randn(3, 8, 8), 2, repeats=2.5)
    with pytest.raises(ValueError, match=r"min_run_time must be a number of seconds >= 0, got -1"):
        vbs.measure_layers(model, torch.randn(3, 8, 8), 2, min_run_time=-1)


def test_small_models_get_more_rounds_within_min_run_time(nets, monkeypatch):
    import workbench.vbs.layers as layers_module

    rounds = []
    real = layers_module._timed_pass
    monkeypatch.setattr(layers_module, "_timed_pass", lambda st, x, clock: rounds.append(x.shape[0]) or
                        real(st, x, clock))
    vbs.measure_layers(nets["linear"](), torch.randn(3, 8, 8), 1, repeats=2, min_run_time=10.0)
    assert len(rounds) == 20  # capped at 10 x repeats
    rounds.clear()
    vbs.measure_layers(nets["linear"](), torch.randn(3, 8, 8), 1, repeats=2, min_run_time=0)
    assert len(rounds) == 2


def test_unit_for():
    assert vbs.unit_for(24 * 1024 * 10, 24) == 10 * 1024
    assert vbs.unit_for(100, 24) == 1024  # at least one KiB
    with pytest.raises(ValueError, match="units >= 1"):
        vbs.unit_for(0, 24)
