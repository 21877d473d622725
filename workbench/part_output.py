"""What a long measurement part on a device writes as it goes: CSV files replaced whole (never half written, so a
part stopped at its deadline leaves the last complete table), timestamped log lines, and the device's cached
memory released between models. Shared by the GPU run's memory part (`workbench.gpu.memory`) and the advisor's
on-device suite (`workbench.experiments.advisor.on_device`), which may not import each other."""

from __future__ import annotations

import gc
import os
import time
from pathlib import Path

import pandas as pd
import torch

__all__ = ["log", "release_memory", "write_csv"]


def write_csv(frame: pd.DataFrame, path: Path) -> None:
    """`frame` to `path`, through a temporary file renamed over it."""
    temporary = path.with_name(f".{path.name}.tmp")
    frame.to_csv(temporary, index=False)
    os.replace(temporary, path)


def log(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", flush=True)


def release_memory(device: torch.device) -> None:
    """Collect garbage and, on CUDA, return the caching allocator's free blocks (after the device finished)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
