"""The tour's measurements: MemoryMeter against sizes computed by hand, and one training step of a ResNet."""

from __future__ import annotations

import matplotlib.pyplot as plt
import pandas as pd
import torch
import torch.nn.functional as F
from matplotlib.figure import Figure
from tqdm.auto import tqdm

import workbench.models as models
from workbench.devices import seed_everything
from workbench.measure import MemoryMeter, format_bytes, measure_training_step

from .plots import plot_step_trace

__all__ = ["allocation_check", "explore_step", "training_step"]


def _traced(trace: pd.DataFrame | None) -> tuple[int, int]:
    """(peak, end) of the live tensor bytes in a MemoryMeter trace (each row: the bytes live after that event)."""
    if trace is None or trace.empty:
        return 0, 0
    return int(trace["bytes"].max()), int(trace["bytes"].iloc[-1])


def allocation_check(device: torch.device | str) -> pd.DataFrame:
    """Allocate 2.5 MB and 10 MB, free the first, allocate 1 MB: the peak is 12.5 MB, the end 11 MB.

    Three counts of the same block: ``peak_bytes``/``end_bytes`` as MemoryMeter reports them (on CUDA
    the caching allocator's, rounded up to its 512-byte blocks; on CPU the tensor tracker's),
    ``tensor_peak_bytes``/``tensor_end_bytes`` from the meter's tensor trace (the storages the ops created,
    on either device), and ``allocator_peak_bytes`` (on CPU the c10 allocator's events, on CUDA
    ``max_memory_allocated``).
    """
    with MemoryMeter(device, trace=True, allocator=True) as meter:
        a = torch.empty(2_500_000, dtype=torch.uint8, device=device)
        b = torch.empty(10_000_000, dtype=torch.uint8, device=device)
        del a
        c = torch.empty(1_000_000, dtype=torch.uint8, device=device)
    del b, c
    tensor_peak, tensor_end = _traced(meter.trace)
    return pd.DataFrame([{"peak_bytes": meter.peak_bytes, "expected_peak_bytes": 12_500_000,
                          "end_bytes": meter.end_bytes, "expected_end_bytes": 11_000_000,
                          "tensor_peak_bytes": tensor_peak, "tensor_end_bytes": tensor_end,
                          "allocator_peak_bytes": meter.allocator_peak_bytes, "device": torch.device(device).type}])


def training_step(
    model_name: str, *, stem: str, batch_size: int, image_size: int, repeats: int, device: torch.device | str,
    seed: int = 0, progress: bool = False,
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """One training step of a ResNet: its record (peak, gradient and parameter bytes, time) and memory trace.

    ``grad_bytes`` is what MemoryMeter reports live after the step (on CUDA the allocator's count, rounded
    up to its 512-byte blocks), ``tensor_grad_bytes`` the end of the meter's tensor trace (the storages
    still live, on either device).

    It runs 1 + `repeats` + 1 steps (warm-up, timed, traced); `progress` shows a bar that moves at
    each step, with the stage and, after the first step, tqdm's estimate of the time left.
    """
    if model_name not in models.RESNETS:
        raise ValueError(f"model_name must be one of {sorted(models.RESNETS)}, got {model_name!r}")
    seed_everything(seed)
    model = models.build(model_name, stem=stem)
    inputs = torch.randn(batch_size, 3, image_size, image_size)
    labels = torch.randint(10, (batch_size,))
    stages = ["warm-up"] + ["timing"] * repeats + ["memory trace"]
    bar = tqdm(total=len(stages), desc=f"{model_name}, batch {batch_size}, {image_size}px", unit="step",
               disable=not progress, leave=False)
    bar.set_postfix_str(stages[0])

    # NOTE: measure_training_step runs its steps itself; its loss function is the one call every
    # step makes, so counting calls there moves the bar without reaching into the measurement.
    def loss_fn(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = F.cross_entropy(outputs, targets)
        bar.update()
        bar.set_postfix_str(stages[min(bar.n, len(stages) - 1)])
        return loss

    try:
        record, trace = measure_training_step(model, inputs, labels, device=device, trace=True, repeats=repeats,
                                              loss_fn=loss_fn)
    finally:
        bar.close()
    row = {"model": model_name, "stem": stem, "batch_size": batch_size, "image_size": image_size, **record,
           "tensor_grad_bytes": _traced(trace)[1], "device": torch.device(device).type}
    return pd.DataFrame([row]), trace


def explore_step(
    model_name: str, *, stem: str, batch_size: int, image_size: int, device: torch.device | str, seed: int = 0,
    verdicts: bool,
) -> tuple[pd.DataFrame, Figure, str]:
    """The tour's explore widget: one step (a progress bar while it runs), its memory trace as a figure
    (marked toy scale where `verdicts` is False) and a one-line summary.

    The figure is closed in pyplot before it is returned (so interact does not draw it a second
    time): show it with `display(fig)`."""
    record, trace = training_step(model_name, stem=stem, batch_size=batch_size, image_size=image_size, repeats=1,
                                  device=device, seed=seed, progress=True)
    fig = plot_step_trace({f"batch {batch_size}, {image_size}px": trace}, verdicts=verdicts)
    plt.close(fig)
    row = record.iloc[0]
    text = f"peak {format_bytes(row['peak_bytes'])}, step {row['median_s'] * 1e3:.0f} ms"
    return record, fig, text
