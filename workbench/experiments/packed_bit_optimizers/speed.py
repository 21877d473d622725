"""Update throughput of the packed-bit optimizers against torch's fused AdamW (Fig 3 of Memory
Efficient Mixed Precision Optimizers, Lewandowski & Kosson: op throughput as a share of memory
bandwidth), and the cost of running the step inside backward (their section 3.2).

Methods are timed side by side in one run, interleaved repeat by repeat; ratios are against
``torch.optim.AdamW(fused=True)`` on fp32 parameters, paired round by round (median with the
min/max over rounds as the spread). Peers (torch fused AdamW on bf16 parameters, torchao's bf16
stochastic-rounding AdamW, optimi's Kahan-summation AdamW, bitsandbytes' 8-bit AdamW) join the
table when installed.

Re-run the whole table (1 and 2 threads, 2M and 16M parameters) with::

    python -m workbench.experiments.packed_bit_optimizers.speed
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import statistics
from collections.abc import Callable, Iterable

import pandas as pd
import torch
from torch import nn
from tqdm.auto import tqdm

from workbench.measure import calls_for, time_callable, time_interleaved
from workbench.optim import PackedAdamW, step_in_backward

from .bench import find_row, parse_format

__all__ = ["memory_bandwidth", "step_throughput", "throughput_share_ratio", "throughput_table", "backward_step_ratio",
           "main"]

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


def _peers(tensors: Callable[[torch.dtype], list[torch.Tensor]]) -> list[tuple[str, Callable, float]]:
    """(name, optimizer factory, bytes moved per parameter) for each installed peer."""
    out: list[tuple[str, Callable, float]] = [
        ("torch AdamW fused (bf16 params, no master)",
         lambda: torch.optim.AdamW(tensors(torch.bfloat16), fused=True), 2 + 2 + 2 + 2 * 2 * 2),
    ]
    if importlib.util.find_spec("torchao") is not None:
        def torchao_sr():
            from torchao.optim import _AdamW
            return _AdamW(tensors(torch.bfloat16), bf16_stochastic_round=True)
        out.append(("torchao _AdamW bf16 SR", torchao_sr, 2 + 2 + 2 + 2 * 2 * 2))
    if importlib.util.find_spec("optimi") is not None:
        def optimi_kahan():
            from optimi import AdamW
            return AdamW(tensors(torch.bfloat16), lr=1e-3, kahan_sum=True)
        out.append(("optimi AdamW bf16 + Kahan", optimi_kahan, 2 + 2 + 2 + 2 * 2 * 2 + 2 * 2))
    if importlib.util.find_spec("bitsandbytes") is not None:
        def bnb_8bit():
            from bitsandbytes.optim import AdamW8bit
            return AdamW8bit(tensors(torch.float32))
        out.append(("bitsandbytes AdamW8bit (fp32 params)", bnb_8bit, 4 + 4 + 4 + 2 * 2))
    return out


def _config(cfg) -> tuple:
    """(packed Format, PackedAdamW options) of a config: a format name ('bf16+8', 'fp16+13 SR') or
    ``(dtype name, extra bits[, options])``."""
    if isinstance(cfg, str):
        fmt = parse_format(cfg)
        options = {"stochastic_rounding": True} if fmt.stochastic_rounding else {}
    else:
        fmt, options = parse_format(f"{cfg[0]}+{cfg[1]}"), dict(cfg[2]) if len(cfg) > 2 else {}
    if not fmt.packed:
        raise ValueError(f"throughput config {cfg!r}: needs a packed format such as 'bf16+8'")
    return fmt, options


def step_throughput(
    *, numel: int, n_tensors: int = 8, configs: Iterable[tuple] = (("bf16", 16),),
    device: torch.device | str = "cpu", repeats: int = 5, compile: bool = True,
    threads: int | None = None, progress: bool = True, peers: bool = False,
    bandwidth_numel: int = BANDWIDTH_NUMEL, bandwidth: float | None = None, compiled_too: bool = False,
) -> pd.DataFrame:
    """Fig 3: AdamW step throughput, packed fused step vs ``torch.optim.AdamW(fused=True)`` (fp32).

    ``configs`` entries are format names ('bf16+8', 'fp16+13 SR'), ``(dtype name, extra bits)`` or
    ``(dtype name, extra bits, options)`` with options passed to :class:`PackedAdamW` (e.g.
    ``{"state_dtype": torch.bfloat16}``). Same
    parameter count split into ``n_tensors`` tensors, same device, same run; the methods' steps are
    interleaved repeat by repeat so that load from other processes hits all of them alike. Bytes
    moved per step are counted analytically (params r/w, gradient read, extra bits r/w, states
    r/w). ``bandwidth_fraction`` divides bytes/s of the median step by :func:`memory_bandwidth`
    over ``bandwidth_numel`` fp32 values (best of 5; or ``bandwidth`` if given). ``ratio_paired`` is
    the median over rounds of torch's time / the method's time in the same round, with
    ``ratio_lo``/``ratio_hi`` the min/max over rounds (each round times ``calls_per_sample`` steps in
    a row per method, at least ``SAMPLE_S`` of torch's step); ``ratio_vs_torch_fused`` compares best
    steps, ``ratio_median_vs_torch_fused`` median steps. ``compile`` True runs the packed optimizers'
    fastest step (`PackedAdamW.step_backend()`, named in ``method``: the hand-written kernel, C++ on
    CPU and Triton on CUDA, where it runs, else torch.compile), False the eager one. ``compiled_too``
    adds each format's torch.compile'd step beside a hand-written one (what the kernel gains, in the
    same run). ``threads`` (CPU) runs every method with that many intra-op threads and restores the
    setting afterwards. ``peers`` adds the installed peer optimizers.
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


def _step_throughput(numel, n_tensors, configs, device, repeats, compile, progress, peers, bw,
                     compiled_too=False) -> pd.DataFrame:
    methods = []  # (name, extra_bits, state dtype, optimizer, bytes per parameter)

    def tensors(dtype):
        out = [torch.zeros(s, device=device, dtype=dtype, requires_grad=True)
               for s in _sizes(numel, n_tensors)]
        for p in out:
            p.grad = torch.randn_like(p) * 1e-3
        return out

    # NOTE: fused=True exists for CPU AdamW in torch 2.13 (checked); it is torch's fastest step.
    methods.append(("torch AdamW fused (fp32)", None, "fp32",
                    torch.optim.AdamW(tensors(torch.float32), fused=True), 28.0))
    for cfg in configs:
        fmt, options = _config(cfg)
        k = fmt.extra_bits
        # compile=True: the fastest step available (a hand-written kernel, else torch.compile); False: eager
        opt = PackedAdamW(tensors(fmt.param_dtype), extra_bits=k, fused=True, compile=None if compile else False,
                          **options)
        opts = [opt]
        if compiled_too and compile and opt.step_backend() not in ("compiled", "eager"):
            opts.append(PackedAdamW(tensors(fmt.param_dtype), extra_bits=k, fused=True, compile=True, **options))
        sdt = options.get("state_dtype", torch.float32)
        state_bytes = 2 if sdt == torch.bfloat16 else 4
        sr = bool(options.get("stochastic_rounding", False))
        for o in opts:
            label = f"Packed AdamW {fmt.name.removesuffix(' SR')}{' SR' if sr else ''}" + (
                " bf16 states" if sdt == torch.bfloat16 else "") + f" fused {o.step_backend().replace('_', ' ')}"
            methods.append((label, k, str(sdt).replace("torch.", "").replace("float32", "fp32"),
                            o, 2 + 2 + 2 + 2 * (k + sr) / 8 + 2 * 2 * state_bytes))
    if peers:
        for name, make, bpp in _peers(tensors):
            try:
                with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                    opt = make()
                    opt.step()
            except Exception as e:  # noqa: BLE001 - a peer that cannot run here is a row that says so
                methods.append((f"{name} [failed: {type(e).__name__}]", None, "", None, bpp))
                continue
            methods.append((name, None, "", opt, bpp))
    runnable = [(i, m) for i, m in enumerate(methods) if m[3] is not None]
    for _, (_, _, _, opt, _) in tqdm(runnable, desc="warm-up / compile", disable=not progress):
        for _ in range(3):
            opt.step()
    # NOTE: a sample is `calls` steps in a row, enough for SAMPLE_S of torch's step: single steps of
    # ~1 ms (2M parameters on 2 threads) gave paired ratios spread over 0.4-2.2 within one run.
    calls = calls_for(methods[0][3].step, SAMPLE_S, repeats=3, device=device)
    by_method = time_interleaved({i: m[3].step for i, m in runnable}, warmup=0, repeats=repeats,
                                 device=device, progress=progress, desc="throughput", calls=calls)
    base = by_method[0]
    rows = []
    for i, (name, k, sdt, _, bpp) in enumerate(methods):
        ts = by_method.get(i)
        row = {"method": name, "extra_bits": k, "state_dtype": sdt, "numel": numel, "n_tensors": n_tensors,
               "bytes_per_param": bpp, "bytes_per_step": bpp * numel, "memory_bandwidth": bw}
        if ts is not None:
            med = statistics.median(ts)
            paired = [b / t for b, t in zip(base, ts, strict=True)]
            row.update(median_s=med, min_s=min(ts), max_s=max(ts), params_per_s=numel / med,
                       bytes_per_s=bpp * numel / med, bandwidth_fraction=bpp * numel / med / bw,
                       ratio_paired=statistics.median(paired), ratio_lo=min(paired), ratio_hi=max(paired),
                       ratio_vs_torch_fused=min(base) / min(ts),
                       ratio_median_vs_torch_fused=statistics.median(base) / med)
        rows.append(row)
    df = pd.DataFrame(rows)
    df["device"] = str(device)
    df["threads"] = torch.get_num_threads()
    df["repeats"] = repeats
    df["calls_per_sample"] = calls
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
    ap.add_argument("--tensors", type=int, default=8, help="the parameter count is split into this many tensors")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--peers", action="store_true", help="add torchao / optimi / bitsandbytes rows")
    ap.add_argument("--compiled-too", action="store_true",
                    help="also time each format's torch.compile'd step beside the hand-written kernel")
    ap.add_argument("--no-backward", action="store_true", help="skip the step-in-backward timing")
    ap.add_argument("--width", type=int, default=1024, help="MLP width of the step-in-backward timing")
    ap.add_argument("--batch", type=int, default=32, help="batch of the step-in-backward timing")
    ap.add_argument("--csv", help="also write the tables to this path (and .backward.csv beside it)")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    df = throughput_table(sizes=args.sizes, threads=args.threads, repeats=args.repeats, peers=args.peers,
                          n_tensors=args.tensors, device=device, compiled_too=args.compiled_too)
    cols = ["threads", "numel", "method", "median_s", "ratio_paired", "ratio_lo", "ratio_hi",
            "ratio_vs_torch_fused", "bytes_per_param", "bandwidth_fraction"]
    fmt = lambda v: f"{v:.4g}"  # noqa: E731
    with pd.option_context("display.width", 200, "display.max_columns", 20, "display.max_colwidth", 48):
        print(f"torch {torch.__version__}, device {device}, in-place update bandwidth (GB/s) by threads:",
              df.groupby("threads")["memory_bandwidth"].first().div(1e9).round(2).to_dict())
        print(df[cols].to_string(index=False, float_format=fmt))
        if args.csv:
            df.to_csv(args.csv, index=False)
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
