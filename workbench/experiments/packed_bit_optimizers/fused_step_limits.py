"""The limits of the step fused into backward, measured, and what each optimizer option costs.

Paper: Lewandowski & Kosson, "Memory Efficient Mixed Precision Optimizers", section 4.1
(limitations: gradient accumulation becomes impossible when the step is fused into backward;
clipping and loss scaling must go through hooks) and section 3.1 (the bytes a packed optimizer
keeps per parameter).

* :func:`bytes_per_param_table`: weights, gradients and optimizer state per parameter after one
  ordinary step, measured (every storage once) beside the analytic count, per format and optimizer
  option (``adamw+amsgrad`` keeps a third state: the running max of the second moment).
* :func:`accumulation_memory`: peak memory of ``step_in_backward(accumulate=N)`` against
  ``accumulate=1`` and an ordinary loop that accumulates N micro-batches, over two optimizer steps
  (``MemoryMeter``): what keeping the gradients over micro-batches costs back.
* :func:`loss_scaling_curves`: an fp16 model whose gradients underflow (a small loss weight puts
  the logits' gradients below fp16's smallest subnormal, 2**-24): without loss scaling the packed
  fp16 run stalls; with ``torch.amp.GradScaler`` (ordinary step, or inside backward) it trains.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import pandas as pd
import torch
from torch import nn

from workbench.measure import MemoryMeter, state_bytes
from workbench.optim import PackedAdamW, step_in_backward

from .peak_memory import _loss, analytic_bytes_per_param, make_model, make_optimizer, parse_format

__all__ = ["accumulation_memory", "bytes_per_param_table", "loss_scaling_curves"]

Batches = list[tuple[torch.Tensor, torch.Tensor]]


def _option(name: str) -> tuple[str, bool]:
    base, _, extra = name.partition("+")
    if base not in ("sgd", "adamw") or extra not in ("", "amsgrad") or (extra and base != "adamw"):
        raise ValueError(f"optimizer {name!r}: allowed 'sgd', 'adamw' or 'adamw+amsgrad'")
    return base, extra == "amsgrad"


def bytes_per_param_table(
    model_fn: Callable[[], nn.Module], batch: tuple[torch.Tensor, torch.Tensor], *,
    formats: Iterable[str] = ("fp32", "bf16+8", "fp16+13 SR"),
    optimizers: Iterable[str] = ("sgd", "adamw", "adamw+amsgrad"), device: torch.device | str = "cpu",
) -> pd.DataFrame:
    """Bytes per parameter held after one ordinary step (gradients still held), measured and analytic.

    One row per (format, optimizer): ``weight``/``grad``/``state_bytes_per_param`` measured with
    ``workbench.measure.state_bytes``; ``analytic_bytes_per_param`` from the format's sizes
    (``peak_memory.analytic_bytes_per_param``). Packed extra bits are padded to 32 values per tensor, so
    small tensors measure slightly above the analytic count.
    """
    device = torch.device(device)
    rows = []
    for name in formats:
        fmt = parse_format(name)
        for option in optimizers:
            base, amsgrad = _option(option)
            torch.manual_seed(0)
            model = make_model(model_fn, fmt, device)
            opt = make_optimizer(model.parameters(), fmt, optimizer=base, lr=1e-3, amsgrad=amsgrad)
            _loss(model, batch[0].to(device), batch[1].to(device), fmt).backward()
            opt.step()
            sizes = state_bytes(model, opt)
            params = sum(p.numel() for p in model.parameters())
            rows.append({
                "format": fmt.name, "optimizer": option, "params": params,
                "weight_bytes_per_param": sizes["parameters"] / params,
                "grad_bytes_per_param": sizes["gradients"] / params,
                "state_bytes_per_param": sizes["optimizer_state"] / params,
                "bytes_per_param": sum(sizes.values()) / params,
                "analytic_bytes_per_param": analytic_bytes_per_param(fmt, optimizer=base, amsgrad=amsgrad),
                "device": str(device),
            })
    return pd.DataFrame(rows)


def _peak(model_fn, fmt, batches, *, in_backward: bool, accumulate: int, optimizer: str, device) -> dict:
    torch.manual_seed(0)
    model = make_model(model_fn, fmt, device)
    opt = make_optimizer(model.parameters(), fmt, optimizer=optimizer, lr=1e-3)
    handle = step_in_backward(model, opt, accumulate=accumulate) if in_backward else None
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    held = 0
    try:
        with MemoryMeter(device) as meter:
            for i, (x, y) in enumerate(batches, start=1):
                (_loss(model, x.to(device), y.to(device), fmt) / accumulate).backward()
                if i % accumulate:  # between micro-batches: the gradients kept for the next one
                    held = max(held, sum(p.grad.untyped_storage().nbytes() for p in model.parameters()
                                         if type(p.grad) is torch.Tensor))
                if handle is None and i % accumulate == 0:
                    opt.step()
                    opt.zero_grad(set_to_none=True)
    finally:
        if handle is not None:
            handle.remove()
    return {"peak_bytes": param_bytes + meter.peak_bytes, "held_gradient_bytes": held,
            "gradient_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
            "largest_gradient_bytes": max(p.numel() * p.element_size() for p in model.parameters()),
            "params": sum(p.numel() for p in model.parameters())}


def accumulation_memory(
    model_fn: Callable[[], nn.Module], batches: Batches, *, format_name: str = "bf16+8", accumulate: int = 4,
    optimizer: str = "adamw", device: torch.device | str = "cpu",
) -> pd.DataFrame:
    """Peak tensor bytes with the step inside backward at ``accumulate=1`` and ``accumulate=N``, and of
    an ordinary loop accumulating N micro-batches, on the same model and micro-batches.

    ``batches`` must hold 2N micro-batches (two optimizer steps at N, so the steady state with the
    optimizer state allocated is inside the measured region); the ``accumulate=1`` run takes a step
    per micro-batch. ``held_gradient_bytes``: the most gradient bytes alive between two micro-batches
    of one step (what accumulation keeps: all of them; 0 for ``accumulate=1`` in backward).
    ``extra_vs_accumulate_1`` is a row's peak minus that of ``accumulate=1``, and
    ``extra_over_gradient_bytes`` that difference over the bytes of all gradients (below 1 where the
    peak falls in a step, after some gradients were already applied and freed).
    """
    if isinstance(accumulate, bool) or not isinstance(accumulate, int) or accumulate < 2:
        raise ValueError(f"accumulate={accumulate!r}: allowed integers >= 2 (1 is the baseline row)")
    if len(batches) != 2 * accumulate:
        raise ValueError(f"batches holds {len(batches)} micro-batches; expected 2 * accumulate = {2 * accumulate}")
    device, fmt = torch.device(device), parse_format(format_name)
    runs = [("step in backward", True, 1), ("step in backward", True, accumulate), ("ordinary step", False, accumulate)]
    rows = [{"mode": mode, "accumulate": n, "format": fmt.name, "optimizer": optimizer,
             "micro_batches": len(batches), "optimizer_steps": len(batches) // n,
             **_peak(model_fn, fmt, batches, in_backward=sib, accumulate=n, optimizer=optimizer, device=device)}
            for mode, sib, n in runs]
    df = pd.DataFrame(rows)
    df["peak_bytes_per_param"] = df["peak_bytes"] / df["params"]
    df["extra_vs_accumulate_1"] = df["peak_bytes"] - df["peak_bytes"].iloc[0]
    df["extra_over_gradient_bytes"] = df["extra_vs_accumulate_1"] / df["gradient_bytes"]
    df["device"], df["torch"], df["threads"] = str(device), torch.__version__, torch.get_num_threads()
    return df


def _teacher_task(n: int, width: int, classes: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, width, generator=g)
    y = (x @ torch.randn(width, classes, generator=g)).argmax(1)
    return x, y


def loss_scaling_curves(
    *, steps: int = 40, loss_weight: float = 2.0**-20, extra_bits: int = 13, lr: float = 1e-2, batch: int = 64,
    width: int = 16, hidden: int = 32, classes: int = 4, seed: int = 0,
) -> pd.DataFrame:
    """Loss per step of fp32 AdamW and of fp16+k PackedAdamW without and with dynamic loss scaling.

    The training loss is ``loss_weight`` times the cross-entropy (as an auxiliary-loss weight, or a
    mean over many elements would): the logits' gradients, at most ``loss_weight / batch``, fall
    below fp16's smallest subnormal (2**-24) and flush to zero. Adam's update does not depend on the
    gradients' scale, so fp32 trains as with weight 1. Variants: ``fp32`` (torch.optim.AdamW),
    ``fp16+k`` (no scaling), ``fp16+k GradScaler`` (ordinary step) and ``fp16+k GradScaler in
    backward`` (``step_in_backward(grad_scale=scaler)``). Rows: variant, step, the unweighted loss
    before the step, the loss scale used, and the fraction of the first layer's weights that moved.
    CPU, weight decay 0 (so a zero gradient leaves the weights exactly as they are).
    """
    x, y = _teacher_task(batch, width, classes, seed)
    rows = []
    for variant in ("fp32", f"fp16+{extra_bits}", f"fp16+{extra_bits} GradScaler",
                    f"fp16+{extra_bits} GradScaler in backward"):
        dtype = torch.float32 if variant == "fp32" else torch.float16
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(width, hidden), nn.Tanh(), nn.Linear(hidden, classes)).to(dtype)
        if dtype == torch.float32:
            opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
        else:
            opt = PackedAdamW(model.parameters(), lr=lr, weight_decay=0.0, extra_bits=extra_bits)
        scaler = torch.amp.GradScaler("cpu") if "GradScaler" in variant else None
        handle = step_in_backward(model, opt, grad_scale=scaler) if variant.endswith("in backward") else None
        start = model[0].weight.detach().clone()
        for step in range(steps):
            loss = nn.functional.cross_entropy(model(x.to(dtype)).float(), y)
            scale = scaler.get_scale() if scaler is not None else 1.0
            rows.append({"variant": variant, "step": step, "loss": float(loss.detach()), "loss_scale": scale,
                         "moved_fraction": float((model[0].weight.detach() != start).float().mean())})
            weighted = loss * loss_weight
            (scaler.scale(weighted) if scaler is not None else weighted).backward()
            if handle is None:
                if scaler is not None:
                    scaler.step(opt)
                else:
                    opt.step()
                opt.zero_grad(set_to_none=True)
            if scaler is not None:
                scaler.update()
        if handle is not None:
            handle.remove()
    df = pd.DataFrame(rows)
    df["loss_weight"], df["extra_bits"], df["lr"], df["torch"] = loss_weight, extra_bits, lr, torch.__version__
    return df
