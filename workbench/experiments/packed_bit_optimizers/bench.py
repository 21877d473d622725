"""Benchmarks for the packed-bit optimizers: peak memory by format, step throughput, fused backward.

Paper: Lewandowski & Kosson, "Memory Efficient Mixed Precision Optimizers" (004), section 4:
Fig 2 (peak memory of a synthetic training, AMP vs 16-bit + extra bits), Fig 3 (update
throughput as a share of memory bandwidth), Table 2 (optimizer step fused into backward).

Every function returns a pandas DataFrame measured in one run, with the baseline beside the
technique; ratios are technique / baseline. CPU memory comes from ``MemoryMeter`` (a dispatch mode),
so the memory runs use the eager per-parameter step, never a compiled one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import pandas as pd
import torch
from torch import nn
from tqdm.auto import tqdm

from workbench.measure import MemoryMeter, time_callable, time_interleaved
from workbench.optim.backward import step_in_backward
from workbench.optim.bits import storage_bits
from workbench.optim.packed import PackedAdamW, PackedSGD

__all__ = [
    "Format", "FORMATS", "parse_format", "make_model", "make_optimizer", "analytic_bytes_per_param",
    "measure_peak", "memory_by_format", "step_time_by_format",
    "fused_backward", "peak_vs_amp",
    "TokenClassifier",
]

_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class Format:
    """A training number format: parameter dtype, packed extra bits (None: plain torch.optim)."""

    name: str
    param_dtype: torch.dtype
    extra_bits: int | None = None
    stochastic_rounding: bool = False
    autocast: torch.dtype | None = None

    @property
    def packed(self) -> bool:
        return self.extra_bits is not None


def parse_format(name: str) -> Format:
    """'fp32', 'amp' (fp32 master + fp16 autocast), 'fp16', 'bf16', 'fp16+8', 'bf16+16', 'fp16+13 SR'."""
    text = name.strip()
    if text == "amp":
        return Format("amp", torch.float32, autocast=torch.float16)
    sr = text.endswith(" SR")
    base = text[:-3].strip() if sr else text
    dtype_name, _, k = base.partition("+")
    if dtype_name not in _DTYPES or (k and not k.isdigit()) or (sr and not k):
        raise ValueError(
            f"format {name!r} not understood: use fp32, amp, fp16, bf16, fp16+K or bf16+K "
            "(K = 0..13 for fp16, 0..16 for bf16), optionally followed by ' SR'"
        )
    dtype = _DTYPES[dtype_name]
    if dtype == torch.float32 and k:
        raise ValueError(f"format {name!r}: extra bits apply to fp16/bf16 only")
    return Format(text, dtype, int(k) if k else None, sr)


FORMATS = [parse_format(n) for n in
           ("fp32", "amp", "fp16", "bf16", "fp16+8", "fp16+13 SR", "bf16+8", "bf16+16")]


class _CastInput(nn.Module):
    """Casts floating inputs to the parameters' dtype (a pure fp16/bf16 model takes 16-bit input)."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype = dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(self.dtype) if x.is_floating_point() else x


def make_model(model_fn: Callable[[], nn.Module], fmt: Format, device: torch.device | str) -> nn.Module:
    """``model_fn()`` in ``fmt``'s parameter dtype on ``device``, taking fp32 inputs."""
    return nn.Sequential(_CastInput(fmt.param_dtype), model_fn()).to(device, fmt.param_dtype)


def make_optimizer(
    params: Iterable, fmt: Format, *, optimizer: str = "sgd", lr: float, momentum: float = 0.9,
    weight_decay: float = 0.0, fused: bool = False, compile: bool = False, seed: int = 0,
) -> torch.optim.Optimizer:
    """torch.optim.SGD/AdamW for plain formats, PackedSGD/PackedAdamW for ``fp16+k``/``bf16+k``."""
    if optimizer not in ("sgd", "adamw"):
        raise ValueError(f"optimizer={optimizer!r}: allowed 'sgd' or 'adamw'")
    if not fmt.packed:
        if optimizer == "sgd":
            return torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay)
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    kw = dict(extra_bits=fmt.extra_bits, stochastic_rounding=fmt.stochastic_rounding,
              fused=fused, compile=compile, seed=seed)
    if optimizer == "sgd":
        return PackedSGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay, **kw)
    return PackedAdamW(params, lr=lr, weight_decay=weight_decay, **kw)


def analytic_bytes_per_param(fmt: Format, *, optimizer: str = "sgd", in_backward: bool = False) -> float:
    """Parameter + gradient + optimizer state (+ AMP's 16-bit weight copy) bytes per parameter.

    With the step inside backward a gradient lives only until its parameter is updated, so
    gradients count as zero per parameter (one layer's gradient remains, not counted here).
    """
    size = torch.tensor([], dtype=fmt.param_dtype).element_size()
    n_states = 1 if optimizer == "sgd" else 2
    if fmt.packed:
        total = size + 4 * n_states + storage_bits(fmt.extra_bits, fmt.stochastic_rounding) / 8
    else:
        total = size + size * n_states
    total += 0 if in_backward else size
    return total + (2 if fmt.autocast is not None else 0)


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor, fmt: Format) -> torch.Tensor:
    ctx = (torch.autocast(x.device.type, dtype=fmt.autocast) if fmt.autocast is not None
           else contextlib.nullcontext())
    with ctx:
        logits = model(x)
    return nn.functional.cross_entropy(logits.float(), y)


def measure_peak(
    model_fn: Callable[[], nn.Module], fmt: Format, batches: list[tuple[torch.Tensor, torch.Tensor]],
    *, in_backward: bool, optimizer: str = "sgd", lr: float = 0.01, device: torch.device | str = "cpu",
) -> dict:
    """Peak tensor bytes of a few training steps: parameters + everything allocated in the steps.

    Parameters exist before the meter opens and are added from their sizes; gradients, optimizer
    state (created at the first step), activations and temporaries are measured.
    """
    device = torch.device(device)
    model = make_model(model_fn, fmt, device)
    opt = make_optimizer(model.parameters(), fmt, optimizer=optimizer, lr=lr)
    handle = step_in_backward(model, opt) if in_backward else None
    params = sum(p.numel() for p in model.parameters())
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    with MemoryMeter(device) as meter:
        for x, y in batches:
            _loss(model, x.to(device), y.to(device), fmt).backward()
            if handle is None:
                opt.step()
                opt.zero_grad(set_to_none=True)
    if handle is not None:
        handle.remove()
    peak = param_bytes + meter.peak_bytes
    return {
        "format": fmt.name, "step_in_backward": in_backward, "params": params,
        "peak_bytes": peak, "peak_bytes_per_param": peak / params,
        "analytic_bytes_per_param": analytic_bytes_per_param(fmt, optimizer=optimizer,
                                                             in_backward=in_backward),
        "steps": len(batches),
    }


def peak_vs_amp(
    model_fn: Callable[[], nn.Module], format_name: str, batches: list[tuple[torch.Tensor, torch.Tensor]],
    *, in_backward: bool, optimizer: str = "sgd", device: torch.device | str = "cpu",
) -> pd.DataFrame:
    """One format's peak beside AMP's (no step in backward) on the same model and batches; the last
    column is the format's peak as a ratio of AMP's."""
    rows = [measure_peak(model_fn, parse_format(name), batches, in_backward=sib, optimizer=optimizer, device=device)
            for name, sib in ((format_name, in_backward), ("amp", False))]
    df = pd.DataFrame(rows)
    df["ratio_vs_amp"] = df["peak_bytes"] / df["peak_bytes"].iloc[-1]
    return df


def memory_by_format(
    model_fn: Callable[[], nn.Module], batches: list[tuple[torch.Tensor, torch.Tensor]], *,
    formats: Iterable[str | Format] = tuple(f.name for f in FORMATS), optimizer: str = "sgd",
    device: torch.device | str = "cpu", progress: bool = True,
) -> pd.DataFrame:
    """Fig 2: peak memory per format, with and without the step inside backward.

    Adds ``ratio_vs_amp``: peak / peak of AMP (without step in backward) when AMP is listed.
    """
    fmts = [f if isinstance(f, Format) else parse_format(f) for f in formats]
    runs = [(f, sib) for f in fmts for sib in (False, True)]
    rows = [measure_peak(model_fn, f, batches, in_backward=sib, optimizer=optimizer, device=device)
            for f, sib in tqdm(runs, desc="memory", disable=not progress)]
    df = pd.DataFrame(rows)
    amp = df[(df["format"] == "amp") & ~df["step_in_backward"]]["peak_bytes"]
    df["ratio_vs_amp"] = df["peak_bytes"] / amp.iloc[0] if len(amp) else float("nan")
    return df


def _time_training_step(model_fn, fmt, batch, *, in_backward, optimizer, lr, repeats, device):
    model = make_model(model_fn, fmt, device)
    opt = make_optimizer(model.parameters(), fmt, optimizer=optimizer, lr=lr)
    handle = step_in_backward(model, opt) if in_backward else None
    x, y = batch[0].to(device), batch[1].to(device)

    def step():
        _loss(model, x, y, fmt).backward()
        if handle is None:
            opt.step()
            opt.zero_grad(set_to_none=True)

    t = time_callable(step, warmup=1, repeats=repeats, device=device)
    if handle is not None:
        handle.remove()
    return t


def step_time_by_format(
    model_fn: Callable[[], nn.Module], batch: tuple[torch.Tensor, torch.Tensor], *,
    formats: Iterable[str], optimizer: str = "sgd", lr: float = 0.01, repeats: int = 10,
    compiled: bool = False, device: torch.device | str = "cpu",
) -> pd.DataFrame:
    """Time of one training step (forward, backward, optimizer step) per format.

    Packed formats run their eager per-parameter step; with ``compiled`` each packed format is
    also timed with the fused ``torch.compile``d step (row ``<format> fused compiled``). The steps
    are interleaved repeat by repeat (load from other processes hits all of them alike);
    ``speedup_vs_amp`` compares best steps, ``speedup_median_vs_amp`` medians.
    """
    device = torch.device(device)
    variants = []
    for name in formats:
        fmt = parse_format(name)
        variants.append((name, fmt, False))
        if compiled and fmt.packed:
            variants.append((f"{name} fused compiled", fmt, True))
    steps: dict[str, Callable[[], None]] = {}
    for name, fmt, fused in variants:
        model = make_model(model_fn, fmt, device)
        opt = make_optimizer(model.parameters(), fmt, optimizer=optimizer, lr=lr, fused=fused,
                             compile=fused)
        x, y = batch[0].to(device), batch[1].to(device)

        def step(model=model, opt=opt, x=x, y=y, fmt=fmt):
            _loss(model, x, y, fmt).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        steps[name] = step
    times = time_interleaved(steps, warmup=1, repeats=repeats, device=device)
    df = pd.DataFrame([{"format": n, "min_s": min(t), "median_s": float(pd.Series(t).median())}
                       for n, t in times.items()])
    if "amp" in set(df["format"]):
        amp = df.set_index("format").loc["amp"]
        df["speedup_vs_amp"] = amp["min_s"] / df["min_s"]
        df["speedup_median_vs_amp"] = amp["median_s"] / df["median_s"]
    return df


class TokenClassifier(nn.Module):
    """A small transformer encoder over token ids with a classification head (Table 2 stand-in)."""

    def __init__(self, vocab: int = 1000, d_model: int = 256, heads: int = 4, layers: int = 4,
                 classes: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        layer = nn.TransformerEncoderLayer(d_model, heads, 4 * d_model, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d_model, classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(tokens)).mean(1))


def fused_backward(
    *, d_model: int = 256, layers: int = 4, vocab: int = 1000, batch: int = 8, seq: int = 64,
    steps: int = 2, repeats: int = 3, optimizer: str = "adamw", lr: float = 2e-5,
    formats: Iterable[str] = ("fp32",), device: torch.device | str = "cpu", seed: int = 0,
) -> pd.DataFrame:
    """Table 2 analogue: peak memory and step time of a transformer with/without step in backward."""
    device = torch.device(device)
    gen = torch.Generator().manual_seed(seed)
    batches = [(torch.randint(vocab, (batch, seq), generator=gen), torch.randint(2, (batch,), generator=gen))
               for _ in range(steps)]

    def model_fn():
        torch.manual_seed(seed)
        return TokenClassifier(vocab, d_model, max(1, d_model // 64), layers)

    rows = []
    for name in formats:
        fmt = parse_format(name)
        for sib in (False, True):
            rec = measure_peak(model_fn, fmt, batches, in_backward=sib, optimizer=optimizer, lr=lr,
                               device=device)
            t = _time_training_step(model_fn, fmt, batches[0], in_backward=sib,
                                    optimizer=optimizer, lr=lr, repeats=repeats, device=device)
            rows.append({**rec, "step_s": t.median_s, "tokens": batch * seq})
    df = pd.DataFrame(rows)
    base = df.groupby("format")["peak_bytes"].transform("first")
    df["peak_ratio"] = df["peak_bytes"] / base
    df["time_ratio"] = df["step_s"] / df.groupby("format")["step_s"].transform("first")
    return df
