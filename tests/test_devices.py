"""Device choice, the environment record and seeding."""

import pytest
import torch

from workbench.devices import environment, pick_device, seed_everything


def test_devices(monkeypatch):
    monkeypatch.setenv("WORKBENCH_DEVICE", "cpu")
    assert pick_device() == torch.device("cpu")
    with pytest.raises(ValueError, match="not supported"):
        pick_device("meta")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            pick_device("cuda")
    env = environment("cpu")
    assert {"torch", "device_name", "threads", "cpu_model", "git_commit"} <= set(env)
    seed_everything(3)
    a = torch.rand(3)
    seed_everything(3)
    assert torch.equal(a, torch.rand(3))
