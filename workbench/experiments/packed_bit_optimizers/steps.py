"""Training-step times of the packed-bit formats and the optimizer step fused into backward.

Paper: Lewandowski & Kosson, "Memory Efficient Mixed Precision Optimizers", section 4: Table 3's
training times by format (AMP vs fp32 vs fp16+8 vs fp16+13 with stochastic rounding), the text's
fused-optimizer (2-10% faster) remark, and Table 2 (optimizer step fused into backward: peak memory
and time of fine-tuning a transformer).

Every variant is timed in interleaved rounds (one call each per round) so that load from other
processes hits all of them alike; ratios pair the rounds and carry their per-round extremes.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Hashable, Iterable, Mapping

import pandas as pd
import torch
from torch import nn

from workbench.measure import time_interleaved
from workbench.optim import step_in_backward

from .bench import _loss, make_model, make_optimizer, measure_peak, parse_format

__all__ = ["paired_ratio", "round_times", "rounds_ratio", "step_time_by_format", "TokenClassifier", "fused_backward"]


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
    handle = step_in_backward(model, opt) if in_backward else None
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
    progress: bool = True,
) -> pd.DataFrame:
    """Time of one training step (forward, backward, optimizer step) per format, interleaved.

    Packed formats run their per-parameter step (row ``<format>``) and, with ``fused``, also the
    flat fused step (row ``<format> fused``); ``compile`` is passed to both, so the pair differs
    in fusion only. Rounds alternate the variants (load from other processes hits all alike).
    ``speedup_vs_<baseline>`` = median baseline time / median time, with ``*_lo``/``*_hi`` the
    lowest and highest paired per-round ratio.
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
    rows = [{"format": n, "median_s": statistics.median(t), "min_s": min(t), "max_s": max(t), "rounds": len(t)}
            for n, t in times.items()]
    df = pd.DataFrame(rows)
    if baseline in times:
        ratios = [paired_ratio(times, n, baseline) for n in times]
        col = f"speedup_vs_{baseline}"
        df[col], df[f"{col}_lo"], df[f"{col}_hi"] = zip(*ratios, strict=True)
    df.attrs["times"] = times
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
    progress: bool = True,
) -> pd.DataFrame:
    """Table 2 analogue: peak memory and step time of a transformer with/without step in backward.

    Memory: ``steps`` metered steps each (fresh optimizer, state included), with the phase where
    the peak falls. Time: the two configurations' training steps interleaved round by round;
    ``time_ratio`` = median in-backward / median ordinary, ``time_ratio_lo``/``_hi`` the paired
    per-round extremes.
    """
    if batch < 1 or seq < 1 or d_model < 1 or layers < 1:
        raise ValueError(f"need batch, seq, d_model, layers >= 1, got {batch}, {seq}, {d_model}, {layers}")
    device = torch.device(device)
    gen = torch.Generator().manual_seed(seed)
    batches = [(torch.randint(vocab, (batch, seq), generator=gen), torch.randint(2, (batch,), generator=gen))
               for _ in range(steps)]

    def model_fn():
        torch.manual_seed(seed)
        return TokenClassifier(vocab, d_model, max(1, d_model // 64), layers)

    rows, fns, handles = [], {}, []
    for name in formats:
        fmt = parse_format(name)
        for sib in (False, True):
            rows.append(measure_peak(model_fn, fmt, batches, in_backward=sib, optimizer=optimizer, lr=lr,
                                     device=device))
            fns[(name, sib)], handle = _training_step(model_fn, fmt, batches[0], in_backward=sib,
                                                      optimizer=optimizer, lr=lr, device=device)
            handles.append(handle)
    times = time_interleaved(fns, warmup=1, repeats=repeats, device=device, progress=progress,
                             desc="fused backward")
    for h in handles:
        if h is not None:
            h.remove()
    df = pd.DataFrame(rows)
    df["step_s"] = [statistics.median(times[(f, s)]) for f, s in zip(df["format"], df["step_in_backward"],
                                                                       strict=True)]
    df["tokens"] = batch * seq
    base = df.groupby("format")["peak_bytes"].transform("first")
    df["peak_ratio"] = df["peak_bytes"] / base
    ratio, lo, hi = [], [], []
    for f, s in zip(df["format"], df["step_in_backward"], strict=True):
        # arguments swapped on purpose: this gives in-backward time / ordinary time
        r, a, b = paired_ratio(times, (f, False), (f, s))
        ratio.append(r)
        lo.append(a)
        hi.append(b)
    df["time_ratio"], df["time_ratio_lo"], df["time_ratio_hi"] = ratio, lo, hi
    return df
