"""run.sh's `memory` part (workbench.gpu.memory): the zoo planned and measured on a device, the table kept model
by model; the advisor suite run through its notebook's own entry point (tests/experiments/test_advisor_on_device.py)."""

import pandas as pd
import torch

from tests.conftest import requires_cuda
from workbench.calcgraph import tracker
from workbench.gpu import memory as gpu_memory


def test_the_zoo_on_a_device_keeps_its_table_model_by_model(tmp_path):
    csv = tmp_path / "memory-zoo.csv"
    table = gpu_memory.zoo_on_device("cpu", (3, 12), csv, cases=["sgd momentum"])
    assert list(table["batch_size"]) == [3, 12] and (table["allocator"] > 0).all() and table["held_out"].all()
    assert table["error"].tolist() == ((table["predicted"] - table["allocator"]) / table["allocator"]).tolist()
    assert list(table.columns) == gpu_memory.ZOO_COLUMNS
    assert pd.read_csv(csv)["model"].tolist() == ["sgd momentum"] * 2  # written as soon as the model finished


def test_zoo_cases_with_their_own_loss_or_sample_batch_are_planned_and_run_with_them():
    # the first H100 run planned these without the case's loss (next-token targets) or its sample of token
    # ids (the lengths a packed sequence needs): both refused at batch 2
    table = gpu_memory.zoo_on_device("cpu", (3,), cases=["tied decoder", "packed bilstm"])
    assert table["refused"].isna().all() and (table["allocator"] > 0).all()
    assert (table["error"].abs() < 0.05).all()


def test_a_case_the_plan_refuses_is_a_row_with_the_reason_and_the_others_still_run(monkeypatch):
    # the convolution stands for cuDNN's RNN kernel, which this CPU never dispatches: refused with cuDNN and
    # without (the way out the refusal names changes nothing here), the next case measured
    monkeypatch.setattr(tracker, "_CUDNN_RNN", frozenset({torch.ops.aten.convolution.default}))
    table = gpu_memory.zoo_on_device("cpu", (2,), cases=["depthwise conv", "sgd momentum"])
    refused = table[table["model"] == "depthwise conv"]
    assert len(refused) == 1 and refused["error"].isna().all()
    assert refused["refused"].str.contains("Unplannable: .*cannot plan an RNN layer").all()
    measured = table[table["model"] == "sgd momentum"]
    assert len(measured) == 1 and measured["refused"].isna().all() and (measured["allocator"] > 0).all()


@requires_cuda
def test_the_zoo_on_cuda_is_calibrated_and_within_the_band_at_held_out_batches():
    # the 2026-11-27 H100 run, uncalibrated: nn.MultiheadAttention -27..-80%, the encoder -49..-63%, a grouped
    # convolution -31% (kernels' workspaces no fake tensor shows); the LSTM through cuDNN refused, then planned
    # without it as the refusal says
    table = gpu_memory.zoo_on_device("cuda", (3, 40, 160), cases=["mha self-attention", "transformer encoder",
                                                                  "grouped conv", "lstm", "batchnorm 2d"])
    refused = table[table["refused"].notna()]
    assert refused["model"].unique().tolist() == ["lstm"] and refused["cudnn"].all()
    measured = table.dropna(subset=["allocator"])
    assert len(measured) == 15 and measured["held_out"].all() and not measured.loc[measured["model"] == "lstm",
                                                                                  "cudnn"].any()
    assert (measured["reserved"] >= measured["allocator"]).all()
    assert measured["error"].between(-0.02, 0.05).all(), measured[["model", "batch_size", "error"]]


def test_the_advisor_half_is_the_advisor_notebook_s_own_entry_point_run_as_a_program(tmp_path):
    command = gpu_memory.advisor_command(tmp_path, "cuda", "gpu")
    assert command[1:] == ["-u", "-m", "workbench.experiments.advisor.on_device", str(tmp_path), "--device", "cuda",
                           "--profile", "gpu"]
