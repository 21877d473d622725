"""run.sh's `memory` part (workbench.report.gpu_memory): the zoo planned and measured on a device, the table
kept model by model, the advisor suite at its notebook's gpu profile."""

import pandas as pd
import torch

from tests.conftest import requires_cuda
from workbench.report import gpu_memory


def test_the_zoo_on_a_device_keeps_its_table_model_by_model(tmp_path):
    csv = tmp_path / "memory-zoo.csv"
    table = gpu_memory.zoo_on_device("cpu", (1, 4), csv, cases=["sgd momentum"])
    assert list(table["batch_size"]) == [1, 4] and (table["max_memory_allocated"] > 0).all()
    assert table["error"].tolist() == ((table["predicted_bytes"] - table["max_memory_allocated"])
                                       / table["max_memory_allocated"]).tolist()
    assert pd.read_csv(csv)["model"].tolist() == ["sgd momentum"] * 2  # written as soon as the model finished


def test_the_advisor_suite_runs_at_its_notebook_s_gpu_profile_cheapest_model_first():
    p = gpu_memory._advisor_parameters("gpu")
    assert p["device"] == "cuda" and p["batch_size"] == 32 and 0 < p["budget_quantile"] < 1
    assert set(p["models"]) <= set(gpu_memory.ADVISOR_ORDER)


@requires_cuda
def test_the_zoo_on_cuda_reads_allocated_and_reserved_peaks(tmp_path):
    table = gpu_memory.zoo_on_device("cuda", (1, 64), cases=["lstm", "batchnorm 2d"])
    measured = table.dropna(subset=["max_memory_allocated"])
    assert len(measured) == 4 and (measured["max_memory_allocated"] > 0).all()
    assert (measured["max_memory_reserved"] >= measured["max_memory_allocated"]).all()
    assert torch.cuda.max_memory_reserved() > 0

