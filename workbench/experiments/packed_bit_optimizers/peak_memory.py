"""Formats and peak memory of the packed-bit optimizers (the timing runs live in ``step_times``).

Paper: Lewandowski & Kosson, "Memory Efficient Mixed Precision Optimizers", section 4: Fig 2
(memory of a synthetic training, AMP vs 16-bit + extra bits, drawn over the steps by category)
and Table 3's memory column (ResNet-18 by format).

Every function returns a pandas DataFrame measured in one run, with the baseline beside the
technique; ratios are technique / baseline. CPU memory comes from ``MemoryMeter`` (a dispatch mode),
so the memory runs use the eager per-parameter step, never a compiled one. Optimizer state is
created inside the metered region (a fresh optimizer per run), so peaks include it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import pandas as pd
import torch
from torch import nn
from tqdm.auto import tqdm

from workbench.dtype_probe import Fp16Probe
from workbench.measure import MemoryMeter, state_bytes
from workbench.optim import PackedAdamW, PackedSGD, step_in_backward
from workbench.optim.formats import storage_bits

from .dtypes import plan_formats

__all__ = [
    "Format", "FORMATS", "parse_format", "make_model", "make_optimizer", "packed_option_available",
    "analytic_bytes_per_param", "measure_peak", "memory_by_format", "peak_of", "step_timeline", "peak_vs_amp",
    "find_row",
    "saving_ceiling",
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
    master_rounding: str = "truncate"  # packed formats: the optimizers' master_rounding ('nearest': ' nearest')
    state_dtype: torch.dtype | None = None  # packed formats: the optimizer state's dtype (None: fp32)

    @property
    def packed(self) -> bool:
        return self.extra_bits is not None


_STATES = " bf16 states"


def parse_format(name: str) -> Format:
    """'fp32', 'amp' (fp32 master + fp16 autocast), 'fp16', 'bf16', 'fp16+8', 'bf16+16', 'fp16+13 SR' (the visible
    value rounded stochastically), 'fp16+8 nearest' (`master_rounding="nearest"`: the visible value rounded to
    nearest, the extra bits its signed remainder); a packed format may end in ' bf16 states' (its momentum or moments
    in bf16: 'fp16+8 bf16 states')."""
    text = name.strip()
    if text == "amp":
        return Format("amp", torch.float32, autocast=torch.float16)
    states = text.endswith(_STATES)
    if states:
        fmt = parse_format(text[: -len(_STATES)])
        if not fmt.packed:
            raise ValueError(f"format {name!r}: ' bf16 states' applies to packed formats (fp16+K, bf16+K) only")
        return dataclasses.replace(fmt, name=text, state_dtype=torch.bfloat16)
    sr, nearest = text.endswith(" SR"), text.endswith(" nearest")
    base = text.removesuffix(" SR").removesuffix(" nearest").strip()
    dtype_name, _, k = base.partition("+")
    if dtype_name not in _DTYPES or (k and not k.isdigit()) or ((sr or nearest) and not k):
        raise ValueError(
            f"format {name!r} not understood: use fp32, amp, fp16, bf16, fp16+K or bf16+K "
            "(K = 0..13 for fp16, 0..16 for bf16), optionally followed by ' SR' or ' nearest', and ' bf16 states'"
        )
    dtype = _DTYPES[dtype_name]
    if dtype == torch.float32 and k:
        raise ValueError(f"format {name!r}: extra bits apply to fp16/bf16 only")
    return Format(text, dtype, int(k) if k else None, sr, master_rounding="nearest" if nearest else "truncate")


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


def packed_option_available(option: str) -> bool:
    """True if this build's ``PackedAdamW`` takes keyword ``option`` (e.g. 'state_dtype')."""
    return option in inspect.signature(PackedAdamW).parameters


def make_optimizer(
    params: Iterable, fmt: Format, *, optimizer: str = "sgd", lr: float, momentum: float = 0.9,
    weight_decay: float = 0.0, fused: bool = False, compile: bool | None = False, seed: int = 0,
    state_dtype: torch.dtype | None = None, amsgrad: bool = False,
) -> torch.optim.Optimizer:
    """torch.optim.SGD/AdamW for plain formats, PackedSGD/PackedAdamW for ``fp16+k``/``bf16+k``.

    ``state_dtype`` (packed formats only) stores the optimizer state (momentum, moments) in that
    dtype; a build whose packed optimizers have no such option raises ``NotImplementedError``.
    ``compile`` (packed formats): False runs the eager update, None the fastest available for
    ``fused`` groups, True the compiled one. ``amsgrad`` (AdamW only) keeps a third state.
    """
    if optimizer not in ("sgd", "adamw"):
        raise ValueError(f"optimizer={optimizer!r}: allowed 'sgd' or 'adamw'")
    if amsgrad and optimizer != "adamw":
        raise ValueError(f"amsgrad=True applies to optimizer='adamw' only, not {optimizer!r}")
    state_dtype = state_dtype if state_dtype is not None else fmt.state_dtype
    if state_dtype is not None and not fmt.packed:
        raise ValueError(f"state_dtype={state_dtype} applies to packed formats (fp16+k, bf16+k) only, "
                         f"not {fmt.name!r}")
    if not fmt.packed:
        if optimizer == "sgd":
            return torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay)
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, amsgrad=amsgrad)
    kw = dict(extra_bits=fmt.extra_bits, stochastic_rounding=fmt.stochastic_rounding,
              master_rounding=fmt.master_rounding, fused=fused, compile=compile, seed=seed)
    if state_dtype is not None:
        if not packed_option_available("state_dtype"):
            raise NotImplementedError("the packed optimizers' state_dtype option is not available in this build")
        kw["state_dtype"] = state_dtype
    if optimizer == "sgd":
        return PackedSGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay, **kw)
    return PackedAdamW(params, lr=lr, weight_decay=weight_decay, amsgrad=amsgrad, **kw)


def analytic_bytes_per_param(fmt: Format, *, optimizer: str = "sgd", in_backward: bool = False,
                             amsgrad: bool = False, accumulate: int = 1) -> float:
    """Parameter + gradient + optimizer state (+ AMP's 16-bit weight copy) bytes per parameter.

    With the step inside backward a gradient lives only until its parameter is updated, so
    gradients count as zero per parameter (one layer's gradient remains, not counted here) unless
    ``accumulate`` > 1 keeps them over micro-batches. ``amsgrad`` (AdamW) adds the running max of
    the second moment: one more state (4 bytes for the packed optimizers' fp32 states, 2 for bf16 states).
    """
    size = torch.tensor([], dtype=fmt.param_dtype).element_size()
    n_states = 1 if optimizer == "sgd" else (3 if amsgrad else 2)
    if fmt.packed:
        state = 4 if fmt.state_dtype is None else torch.tensor([], dtype=fmt.state_dtype).element_size()
        total = size + state * n_states + storage_bits(fmt.extra_bits, fmt.stochastic_rounding) / 8
    else:
        total = size + size * n_states
    total += 0 if in_backward and accumulate == 1 else size
    return total + (2 if fmt.autocast is not None else 0)


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor, fmt: Format) -> torch.Tensor:
    ctx = (torch.autocast(x.device.type, dtype=fmt.autocast) if fmt.autocast is not None
           else contextlib.nullcontext())
    with ctx:
        logits = model(x)
    return nn.functional.cross_entropy(logits.float(), y)


# ------------------------------------------------------------------------------ phase marks
# NOTE: a do-nothing custom op marks phase boundaries inside MemoryMeter's trace: the meter
# records the 0-byte tensor it returns as one event named after the op, so the trace can be cut
# into forward / backward / step without reaching into the meter's internals.
_MARK_OP = "phase_mark.default"


@torch.library.custom_op("workbench_packed_bits::phase_mark", mutates_args=())
def _phase_mark(x: torch.Tensor) -> torch.Tensor:
    return x.new_empty(0)


@_phase_mark.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return x.new_empty(0)


class _Marks:
    """Phase labels ("<phase> <step>") and the gradient / optimizer-state bytes live at each mark."""

    def __init__(self, model: nn.Module, opt: torch.optim.Optimizer, device: torch.device) -> None:
        self.model, self.opt = model, opt
        self.probe = torch.empty(0, device=device)
        self.step = 0
        self.labels: list[str] = []
        self.grads: list[int] = []
        self.state: list[int] = []

    def __call__(self, phase: str) -> None:
        sizes = state_bytes(self.model, self.opt)
        self.labels.append(f"{phase} {self.step}")
        self.grads.append(sizes["gradients"])
        self.state.append(sizes["optimizer_state"])
        _phase_mark(self.probe)


def _run_metered(model, opt, fmt, batches, *, in_backward, device, release=step_in_backward
                 ) -> tuple[MemoryMeter, _Marks]:
    marks = _Marks(model, opt, device)
    handle = release(model, opt) if in_backward else None
    # registered after step_in_backward's hooks, so a mark sees the gradient already freed
    hooks = [p.register_post_accumulate_grad_hook(lambda _p: marks("backward"))
             for p in model.parameters() if p.requires_grad]
    try:
        with MemoryMeter(device, trace=True) as meter:
            for i, (x, y) in enumerate(batches, start=1):
                marks.step = i
                marks("forward")
                loss = _loss(model, x.to(device), y.to(device), fmt)
                marks("backward")
                loss.backward()
                del loss
                if handle is None:
                    marks("step")
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                marks("end")
    finally:
        for h in hooks:
            h.remove()
        if handle is not None:
            handle.remove()
    return meter, marks


def _timeline(meter: MemoryMeter, marks: _Marks, param_bytes: int) -> pd.DataFrame:
    trace = meter.trace.copy()
    index = (trace["op"] == _MARK_OP).cumsum() - 1  # which mark each event follows
    idx = index.clip(lower=0).to_numpy()
    trace["phase"] = [marks.labels[i].split()[0] if k >= 0 else "forward"
                      for i, k in zip(idx, index, strict=True)]
    trace["step"] = [int(marks.labels[i].split()[1]) for i in idx]
    trace["parameters"] = param_bytes
    trace["gradients"] = [marks.grads[i] for i in idx]
    trace["optimizer_state"] = [marks.state[i] for i in idx]
    trace["total"] = trace["bytes"] + param_bytes
    # NOTE: activations and temporaries are what is live besides parameters, gradients and state
    # at the last mark. AMP's 16-bit weight copies land here (the paper's profiler also counts
    # them as activations); state being created inside a step shows here until the step's end.
    # Frees between two marks that take the total below the known categories are gradients
    # being released (zero_grad, or the step in backward), so they come off the gradients.
    other = trace["total"] - trace["parameters"] - trace["gradients"] - trace["optimizer_state"]
    trace["gradients"] = (trace["gradients"] + other.clip(upper=0)).clip(lower=0)
    trace["activations_temporaries"] = other.clip(lower=0)
    return trace.drop(columns="bytes")


def measure_peak(
    model_fn: Callable[[], nn.Module], fmt: Format, batches: list[tuple[torch.Tensor, torch.Tensor]],
    *, in_backward: bool, optimizer: str = "sgd", lr: float = 0.01, device: torch.device | str = "cpu",
    return_timeline: bool = False,
) -> dict | tuple[dict, pd.DataFrame]:
    """Peak tensor bytes of a few training steps: parameters + everything allocated in the steps.

    A fresh optimizer per run, so its state (created at the first step) is inside the metered
    region. Parameters exist before the meter opens and are added from their sizes; gradients,
    optimizer state, activations and temporaries are measured. The record says where the peak
    falls (``peak_phase``: forward / backward / step / end, ``peak_step``, ``peak_op``) and splits
    the peak by category. ``return_timeline`` also returns memory over the steps by category.
    """
    device = torch.device(device)
    model = make_model(model_fn, fmt, device)
    opt = make_optimizer(model.parameters(), fmt, optimizer=optimizer, lr=lr)
    record, timeline = peak_of(model, opt, fmt, batches, in_backward=in_backward, device=device)
    record["analytic_bytes_per_param"] = analytic_bytes_per_param(fmt, optimizer=optimizer, in_backward=in_backward)
    return (record, timeline) if return_timeline else record


def peak_of(model: nn.Module, opt: torch.optim.Optimizer, fmt: Format,
            batches: list[tuple[torch.Tensor, torch.Tensor]], *, in_backward: bool, device: torch.device,
            release: Callable = step_in_backward, name: str | None = None) -> tuple[dict, pd.DataFrame]:
    """`measure_peak`'s record and timeline of a model and optimizer built already (`fmt`: the model's number
    format). ``release(model, opt)`` puts the step into backward where ``in_backward`` (a peer's own way:
    `peers.peer_peak`); ``name`` is the row's ``format`` (default ``fmt.name``)."""
    name = fmt.name if name is None else name
    params = sum(p.numel() for p in model.parameters())
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    meter, marks = _run_metered(model, opt, fmt, batches, in_backward=in_backward, device=device, release=release)
    timeline = _timeline(meter, marks, param_bytes)
    peak = param_bytes + meter.peak_bytes
    at = timeline.loc[timeline["total"].idxmax()]
    record = {
        "format": name, "step_in_backward": in_backward, "params": params,
        "peak_bytes": peak, "peak_bytes_per_param": peak / params, "analytic_bytes_per_param": math.nan,
        "steps": len(batches), "peak_phase": at["phase"], "peak_step": int(at["step"]), "peak_op": at["op"],
        "peak_gradients": int(at["gradients"]), "peak_optimizer_state": int(at["optimizer_state"]),
        "peak_activations_temporaries": int(at["activations_temporaries"]),
    }
    timeline.insert(0, "format", name)
    timeline.insert(1, "step_in_backward", in_backward)
    return record, timeline


def step_timeline(
    model_fn: Callable[[], nn.Module], batches: list[tuple[torch.Tensor, torch.Tensor]], *,
    formats: Iterable[tuple[str, bool]] = (("amp", False), ("fp16+8", True)), optimizer: str = "sgd",
    device: torch.device | str = "cpu", fp16_on_slow_cpu: str = "fp16", fp16_probe: Fp16Probe | None = None,
) -> pd.DataFrame:
    """Fig 2's timeline panels: live memory over the steps by category, one block per
    (format, step in backward) pair; columns as :func:`measure_peak`'s timeline, and ``ran_as`` (the
    format run: the bf16 twin as in :func:`memory_by_format`)."""
    pairs = list(formats)
    plan = plan_formats([parse_format(name) for name, _ in pairs], device=device,
                        fp16_on_slow_cpu=fp16_on_slow_cpu, fp16_probe=fp16_probe)
    frames = []
    for (asked, ran, _), (_, sib) in zip(plan, pairs, strict=True):
        frame = measure_peak(model_fn, ran, batches, in_backward=sib, optimizer=optimizer, device=device,
                             return_timeline=True)[1]
        frames.append(frame.assign(format=asked.name, ran_as=ran.name))
    return pd.concat(frames, ignore_index=True)


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
    in_backward: Iterable[bool] = (False, True), lr: float = 0.01, device: torch.device | str = "cpu",
    progress: bool = True, fp16_on_slow_cpu: str = "fp16", fp16_probe: Fp16Probe | None = None,
) -> pd.DataFrame:
    """Fig 2 / Table 3: peak memory per format, with and/or without the step inside backward.

    Adds ``ratio_vs_amp``: peak / peak of AMP (without step in backward) when AMP is listed.
    ``fp16_on_slow_cpu="bf16"`` runs a format's bf16 twin (same bytes: `dtypes.bf16_twin`) where
    ``fp16_probe`` (None: `workbench.dtype_probe.probe_fp16` of ``device``) finds fp16 slow; "fp16" runs
    what is asked. ``format`` names the format asked for, ``ran_as`` the one run, ``dtype_note`` why.
    """
    fmts = [f if isinstance(f, Format) else parse_format(f) for f in formats]
    plan = plan_formats(fmts, device=device, fp16_on_slow_cpu=fp16_on_slow_cpu, fp16_probe=fp16_probe)
    runs = [(p, sib) for p in plan for sib in in_backward]
    rows = [{**measure_peak(model_fn, ran, batches, in_backward=sib, optimizer=optimizer, lr=lr, device=device),
             "format": asked.name, "ran_as": ran.name, "dtype_note": note}
            for (asked, ran, note), sib in tqdm(runs, desc="memory", disable=not progress)]
    df = pd.DataFrame(rows)
    amp = df[(df["format"] == "amp") & ~df["step_in_backward"]]["peak_bytes"]
    df["ratio_vs_amp"] = df["peak_bytes"] / amp.iloc[0] if len(amp) else float("nan")
    return df


def find_row(df: pd.DataFrame | None, **match) -> pd.Series | None:
    """The first row of ``df`` whose columns equal ``match`` (e.g. ``format="amp"``), or None."""
    if df is None or len(df) == 0 or any(k not in df for k in match):
        return None
    mask = pd.Series(True, index=df.index)
    for key, value in match.items():
        mask &= df[key] == value
    hits = df[mask]
    return None if hits.empty else hits.iloc[0]


def saving_ceiling(df_mem: pd.DataFrame, *, optimizer: str = "sgd", packed: str = "fp16+8") -> float:
    """The largest saving against the measured AMP peak that ``packed`` with the step in backward
    can reach: 1 - (its analytic bytes per parameter) / (AMP's measured peak bytes per parameter).

    The paper's 54% (Fig 2) is against an AMP that holds 14 bytes per parameter at its peak; a
    measured AMP peak below that lowers the ceiling of the saving."""
    amp = find_row(df_mem, format="amp", step_in_backward=False)
    if amp is None:
        return float("nan")
    floor = analytic_bytes_per_param(parse_format(packed), optimizer=optimizer, in_backward=True)
    return 1 - floor / float(amp["peak_bytes_per_param"])
