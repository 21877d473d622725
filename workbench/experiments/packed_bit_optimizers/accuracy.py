"""Accuracy by number format and forward error of 16-bit additions.

Paper: Lewandowski & Kosson, "Memory Efficient Mixed Precision Optimizers", section 4
("Accuracy", "Stochastic Rounding"), Table 3 (ResNet-18/CIFAR-10 by format), Fig 4 (fp16 stalls
where fp16+8 matches fp32) and Fig 6 (forward error of in-place 16-bit additions).

fp8 rows follow the paper's own emulation ("e5m2 fp8 is equivalent to a truncated fp16"): the
model runs on fp16 weights whose significand is cut to e5m2's 2 bits. Plain fp8 truncates the
weights after every step; fp8+k keeps k more significand bits (fp8+8 = the full fp16 value) in
the optimizer, truncated toward zero like the packed split, and shows the model only the e5m2 part.
Every regime runs over several seeds, so a gap between formats comes with its spread.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable

import pandas as pd
import torch
from torch import nn
from tqdm.auto import tqdm

from workbench.data import ImageSet, load, make_loader, synthetic_images
from workbench.models import MLP, build
from workbench.optim.split_merge import merge_values, nearest_offset, split_values
from workbench.train import evaluate, train

from .peak_memory import make_model, make_optimizer, measure_peak, parse_format, _loss

__all__ = ["truncate_to_e5m2", "truncate_significand", "fp8_extra_bits", "load_task", "accuracy_by_format",
           "accuracy_summary", "paired_gap", "addition_error"]


def truncate_significand(x: torch.Tensor, bits: int) -> torch.Tensor:
    """fp16 -> fp16 keeping the top ``bits`` (0..10) of the 10-bit significand, rounded toward zero."""
    if x.dtype != torch.float16:
        raise TypeError(f"truncate_significand needs a torch.float16 tensor, got {x.dtype}")
    if not 0 <= bits <= 10:
        raise ValueError(f"bits={bits} must be in 0..10 (fp16 has 10 significand bits)")
    mask = ~((1 << (10 - bits)) - 1)
    return (x.view(torch.int16) & mask).to(torch.int16).view(torch.float16)


def truncate_to_e5m2(x: torch.Tensor) -> torch.Tensor:
    """fp16 -> fp16 whose significand keeps e5m2's 2 bits, rounded toward zero (fp8 emulation)."""
    return truncate_significand(x, 2)


def fp8_extra_bits(name: str) -> int | None:
    """Extra bits of an emulated fp8 format name: 'fp8' -> 0, 'fp8+4' -> 4; None if not fp8."""
    base, plus, k = name.strip().partition("+")
    if base != "fp8":
        return None
    if plus and not (k.isdigit() and 0 <= int(k) <= 8):
        raise ValueError(f"format {name!r}: fp8+K needs K in 0..8 (fp8+8 is the full fp16 value)")
    return int(k) if plus else 0


class _Fp8Weights:
    """Keeps fp16 weights and shows the model e5m2-truncated copies during forward/backward.

    The optimizer's value keeps 2 + ``extra_bits`` significand bits (cut toward zero after each
    step); plain fp8 (``extra_bits=0``) keeps only what the model sees.

    # NOTE: torch's float8 dtypes have no CPU matmul/autograd, so fp8 is emulated on fp16 values
    # as in the paper (Table 3); gradients flow straight through the truncation.
    """

    def __init__(self, model: nn.Module, *, extra_bits: int) -> None:
        self.params = [p for p in model.parameters() if p.dtype == torch.float16]
        self.keep_master = extra_bits > 0
        self.bits = 2 + extra_bits
        self.master: list[torch.Tensor] = []

    def before_forward(self) -> None:
        with torch.no_grad():
            if self.keep_master:
                self.master = [truncate_significand(p.detach(), self.bits) for p in self.params]
            for p in self.params:
                p.copy_(truncate_to_e5m2(p))

    def before_step(self) -> None:
        if self.keep_master:
            with torch.no_grad():
                for p, m in zip(self.params, self.master, strict=True):
                    p.copy_(m)


# The whole sets, split as before: the bundled digits 80/20 by a seeded shuffle, CIFAR-10 its own split.
_SPLITS = {"digits": (1438, 359), "cifar10": (50000, 10000)}


def load_task(
    dataset: str, *, model: str = "mlp", hidden: int = 128, n: int = 2000, size: int = 16,
    noise: float = 0.8, seed: int = 0,
) -> tuple[Callable[[], nn.Module], ImageSet, ImageSet, str]:
    """(model_fn, train set, test set, description) for 'digits', 'synthetic' or 'cifar10'.

    ``model`` is 'mlp' (two hidden ReLU layers of ``hidden`` units) or 'resnet18' (CIFAR stem, built by
    :func:`workbench.models.build`). 'digits' and 'cifar10' come from :func:`workbench.data.load`;
    'synthetic' is ``n`` seeded images of ``size`` x ``size`` with pixel ``noise`` (a harder task).
    """
    if dataset in _SPLITS:
        train_set, test_set = load(dataset, *_SPLITS[dataset], seed=seed,
                                   shape=(1, 8, 8) if dataset == "digits" else None)
    elif dataset == "synthetic":
        # NOTE: workbench.data.load has no noise level; this task needs one to be hard
        full = synthetic_images(n, shape=(1, size, size), num_classes=10, seed=seed, noise=noise)
        train_set, test_set = full.split(0.2, seed=seed)
    else:
        raise ValueError(f"dataset={dataset!r}: allowed 'digits', 'synthetic', 'cifar10'")
    c, h, w = train_set.images.shape[1:]
    if model == "mlp":
        def model_fn() -> nn.Module:
            return MLP(sizes=(c * h * w, hidden, hidden, train_set.num_classes), activation="relu")
        desc = f"MLP {c * h * w}-{hidden}-{hidden}-{train_set.num_classes}"
    elif model == "resnet18":
        def model_fn() -> nn.Module:
            return build("resnet18", num_classes=train_set.num_classes, stem="cifar", in_channels=c)
        desc = "ResNet-18"
    else:
        raise ValueError(f"model={model!r}: allowed 'mlp', 'resnet18'")
    return model_fn, train_set, test_set, f"{desc} on {train_set.name} ({len(train_set)} train)"


def _train_fp8(model, opt, loader, epochs, device, scheduler, *, extra_bits) -> None:
    wrap = _Fp8Weights(model, extra_bits=extra_bits)
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
    momentum: float = 0.9, weight_decay: float = 0.0, seeds: Iterable[int] = (0,),
    device: torch.device | str = "cpu", measure_memory: bool = True, regime: str = "", task: str = "",
    fused: bool = False, progress: bool = True,
) -> pd.DataFrame:
    """Train one model per format and seed; per seed every format has the same initial weights,
    data order and cosine schedule.

    One row per (format, seed): final test accuracy, final train loss, training seconds, and (when
    ``measure_memory``, first seed only) the peak tensor bytes of two training steps of a fresh
    model and optimizer (parameters and optimizer state included) measured apart, so timing runs
    are not slowed by the CPU meter. ``fused`` runs the packed optimizers' flat eager step.
    ``regime`` and ``task`` (what is trained, e.g. :func:`load_task`'s description) label the rows.
    Formats: anything :func:`parse_format` reads, and emulated 'fp8' / 'fp8+K'.
    """
    device = torch.device(device)
    formats, seeds = list(formats), list(seeds)
    if not seeds:
        raise ValueError("seeds must name at least one seed")
    for name in formats:  # fail before any training
        if fp8_extra_bits(name) is None:
            parse_format(name)
    rows = []
    runs = [(name, seed) for seed in seeds for name in formats]
    for name, seed in tqdm(runs, desc=f"accuracy {regime}".strip(), disable=not progress):
        fp8 = fp8_extra_bits(name)
        fmt = parse_format("fp16" if fp8 is not None else name)
        torch.manual_seed(seed)
        model = make_model(model_fn, fmt, device)
        opt = make_optimizer(model.parameters(), fmt, optimizer=optimizer, lr=lr,
                             momentum=momentum, weight_decay=weight_decay, seed=seed,
                             fused=fused and fmt.packed)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=epochs)
        loader = make_loader(train_set, batch_size, shuffle=True, seed=seed)
        test_loader = make_loader(test_set, 256, shuffle=False)
        if fp8 is not None:
            start = time.perf_counter()
            _train_fp8(model, opt, loader, epochs, device, sched, extra_bits=fp8)
            seconds, loss = time.perf_counter() - start, float("nan")
            acc = evaluate(model, test_loader, device)
        else:
            hist = train(model, loader, epochs=epochs, optimizer=opt, device=device,
                         test_loader=test_loader, scheduler=sched, autocast_dtype=fmt.autocast,
                         loss_fn=lambda logits, y: nn.functional.cross_entropy(logits.float(), y),
                         progress=False)
            seconds, loss, acc = hist["seconds"].sum(), hist["loss"].iloc[-1], hist["test_acc"].iloc[-1]
        peak = float("nan")
        if measure_memory and fp8 is None and seed == seeds[0]:
            # NOTE: a fresh model and optimizer, so the optimizer state is created inside the meter
            batches = [b for b, _ in zip(loader, range(2), strict=False)]
            peak = measure_peak(model_fn, fmt, batches, in_backward=False, optimizer=optimizer, lr=lr,
                                device=device)["peak_bytes"]
        rows.append({"format": name, "regime": regime, "task": task, "seed": seed, "lr": lr, "epochs": epochs,
                     "test_acc": acc, "train_loss": loss, "seconds": seconds, "peak_bytes": peak,
                     "params": sum(p.numel() for p in model.parameters())})
    return pd.DataFrame(rows)


def accuracy_summary(df: pd.DataFrame) -> pd.DataFrame:
    """Mean, lowest and highest test accuracy (%) over seeds per regime and format."""
    g = df.assign(acc=100 * df["test_acc"]).groupby(["regime", "format"], sort=False)["acc"]
    return pd.DataFrame({"mean_acc": g.mean(), "min_acc": g.min(), "max_acc": g.max(),
                         "seeds": g.size()}).reset_index()


def paired_gap(df: pd.DataFrame, regime: str, first: str, second: str, *,
               absolute: bool = False) -> tuple[float, float, float]:
    """(mean, lowest, highest) over seeds of accuracy(first) - accuracy(second) in points, paired
    by seed; ``absolute`` takes |gap| per seed."""
    sub = df[df["regime"] == regime].pivot_table(index="seed", columns="format", values="test_acc")
    missing = {first, second} - set(sub.columns)
    if missing:
        raise ValueError(f"regime {regime!r} has no format(s) {sorted(missing)}; it has {sorted(sub.columns)}")
    gap = 100 * (sub[first] - sub[second])
    if absolute:
        gap = gap.abs()
    return float(gap.mean()), float(gap.min()), float(gap.max())


def _add_packed(master_half, extra_vals, y, k, rounding, gen):
    """`master += y` in the packed format: fp16 plus `k` extra bits, the fp16 value split from the fp32 sum by
    `rounding` ("truncate": the paper's; "stochastic"; "nearest": the fp16 value rounded to nearest, the extra bits
    holding the signed remainder)."""
    sr, nearest = rounding == "stochastic", rounding == "nearest"
    master = merge_values(master_half, extra_vals, extra_bits=k, stochastic_rounding=sr, nearest=nearest)
    noise = None
    if sr:
        noise = torch.randint(0, 2**13, master.shape, dtype=torch.int32, generator=gen)
    return split_values(master + y.float(), dtype=torch.float16, extra_bits=k, stochastic_rounding=sr, noise=noise,
                        nearest=nearest, master_noise=nearest_offset(torch.float16, k) if nearest else None)


# Fig 6's formats: (label, extra bits, rounding of the 16-bit value)
ADDITION_FORMATS = (("fp16", None, "nearest"), ("fp16+8", 8, "truncate"), ("fp16+8 SR", 8, "stochastic"),
                    ("fp16+8 nearest", 8, "nearest"))


def addition_error(
    *, sizes: Iterable[int] = (10**3, 10**4, 10**5), n_ops: Iterable[int] = (1, 10, 100, 1000),
    width: int = 4096, seed: int = 0,
) -> pd.DataFrame:
    """Fig 6: relative forward error of the 16-bit value after in-place additions ``x += y``.

    Formats (`ADDITION_FORMATS`): fp16 (round to nearest), fp16+8 (extra bits, split toward zero: the paper's),
    fp16+8 SR (stochastic rounding of the visible value), fp16+8 nearest (the visible value rounded to nearest, the
    extra bits holding the signed remainder: `master_rounding="nearest"`). x and every y are standard-normal fp16
    values; the exact result is computed in float64. Error = ||x16 - exact|| / ||exact||.
    Panel "one op": error after one addition for each size; panel "many ops": error after m
    additions of a ``width``-sized tensor.
    """
    gen = torch.Generator().manual_seed(seed)
    rows = []

    def run(n, m, panel):
        x0 = torch.randn(n, generator=gen).half()
        ys = [torch.randn(n, generator=gen).half() for _ in range(m)]
        exact = x0.double() + torch.stack([y.double() for y in ys]).sum(0)
        for fmt, k, rounding in ADDITION_FORMATS:
            if k is None:
                x = x0.clone()
                for y in ys:
                    x += y
            else:
                x, vals = x0.clone(), torch.zeros(n, dtype=torch.int32)
                for y in ys:
                    x, vals = _add_packed(x, vals, y, k, rounding, gen)
            err = (x.double() - exact).norm() / exact.norm()
            rows.append({"panel": panel, "format": fmt, "n": n, "ops": m, "rel_error": err.item()})

    for n in sizes:
        run(n, 1, "one op")
    for m in n_ops:
        run(width, m, "many ops")
    df = pd.DataFrame(rows)
    df["fp16_eps"] = math.ldexp(1.0, -11)
    return df
