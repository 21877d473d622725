"""Training-step times of the packed-bit formats (the step fused into backward is timed in ``table2``).

Paper: Lewandowski & Kosson, "Memory Efficient Mixed Precision Optimizers", section 4: Table 3's
training times by format (AMP vs fp32 vs fp16+8 vs fp16+13 with stochastic rounding, ResNet-18 on
CIFAR-10 at batch 256 on a V100) and the text's fused-optimizer (2-10% faster) remark.

Every variant is timed in interleaved rounds (one call each per round) so that load from other
processes hits all of them alike; ratios pair the rounds and carry their per-round extremes. Beside
the wall time, the device time of one more step under torch.profiler (``kernel_s``): a GPU step whose
kernels fill under half its wall time measured the host (`workbench.timing.host_bound`), as the first
H100 run's 1.7-9.2 ms steps of a small MLP at batch 64 did.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Hashable, Iterable, Mapping

import pandas as pd
import torch
from torch import nn

from workbench.data import make_loader, synthetic_images
from workbench.measure import time_interleaved
from workbench.models import build
from workbench.optim import step_in_backward
from workbench.timing import kernel_seconds

from .peak_memory import _loss, make_model, make_optimizer, parse_format

__all__ = ["paired_ratio", "round_times", "rounds_ratio", "speed_workload", "step_time_by_format"]

SPEED_MODELS = ("task", "resnet18")


def paired_ratio(times: dict[Hashable, list[float]], name: Hashable, base: Hashable) -> tuple[float, float, float]:
    """(median ratio, lowest, highest) of base time / ``name`` time over interleaved rounds.

    The median ratio is of the two medians; the spread pairs the rounds (round r of ``name``
    against round r of ``base``), so load that hit one round hits both sides of its ratio.
    """
    a, b = times[name], times[base]
    per_round = [tb / ta for ta, tb in zip(a, b, strict=True)]
    return statistics.median(b) / statistics.median(a), min(per_round), max(per_round)


def round_times(times: Mapping[Hashable, list[float]]) -> pd.DataFrame:
    """Interleaved per-round times as a long table (``name``, ``round``, ``seconds``), so paired
    ratios can be recomputed from saved records (``step_time_by_format``'s ``attrs["times"]``)."""
    rows = [{"name": str(name), "round": r, "seconds": float(t)}
            for name, ts in times.items() for r, t in enumerate(ts)]
    return pd.DataFrame(rows, columns=["name", "round", "seconds"])


def rounds_ratio(rounds: pd.DataFrame, name: str, base: str) -> tuple[float, float, float] | None:
    """:func:`paired_ratio` (base time / ``name`` time) from a :func:`round_times` table; None if
    either name is missing."""
    times = {n: list(g.sort_values("round")["seconds"]) for n, g in rounds.groupby("name")}
    if name not in times or base not in times:
        return None
    return paired_ratio(times, name, base)


def _training_step(model_fn, fmt, batch, *, in_backward, optimizer, lr, device, fused=False, compile=False):
    model = make_model(model_fn, fmt, device)
    opt = make_optimizer(model.parameters(), fmt, optimizer=optimizer, lr=lr, fused=fused and fmt.packed,
                         compile=compile and fmt.packed)
    return step_of(model, opt, fmt, batch, in_backward=in_backward, device=device)


def step_of(model, opt, fmt, batch, *, in_backward, device, release=step_in_backward):
    """``(step, handle)``: one training step of a model and optimizer built already (the step in backward put
    there by ``release(model, opt)``, whose handle is returned), on ``batch`` moved to ``device``."""
    handle = release(model, opt) if in_backward else None
    x, y = batch[0].to(device), batch[1].to(device)

    def step() -> None:
        _loss(model, x, y, fmt).backward()
        if handle is None:
            opt.step()
            opt.zero_grad(set_to_none=True)

    return step, handle


def step_time_by_format(
    model_fn: Callable[[], nn.Module], batch: tuple[torch.Tensor, torch.Tensor], *,
    formats: Iterable[str], optimizer: str = "sgd", lr: float = 0.01, repeats: int = 10,
    fused: bool = False, compile: bool = False, baseline: str = "amp", device: torch.device | str = "cpu",
    workload: str = "", progress: bool = True,
) -> pd.DataFrame:
    """Time of one training step (forward, backward, optimizer step) per format, interleaved.

    Packed formats run their per-parameter step (row ``<format>``) and, with ``fused``, also the
    flat fused step (row ``<format> fused``); ``compile`` is passed to both, so the pair differs
    in fusion only. Rounds alternate the variants (load from other processes hits all alike).
    ``speedup_vs_<baseline>`` = median baseline time / median time, with ``*_lo``/``*_hi`` the
    lowest and highest paired per-round ratio. ``kernel_s``: the device time of one more step under
    torch.profiler; ``kernel_share`` its share of ``median_s``. ``workload`` (the model's description)
    and the batch size are recorded on every row.
    """
    device = torch.device(device)
    suffix = " compiled" if compile else ""
    steps: dict[str, Callable[[], None]] = {}
    for name in formats:
        fmt = parse_format(name)
        steps[name] = _training_step(model_fn, fmt, batch, in_backward=False, optimizer=optimizer,
                                     lr=lr, device=device, compile=compile)[0]
        if fused and fmt.packed:
            steps[f"{name} fused{suffix}"] = _training_step(
                model_fn, fmt, batch, in_backward=False, optimizer=optimizer, lr=lr, device=device,
                fused=True, compile=compile)[0]
    times = time_interleaved(steps, warmup=2 if compile else 1, repeats=repeats, device=device,
                             progress=progress, desc="training steps")
    kernel = {n: kernel_seconds(fn, calls=1, warmup=0, device=device) for n, fn in steps.items()}
    rows = [{"format": n, "median_s": statistics.median(t), "min_s": min(t), "max_s": max(t), "rounds": len(t),
             "kernel_s": kernel[n], "kernel_share": kernel[n] / statistics.median(t), "device": device.type,
             "workload": workload, "batch": len(batch[0])}
            for n, t in times.items()]
    df = pd.DataFrame(rows)
    if baseline in times:
        ratios = [paired_ratio(times, n, baseline) for n in times]
        col = f"speedup_vs_{baseline}"
        df[col], df[f"{col}_lo"], df[f"{col}_hi"] = zip(*ratios, strict=True)
    df.attrs["times"] = times
    return df


def speed_workload(model: str, batch: int, *, task: tuple | None = None, seed: int = 0,
                   ) -> tuple[Callable[[], nn.Module], tuple[torch.Tensor, torch.Tensor], str]:
    """The model and one batch the training-step times run on, and its description.

    ``"resnet18"``: Table 3's model, ResNet-18 at the paper's 64 channels with the CIFAR stem, on seeded
    synthetic 3 x 32 x 32 images (pixels do not change a step's time); ``"task"``: ``task``'s model and
    training set (an accuracy task of ``load_task``: (model_fn, train, test, description)).
    """
    if model not in SPEED_MODELS:
        raise ValueError(f"speed model must be one of {list(SPEED_MODELS)}, got {model!r}")
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    if model == "resnet18":
        data = synthetic_images(batch, shape=(3, 32, 32), num_classes=10, seed=seed)
        return (lambda: build("resnet18", width=1.0, num_classes=10, stem="cifar"),
                next(iter(make_loader(data, batch, shuffle=False))), "ResNet-18 (64 channels, CIFAR stem), 32x32")
    if task is None:
        raise ValueError("speed model 'task' needs task=(model_fn, train, test, description) from load_task")
    return task[0], next(iter(make_loader(task[1], batch, shuffle=False))), task[3]
