"""The advisor's peers run for real on a small model: MemTracker's prediction, the trial-based finders'
answers, each checked under the allocator."""

import pytest
import torch

from workbench.experiments.advisor import peers, suite


def test_memtracker_sees_the_mlp_exactly_and_misses_the_lstm_workspace():
    model = suite.suite_model("mlp", width=0.125, image_size=16)
    build, shape = model.build, model.shape
    real = peers._allocator_peak(build, shape, 8, "adamw")
    assert peers.memtracker_peak(build, shape, 8) == pytest.approx(real, rel=0.01)
    model = suite.suite_model("lstm", width=0.125, image_size=16)
    build, shape = model.build, model.shape
    assert peers.memtracker_peak(build, shape, 8) < 0.8 * peers._allocator_peak(build, shape, 8, "adamw")


def test_every_answer_is_checked_by_a_real_run(one_thread):
    candidates, decisions, advices = suite.evaluate(
        ["mlp"], batch_size=4, width=0.125, image_size=16, budget_quantile=1.0, repeats=1, min_run_time=0.01,
        progress=False, candidates=lambda c: c.name == "fp32")  # the row the peers model
    assert (candidates["repeat_step_seconds"] > 0).all() and candidates["repeat_error"].notna().all()
    assert (decisions["kernel_build_seconds"] >= 0).all()  # the kernel built before the first planning clock
    table = peers.peer_table("mlp", advices["mlp"], width=0.125, image_size=16, start_batch=16)
    assert {"advisor (fp32 row)", "torch MemTracker (fake tensors)", "accelerate find_executable_batch_size",
            "lightning scale_batch_size (power)", "lightning scale_batch_size (binsearch)"} <= set(table["method"])
    batches = table[table["question"].str.startswith("largest batch in")]
    assert "fp32's peak at batch 8" in batches["question"].iloc[0]
    assert batches[batches["answer"].notna()]["allocator_bytes"].notna().all()
    mine = batches[batches["method"] == "advisor (fp32 row)"].iloc[0]
    # a budget of its own, which fp32 fits at twice the suite's batch: every finder has a batch to find
    assert mine["trials"] == 0 and mine["within_budget"] and mine["answer"] >= 4
    others = batches[batches["method"] != "advisor (fp32 row)"]
    assert ((others["trials"] > 0) | others["note"].str.startswith("failed")).all()
    assert torch.get_num_threads() == 1
