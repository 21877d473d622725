"""One small training and evaluation loop every notebook reuses.

Techniques plug in as ordinary torch objects: a wrapped model (checkpointing, a decode layer),
an optimizer (packed-bit), `autocast_dtype` for mixed precision, or `optimizer=None` when the
step runs inside backward.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable

import pandas as pd
import torch
from torch import nn
from tqdm.auto import tqdm

from .measure import MemoryMeter

__all__ = ["train", "evaluate"]


def _to(x, device: torch.device):
    return x.to(device, non_blocking=True) if hasattr(x, "to") else x


def _autocast(device: torch.device, dtype: torch.dtype | None):
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


@torch.no_grad()
def evaluate(
    model: nn.Module, loader: Iterable, device: torch.device | str, *,
    autocast_dtype: torch.dtype | None = None,
) -> float:
    """Top-1 accuracy of `model` over `loader`, in eval mode (training mode is restored)."""
    device = torch.device(device)
    was_training = model.training
    model.eval()
    correct = total = 0
    try:
        for inputs, labels in loader:
            labels = labels.to(device)
            with _autocast(device, autocast_dtype):
                logits = model(_to(inputs, device))
            correct += (logits.argmax(1) == labels).sum().item()
            total += labels.numel()
    finally:
        model.train(was_training)
    return correct / max(total, 1)


def train(
    model: nn.Module, train_loader: Iterable, *, epochs: int,
    optimizer: torch.optim.Optimizer | None, device: torch.device | str,
    test_loader: Iterable | None = None, scheduler=None,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    autocast_dtype: torch.dtype | None = None, grad_scaler: torch.amp.GradScaler | None = None,
    measure_memory: bool = False, progress: bool = True,
    step_callback: Callable[[int, float], None] | None = None,
) -> pd.DataFrame:
    """Train for `epochs`; one DataFrame row per epoch.

    Columns: epoch, loss (mean over batches), train_acc, test_acc (NaN without a test loader),
    seconds (training time of the epoch, evaluation excluded), peak_bytes (tensor peak of the
    epoch's training from MemoryMeter when `measure_memory`, else NaN; the CPU meter slows
    training, so leave it off when timing). `scheduler.step()` runs once per epoch;
    `step_callback(step, loss)` after every batch.
    """
    if epochs < 1:
        raise ValueError(f"epochs must be >= 1, got {epochs}")
    device = torch.device(device)
    loss_fn = loss_fn or nn.functional.cross_entropy
    model.to(device).train()
    rows, step = [], 0
    per_epoch = _length(train_loader)
    total = epochs * per_epoch if per_epoch is not None else None
    bar = tqdm(total=total, disable=not progress, desc="train", leave=False)
    for epoch in range(1, epochs + 1):
        loss_sum, correct, seen, batches = 0.0, 0, 0, 0
        meter = MemoryMeter(device) if measure_memory else contextlib.nullcontext()
        start = time.perf_counter()
        with meter:
            for inputs, labels in train_loader:
                labels = labels.to(device, non_blocking=True)
                with _autocast(device, autocast_dtype):
                    logits = model(_to(inputs, device))
                    loss = loss_fn(logits, labels)
                if grad_scaler is not None:
                    grad_scaler.scale(loss).backward()
                else:
                    loss.backward()
                if optimizer is not None:
                    if grad_scaler is not None:
                        grad_scaler.step(optimizer)
                        grad_scaler.update()
                    else:
                        optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                loss_value = loss.item()
                loss_sum += loss_value
                correct += (logits.detach().argmax(1) == labels).sum().item()
                seen += labels.numel()
                batches += 1
                step += 1
                if step_callback is not None:
                    step_callback(step, loss_value)
                bar.update()
                bar.set_postfix(epoch=epoch, loss=f"{loss_value:.3f}")
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds = time.perf_counter() - start
        if scheduler is not None:
            scheduler.step()
        test_acc = (
            evaluate(model, test_loader, device, autocast_dtype=autocast_dtype)
            if test_loader is not None else float("nan")
        )
        rows.append({
            "epoch": epoch, "loss": loss_sum / max(batches, 1), "train_acc": correct / max(seen, 1),
            "test_acc": test_acc, "seconds": seconds,
            "peak_bytes": meter.peak_bytes if measure_memory else float("nan"),
        })
    bar.close()
    return pd.DataFrame(rows)


def _length(loader: Iterable) -> int | None:
    try:
        return len(loader)  # type: ignore[arg-type]
    except TypeError:
        return None
