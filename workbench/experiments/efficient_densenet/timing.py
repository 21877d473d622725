"""Timing experiments of the efficient DenseNet notebook: Pleiss, Chen, Huang, Li, van der Maaten,
Weinberger, "Memory-Efficient Implementation of DenseNets" (2017).

Fig 5 (time per minibatch per variant, paired ratios from interleaved rounds with their spread),
Section 4's share of batch normalization in a forward-backward pass, and Fig 2 right (contiguous
vs strided convolution input). The paper timed all three on GPUs (a Maxwell Titan-X, a GTX 980).

Beside each wall time, ``kernel_s`` is the time the device spent in operators during one more call
under torch.profiler (`workbench.timing.kernel_seconds`) and ``kernel_share`` its share of the median
wall time: on a GPU, a share under one half says the timing measured the host (Python, launches), not
the GPU (issue 34: the 100-layer model's step at batch 64 took 44 ms on an H100, about 1% of its rate).
"""

from __future__ import annotations

import functools
import math

import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from workbench.devices import pick_device
from workbench.measure import time_interleaved
from workbench.models import densenet_bc
from workbench.timing import kernel_seconds

from .memory import _batch, _forms, _model

__all__ = ["time_per_minibatch", "bn_time_share", "conv_contiguity", "contiguity_ratio"]

_TIME_FORMS = ("naive", "checkpoint", "shared")


def _paired(times: dict, form: str, ref: str) -> tuple[float, float, float]:
    if ref not in times:
        return math.nan, math.nan, math.nan
    r = np.asarray(times[form]) / np.asarray(times[ref])
    return float(np.median(r)), float(r.min()), float(r.max())


def _kernel(fn, device: torch.device) -> float:
    """Seconds in device operators of one call of ``fn`` (already warmed up by the timed rounds)."""
    return kernel_seconds(fn, calls=1, warmup=0, device=device)


def time_per_minibatch(depth: int = 100, *, forms=_TIME_FORMS, growth_rate: int = 12,
                       batch_size: int = 64, image_size: int = 32, rounds: int = 5,
                       warmup: int = 1, device: torch.device | str | None = None,
                       seed: int = 0, progress: bool = True) -> pd.DataFrame:
    """Seconds per training step (forward + backward) per form, paper Fig 5.

    One model per form with identical weights; the forms are timed in interleaved rounds
    (order rotated each round) so drift and other load hit all of them alike.
    ``ratio_to_naive`` is the median over rounds of time(form) / time(naive) in that round,
    ``ratio_to_naive_min``/``_max`` its spread over rounds; ``ratio_to_checkpoint`` likewise.
    ``kernel_s``/``kernel_share``: device time of one more step and its share of ``median_s``.
    """
    forms = _forms(forms)
    if rounds < 1 or warmup < 0:
        raise ValueError(f"rounds={rounds} (>= 1), warmup={warmup} (>= 0)")
    device = pick_device(str(device) if device is not None else None)
    torch.manual_seed(seed)
    state = densenet_bc(depth, growth_rate, 10).state_dict()
    x, y = _batch(batch_size, image_size, device, seed)

    def make_step(form):
        m = _model(depth, form, growth_rate).to(device).train()
        m.load_state_dict(state)

        def step():
            m.zero_grad(set_to_none=True)
            F.cross_entropy(m(x), y).backward()
        return step

    # warmup + 1: the first timed call of each form was discarded before as well
    steps = {f: make_step(f) for f in forms}
    times = time_interleaved(steps, warmup=warmup + 1, repeats=rounds,
                             device=device, rotate=True, progress=progress, desc="time per minibatch")
    rows = []
    for f in forms:
        t = np.asarray(times[f])
        kernel = _kernel(steps[f], device)
        to_naive, to_ckpt = _paired(times, f, "naive"), _paired(times, f, "checkpoint")
        rows.append({"form": f, "median_s": float(np.median(t)), "min_s": float(t.min()),
                     "max_s": float(t.max()), "ratio_to_naive": to_naive[0],
                     "ratio_to_naive_min": to_naive[1], "ratio_to_naive_max": to_naive[2],
                     "ratio_to_checkpoint": to_ckpt[0], "ratio_to_checkpoint_min": to_ckpt[1],
                     "ratio_to_checkpoint_max": to_ckpt[2], "kernel_s": kernel,
                     "kernel_share": kernel / float(np.median(t)), "depth": depth,
                     "growth_rate": growth_rate, "batch_size": batch_size,
                     "image_size": image_size, "rounds": rounds, "device": str(device)})
    return pd.DataFrame(rows)


def bn_time_share(depth: int = 100, *, growth_rate: int = 12, batch_size: int = 64,
                  image_size: int = 32, rounds: int = 5, warmup: int = 1,
                  device: torch.device | str | None = None, seed: int = 0,
                  progress: bool = True) -> pd.DataFrame:
    """Share of a training step (naive form) spent in batch normalization, by ablation.

    The same model with every BatchNorm2d replaced by an identity is timed against the naive
    model in interleaved rounds, each model both for a training step (forward + backward) and
    for a forward pass alone (no autograd graph). Per round, ``bn_forward_share`` is
    ``(forward with BN - forward without BN) / step with BN``: computing the normalized features
    as a share of one forward-backward pass, the paper's Section 4 quantity ("roughly 5%", the
    cost of recomputing them in backward). ``bn_share`` is ``1 - step without BN / step with BN``
    (BN's forward and backward). Both are medians over rounds with their min/max. Convolution
    cost does not depend on the values it is given, so the differences are the BN layers' time.
    ``kernel_share``/``forward_kernel_share``: device time of one more step / forward under the profiler
    over the median wall time of each.
    """
    if rounds < 1 or warmup < 0:
        raise ValueError(f"rounds={rounds} (>= 1), warmup={warmup} (>= 0)")
    device = pick_device(str(device) if device is not None else None)
    torch.manual_seed(seed)
    x, y = _batch(batch_size, image_size, device, seed)
    with_bn = densenet_bc(depth, growth_rate, 10).to(device).train()
    without = densenet_bc(depth, growth_rate, 10).to(device).train()
    without.load_state_dict(with_bn.state_dict())
    for module in list(without.modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, nn.BatchNorm2d):
                setattr(module, child_name, nn.Identity())

    def make_step(m):
        def step():
            m.zero_grad(set_to_none=True)
            F.cross_entropy(m(x), y).backward()
        return step

    def make_forward(m):
        def forward():
            with torch.no_grad():
                m(x)
        return forward

    models = {"with BN": with_bn, "without BN": without}
    calls = {**{v: make_step(m) for v, m in models.items()},
             **{("forward", v): make_forward(m) for v, m in models.items()}}
    times = time_interleaved(calls, warmup=warmup + 1, repeats=rounds, device=device, rotate=True,
                             progress=progress, desc="BN time share")
    step = {v: np.asarray(times[v]) for v in models}
    fwd = {v: np.asarray(times["forward", v]) for v in models}
    kernel = {key: _kernel(fn, device) for key, fn in calls.items()}
    share = 1.0 - step["without BN"] / step["with BN"]
    fwd_share = (fwd["with BN"] - fwd["without BN"]) / step["with BN"]
    return pd.DataFrame([{
        "variant": v, "median_s": float(np.median(step[v])), "min_s": float(step[v].min()),
        "max_s": float(step[v].max()), "forward_median_s": float(np.median(fwd[v])),
        "kernel_s": kernel[v], "kernel_share": kernel[v] / float(np.median(step[v])),
        "forward_kernel_s": kernel["forward", v],
        "forward_kernel_share": kernel["forward", v] / float(np.median(fwd[v])),
        "bn_share": float(np.median(share)), "bn_share_min": float(share.min()),
        "bn_share_max": float(share.max()), "bn_forward_share": float(np.median(fwd_share)),
        "bn_forward_share_min": float(fwd_share.min()), "bn_forward_share_max": float(fwd_share.max()),
        "depth": depth, "growth_rate": growth_rate, "batch_size": batch_size, "image_size": image_size,
        "rounds": rounds, "device": str(device)} for v in models])


def conv_contiguity(channels=(48, 96, 192, 384), *, out_channels: int = 12,
                    batch_size: int = 64, image_size: int = 32, repeats: int = 5,
                    device: torch.device | str | None = None, seed: int = 0,
                    progress: bool = True) -> pd.DataFrame:
    """3x3 convolution time on a contiguous input vs the same values as a strided view.

    The non-contiguous input is a channel slice of a buffer twice as wide (batch stride
    larger than the tensor), the layout a layer reading from a wider feature store sees.
    Timed interleaved; ``ratio_to_contiguous`` is the median paired ratio (paper Fig 2 right)
    and ``round_ratios`` the paired ratio of each round; ``kernel_share`` the device time of one more
    call under the profiler over the median wall time.
    """
    device = pick_device(str(device) if device is not None else None)
    g = torch.Generator().manual_seed(seed)
    rows = []
    for c in tqdm(list(channels), desc="conv contiguity", disable=not progress):
        if c < 1:
            raise ValueError(f"channels must be >= 1, got {c}")
        wide = torch.randn(batch_size, 2 * c, image_size, image_size, generator=g).to(device)
        inputs = {"contiguous": wide[:, :c].contiguous(), "non-contiguous": wide[:, :c]}
        weight = torch.randn(out_channels, c, 3, 3, generator=g).to(device)
        calls = {k: functools.partial(F.conv2d, v, weight, padding=1) for k, v in inputs.items()}
        with torch.no_grad():
            times = time_interleaved(calls, warmup=2, repeats=repeats, device=device)
            kernel = {k: _kernel(fn, device) for k, fn in calls.items()}
        base = np.asarray(times["contiguous"])
        for k, t in times.items():
            r = np.asarray(t) / base
            rows.append({"in_channels": c, "layout": k, "median_s": float(np.median(t)),
                         "kernel_s": kernel[k], "kernel_share": kernel[k] / float(np.median(t)),
                         "ratio_to_contiguous": float(np.median(r)),
                         "round_ratios": [float(v) for v in r],
                         "out_channels": out_channels, "batch_size": batch_size,
                         "image_size": image_size, "device": str(device)})
    return pd.DataFrame(rows)


def contiguity_ratio(conv: pd.DataFrame) -> tuple[float, float, float]:
    """Non-contiguous / contiguous time, median over channel counts, and its spread over
    rounds: (value, min, max) where min and max are that median taken round by round."""
    nc = conv[conv["layout"] == "non-contiguous"]
    per_round = np.median(np.array(list(nc["round_ratios"]), dtype=float), axis=0)
    return (float(nc["ratio_to_contiguous"].median()), float(per_round.min()),
            float(per_round.max()))
