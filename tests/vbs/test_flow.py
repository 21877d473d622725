"""workbench.vbs.flow: the executor's live memory over a plan, its copies counted exactly."""

import numpy as np
import pytest

from workbench import vbs
from workbench.vbs.flow import Flow, account, byte_sizes, table_sizes


def _chain(inp, out, ws, B=2) -> vbs.LayerProfile:
    """Per-sample sizes, linear in the batch: in, out and ws per layer, for batches 1..B."""
    b = np.arange(1, B + 1)
    col = lambda v: np.asarray(v)[:, None] * b  # noqa: E731
    return vbs.LayerProfile(np.ones((len(inp), B)), col(inp), col(out), col(ws))


def _step(layers, i, q, reserved=0):
    return vbs.uniform_step(layers, i, q, reserved)


def test_the_worked_example_step_by_step(worked_example):
    """Request of 2 handed over as one tensor per sample: L1 gathers both (2 + 2, under its own
    2 + 2 + 2), L2 takes the first of L1's output and then copies the second out (2 + 1 + 1, under
    7), L3 gathers the two phases (2 + 2). Nothing exceeds the DP's 7."""
    p = vbs.dp(worked_example, memory=7, batch=2)
    assert [s.executed for s in p.steps] == [6, 7, 7, 6]
    assert p.peak == 7


def test_gathering_phases_into_a_shrinking_layer_costs_a_copy():
    """L1 (x4) runs one sample at a time, L2 (pooling, /4) runs both at once: the two outputs and
    their merged copy live together before L2 runs, 16 units, where the DP counts 4 + 4 + 2 = 10."""
    t = _chain(inp=[1, 4], out=[4, 1], ws=[0, 0])
    steps = [_step(t, 0, 1, reserved=1), _step(t, 0, 1, reserved=4), _step(t, 1, 2)]
    p, peak = account(vbs.Plan("vbs", 20, 2, 1, t.names, steps), table_sizes(t))
    assert [s.executed for s in p.steps] == [6, 9, 16] and peak == 16
    assert max(s.reserved + s.used for s in steps) == 10 and p.peak == 16
    # the DP plans around it: at 15 units it takes another schedule whose execution fits
    q = vbs.dp(t, memory=15, batch=2)
    assert q.peak <= 15 and q.layer_batches != {"L1": [1, 1], "L2": [2]}


def test_taking_part_of_a_chunk_frees_the_rest_by_copying_it():
    """L1 runs both samples (out 8), L2 one at a time: after L2's first step the second sample is
    copied out (8 + 1 + 4 = 13) and the chunk of two freed, so L2's second step holds 4 + 1 + 1."""
    t = _chain(inp=[1, 4], out=[4, 1], ws=[0, 0])
    steps = [_step(t, 0, 2), _step(t, 1, 1, reserved=4), _step(t, 1, 1, reserved=1)]
    p, peak = account(vbs.Plan("vbs", 20, 2, 1, t.names, steps), table_sizes(t))
    assert [s.executed for s in p.steps] == [10, 13, 6] and peak == 13
    # the outputs (two chunks of one) are gathered at the end: 2 + 2, within the run's peak
    assert max(s.reserved + s.used for s in steps) == 10


def test_a_request_the_caller_keeps_is_held_whole_and_never_copied():
    """The same steps with the request kept: its 2 units stay allocated to the end (the first step
    reads a view, so 2 + 0 + 4; the second 2 + 4 + 4) and nothing of it is copied or freed."""
    t = _chain(inp=[1, 4], out=[4, 1], ws=[0, 0])
    steps = [_step(t, 0, 1, reserved=1), _step(t, 0, 1, reserved=4), _step(t, 1, 2)]
    p, peak = account(vbs.Plan("vbs", 20, 2, 1, t.names, steps), table_sizes(t), request="kept")
    assert [s.executed for s in p.steps] == [6, 10, 18] and peak == 18
    with pytest.raises(ValueError, match=r"request must be one of \['pieces', 'kept'\]"):
        Flow(table_sizes(t), 2, request="mine")


def test_bytes_and_tables_agree_and_a_missing_sample_is_named(random_branched):
    t = _chain(inp=[3, 5, 2], out=[5, 2, 7], ws=[1, 0, 2], B=4)
    p = vbs.dp(t, memory=60, batch=4)
    by_table = account(p, table_sizes(t))[1]
    by_bytes = account(p, byte_sizes([3, 5, 2, 7], {}, 1))[1]
    assert by_table == by_bytes == p.peak
    bad = vbs.Plan("vbs", 60, 4, 1, t.names, [_step(t, 0, 4), _step(t, 1, 4), _step(t, 2, 4), _step(t, 2, 1)])
    with pytest.raises(ValueError, match=r"asks for 1 samples at layer 2, but only 0 are waiting"):
        account(bad, table_sizes(t))


@pytest.mark.parametrize("seed", range(6))
def test_every_plan_fits_its_budget_as_executed(seed, random_linear, random_branched):
    """DP, FBS, Greedy-VBS and plan(): the executed peak (copies included) is within the budget,
    and never below the DP's own accounting."""
    rng = np.random.default_rng(700 + seed)
    B = int(rng.integers(3, 6))
    tables = random_branched(rng, B) if seed % 2 else random_linear(rng, int(rng.integers(3, 7)), B)[0]
    low = vbs.smallest_budget(tables, batch=B)
    for memory in range(low, low + 30, 4):
        for make in (vbs.dp, vbs.fbs, vbs.greedy_vbs, vbs.plan):
            try:
                p = make(tables, memory=memory, batch=B)
            except ValueError:
                continue
            executed = account(p, table_sizes(tables))[1]
            assert executed <= p.peak <= memory
            assert max(s.reserved + s.used for s in p.steps) <= p.peak
