"""Update throughput of the packed-bit optimizers against torch's fused AdamW (Fig 3 of Memory
Efficient Mixed Precision Optimizers, Lewandowski & Kosson: op throughput as a share of memory
bandwidth), and the cost of running the step inside backward (their section 3.2).

Each method is timed as users call it: ``optimizer.step()`` on a training-loop step, the gradients new
tensors each step as ``zero_grad(set_to_none=True)`` leaves them (``training_step``), with each packed
format's kernel alone beside it. Two independent timings: interleaved rounds, paired round by round against
``torch.optim.AdamW(fused=True)`` on fp32 parameters (median with the min/max over rounds as the spread),
and blocks of steps in a row, method after method (CUDA events on CUDA, the wall clock on CPU). Peers
(torch fused AdamW on bf16 parameters, torchao's bf16 stochastic-rounding AdamW, optimi's Kahan-summation
AdamW, bitsandbytes' 8-bit AdamW) join the table when installed.

Re-run the CPU table of issue 34 (4M parameters in 8 tensors, 1 thread) on a quiet machine with::

    python -m workbench.experiments.packed_bit_optimizers.throughput --sizes 4194304 --threads 1 --repeats 15 \
        --no-backward

and the GPU one (1e8 parameters in 64 tensors) with ``--device cuda --sizes 100000000 --tensors 64``. On a CPU,
``--variants`` first measures every build variant of the hand-written kernel against torch at ``--threads`` on the
first size and keeps the fastest for this CPU (``workbench.optim.tune_cpu_kernel``; minutes the first time, for
the builds), so the table and later processes run it; the table's ``kernel_variant`` column names the build run.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.util
import io
import os
import statistics
import time
from collections.abc import Callable, Iterable

import pandas as pd
import torch
from torch import nn
from tqdm.auto import tqdm

from workbench.measure import calls_for, time_callable, time_interleaved
from workbench.optim import PackedAdamW, cpu_kernel, cpu_variants, step_in_backward
from workbench.optim.tune_cpu_kernel import training_step

from .peak_memory import find_row, parse_format
from .cpu_throughput import bytes_per_param
from .peer_import import import_peer
from .peers import FLASH, PeerUnavailable, make_peer

__all__ = ["memory_bandwidth", "step_throughput", "steps_in_a_row", "throughput_share_ratio", "throughput_table",
           "backward_step_ratio", "main"]

# NOTE: 128 MiB, far beyond any CPU's last-level cache, so the update measures DRAM bandwidth (an
# 8 MB buffer stays in cache and rated torch's 16M-parameter step above the ceiling).
BANDWIDTH_NUMEL = 1 << 25
SAMPLE_S = 0.01  # the least time one timed sample of a step takes (steps in a row)


def memory_bandwidth(numel: int = BANDWIDTH_NUMEL, *, device: torch.device | str = "cpu", repeats: int = 5) -> float:
    """Measured bytes/s of an in-place fp32 update ``x += 1`` (each element read once, written once).

    # NOTE: in place, as an optimizer updates its parameters and states. An out-of-place copy also
    # reads each destination line before writing it on CPUs (write-allocate), so on this 2-core
    # Xeon it measured half of what torch's fused AdamW moves and rated torch at 1.5-1.9x "copy
    # bandwidth".
    """
    if numel < 1:
        raise ValueError(f"numel={numel} must be >= 1")
    x = torch.zeros(numel, device=device)
    t = time_callable(lambda: x.add_(1.0), warmup=2, repeats=repeats, device=torch.device(device))
    # NOTE: the best of the repeats: bandwidth is a hardware ceiling, and on a shared machine the
    # median mostly measures other processes.
    return 2 * x.nbytes / t.min_s


def _sizes(numel: int, n_tensors: int) -> list[int]:
    base = numel // n_tensors
    return [base + (numel - base * n_tensors if i == 0 else 0) for i in range(n_tensors)]


def _peers() -> list[tuple[str, Callable, torch.dtype, float]]:
    """(name, optimizer factory over a parameter list, parameter dtype, bytes moved per parameter) per peer."""
    out: list[tuple[str, Callable, torch.dtype, float]] = [
        ("torch AdamW fused (bf16 params, no master)", lambda ps: torch.optim.AdamW(ps, fused=True), torch.bfloat16,
         2 + 2 + 2 + 2 * 2 * 2),
    ]
    if importlib.util.find_spec("torchao") is not None:
        def torchao_sr(ps):
            return import_peer("torchao.optim")._AdamW(ps, bf16_stochastic_round=True)
        out.append(("torchao _AdamW bf16 SR", torchao_sr, torch.bfloat16, 2 + 2 + 2 + 2 * 2 * 2))
    if importlib.util.find_spec("optimi") is not None:
        def optimi_kahan(ps):
            from optimi import AdamW
            return AdamW(ps, lr=1e-3, kahan_sum=True)
        out.append(("optimi AdamW bf16 + Kahan", optimi_kahan, torch.bfloat16, 2 + 2 + 2 + 2 * 2 * 2 + 2 * 2))
    if importlib.util.find_spec("bitsandbytes") is not None:
        def bnb_8bit(ps):
            from bitsandbytes.optim import AdamW8bit
            return AdamW8bit(ps)
        out.append(("bitsandbytes AdamW8bit (fp32 params)", bnb_8bit, torch.float32, 4 + 4 + 4 + 2 * 2))
    if importlib.util.find_spec("flashoptim") is not None:  # its own format, as the peers table builds it: bf16
        # weights + an 8-bit error term, 8-bit moments with an fp16 scale per 32 (PeerUnavailable on a CPU)
        out.append((FLASH, lambda ps: make_peer(FLASH, ps, lr=1e-3), torch.bfloat16,
                    2 + 2 + 1 + 1 + 2 + 2 * (1 + 1) + 2 * 2 * 2 / 32))
    return out


_STATES = {" bf16 states": torch.bfloat16, " int8 states": torch.int8}  # a config's moments other than fp32


def _config(cfg) -> tuple:
    """(packed Format, PackedAdamW options) of a config: a format name ('bf16+8', 'fp16+13 SR', 'bf16+8 nearest', with
    ' bf16 states' or ' int8 states' after it for bf16 or 8-bit moments: a notebook profile's form) or ``(dtype
    name, extra bits[, options])``."""
    if isinstance(cfg, str):
        states = next((suffix for suffix in _STATES if cfg.endswith(suffix)), "")
        fmt = parse_format(cfg.removesuffix(states))
        options = {"stochastic_rounding": True} if fmt.stochastic_rounding else {}
        if fmt.master_rounding != "truncate":  # 'bf16+8 nearest'
            options["master_rounding"] = fmt.master_rounding
        if states:
            options["state_dtype"] = _STATES[states]
    else:
        fmt, options = parse_format(f"{cfg[0]}+{cfg[1]}"), dict(cfg[2]) if len(cfg) > 2 else {}
    if not fmt.packed:
        raise ValueError(f"throughput config {cfg!r}: needs a packed format such as 'bf16+8'")
    return fmt, options


def steps_in_a_row(fn: Callable[[], object], steps: int, blocks: int, device: torch.device) -> list[float]:
    """Seconds per call over ``blocks`` blocks of ``steps`` calls in a row: CUDA events on CUDA (the GPU's
    own clock, no host synchronisation between steps), the wall clock on CPU. The second method of
    :func:`step_throughput`, independent of the interleaved rounds (one method after another)."""
    out = []
    for _ in range(blocks):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize(device)
            start.record()
            for _ in range(steps):
                fn()
            end.record()
            end.synchronize()
            out.append(start.elapsed_time(end) / 1e3 / steps)
        else:
            t0 = time.perf_counter()
            for _ in range(steps):
                fn()
            out.append((time.perf_counter() - t0) / steps)
    return out


def step_throughput(
    *, numel: int, n_tensors: int = 8, configs: Iterable[tuple] = (("bf16", 16),),
    device: torch.device | str = "cpu", repeats: int = 5, compile: bool = True,
    threads: int | None = None, progress: bool = True, peers: bool = False,
    bandwidth_numel: int = BANDWIDTH_NUMEL, bandwidth: float | None = None, compiled_too: bool = False,
) -> pd.DataFrame:
    """Fig 3: AdamW step throughput, packed fused step vs ``torch.optim.AdamW(fused=True)`` (fp32).

    ``configs`` entries are format names ('bf16+8', 'fp16+13 SR'), ``(dtype name, extra bits)`` or
    ``(dtype name, extra bits, options)`` with options passed to :class:`PackedAdamW` (e.g.
    ``{"state_dtype": torch.bfloat16}``). Same parameter count split into ``n_tensors`` tensors, same
    device, same run. Each method is timed as users call it, ``optimizer.step()`` on a training-loop step
    (:func:`training_step`: new gradient tensors each step), ``timed == "step"``; each packed format's
    kernel alone beside it (``PackedAdamW.flat_update``, ``timed == "kernel"``). Bytes moved per step are
    counted analytically (params r/w, gradient read, extra bits r/w, states r/w).

    Two independent timings: (1) interleaved rounds, ``calls_per_sample`` steps in a row per method and
    round (at least ``SAMPLE_S`` of torch's step): ``ratio_paired`` is the median over rounds of torch's
    time / the method's in the same round, ``ratio_lo``/``ratio_hi`` the min/max; ``median_s``/``min_s``/
    ``max_s``; ``ratio_vs_torch_fused`` compares best steps, ``ratio_median_vs_torch_fused`` medians;
    ``bandwidth_fraction`` is bytes/s at ``median_s`` over :func:`memory_bandwidth` (``bandwidth`` if
    given). (2) :func:`steps_in_a_row`, method after method (CUDA events on CUDA, the wall clock on CPU):
    ``inarow_median_s``/``inarow_min_s``/``inarow_max_s``, ``ratio_inarow`` (medians) with
    ``ratio_inarow_lo``/``ratio_inarow_hi`` (torch's fastest block over the method's slowest, and the reverse)
    and ``bandwidth_fraction_inarow``. ``compile`` True runs the packed optimizers' fastest step
    (``PackedAdamW.step_backend()``, in ``method``), False the eager one; ``compiled_too`` adds each format's
    torch.compile'd step beside a hand-written kernel. ``threads`` (CPU) sets intra-op threads for the run;
    ``peers`` adds the installed peer optimizers. ``load_before``/``load_after``: the machine's load average.
    """
    if numel < n_tensors or n_tensors < 1:
        raise ValueError(f"numel={numel} must be >= n_tensors={n_tensors} >= 1")
    if repeats < 1:
        raise ValueError(f"repeats={repeats} must be >= 1")
    device = torch.device(device)
    saved_threads = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        bw = bandwidth if bandwidth is not None else memory_bandwidth(bandwidth_numel, device=device)
        return _step_throughput(numel, n_tensors, list(configs), device, repeats, compile, progress,
                                peers, bw, compiled_too)
    finally:
        torch.set_num_threads(saved_threads)


def _label(fmt, options: dict, backend: str) -> str:
    sr = bool(options.get("stochastic_rounding", False))
    states = next((suffix for suffix, dtype in _STATES.items() if options.get("state_dtype") == dtype), "")
    return f"Packed AdamW {fmt.name.removesuffix(' SR')}{' SR' if sr else ''}{states} fused {backend.replace('_', ' ')}"


def _step_throughput(numel, n_tensors, configs, device, repeats, compile, progress, peers, bw,
                     compiled_too=False) -> pd.DataFrame:
    load_before = os.getloadavg()[0]
    torch.manual_seed(0)
    sizes = _sizes(numel, n_tensors)
    # (name, extra bits, state dtype, callable, bytes per parameter, timed)
    torch_opt, torch_step = training_step(lambda ps: torch.optim.AdamW(ps, fused=True), sizes, torch.float32, device)
    methods = [("torch AdamW fused (fp32)", None, "fp32", torch_step, 28.0, "step")]
    packed = []
    for cfg in configs:
        fmt, options = _config(cfg)
        k, sdt = fmt.extra_bits, options.get("state_dtype", torch.float32)
        bpp = bytes_per_param(k, bool(options.get("stochastic_rounding")), sdt)
        sdt_name = str(sdt).replace("torch.", "").replace("float32", "fp32")
        choices = [None if compile else False]
        for c in choices:  # None: the fastest step (a hand-written kernel); False: eager; True: compiled
            make = functools.partial(PackedAdamW, extra_bits=k, fused=True, compile=c, **options)
            opt, step = training_step(make, sizes, fmt.param_dtype, device)
            if compiled_too and c is None and opt.step_backend() not in ("compiled", "eager"):
                choices.append(True)  # the compiled step of the same format, timed next
            methods.append((_label(fmt, options, opt.step_backend()), k, sdt_name, step, bpp, "step"))
            packed.append((len(methods) - 1, opt))
    if peers:
        for name, make, dtype, bpp in _peers():
            try:
                with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                    _, step = training_step(make, sizes, dtype, device)
                    step()
            except PeerUnavailable as e:  # it says why ("unavailable: CUDA only (...)")
                methods.append((f"{name} [{e}]", None, "", None, bpp, "step"))
                continue
            except Exception as e:  # noqa: BLE001 - a peer that cannot run here is a row that says so
                methods.append((f"{name} [failed: {type(e).__name__}]", None, "", None, bpp, "step"))
                continue
            methods.append((name, None, "", step, bpp, "step"))
    runnable = [m for m in methods if m[3] is not None]
    for m in tqdm(runnable, desc="warm-up / compile", disable=not progress):
        for _ in range(3):
            m[3]()
    for i, opt in packed:  # the kernel alone, on the same buffers, beside each packed step
        name, k, sdt, _, bpp, _ = methods[i]
        methods.append((f"{name} (kernel alone)", k, sdt, opt.flat_update(), bpp, "kernel"))
    # NOTE: a sample is `calls` steps in a row, enough for SAMPLE_S of torch's step: single steps of
    # ~1 ms (2M parameters on 2 threads) gave paired ratios spread over 0.4-2.2 within one run.
    calls = calls_for(torch_step, SAMPLE_S, repeats=3, device=device)
    fns = {i: m[3] for i, m in enumerate(methods) if m[3] is not None}
    paired = time_interleaved(fns, warmup=1, repeats=repeats, device=device, progress=progress,
                              desc="throughput", calls=calls)
    in_a_row = {i: steps_in_a_row(fn, calls, repeats, device) for i, fn in fns.items()}
    base, base_row = paired[0], in_a_row[0]
    rows = []
    for i, (name, k, sdt, _, bpp, timed) in enumerate(methods):
        row = {"method": name, "timed": timed, "extra_bits": k, "state_dtype": sdt, "numel": numel,
               "n_tensors": n_tensors, "bytes_per_param": bpp, "bytes_per_step": bpp * numel, "memory_bandwidth": bw}
        ts, rs = paired.get(i), in_a_row.get(i)
        if ts is not None:
            med, rmed = statistics.median(ts), statistics.median(rs)
            ratios = [b / t for b, t in zip(base, ts, strict=True)]
            row.update(median_s=med, min_s=min(ts), max_s=max(ts), params_per_s=numel / med,
                       bytes_per_s=bpp * numel / med, bandwidth_fraction=bpp * numel / med / bw,
                       ratio_paired=statistics.median(ratios), ratio_lo=min(ratios), ratio_hi=max(ratios),
                       ratio_vs_torch_fused=min(base) / min(ts),
                       ratio_median_vs_torch_fused=statistics.median(base) / med,
                       inarow_median_s=rmed, inarow_min_s=min(rs), inarow_max_s=max(rs),
                       ratio_inarow=statistics.median(base_row) / rmed, ratio_inarow_lo=min(base_row) / max(rs),
                       ratio_inarow_hi=max(base_row) / min(rs), bandwidth_fraction_inarow=bpp * numel / rmed / bw)
        rows.append(row)
    df = pd.DataFrame(rows)
    df["device"] = str(device)
    df["threads"] = torch.get_num_threads()
    df["repeats"] = repeats
    df["calls_per_sample"] = calls
    df["load_before"], df["load_after"] = round(load_before, 2), round(os.getloadavg()[0], 2)
    df["cpu"] = cpu_variants.cpu_model() if device.type == "cpu" else str(device)
    df["kernel_variant"] = cpu_kernel.variant() if device.type == "cpu" else None
    return df


def throughput_share_ratio(df_tp: pd.DataFrame, method: str,
                           base: str = "torch AdamW fused (fp32)") -> tuple[float, float, float] | None:
    """Fig 3's efficiency: ``method``'s bytes/s (share of bandwidth) over ``base``'s, both at their
    median step, with the spread of the paired per-round step ratios; None if either is missing.

    A packed step moves fewer bytes than torch's fp32 step, so the share ratio is the steps/s ratio
    times the bytes-per-step ratio."""
    row, ref = find_row(df_tp, method=method), find_row(df_tp, method=base)
    if row is None or ref is None or pd.isna(row.get("median_s")) or pd.isna(ref.get("median_s")):
        return None
    bytes_ratio = float(row["bytes_per_param"]) / float(ref["bytes_per_param"])
    return (float(row["bytes_per_s"]) / float(ref["bytes_per_s"]), float(row["ratio_lo"]) * bytes_ratio,
            float(row["ratio_hi"]) * bytes_ratio)


DEFAULT_CONFIGS = (("bf16", 8), ("bf16", 16), ("bf16", 8, {"state_dtype": torch.bfloat16}))


def throughput_table(
    *, sizes: Iterable[int] = (1 << 21, 1 << 24), threads: Iterable[int] = (1, 2),
    configs: Iterable[tuple] = DEFAULT_CONFIGS, n_tensors: int = 8, repeats: int = 7,
    peers: bool = False, device: torch.device | str = "cpu", progress: bool = True, compiled_too: bool = False,
) -> pd.DataFrame:
    """:func:`step_throughput` for every (threads, size); one memory bandwidth per thread count."""
    frames = []
    device = torch.device(device)
    # NOTE: intra-op threads drive CPU kernels only; on CUDA one pass at torch's default suffices.
    for th in threads if device.type == "cpu" else [None]:
        saved = torch.get_num_threads()
        if th:
            torch.set_num_threads(th)
        try:
            bw = memory_bandwidth(BANDWIDTH_NUMEL, device=device)
        finally:
            torch.set_num_threads(saved)
        for n in sizes:
            frames.append(step_throughput(numel=n, n_tensors=n_tensors, configs=configs, device=device,
                                          repeats=repeats, threads=th, progress=progress, peers=peers,
                                          bandwidth=bw, compiled_too=compiled_too))
    return pd.concat(frames, ignore_index=True)


def _mlp(width: int, depth: int, dtype: torch.dtype) -> nn.Module:
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, 10)).to(dtype)


def backward_step_ratio(
    *, width: int = 1024, depth: int = 4, batch: int = 32, extra_bits: int = 8, repeats: int = 7,
    threads: int | None = None, compile: bool = True, progress: bool = True,
    device: torch.device | str = "cpu",
) -> pd.DataFrame:
    """A bf16 MLP training step with the step inside backward vs the same step with a fused step.

    Both use :class:`PackedAdamW` (``compile`` as given): the normal step is forward, backward,
    the fused flat step and ``zero_grad``; the other is forward and backward with
    :func:`step_in_backward` (per-parameter steps, compiled with dynamic shapes). Interleaved
    rounds; ``ratio`` is the in-backward time / normal time (median over paired rounds, min/max).
    """
    device = torch.device(device)
    saved = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        torch.manual_seed(0)
        x = torch.randn(batch, width, device=device).bfloat16()
        y = torch.randint(0, 10, (batch,), device=device)
        normal = _mlp(width, depth, torch.bfloat16).to(device)
        inside = _mlp(width, depth, torch.bfloat16).to(device)
        opt_n = PackedAdamW(normal.parameters(), extra_bits=extra_bits, fused=True, compile=compile)
        opt_i = PackedAdamW(inside.parameters(), extra_bits=extra_bits, compile=compile)
        handle = step_in_backward(inside, opt_i)

        def step_normal():
            nn.functional.cross_entropy(normal(x).float(), y).backward()
            opt_n.step()
            opt_n.zero_grad(set_to_none=True)

        def step_inside():
            nn.functional.cross_entropy(inside(x).float(), y).backward()

        for f in tqdm((step_normal, step_inside), desc="warm-up / compile", disable=not progress):
            for _ in range(3):
                f()
        ts = time_interleaved({"normal": step_normal, "in_backward": step_inside}, warmup=0,
                              repeats=repeats, device=device, progress=progress, desc="backward step")
        handle.remove()
        paired = [i / n for n, i in zip(ts["normal"], ts["in_backward"], strict=True)]
        params = sum(p.numel() for p in normal.parameters())
        return pd.DataFrame([{
            "params": params, "tensors": len(list(normal.parameters())), "batch": batch,
            "extra_bits": extra_bits, "compiled": compile,
            "normal_median_s": statistics.median(ts["normal"]),
            "in_backward_median_s": statistics.median(ts["in_backward"]),
            "ratio": statistics.median(paired), "ratio_lo": min(paired), "ratio_hi": max(paired),
            "threads": torch.get_num_threads(), "repeats": repeats, "device": str(device),
        }])
    finally:
        torch.set_num_threads(saved)


def main(argv: list[str] | None = None) -> None:
    """Print the throughput table (and the step-in-backward ratio) for a quiet machine."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", help="cpu or cuda (on CUDA --threads is ignored)")
    ap.add_argument("--sizes", type=int, nargs="+", default=[1 << 21, 1 << 24])
    ap.add_argument("--tensors", type=int, nargs="+", default=[8],
                    help="the parameter count is split into this many tensors (several: one table after another)")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--configs", nargs="+", help="packed formats, e.g. bf16+8 bf16+12 'fp16+13 SR' "
                    "'bf16+8 bf16 states' 'bf16+8 int8 states' (default: bf16+8, bf16+16, bf16+8 with bf16 states)")
    ap.add_argument("--peers", action="store_true", help="add torchao / optimi / bitsandbytes / FlashOptim rows")
    ap.add_argument("--compiled-too", action="store_true",
                    help="also time each format's torch.compile'd step beside the hand-written kernel")
    ap.add_argument("--no-backward", action="store_true", help="skip the step-in-backward timing")
    ap.add_argument("--width", type=int, default=1024, help="MLP width of the step-in-backward timing")
    ap.add_argument("--batch", type=int, default=32, help="batch of the step-in-backward timing")
    ap.add_argument("--csv", help="also write the tables to this path (and .backward.csv beside it)")
    ap.add_argument("--variants", action="store_true", help="CPU: first measure every build variant of the kernel "
                    "and keep the fastest (workbench.optim.tune_cpu_kernel)")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if args.variants and device.type == "cpu":
        from workbench.optim import tune_cpu_kernel

        tune_cpu_kernel.print_table(*tune_cpu_kernel.tune(threads=args.threads, numel=args.sizes[0],
                                                          n_tensors=args.tensors[0], progress=True))
    cols = ["threads", "numel", "n_tensors", "method", "median_s", "ratio_paired", "ratio_lo", "ratio_hi",
            "bandwidth_fraction", "inarow_median_s", "ratio_inarow", "ratio_inarow_lo", "ratio_inarow_hi",
            "bandwidth_fraction_inarow", "load_before", "load_after"]
    fmt = lambda v: f"{v:.4g}"  # noqa: E731
    frames = []
    with pd.option_context("display.width", 200, "display.max_columns", 20, "display.max_colwidth", 48):
        for n_tensors in args.tensors:  # the CSV written after each: a run stopped by a deadline keeps the first
            df = throughput_table(sizes=args.sizes, threads=args.threads, repeats=args.repeats, peers=args.peers,
                                  configs=args.configs or DEFAULT_CONFIGS,
                                  n_tensors=n_tensors, device=device, compiled_too=args.compiled_too)
            print(f"torch {torch.__version__}, device {device} ({df['cpu'].iloc[0]}; CPU kernel build "
                  f"{df['kernel_variant'].iloc[0]}), {n_tensors} tensors, in-place update bandwidth (GB/s) by threads:",
                  df.groupby("threads")["memory_bandwidth"].first().div(1e9).round(2).to_dict())
            print(df[cols].to_string(index=False, float_format=fmt), flush=True)
            frames.append(df)
            if args.csv:
                pd.concat(frames, ignore_index=True).to_csv(args.csv, index=False)
        if not args.no_backward:
            threads = args.threads if device.type == "cpu" else [None]
            back = pd.concat([backward_step_ratio(threads=t, repeats=args.repeats, progress=False, device=device,
                                                  width=args.width, batch=args.batch) for t in threads],
                             ignore_index=True)
            print(back.to_string(index=False, float_format=fmt))
            if args.csv:
                back.to_csv(args.csv.removesuffix(".csv") + ".backward.csv", index=False)


if __name__ == "__main__":
    main()
