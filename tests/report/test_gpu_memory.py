"""run.sh's `memory` part (workbench.report.gpu_memory): the zoo planned and measured on a device, the table
kept model by model, the advisor suite at its notebook's gpu profile."""

import pandas as pd
import torch

from tests.conftest import requires_cuda
from workbench.calcgraph import tracker
from workbench.report import gpu_memory


def test_the_zoo_on_a_device_keeps_its_table_model_by_model(tmp_path):
    csv = tmp_path / "memory-zoo.csv"
    table = gpu_memory.zoo_on_device("cpu", (1, 4), csv, cases=["sgd momentum"])
    assert list(table["batch_size"]) == [1, 4] and (table["max_memory_allocated"] > 0).all()
    assert table["error"].tolist() == ((table["predicted_bytes"] - table["max_memory_allocated"])
                                       / table["max_memory_allocated"]).tolist()
    assert pd.read_csv(csv)["model"].tolist() == ["sgd momentum"] * 2  # written as soon as the model finished


def test_zoo_cases_with_their_own_loss_or_sample_batch_are_planned_and_run_with_them():
    # the first H100 run planned these without the case's loss (next-token targets) or its sample of token
    # ids (the lengths a packed sequence needs): both refused at batch 2
    table = gpu_memory.zoo_on_device("cpu", (3,), cases=["tied decoder", "packed bilstm"])
    assert table["refused"].isna().all() and (table["max_memory_allocated"] > 0).all()
    assert (table["error"].abs() < 0.05).all()


def test_a_case_the_plan_refuses_is_a_row_with_the_reason_and_the_others_still_run(monkeypatch):
    # the convolution stands for cuDNN's RNN kernel, which this CPU never dispatches: refused with cuDNN and
    # without (the way out the refusal names changes nothing here), the next case measured
    monkeypatch.setattr(tracker, "_CUDNN_RNN", frozenset({torch.ops.aten.convolution.default}))
    table = gpu_memory.zoo_on_device("cpu", (2,), cases=["depthwise conv", "sgd momentum"])
    refused = table[table["model"] == "depthwise conv"]
    assert refused["cudnn"].tolist() == [True, False]
    assert refused["refused"].str.contains("cannot plan an RNN layer").all() and refused["error"].isna().all()
    measured = table[table["model"] == "sgd momentum"]
    assert len(measured) == 1 and measured["refused"].isna().all() and (measured["max_memory_allocated"] > 0).all()


def test_the_advisor_suite_runs_at_its_notebook_s_gpu_profile_cheapest_model_first():
    p = gpu_memory._advisor_parameters("gpu")
    assert p["device"] == "cuda" and p["batch_size"] == 32 and 0 < p["budget_quantile"] < 1
    assert set(p["models"]) <= set(gpu_memory.ADVISOR_ORDER)


@requires_cuda
def test_the_zoo_on_cuda_reads_allocated_and_reserved_peaks(tmp_path):
    table = gpu_memory.zoo_on_device("cuda", (1, 64), cases=["lstm", "batchnorm 2d"])
    # the LSTM through cuDNN is refused (see calcgraph.tracker._refuse_unplannable), then planned without it
    refused = table[table["refused"].notna()]
    assert refused["model"].tolist() == ["lstm"] * 2 and refused["cudnn"].all()
    measured = table.dropna(subset=["max_memory_allocated"])
    assert len(measured) == 4 and (measured["max_memory_allocated"] > 0).all()
    assert not measured.loc[measured["model"] == "lstm", "cudnn"].any()
    assert (measured["max_memory_reserved"] >= measured["max_memory_allocated"]).all()
    assert torch.cuda.max_memory_reserved() > 0

