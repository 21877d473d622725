"""Update throughput of the packed-bit optimizers against torch's fused AdamW (Fig 3 of Memory
Efficient Mixed Precision Optimizers, Lewandowski & Kosson: op throughput as a share of memory
bandwidth).

Methods are timed side by side in one run, interleaved repeat by repeat; ratios are against
``torch.optim.AdamW(fused=True)`` on fp32 parameters.
"""

from __future__ import annotations

from collections.abc import Iterable

import pandas as pd
import torch
from tqdm.auto import tqdm

from workbench.measure import time_callable, time_interleaved
from workbench.optim.packed import PackedAdamW

from .bench import parse_format

__all__ = ["copy_bandwidth", "step_throughput"]


def copy_bandwidth(numel: int, *, device: torch.device | str = "cpu", repeats: int = 5) -> float:
    """Measured bytes/s of an fp32 tensor copy (each element read once and written once)."""
    src = torch.randn(numel, device=device)
    dst = torch.empty_like(src)
    t = time_callable(lambda: dst.copy_(src), warmup=2, repeats=repeats, device=torch.device(device))
    # NOTE: the best of the repeats: bandwidth is a hardware ceiling, and on a shared machine the
    # median mostly measures other processes.
    return 2 * src.nbytes / t.min_s


def _sizes(numel: int, n_tensors: int) -> list[int]:
    base = numel // n_tensors
    return [base + (numel - base * n_tensors if i == 0 else 0) for i in range(n_tensors)]


def step_throughput(
    *, numel: int, n_tensors: int = 8, configs: Iterable[tuple[str, int]] = (("bf16", 16),),
    device: torch.device | str = "cpu", repeats: int = 5, compile: bool = True,
    threads: int | None = None, progress: bool = True,
) -> pd.DataFrame:
    """Fig 3: AdamW step throughput, packed fused step vs ``torch.optim.AdamW(fused=True)`` (fp32).

    Same parameter count split into ``n_tensors`` tensors, same device, same run; the methods'
    steps are interleaved repeat by repeat so that load from other processes hits all of them
    alike. Bytes moved per step are counted analytically (params r/w, gradient read, extra bits
    r/w, two fp32 states r/w). ``bandwidth_fraction`` divides bytes/s of the best step by the
    measured copy bandwidth (best copy); ``ratio_vs_torch_fused`` compares best steps,
    ``ratio_median_vs_torch_fused`` median steps. ``threads`` (CPU) runs every method with that
    many intra-op threads and restores the setting afterwards.
    """
    device = torch.device(device)
    saved_threads = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        return _step_throughput(numel, n_tensors, list(configs), device, repeats, compile, progress)
    finally:
        torch.set_num_threads(saved_threads)


def _step_throughput(numel, n_tensors, configs, device, repeats, compile, progress) -> pd.DataFrame:
    bw = copy_bandwidth(max(numel, 1 << 20), device=device)
    methods = []  # (name, extra_bits, optimizer, bytes per parameter)

    def tensors(dtype):
        out = [torch.zeros(s, device=device, dtype=dtype, requires_grad=True)
               for s in _sizes(numel, n_tensors)]
        for p in out:
            p.grad = torch.randn_like(p)
        return out

    # NOTE: fused=True exists for CPU AdamW in torch 2.13 (checked); it is torch's fastest step.
    methods.append(("torch AdamW fused (fp32)", None,
                    torch.optim.AdamW(tensors(torch.float32), fused=True), 28.0))
    for dtype_name, k in configs:
        fmt = parse_format(f"{dtype_name}+{k}")
        opt = PackedAdamW(tensors(fmt.param_dtype), extra_bits=k, fused=True, compile=compile)
        label = f"Packed AdamW {fmt.name} fused" + (" compiled" if compile else " eager")
        methods.append((label, k, opt, 2 + 2 + 2 + 2 * k / 8 + 16))
    for _, _, opt, _ in tqdm(methods, desc="warm-up / compile", disable=not progress):
        for _ in range(2):
            opt.step()
    by_method = time_interleaved({i: opt.step for i, (_, _, opt, _) in enumerate(methods)}, warmup=0,
                                 repeats=repeats, device=device, progress=progress, desc="throughput")
    rows = []
    for (name, k, _, bpp), ts in zip(methods, by_method.values(), strict=True):
        best, median = min(ts), float(pd.Series(ts).median())
        rows.append({"method": name, "extra_bits": k, "numel": numel, "n_tensors": n_tensors,
                     "median_s": median, "min_s": best, "params_per_s": numel / best,
                     "bytes_per_step": bpp * numel, "bytes_per_s": bpp * numel / best,
                     "bandwidth_fraction": bpp * numel / best / bw, "copy_bandwidth": bw})
    df = pd.DataFrame(rows)
    df["ratio_vs_torch_fused"] = df["min_s"].iloc[0] / df["min_s"]
    df["ratio_median_vs_torch_fused"] = df["median_s"].iloc[0] / df["median_s"]
    df["device"] = str(device)
    df["threads"] = torch.get_num_threads()
    return df
