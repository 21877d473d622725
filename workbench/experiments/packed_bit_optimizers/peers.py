"""Side by side with other low-memory optimizers, on the same model and data.

Context: Lewandowski & Kosson, "Memory Efficient Mixed Precision Optimizers" (section 3.1) keep a
16-bit weight plus k packed extra bits instead of an fp32 master copy. Other ways to train 16-bit
weights without drift: stochastic rounding of bf16 weights (torchao's ``_AdamW(bf16_stochastic_round=True)``),
Kahan-compensated bf16 updates (torch-optimi's ``AdamW(kahan_sum=True)``), keeping fp32 weights
and shrinking the state instead (bitsandbytes' 8-bit AdamW), or 8-bit moments with a bf16 weight and an
8-bit error term (FlashOptim's ``FlashAdamW``: CUDA only; on a CPU only its plain bf16 path runs). Every
method runs AdamW with the same hyper-parameters; rows: torch fp32, AMP, torch bf16, the peers and ours at k
extra bits with fp32 or bf16 moments. A peer that is not installed, or an option this build lacks, is a row that
says so.

Measured per method: bytes per parameter held between steps (weights + gradients + optimizer
state, every storage counted once, after a real step), optimizer-step time (steps interleaved
round by round, median and spread), and test accuracy at a small learning rate over several seeds.
"""

from __future__ import annotations

import statistics
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import pandas as pd
import torch
from torch import nn
from tqdm.auto import tqdm

from workbench.data import ImageSet, make_loader
from workbench.measure import state_bytes, time_interleaved
from workbench.optim import step_in_backward
from workbench.train import train

from .peak_memory import _loss, make_model, make_optimizer, parse_format, peak_of
from .peer_import import import_peer
from .step_times import step_of

__all__ = ["PEER_METHODS", "PeerUnavailable", "peer_methods", "make_peer", "peer_label", "peer_peak", "peer_step",
           "peer_table"]


class PeerUnavailable(RuntimeError):
    """A method that cannot run here (library not installed, option missing in this build)."""


@dataclass(frozen=True)
class _Method:
    name: str
    library: str  # import name of the package providing the optimizer ("torch", "torchao", ...)
    fmt: str  # parse_format name of the model's number format
    extra_bits: int | None = None
    state_dtype: str = "fp32"
    sgd: str | None = None  # its row's name with SGD (momentum 0.9) instead of AdamW; None: no SGD set up here


# FlashOptim's own format (bf16 weights rounded to nearest + an 8-bit error term, int8 moments in groups of 32) and
# the one path its constructor allows on a CPU (bf16 weights and moments, no error bits, unfused): the first is a
# row that says "unavailable: CUDA only" there, never a gap
FLASH = "FlashOptim FlashAdamW (24-bit master, 8-bit moments)"
FLASH_PLAIN = "FlashOptim FlashAdamW, its CPU path (bf16 moments, no error bits, unfused)"


def _ours(k: int, state: str) -> _Method:
    name = f"ours bf16+{k} ({state} states)"
    return _Method(name, "workbench", f"bf16+{k}", k, state, sgd=name)


_METHODS = {m.name: m for m in [
    _Method("torch fp32", "torch", "fp32", sgd="torch fp32"),
    _Method("AMP (fp32 + fp16 autocast)", "torch", "amp", sgd="AMP (fp32 + fp16 autocast)"),
    _Method("torch bf16", "torch", "bf16", sgd="torch bf16"),
    _Method("torchao bf16 + SR", "torchao", "bf16"),
    _Method("optimi bf16 + Kahan", "optimi", "bf16"),
    _Method("bitsandbytes 8-bit AdamW", "bitsandbytes", "fp32"),
    _Method(FLASH, "flashoptim", "bf16", sgd="FlashOptim FlashSGD (24-bit master, 8-bit momentum)"),
    _Method(FLASH_PLAIN, "flashoptim", "bf16", sgd="FlashOptim FlashSGD, its CPU path (bf16 momentum, no error bits, "
                                                   "unfused)"),
    *[_ours(k, s) for s in ("fp32", "bf16") for k in (0, 4, 8, 16)],
]}
PEER_METHODS = tuple(_METHODS)


def peer_methods(text: str | Iterable[str] = "all") -> list[str]:
    """Method names from a comma-separated list (or 'all'); unknown names raise ValueError."""
    names = [s.strip() for s in text.split(",")] if isinstance(text, str) else list(text)
    names = [n for n in names if n]
    if names == ["all"]:
        return list(PEER_METHODS)
    bad = [n for n in names if n not in _METHODS]
    if bad:
        raise ValueError(f"unknown method(s) {bad}; allowed: {', '.join(PEER_METHODS)} (or 'all')")
    return names


def _version(library: str) -> str:
    try:
        return str(import_peer(library).__version__)
    except Exception:  # noqa: BLE001 - a library that does not import has no version here
        return ""


def make_peer(
    name: str, params: Iterable[torch.Tensor], *, lr: float, weight_decay: float = 0.0, seed: int = 0,
    compile: bool = False, optimizer: str = "adamw",
) -> torch.optim.Optimizer:
    """The AdamW optimizer of method ``name`` (betas 0.9/0.999, eps 1e-8 for every method), or with
    ``optimizer="sgd"`` its SGD with momentum 0.9 (Table 3's optimizer: torch's, ours and FlashOptim's).

    Raises ``PeerUnavailable`` when its library is not installed or this build lacks the option.
    """
    if name not in _METHODS:
        raise ValueError(f"unknown method {name!r}; allowed: {', '.join(PEER_METHODS)}")
    if optimizer not in ("adamw", "sgd"):
        raise ValueError(f"optimizer={optimizer!r}: allowed 'adamw' or 'sgd'")
    m = _METHODS[name]
    if optimizer == "sgd" and m.sgd is None:
        raise PeerUnavailable(f"{m.library}: only its AdamW is set up here")
    common = dict(lr=lr, weight_decay=weight_decay, **(dict(momentum=0.9) if optimizer == "sgd" else
                                                       dict(betas=(0.9, 0.999), eps=1e-8)))
    if m.library == "torch":
        return (torch.optim.SGD if optimizer == "sgd" else torch.optim.AdamW)(params, **common)
    if m.library == "workbench":
        try:
            return make_optimizer(params, parse_format(m.fmt), optimizer=optimizer, lr=lr, weight_decay=weight_decay,
                                  fused=True, compile=compile, seed=seed,
                                  state_dtype=torch.bfloat16 if m.state_dtype == "bf16" else None)
        except NotImplementedError as exc:
            raise PeerUnavailable(f"not available in this build ({exc})") from exc
    try:
        lib = import_peer(m.library)
    except ImportError as exc:
        raise PeerUnavailable(f"{m.library} is not installed (pip install 'workbench[peers]')") from exc
    if m.library == "torchao":
        return import_peer("torchao.optim")._AdamW(params, **common, bf16_stochastic_round=True)
    if m.library == "optimi":
        return lib.AdamW(params, **common, kahan_sum=True)
    if m.library == "flashoptim":
        options = dict(quantize=True, master_weight_bits=24, fused=True) if name == FLASH else dict(
            quantize=False, master_weight_bits=None, fused=False)
        try:
            with warnings.catch_warnings():  # its CPU path warns that it is plain low-precision training: the row says
                warnings.simplefilter("ignore", UserWarning)
                return (lib.FlashSGD if optimizer == "sgd" else lib.FlashAdamW)(params, **common, **options)
        except NotImplementedError as exc:  # "Quantization requires a CUDA device."
            raise PeerUnavailable(f"unavailable: CUDA only ({exc})") from exc
    # NOTE: bitsandbytes keeps small tensors (< 4096 values) in 32-bit state by default; the
    # threshold is left as shipped, so small layers' state shows up in the measured bytes.
    return lib.optim.AdamW8bit(params, **common)


def _release(name: str) -> Callable:
    """How method ``name`` puts its step into backward: FlashOptim's own gradient release, else
    `workbench.optim.step_in_backward` (torch's optimizers, ours)."""
    if _METHODS[name].library == "flashoptim":
        return import_peer("flashoptim").enable_gradient_release
    return step_in_backward


def peer_peak(name: str, model_fn: Callable[[], nn.Module], batches: list[tuple[torch.Tensor, torch.Tensor]], *,
              in_backward: bool, optimizer: str = "adamw", lr: float, device: torch.device | str = "cpu") -> dict:
    """`peak_memory.measure_peak`'s record for method ``name`` in its own format, the step in backward its own
    way (`_release`); ``format`` is `peer_label`'s. Raises ``PeerUnavailable`` where it cannot run here."""
    model, opt, fmt = _build(name, model_fn, lr=lr, device=device, optimizer=optimizer)
    return peak_of(model, opt, fmt, batches, in_backward=in_backward, device=torch.device(device),
                   release=_release(name), name=peer_label(name, optimizer))[0]


def peer_label(name: str, optimizer: str = "adamw") -> str:
    """Method ``name``'s row name for ``optimizer`` (its SGD form's name, e.g. FlashOptim's FlashSGD)."""
    return (_METHODS[name].sgd or name) if optimizer == "sgd" else name


def peer_step(name: str, model_fn: Callable[[], nn.Module], batch: tuple[torch.Tensor, torch.Tensor], *,
              in_backward: bool, optimizer: str = "adamw", lr: float, device: torch.device | str = "cpu"
              ) -> tuple[Callable[[], None], object]:
    """``(step, handle)``: one training step of method ``name`` (as `step_times`' steps of a format, the step in
    backward its own way). Raises ``PeerUnavailable`` where it cannot run here."""
    model, opt, fmt = _build(name, model_fn, lr=lr, device=device, optimizer=optimizer)
    return step_of(model, opt, fmt, batch, in_backward=in_backward, device=device, release=_release(name))


def _build(name, model_fn, *, lr, device, weight_decay=0.0, seed=0, compile=False, optimizer="adamw"):
    """(model in method ``name``'s format on ``device``, its optimizer, the format), seeded by ``seed``."""
    torch.manual_seed(seed)
    fmt = parse_format(_METHODS[name].fmt)
    model = make_model(model_fn, fmt, device)
    return model, make_peer(name, model.parameters(), lr=lr, weight_decay=weight_decay, seed=seed,
                            compile=compile, optimizer=optimizer), fmt


def peer_table(
    model_fn: Callable[[], nn.Module], train_set: ImageSet, test_set: ImageSet, *,
    methods: Iterable[str] = PEER_METHODS, lr: float = 1e-4, weight_decay: float = 0.0, epochs: int = 3,
    batch_size: int = 64, seeds: Iterable[int] = (0, 1, 2), repeats: int = 10, compile: bool = False,
    device: torch.device | str = "cpu", progress: bool = True,
) -> pd.DataFrame:
    """One row per method: availability, bytes/param (weights + grads + state), optimizer-step
    time, and accuracy over ``seeds`` at learning rate ``lr``.

    Step times: every available method's ``step()`` on the gradients of one real batch, the
    methods interleaved round by round; ``speed_vs_torch_fp32`` is torch fp32's median over the
    method's median, ``*_lo``/``*_hi`` the paired per-round extremes.
    """
    device = torch.device(device)
    names, seeds = peer_methods(list(methods)), list(seeds)
    if not seeds or epochs < 1 or repeats < 1:
        raise ValueError(f"need seeds, epochs >= 1 and repeats >= 1; got seeds={seeds}, epochs={epochs}, "
                         f"repeats={repeats}")
    x, y = next(iter(make_loader(train_set, batch_size, shuffle=True, seed=seeds[0])))
    rows, steps = {}, {}
    for name in names:
        m = _METHODS[name]
        row = {"method": name, "library": m.library, "version": _version(m.library), "format": m.fmt,
               "extra_bits": m.extra_bits, "state_dtype": m.state_dtype, "available": True, "note": ""}
        try:
            model, opt, fmt = _build(name, model_fn, lr=lr, weight_decay=weight_decay, seed=seeds[0],
                                     compile=compile, device=device)
        except PeerUnavailable as exc:
            rows[name] = {**row, "available": False, "note": str(exc)}
            continue
        _loss(model, x.to(device), y.to(device), fmt).backward()
        opt.step()  # state exists after a step; gradients are still held
        sizes = state_bytes(model, opt)
        params = sum(p.numel() for p in model.parameters())
        row.update(params=params, weight_bytes_per_param=sizes["parameters"] / params,
                   grad_bytes_per_param=sizes["gradients"] / params,
                   state_bytes_per_param=sizes["optimizer_state"] / params)
        row["bytes_per_param"] = sum(sizes.values()) / params
        rows[name] = row
        steps[name] = opt.step
    if steps:
        times = time_interleaved(steps, warmup=2, repeats=repeats, device=device, progress=progress,
                                 desc="optimizer steps")
        base = times.get("torch fp32")
        for name, t in times.items():
            med = statistics.median(t)
            rows[name].update(step_median_s=med, step_min_s=min(t), step_max_s=max(t),
                              params_per_s=rows[name]["params"] / med)
            if base is not None:
                per_round = [b / a for a, b in zip(t, base, strict=True)]
                rows[name].update(speed_vs_torch_fp32=statistics.median(base) / med,
                                  speed_vs_torch_fp32_lo=min(per_round), speed_vs_torch_fp32_hi=max(per_round))
    accs = _accuracy(model_fn, train_set, test_set, [n for n in names if rows[n]["available"]], lr=lr,
                     weight_decay=weight_decay, epochs=epochs, batch_size=batch_size, seeds=seeds,
                     compile=compile, device=device, progress=progress)
    for name, vals in accs.items():
        acc = [100 * a for a, _ in vals]
        rows[name].update(acc_mean=statistics.fmean(acc), acc_min=min(acc), acc_max=max(acc),
                          train_loss_mean=statistics.fmean(loss for _, loss in vals), seeds=len(vals))
    df = pd.DataFrame([rows[n] for n in names])
    df["lr"], df["epochs"], df["device"] = lr, epochs, str(device)
    return df


def _accuracy(model_fn, train_set, test_set, names, *, lr, weight_decay, epochs, batch_size, seeds, compile,
              device, progress) -> dict[str, list[tuple[float, float]]]:
    out: dict[str, list[tuple[float, float]]] = {n: [] for n in names}
    test_loader = make_loader(test_set, 256, shuffle=False)
    for seed in seeds:
        for name in tqdm(names, desc=f"peers, seed {seed}", disable=not progress, leave=False):
            model, opt, fmt = _build(name, model_fn, lr=lr, weight_decay=weight_decay, seed=seed,
                                     compile=compile, device=device)
            loader = make_loader(train_set, batch_size, shuffle=True, seed=seed)
            hist = train(model, loader, epochs=epochs, optimizer=opt, device=device, test_loader=test_loader,
                         autocast_dtype=fmt.autocast, progress=False,
                         loss_fn=lambda logits, t: nn.functional.cross_entropy(logits.float(), t))
            out[name].append((float(hist["test_acc"].iloc[-1]), float(hist["loss"].iloc[-1])))
    return out
