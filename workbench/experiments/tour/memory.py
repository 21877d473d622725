"""The tour's measurements: MemoryMeter against sizes computed by hand, and one training step of a ResNet."""

from __future__ import annotations

import pandas as pd
import torch

import workbench.models as models
from workbench.devices import seed_everything
from workbench.measure import MemoryMeter, measure_training_step

__all__ = ["allocation_check", "training_step"]


def allocation_check(device: torch.device | str) -> pd.DataFrame:
    """Allocate 2.5 MB and 10 MB, free the first, allocate 1 MB: the peak is 12.5 MB, the end 11 MB."""
    with MemoryMeter(device) as meter:
        a = torch.empty(2_500_000, dtype=torch.uint8, device=device)
        b = torch.empty(10_000_000, dtype=torch.uint8, device=device)
        del a
        c = torch.empty(1_000_000, dtype=torch.uint8, device=device)
    del b, c
    return pd.DataFrame([{"peak_bytes": meter.peak_bytes, "expected_peak_bytes": 12_500_000,
                          "end_bytes": meter.end_bytes, "expected_end_bytes": 11_000_000}])


def training_step(
    model_name: str, *, stem: str, batch_size: int, image_size: int, repeats: int, device: torch.device | str,
    seed: int = 0,
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """One training step of a ResNet: its record (peak, gradient and parameter bytes, time) and memory trace."""
    if model_name not in models.RESNETS:
        raise ValueError(f"model_name must be one of {sorted(models.RESNETS)}, got {model_name!r}")
    seed_everything(seed)
    model = models.build(model_name, stem=stem)
    inputs = torch.randn(batch_size, 3, image_size, image_size)
    labels = torch.randint(10, (batch_size,))
    record, trace = measure_training_step(model, inputs, labels, device=device, trace=True, repeats=repeats)
    row = {"model": model_name, "stem": stem, "batch_size": batch_size, "image_size": image_size, **record}
    return pd.DataFrame([row]), trace
