"""The advisor's peers run for real on a small model: MemTracker's prediction, the trial-based finders'
answers, each checked under the allocator."""

import pytest
import torch

from workbench.advisor import Config, advise
from workbench.calcgraph import forked
from workbench.experiments.advisor import peers, suite
from workbench.measure import AllocatorMeter


@pytest.fixture(scope="module")
def lstm_advice():
    model = suite.suite_model("lstm", width=0.125, image_size=16)
    torch.manual_seed(0)
    return advise(model.build, model.batch(4, device="cpu"), memory_budget=2**40, loss_fn=model.loss_fn,
                  min_run_time=0.01, candidates=[Config(), Config(step_in_backward=True)])


def test_memtracker_traces_the_candidates_own_program_and_misses_the_lstm_workspace(lstm_advice):
    """MemTracker on the advisor's program (two steps: it refuses a second iteration's module statistics unless
    they are cleared): it misses oneDNN's LSTM workspace, which no fake tensor shows and calibration measures."""
    for config in ("fp32", "fp32, step in backward"):
        with AllocatorMeter() as meter:
            lstm_advice.program(config)(8, None)
        assert peers.memtracker_program_peak(lstm_advice, config, 8) < 0.8 * meter.peak_bytes, config
        assert abs(lstm_advice._by_name[config].peak(8) / meter.peak_bytes - 1) < 0.05, config


def test_every_answer_is_checked_by_a_real_run(one_thread):
    candidates, decisions, advices = suite.evaluate(
        ["mlp"], batch_size=4, width=0.125, image_size=16, budget_quantile=1.0, repeats=1, min_run_time=0.01,
        progress=False, candidates=lambda c: c.name == "fp32")  # the row the peers model
    assert (candidates["measured_step_seconds"] > 0).all() and candidates["repeat_error"].notna().all()
    assert (decisions["kernel_build_seconds"] >= 0).all()  # the kernel built before the first planning clock
    table = peers.peer_table("mlp", advices["mlp"], width=0.125, image_size=16, start_batch=16)
    assert {"advisor (fp32 row)", "torch MemTracker (fake tensors)", "accelerate find_executable_batch_size",
            "lightning scale_batch_size (power)", "lightning scale_batch_size (binsearch)"} <= set(table["method"])
    peaks = table[table["question"].str.startswith("peak")].set_index(["question", "method"])
    for question, size in (("peak at batch 4", 4), ("peak at batch 12 (held out)", 12)):
        mine = peaks.loc[(question, "advisor (fp32 row)")]
        theirs = peaks.loc[(question, "torch MemTracker (fake tensors)")]
        assert mine["allocator_bytes"] == theirs["allocator_bytes"] > 0  # one program, one real run of it
        assert mine["configurations"] == 1 and theirs["configurations"] == 1 and theirs["seconds"] > 0
        # traced in a forked process (where this machine has two cores) or here: one answer
        assert theirs["answer"] == peers.memtracker_program_peak(advices["mlp"], "fp32", size)
        assert ("forked process" in theirs["note"]) == (forked.worker_count() > 1), theirs["note"]
    batches = table[table["question"].str.startswith("largest batch in")]
    assert "fp32's peak at batch 8" in batches["question"].iloc[0]
    assert batches[batches["answer"].notna()]["allocator_bytes"].notna().all()
    mine = batches[batches["method"] == "advisor (fp32 row)"].iloc[0]
    # a budget of its own, which fp32 fits at twice the suite's batch: every finder has a batch to find
    assert mine["trials"] == 0 and mine["within_budget"] and mine["answer"] >= 4
    others = batches[batches["method"] != "advisor (fp32 row)"]
    assert ((others["trials"] > 0) | others["note"].str.startswith("failed")).all()
    assert torch.get_num_threads() == 1
