"""The hand-written CPU packed step against torch's fused fp32 AdamW and the compiled packed step, as the
optimizer's ``step()`` and as the kernel alone.

Paper: Lewandowski & Kosson, "Memory Efficient Mixed Precision Optimizers", section 3.1 (the fused
packed optimizers) and Fig 3 (op throughput as a share of memory bandwidth). Kernel:
``workbench.optim.cpu_kernel``.

One table row per (threads, size, method): ``torch.optim.AdamW(fused=True).step()`` on fp32 parameters
(28 bytes moved per parameter), and for each packed format ``PackedAdamW(..., fused=True).step()`` as users
call it (``step``: both on a training-loop step, new gradient tensors each step, ``tune_cpu_kernel.training_step``),
the C++ kernel alone on flat buffers (``kernel``) and the ``torch.compile``d flat step
(``workbench.optim.update.compiled_update``, what ``fused=True, compile=True`` runs) on the same flat
buffers; the parameters in ``n_tensors`` tensors. All methods are timed interleaved round by round
(order rotated); ``ratio`` is the median over rounds of torch's time / the method's time in the same
round, ``ratio_lo``/``ratio_hi`` the min/max. ``bandwidth_fraction`` divides the method's bytes/s at
its median by the bytes/s of an in-place ``add_`` over fp32 values moving the same number of bytes
(read and write), timed in the same rounds (its best round: bandwidth is a ceiling). The load average
of the machine is recorded before and after.

Run the whole table with (issue 34's case alone: ``--sizes 4194304 --threads 1``)::

    python -m workbench.experiments.packed_bit_optimizers.cpu_throughput
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import statistics
from collections.abc import Callable, Iterable

import pandas as pd
import torch

from workbench.measure import time_interleaved
from workbench.optim import PackedAdamW, cpu_kernel, cpu_variants, quantized
from workbench.optim.formats import storage_bits
from workbench.optim.update import adam_math, compiled_update
from workbench.optim.tune_cpu_kernel import training_step

__all__ = ["DEFAULT_FORMATS", "bytes_per_param", "kernel_table", "kernel_throughput", "main"]

# (16-bit dtype, extra bits, stochastic rounding, state dtype)
DEFAULT_FORMATS = (
    (torch.bfloat16, 8, False, torch.float32),
    (torch.bfloat16, 16, False, torch.float32),
    (torch.bfloat16, 8, False, torch.bfloat16),
    (torch.bfloat16, 16, False, torch.bfloat16),
)
_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16"}
_COMPILED_AT: dict[str, int] = {}


def bytes_per_param(extra_bits: int, stochastic_rounding: bool, state_dtype: torch.dtype) -> float:
    """Bytes an AdamW packed step moves per parameter: 16-bit value r/w, gradient read, extra bits
    r/w, two moments r/w (24 for bf16+8 with fp32 moments, 16 with bf16 moments, 12.25 with 8-bit moments: a
    code and a share of its group's bf16 scale each)."""
    state = {torch.bfloat16: 2.0, torch.int8: 1 + 2 / quantized.GROUP}.get(state_dtype, 4.0)
    return 2 + 2 + 2 + 2 * storage_bits(extra_bits, stochastic_rounding) / 8 + 2 * 2 * state


def _label(dtype, k, sr, sdt) -> str:
    return f"{_NAMES[dtype]}+{k}{' SR' if sr else ''}" + (" bf16 moments" if sdt == torch.bfloat16 else "")


def _coef(step: int = 10, lr: float = 1e-3, wd: float = 1e-2, betas=(0.9, 0.999), eps: float = 1e-8) -> torch.Tensor:
    """PackedAdamW's coefficients for ``step`` (workbench.optim.update.adam_math's layout)."""
    b1, b2 = betas
    return torch.tensor([1.0 - lr * wd, wd, 1.0 - b1, b2, 1.0 - b2, math.sqrt(1.0 - b2**step), eps,
                         lr / (1.0 - b1**step), b1], dtype=torch.float32)


def _flat_buffers(numel: int, dtype, k: int, sr: bool, sdt, seed: int) -> tuple:
    g = torch.Generator().manual_seed(seed)
    half = torch.randn(numel, generator=g).mul_(0.05).to(dtype)
    grad = torch.randn(numel, generator=g).mul_(1e-3).to(dtype)
    planes = list(torch.zeros(storage_bits(k, sr) // 8, numel, dtype=torch.uint8).unbind(0))
    states = [torch.zeros(numel, dtype=sdt), torch.zeros(numel, dtype=sdt)]
    return half, grad, planes, states


def kernel_throughput(
    *, numel: int, threads: int | None = None, formats: Iterable[tuple] = DEFAULT_FORMATS,
    repeats: int = 15, compiled: bool = True, n_tensors: int = 8, seed: int = 0, progress: bool = False,
) -> pd.DataFrame:
    """One (threads, size) block of the table: torch fused fp32 AdamW, and per format the C++ kernel
    (when :func:`cpu_kernel.available`) and, with ``compiled``, the compiled flat step.

    ``formats`` holds ``(dtype, extra_bits, stochastic_rounding, state_dtype)``; torch's parameters
    are ``numel`` fp32 values split into ``n_tensors`` tensors (its multi-tensor fused step), the
    packed steps run over one flat buffer of ``numel`` values (the fused group).
    """
    if numel < n_tensors or n_tensors < 1:
        raise ValueError(f"numel={numel} must be >= n_tensors={n_tensors} >= 1")
    if repeats < 3:
        raise ValueError(f"repeats={repeats} must be >= 3")
    saved = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        return _throughput(numel, list(formats), repeats, compiled, n_tensors, seed, progress)
    finally:
        torch.set_num_threads(saved)


def _throughput(numel, formats, repeats, compiled, n_tensors, seed, progress) -> pd.DataFrame:

    load_before = os.getloadavg()
    torch.manual_seed(seed)
    sizes = [numel // n_tensors + (numel % n_tensors if i == 0 else 0) for i in range(n_tensors)]
    cpu = torch.device("cpu")
    _, torch_step = training_step(lambda ps: torch.optim.AdamW(ps, lr=1e-3, fused=True), sizes, torch.float32, cpu)
    methods: dict[str, tuple[Callable[[], object], float, str]] = {
        "torch": (torch_step, 28.0, "torch AdamW fused (fp32)")}
    bandwidth_buffers: dict[float, torch.Tensor] = {28.0: torch.zeros(numel * 28 // 8)}
    coef = _coef()
    have_kernel = cpu_kernel.available()
    if compiled and _COMPILED_AT.get("threads") != torch.get_num_threads():
        # NOTE: inductor writes the thread count into its C++ kernels; kernels compiled under another
        # count would run with it, so the compiled step is recompiled when the count changes.
        torch._dynamo.reset()
        _COMPILED_AT["threads"] = torch.get_num_threads()
    for i, (dtype, k, sr, sdt) in enumerate(formats):
        half, grad, planes, states = _flat_buffers(numel, dtype, k, sr, sdt, seed + 1 + i)
        static = dict(math_fn=adam_math, extra_bits=k, stochastic_rounding=sr, master_rounding="truncate",
                      options={"decoupled": True})
        key = 12345 if sr else None
        bpp = bytes_per_param(k, sr, sdt)
        bandwidth_buffers.setdefault(bpp, torch.zeros(int(numel * bpp) // 8))
        label = _label(dtype, k, sr, sdt)
        make = functools.partial(PackedAdamW, lr=1e-3, extra_bits=k, stochastic_rounding=sr, state_dtype=sdt,
                                 fused=True)
        opt, step = training_step(make, sizes, dtype, cpu)
        methods[f"step {label} ({opt.step_backend().replace('_', ' ')})"] = (step, bpp, label)
        if have_kernel:
            def run_kernel(half=half, grad=grad, planes=planes, states=states, static=static, key=key):
                cpu_kernel.packed_update_cpu(half, grad, planes, states, coef, key, **static)
            methods[f"kernel {label}"] = (run_kernel, bpp, label)
        if compiled:
            update = compiled_update(dynamic=True, device_type="cpu", key=(dtype, sdt), **static)
            key_t = torch.tensor(key, dtype=torch.int32) if key is not None else None

            def run_compiled(update=update, half=half, grad=grad, planes=planes, states=states, key_t=key_t):
                update(half, grad, planes, states, coef, key_t)
            methods[f"compiled {label}"] = (run_compiled, bpp, label)
    fns = {name: m[0] for name, m in methods.items()}
    for bpp, buf in bandwidth_buffers.items():
        fns[f"add_ {bpp:g} B/param"] = lambda buf=buf: buf.add_(1.0)
    times = time_interleaved(fns, warmup=3, repeats=repeats, rotate=True, progress=progress, desc=f"{numel}")
    base = times["torch"]
    rows = []
    for name, (_, bpp, label) in methods.items():
        ts = times[name]
        med = statistics.median(ts)
        paired = [b / t for b, t in zip(base, ts, strict=True)]
        add_best = min(times[f"add_ {bpp:g} B/param"])
        rows.append({
            "method": name if name != "torch" else methods[name][2], "format": label,
            "numel": numel, "bytes_per_param": bpp, "median_ms": med * 1e3, "min_ms": min(ts) * 1e3,
            "ratio": statistics.median(paired), "ratio_lo": min(paired), "ratio_hi": max(paired),
            "GB_per_s": bpp * numel / med / 1e9, "add_GB_per_s": bpp * numel / add_best / 1e9,
            "bandwidth_fraction": add_best / med,
        })
    df = pd.DataFrame(rows)
    load_after = os.getloadavg()
    df["threads"] = torch.get_num_threads()
    df["repeats"] = repeats
    df["load_before"] = round(load_before[0], 2)
    df["load_after"] = round(load_after[0], 2)
    df["cpu"] = cpu_variants.cpu_model()
    df["capability"] = torch.backends.cpu.get_cpu_capability()
    df["kernel_variant"] = cpu_kernel.variant()
    df["torch"] = torch.__version__
    return df


def kernel_table(
    *, sizes: Iterable[int] = (1 << 21, 1 << 24), threads: Iterable[int] = (1, 2),
    formats: Iterable[tuple] = DEFAULT_FORMATS, repeats: int = 15, compiled: bool = True, progress: bool = False,
) -> pd.DataFrame:
    """:func:`kernel_throughput` for every (threads, size)."""
    formats = list(formats)
    frames = [kernel_throughput(numel=n, threads=t, formats=formats, repeats=repeats, compiled=compiled,
                                progress=progress)
              for t in threads for n in sizes]
    return pd.concat(frames, ignore_index=True)


def main(argv: list[str] | None = None) -> None:
    """Print the table (2M and 16M parameters at 1 and 2 threads by default)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[1 << 21, 1 << 24])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--no-compiled", action="store_true", help="skip the torch.compile'd step (compiles per format)")
    ap.add_argument("--fp16", action="store_true", help="add fp16+8 (fp32 and bf16 moments) and bf16+7 SR")
    ap.add_argument("--csv", help="also write the table to this path")
    args = ap.parse_args(argv)
    formats = list(DEFAULT_FORMATS)
    if args.fp16:
        formats += [(torch.float16, 8, False, torch.float32), (torch.float16, 8, False, torch.bfloat16),
                    (torch.bfloat16, 7, True, torch.float32)]
    df = kernel_table(sizes=args.sizes, threads=args.threads, formats=formats, repeats=args.repeats,
                      compiled=not args.no_compiled, progress=True)
    cols = ["threads", "numel", "method", "bytes_per_param", "median_ms", "ratio", "ratio_lo", "ratio_hi",
            "GB_per_s", "bandwidth_fraction", "load_before", "load_after"]
    with pd.option_context("display.width", 220, "display.max_columns", 20, "display.max_colwidth", 40):
        print(f"torch {torch.__version__}, {df['cpu'].iloc[0]}, {df['capability'].iloc[0]}, kernel build: "
              f"{cpu_kernel.variant() if cpu_kernel.available() else 'not available'}")
        print(df[cols].to_string(index=False, float_format=lambda v: f"{v:.3g}"))
    if args.csv:
        df.to_csv(args.csv, index=False)


if __name__ == "__main__":
    main()
