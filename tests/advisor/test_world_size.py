"""The advisor's answer for training sharded by FSDP2 (issue 37): each candidate's per-rank plan at world sizes
2, 4 and 8 from a fake process group, against torch's FSDPMemTracker and the allocator in the fake group, and
the chosen candidate's plan against each rank's allocator peak in a real 2-process gloo run.

The model (255 rows in one layer, as ``tests/calcgraph/test_sharded.py``) shards unevenly on 2, 4 and 8 ranks.
"""

import functools
import gc

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh

from workbench.advisor import Config, advise
from workbench.advisor.costs import training_step
from workbench.advisor.workload import Workload
from workbench.calcgraph.sharded import fsdp_tracker_peak, measure_sharded_peak, run_on_ranks
from workbench.measure import AllocatorMeter
from workbench.models import MLP

WIDTHS, BATCH = (64, 256, 255, 10), 16
MODEL = functools.partial(MLP, WIDTHS, "relu")  # module-level and picklable: the ranks build it too


def _batch():
    g = torch.Generator().manual_seed(0)
    return torch.randn(BATCH, WIDTHS[0], generator=g), torch.randint(0, 10, (BATCH,), generator=g)


@pytest.mark.parametrize("world_size", [2, 4, 8])
def test_each_candidates_rank_plan_matches_fsdp_mem_tracker(world_size):
    grid = [Config(), Config("bf16", 8)]  # what is asserted, and below each rank's step in backward and packed state
    grid += [Config(step_in_backward=True), Config("bf16", 16, "bf16", True)] if world_size == 2 else []
    advice = advise(MODEL, _batch(), memory_budget=2**30, world_size=world_size, calibrate=False,
                    min_run_time=0.01, candidates=grid)
    table = advice.table.set_index("config")
    tracker = fsdp_tracker_peak(MODEL, (WIDTHS[0],), world_size, BATCH)["Total"]  # fp32 AdamW, as torch runs it
    torch.testing.assert_close(float(table.loc["fp32", "predicted_peak_bytes"]), float(tracker), rtol=1e-3, atol=0)
    local = sum(-(-b // world_size) * (a + 1) for a, b in zip(WIDTHS[:-1], WIDTHS[1:], strict=True))
    tensors = 2 * (len(WIDTHS) - 1)  # weights and biases, each with a 4-byte step count
    assert table.loc["fp32", "optimizer_state"] == 8 * local + 4 * tensors  # the shard of AdamW's two moments
    assert table.loc["bf16+8", "predicted_peak_bytes"] < table.loc["fp32", "predicted_peak_bytes"]
    assert any("sharded by FSDP2 over" in note for note in advice.notes)
    assert (table["checkpoint"] == "none").all()


def test_the_calibrated_rank_plan_meets_the_allocator_and_verifies():
    advice = advise(MODEL, _batch(), memory_budget=2**30, world_size=2, min_run_time=0.01, candidates=[Config()])
    allocator = measure_sharded_peak(MODEL, (WIDTHS[0],), 2, BATCH)  # torch's own AdamW: the same peak
    torch.testing.assert_close(float(advice.best["predicted_peak_bytes"]), float(allocator), rtol=0.02, atol=0)
    result = advice.verify()
    assert abs(result["peak_error"]) <= 0.02 and not result["recalibrated"]


def test_sharded_plans_are_refused_off_the_cpu_and_for_bad_world_sizes():
    for world_size, device, match in [(0, "cpu", "world_size must be a whole number of ranks in 1..1024, got 0"),
                                      (2.0, "cpu", "got 2.0"), (2, "cuda", "cuda")]:  # on CPU, or no CUDA here
        with pytest.raises(ValueError, match=match):
            advise(MODEL, _batch(), memory_budget=2**30, world_size=world_size, device=device, calibrate=False)


def _rank_peak(rank: int, world_size: int) -> int:
    work = Workload.of(MODEL, *_batch(), None, "adamw", 1e-3, torch.device("cpu"), world_size)
    work.mesh = init_device_mesh("cpu", (world_size,))
    batch = work.make_batch(Config())
    gc.collect()
    with AllocatorMeter() as meter:  # the advisor's fp32 candidate as `build()` makes it, two steps
        step = training_step(work, Config())
        step(batch(BATCH, work.device))
        step(batch(BATCH, work.device))
    return meter.peak_bytes


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available()
                    or "spawn" not in mp.get_all_start_methods(),
                    reason="needs torch.distributed with gloo and the spawn start method")
def test_the_rank_plan_against_a_real_two_process_run():
    """Each rank's allocator peak in a real gloo run: the calibrated plan plus at most two steps of gloo's
    reduce-scatter input clones (a race between threads, see `workbench.calcgraph.sharded`)."""
    advice = advise(MODEL, _batch(), memory_budget=2**30, world_size=2, min_run_time=0.01, candidates=[Config()])
    predicted = int(advice.best["predicted_peak_bytes"])
    clones = sum(4 * -(-b // 2) * 2 * (a + 1) for a, b in zip(WIDTHS[:-1], WIDTHS[1:], strict=True))
    for rank, peak in enumerate(run_on_ranks(_rank_peak, 2, timeout=180)):
        assert 0.98 * predicted <= peak <= 1.02 * predicted + 2 * clones, (rank, predicted, peak)
