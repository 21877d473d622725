"""Accuracy by number format and forward error of 16-bit additions (paper 004, Table 3, Fig 4, Fig 6).

Paper: Lewandowski & Kosson, "Memory Efficient Mixed Precision Optimizers" (004), section 4
("Accuracy", "Stochastic Rounding"), Table 3 (ResNet-18/CIFAR-10 by format), Fig 4 (fp16 stalls
where fp16+8 matches fp32) and Fig 6 (forward error of in-place 16-bit additions).

fp8 rows follow the paper's own emulation ("e5m2 fp8 is equivalent to a truncated fp16"): the
model runs on fp16 weights whose significand is cut to e5m2's 2 bits. Plain fp8 rounds the
weights after every step; fp8+8 keeps 8 more bits (= the full fp16 value) in the optimizer and
shows the model only the truncated weights.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable

import pandas as pd
import torch
from torch import nn
from tqdm.auto import tqdm

from workbench.data import ImageSet, load_cifar10, load_digits, make_loader, synthetic_images
from workbench.measure import MemoryMeter
from workbench.models import MLP, resnet18
from workbench.optim.bits import merge_values, split_values
from workbench.train import evaluate, train

from .bench import _loss, make_model, make_optimizer, parse_format

__all__ = ["truncate_to_e5m2", "load_task", "accuracy_by_format", "addition_error"]

_FP8 = ("fp8", "fp8+8")


def truncate_to_e5m2(x: torch.Tensor) -> torch.Tensor:
    """fp16 -> fp16 whose significand keeps e5m2's 2 bits, rounded toward zero (fp8 emulation)."""
    bits = x.view(torch.int16)
    return (bits & ~0xFF).to(torch.int16).view(torch.float16)


class _Fp8Weights:
    """Keeps fp16 weights and shows the model e5m2-truncated copies during forward/backward.

    # NOTE: torch's float8 dtypes have no CPU matmul/autograd, so fp8 is emulated on fp16 values
    # as in the paper (Table 3); gradients flow straight through the truncation.
    """

    def __init__(self, model: nn.Module, *, keep_master: bool) -> None:
        self.params = [p for p in model.parameters() if p.dtype == torch.float16]
        self.keep_master = keep_master
        self.master: list[torch.Tensor] = []

    def before_forward(self) -> None:
        with torch.no_grad():
            if self.keep_master:
                self.master = [p.detach().clone() for p in self.params]
            for p in self.params:
                p.copy_(truncate_to_e5m2(p))

    def before_step(self) -> None:
        if self.keep_master:
            with torch.no_grad():
                for p, m in zip(self.params, self.master, strict=True):
                    p.copy_(m)


def load_task(
    dataset: str, *, model: str = "mlp", hidden: int = 128, n: int = 2000, size: int = 16,
    noise: float = 0.8, seed: int = 0,
) -> tuple[Callable[[], nn.Module], ImageSet, ImageSet, str]:
    """(model_fn, train set, test set, description) for 'digits', 'synthetic' or 'cifar10'.

    ``model`` is 'mlp' (two hidden ReLU layers of ``hidden`` units) or 'resnet18' (CIFAR stem).
    """
    if dataset == "digits":
        train_set, test_set = load_digits().split(0.2, seed=seed)
    elif dataset == "synthetic":
        full = synthetic_images(n, shape=(1, size, size), num_classes=10, seed=seed, noise=noise)
        train_set, test_set = full.split(0.2, seed=seed)
    elif dataset == "cifar10":
        train_set, test_set = load_cifar10()
    else:
        raise ValueError(f"dataset={dataset!r}: allowed 'digits', 'synthetic', 'cifar10'")
    c, h, w = train_set.images.shape[1:]
    if model == "mlp":
        def model_fn() -> nn.Module:
            return MLP(sizes=(c * h * w, hidden, hidden, train_set.num_classes), activation="relu")
        desc = f"MLP {c * h * w}-{hidden}-{hidden}-{train_set.num_classes}"
    elif model == "resnet18":
        def model_fn() -> nn.Module:
            return resnet18(train_set.num_classes, stem="cifar", in_channels=c)
        desc = "ResNet-18"
    else:
        raise ValueError(f"model={model!r}: allowed 'mlp', 'resnet18'")
    return model_fn, train_set, test_set, f"{desc} on {train_set.name} ({len(train_set)} train)"


def _train_fp8(model, opt, loader, epochs, device, scheduler, *, keep_master) -> None:
    wrap = _Fp8Weights(model, keep_master=keep_master)
    fmt = parse_format("fp16")
    for _ in range(epochs):
        for x, y in loader:
            wrap.before_forward()
            _loss(model, x.to(device), y.to(device), fmt).backward()
            wrap.before_step()
            opt.step()
            opt.zero_grad(set_to_none=True)
        if scheduler is not None:
            scheduler.step()
    wrap.before_forward()  # evaluate what the model sees


def accuracy_by_format(
    model_fn: Callable[[], nn.Module], train_set: ImageSet, test_set: ImageSet, *,
    formats: Iterable[str], epochs: int, lr: float, batch_size: int = 64, optimizer: str = "sgd",
    momentum: float = 0.9, weight_decay: float = 0.0, seed: int = 0,
    device: torch.device | str = "cpu", measure_memory: bool = True, regime: str = "",
    fused: bool = False, progress: bool = True,
) -> pd.DataFrame:
    """Train one model per format with the same seed, data order and cosine schedule.

    One row per format: final test accuracy, final train loss, training seconds, and (when
    ``measure_memory``) the peak tensor bytes of two extra training steps measured separately
    (parameters included), so timing runs are not slowed by the CPU meter. ``fused`` runs the
    packed optimizers' flat eager step (one update over the whole group; uncompiled, so the CPU
    meter can see it) instead of one update per parameter.
    """
    device = torch.device(device)
    rows = []
    for name in tqdm(list(formats), desc=f"accuracy {regime}".strip(), disable=not progress):
        fmt = parse_format("fp16" if name in _FP8 else name)
        torch.manual_seed(seed)
        model = make_model(model_fn, fmt, device)
        opt = make_optimizer(model.parameters(), fmt, optimizer=optimizer, lr=lr,
                             momentum=momentum, weight_decay=weight_decay, seed=seed,
                             fused=fused and fmt.packed)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=epochs)
        loader = make_loader(train_set, batch_size, shuffle=True, seed=seed)
        test_loader = make_loader(test_set, 256, shuffle=False)
        if name in _FP8:
            start = time.perf_counter()
            _train_fp8(model, opt, loader, epochs, device, sched, keep_master=name == "fp8+8")
            seconds, loss = time.perf_counter() - start, float("nan")
            acc = evaluate(model, test_loader, device)
        else:
            hist = train(model, loader, epochs=epochs, optimizer=opt, device=device,
                         test_loader=test_loader, scheduler=sched, autocast_dtype=fmt.autocast,
                         loss_fn=lambda logits, y: nn.functional.cross_entropy(logits.float(), y),
                         progress=False)
            seconds, loss, acc = hist["seconds"].sum(), hist["loss"].iloc[-1], hist["test_acc"].iloc[-1]
        peak = float("nan")
        if measure_memory and name not in _FP8:
            batches = [b for b, _ in zip(loader, range(2), strict=False)]
            param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
            with MemoryMeter(device) as meter:
                for x, y in batches:
                    _loss(model, x.to(device), y.to(device), fmt).backward()
                    opt.step()
                    opt.zero_grad(set_to_none=True)
            peak = param_bytes + meter.peak_bytes
        rows.append({"format": name, "regime": regime, "lr": lr, "epochs": epochs,
                     "test_acc": acc, "train_loss": loss, "seconds": seconds, "peak_bytes": peak,
                     "params": sum(p.numel() for p in model.parameters())})
    return pd.DataFrame(rows)


def _add_packed(master_half, extra_vals, y, k, sr, gen):
    master = merge_values(master_half, extra_vals, extra_bits=k, stochastic_rounding=sr)
    noise = None
    if sr:
        noise = torch.randint(0, 2**13, master.shape, dtype=torch.int32, generator=gen)
    return split_values(master + y.float(), dtype=torch.float16, extra_bits=k,
                        stochastic_rounding=sr, noise=noise)


def addition_error(
    *, sizes: Iterable[int] = (10**3, 10**4, 10**5), n_ops: Iterable[int] = (1, 10, 100, 1000),
    width: int = 4096, seed: int = 0,
) -> pd.DataFrame:
    """Fig 6: relative forward error of the 16-bit value after in-place additions ``x += y``.

    Formats: fp16 (round to nearest), fp16+8 (extra bits, split toward zero), fp16+8 SR
    (stochastic rounding of the visible value). x and every y are standard-normal fp16 values;
    the exact result is computed in float64. Error = ||x16 - exact|| / ||exact||.
    Panel "one op": error after one addition for each size; panel "many ops": error after m
    additions of a ``width``-sized tensor.
    """
    gen = torch.Generator().manual_seed(seed)
    rows = []

    def run(n, m, panel):
        x0 = torch.randn(n, generator=gen).half()
        ys = [torch.randn(n, generator=gen).half() for _ in range(m)]
        exact = x0.double() + torch.stack([y.double() for y in ys]).sum(0)
        for fmt, k, sr in (("fp16", None, False), ("fp16+8", 8, False), ("fp16+8 SR", 8, True)):
            if k is None:
                x = x0.clone()
                for y in ys:
                    x += y
            else:
                x, vals = x0.clone(), torch.zeros(n, dtype=torch.int32)
                for y in ys:
                    x, vals = _add_packed(x, vals, y, k, sr, gen)
            err = (x.double() - exact).norm() / exact.norm()
            rows.append({"panel": panel, "format": fmt, "n": n, "ops": m, "rel_error": err.item()})

    for n in sizes:
        run(n, 1, "one op")
    for m in n_ops:
        run(width, m, "many ops")
    df = pd.DataFrame(rows)
    df["fp16_eps"] = math.ldexp(1.0, -11)
    return df
