"""The options every packed optimizer takes, declared, checked and documented once (``PackedOptions``).

Paper: Lewandowski & Kosson, "Memory Efficient Mixed Precision Optimizers", section 3.1: the number
of extra bits kept (16 for bf16 and 13 for fp16 keep "a full fp32 accuracy"; fewer are explored),
stochastic rounding with one more stored bit, and the "Fused" optimizers. ``master_rounding``,
``state_dtype``, ``compile`` and ``seed`` go beyond the paper (see each field).

``PackedSGD``, ``PackedAdamW``, ``PackedAdam`` (and any ``PackedOptimizer``) take these as keyword
arguments after their algorithm's own; :func:`takes_options` spells them out in the constructor's
signature, so ``help()`` and ``inspect.signature`` show them as before.

torch.optim's implementation switches ``foreach``, ``capturable`` and ``differentiable`` are
accepted at torch's defaults (so ``PackedAdamW`` is a drop-in for ``torch.optim.AdamW``) and
refused otherwise, with what to use instead (:data:`TORCH_ONLY`).
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import numbers
from collections.abc import Callable
from typing import Any, ClassVar

import torch

from ..measure_args import check_flag  # re-exported: the packed optimizers' switches

__all__ = ["MASTER_ROUNDING", "STATE_DTYPES", "TORCH_ONLY", "PackedOptions", "check_betas", "check_flag", "check_real",
           "takes_options"]

STATE_DTYPES = (torch.float32, torch.bfloat16, torch.int8)
MASTER_ROUNDING = ("truncate", "stochastic", "nearest")

#: torch.optim keywords the packed optimizers take only at torch's defaults: name -> (allowed values,
#: why not and what to use instead).
TORCH_ONLY: dict[str, tuple[tuple, str]] = {
    "foreach": ((None, False), "the packed optimizers have no multi-tensor (foreach) path; use fused=True "
                "(one flat update over each param group, the fastest step on the device)"),
    "capturable": ((False,), "the packed step reads step counts and the loss scale on the host and cannot be "
                   "captured in a CUDA graph; step outside graph capture, or use torch.optim.AdamW("
                   "capturable=True) on fp32 parameters"),
    "differentiable": ((False,), "the packed step rounds to 16 bits plus packed integer bits, which has no "
                       "gradient; use torch.optim.AdamW/SGD(differentiable=True) on fp32 parameters"),
}


def check_real(name: str, value: Any, *, low: float = 0.0, high: float = math.inf,
               high_open: bool = False) -> None:
    """TypeError for a non-number, ValueError for NaN/inf or a value outside [low, high]."""
    if torch.is_tensor(value) and value.numel() == 1 and value.is_floating_point():
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name}={value!r} must be a real number, got {type(value).__name__}")
    upper_ok = value < high if high_open else value <= high
    if not (math.isfinite(value) and value >= low and upper_ok):
        bracket = ")" if high_open else "]"
        raise ValueError(f"{name}={value!r} out of range: allowed finite values in [{low}, {high}{bracket}")


def check_betas(betas: Any) -> tuple:
    """``betas`` as a tuple of two, or a TypeError naming what was given (a float is not a pair)."""
    if isinstance(betas, (str, bytes)) or not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise TypeError(f"betas={betas!r} must be a pair (beta1, beta2) of numbers in [0, 1), e.g. (0.9, 0.999)")
    return tuple(betas)


@dataclasses.dataclass(frozen=True, kw_only=True)
class PackedOptions:
    """Keyword options of the packed optimizers.

    The first five are per param group: they are the group defaults, and a param-group dict may set
    its own (checked when the group is added, by :meth:`check_group`). ``compile`` and ``seed``
    belong to the optimizer, as do torch's ``foreach``/``capturable``/``differentiable`` (accepted
    only at torch's defaults, see :data:`TORCH_ONLY`).
    """

    #: k, the bits of the fp32 master value kept below the 16-bit parameter: 0..16 for bf16, 0..13
    #: for fp16 (the full width makes the master value exact fp32 inside fp16's normal range).
    extra_bits: int
    #: Round the 16-bit value handed to the model stochastically (unbiased w.r.t. the fp32 value);
    #: one more stored bit per value "un-rounds" it, so the master value is unchanged.
    stochastic_rounding: bool = False
    #: ``"truncate"`` (the paper: the master value is cut to p + k bits every step) or
    #: ``"stochastic"`` (rounded stochastically at its lowest kept bit, so small k stays unbiased) or
    #: ``"nearest"`` (truncate's master value, but the 16-bit value the model sees is rounded to nearest and
    #: the extra bits read as the signed remainder: half the error at the same bytes; k = 0: the 16-bit value
    #: is the update rounded to nearest; not with ``stochastic_rounding``, see ``split_merge``).
    master_rounding: str = "truncate"
    #: dtype of the optimizer states (momentum, moments): torch.float32, or torch.bfloat16 (torch.optim's
    #: own behaviour for bf16 parameters; half the bytes), or torch.int8 (8-bit codes in groups of 32 values
    #: with a bf16 scale each, 1.0625 bytes per value: ``workbench.optim.quantized``; the eager update).
    state_dtype: torch.dtype = torch.float32
    #: One flat update over the whole group ("Fused" in 3.1; see ``workbench.optim.fused``), run by
    #: the fastest step available on the device (``workbench.optim.fused.select_step``).
    fused: bool = False
    #: ``True``: ``torch.compile`` the update (C++ on CPU, Triton on GPU; bit-identical to the eager
    #: update); ``False``: always the eager update; ``None``: the fastest step available for fused
    #: groups (compiled where torch.compile works, else eager), the eager update for the others.
    compile: bool | None = None
    #: Key of the random bits of stochastic rounding; drawn from torch's global generator when None.
    seed: int | None = None
    #: torch.optim's switches, accepted at torch's defaults only (:data:`TORCH_ONLY`).
    foreach: bool | None = None
    capturable: bool = False
    differentiable: bool = False

    GROUP: ClassVar[tuple[str, ...]] = ("extra_bits", "stochastic_rounding", "master_rounding",
                                        "state_dtype", "fused")

    def __post_init__(self) -> None:
        check_flag("stochastic_rounding", self.stochastic_rounding)
        check_flag("fused", self.fused)
        seed = self.seed
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise TypeError(f"seed={seed!r} must be an int or None")
        if self.compile not in (None, True, False):
            raise TypeError(f"compile={self.compile!r} must be True, False or None (the fastest step available)")
        for name, (allowed, instead) in TORCH_ONLY.items():
            value = getattr(self, name)
            if value not in allowed:
                raise ValueError(f"{name}={value!r} is not supported (allowed: "
                                 f"{' or '.join(map(repr, allowed))}): {instead}")

    @classmethod
    def from_keywords(cls, owner: str, keywords: dict[str, Any]) -> PackedOptions:
        """The options among a constructor's ``**keywords``; Python's own errors, naming ``owner``."""
        names = {f.name for f in dataclasses.fields(cls)}
        for name in keywords:
            if name not in names:
                raise TypeError(f"{owner}() got an unexpected keyword argument {name!r}")
        if "extra_bits" not in keywords:
            raise TypeError(f"{owner}() missing 1 required keyword-only argument: 'extra_bits'")
        try:
            return cls(**keywords)
        except ValueError as e:
            raise ValueError(f"{owner.split('.')[0]}: {e}") from None

    def group_defaults(self) -> dict[str, Any]:
        """The per-group options as param-group defaults (flags as bools)."""
        return dict(extra_bits=self.extra_bits, stochastic_rounding=bool(self.stochastic_rounding),
                    master_rounding=self.master_rounding, state_dtype=self.state_dtype, fused=bool(self.fused))

    @staticmethod
    def check_group(group: dict[str, Any]) -> None:
        """Raise for a group's extra_bits, master_rounding or state_dtype outside what is allowed.

        (The range of extra_bits depends on the parameters' dtype: ``formats.check_format``.)
        """
        k = group["extra_bits"]
        if isinstance(k, bool) or not isinstance(k, int):
            raise TypeError(f"extra_bits={k!r} must be an int in 0..16 (bf16) / 0..13 (fp16)")
        for name in ("stochastic_rounding", "fused", "amsgrad", "maximize", "nesterov", "decoupled"):
            if name in group:  # the options, and torch.optim's switches of the algorithms that have them
                check_flag(name, group[name])
        if group["master_rounding"] not in MASTER_ROUNDING:
            raise ValueError(f"master_rounding={group['master_rounding']!r}: allowed {MASTER_ROUNDING}")
        if group["master_rounding"] == "nearest" and group["stochastic_rounding"]:
            raise ValueError("master_rounding='nearest' and stochastic_rounding=True: the 16-bit value is rounded "
                             "either to nearest or stochastically; choose one")
        if group["state_dtype"] not in STATE_DTYPES:
            raise TypeError(f"state_dtype={group['state_dtype']!r}: allowed torch.float32, torch.bfloat16, torch.int8")


def takes_options(init: Callable) -> Callable:
    """Mark ``__init__(self, ..., **options)`` as taking :class:`PackedOptions`' keywords.

    Its signature (``inspect.signature``, ``help()``) then lists each option as a keyword-only
    argument with its default, after the constructor's own arguments.
    """
    sig = inspect.signature(init)
    own = [p for p in sig.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    options = [
        inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, annotation=f.type,
                          default=inspect.Parameter.empty if f.default is dataclasses.MISSING else f.default)
        for f in dataclasses.fields(PackedOptions)
    ]
    init.__signature__ = sig.replace(parameters=[*own, *options])
    return init
