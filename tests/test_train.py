import math

import pytest
import torch

from workbench.data import load_digits, make_loader
from workbench.models import MLP
from workbench.train import evaluate, train


def test_training_learns_digits_and_records_each_epoch():
    train_set, test_set = load_digits().split(0.2, seed=0)
    model = MLP((64, 32, 10), "relu")
    test_loader = make_loader(test_set, 256, shuffle=False)
    before = evaluate(model, test_loader, "cpu")
    frame = train(
        model, make_loader(train_set, 64), epochs=3, device="cpu", test_loader=test_loader,
        optimizer=torch.optim.Adam(model.parameters(), 1e-2), measure_memory=True, progress=False,
    )
    assert list(frame.columns) == ["epoch", "loss", "train_acc", "test_acc", "seconds", "peak_bytes"]
    assert frame.epoch.tolist() == [1, 2, 3]
    assert frame.loss.iloc[-1] < frame.loss.iloc[0]
    assert frame.test_acc.iloc[-1] > max(before, 0.8)
    assert (frame.peak_bytes > 0).all()


def test_optimizer_none_leaves_the_step_to_the_caller():
    data = load_digits().subset(64)
    model = MLP((64, 10), "relu")
    seen = []
    frame = train(model, make_loader(data, 32), epochs=1, optimizer=None, device="cpu",
                  step_callback=lambda step, loss: seen.append(step), progress=False)
    assert seen == [1, 2]
    assert all(p.grad is not None for p in model.parameters())
    assert math.isnan(frame.test_acc.iloc[0]) and math.isnan(frame.peak_bytes.iloc[0])
    with pytest.raises(ValueError, match="epochs must be >= 1"):
        train(model, make_loader(data, 32), epochs=0, optimizer=None, device="cpu")
