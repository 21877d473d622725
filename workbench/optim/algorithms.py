"""PackedSGD / PackedAdamW / PackedAdam: torch.optim's SGD, AdamW and Adam on fp16/bf16 parameters plus k
packed extra bits, without an fp32 master copy.

Paper: Lewandowski & Kosson, "Memory Efficient Mixed Precision Optimizers", section 3.1 ("we provide an
implementation for classic optimizers (Adam and SGD) to use transparently on a fp16 or bf16 model"). Each
class states its algorithm (hyperparameters, states, the update's coefficients and options); the packed
machinery they share (extra bits, fused flat steps, state dicts) is ``workbench.optim.packed.PackedOptimizer``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch

from workbench.optim.options import check_betas, check_real, takes_options
from workbench.optim.packed import PackedOptimizer
from workbench.optim.update import adam_math, sgd_math

__all__ = ["PackedSGD", "PackedAdamW", "PackedAdam", "master_weight"]


class PackedSGD(PackedOptimizer):
    """SGD (torch.optim.SGD semantics) on fp16/bf16 parameters plus k packed extra bits.

    The momentum buffer (in groups with momentum) is kept in ``state_dtype``. Keyword options
    (``extra_bits`` required): :class:`PackedOptions`.
    """

    @takes_options
    def __init__(self, params: Iterable, lr: float, momentum: float = 0.0, dampening: float = 0.0,
                 weight_decay: float = 0.0, nesterov: bool = False, *, maximize: bool = False,
                 **options: Any) -> None:
        defaults = dict(lr=lr, momentum=momentum, dampening=dampening,
                        weight_decay=weight_decay, nesterov=nesterov, maximize=maximize)
        super().__init__(params, defaults, **options)

    def _check_group(self, group):
        check_real("momentum", group["momentum"])
        check_real("dampening", group["dampening"])
        if group["nesterov"] and (group["momentum"] <= 0 or group["dampening"] != 0):
            raise ValueError("nesterov needs momentum > 0 and dampening = 0")

    def _state_keys(self, group):
        # NOTE: per group, as torch.optim.SGD: a group may set momentum when the default has none.
        return ("momentum_buffer",) if group["momentum"] != 0 else ()

    def _coef_values(self, group, step):
        return [group["lr"], group["weight_decay"], group["momentum"], 1.0 - group["dampening"]]

    def _options(self, group, step):
        return dict(momentum=group["momentum"] != 0, nesterov=group["nesterov"], first=step == 0,
                    maximize=bool(group.get("maximize", False)))

    def _math(self):
        return sgd_math


class PackedAdamW(PackedOptimizer):
    """AdamW (torch.optim.AdamW semantics) on fp16/bf16 parameters plus k packed extra bits.

    ``decoupled=False`` gives Adam (L2 weight decay added to the gradient); see :class:`PackedAdam`.
    ``state_dtype=torch.bfloat16`` keeps both moments in bf16 (4 instead of 8 bytes per parameter),
    ``torch.int8`` in 8-bit codes with a bf16 scale per 32 values (2.125 bytes; ``workbench.optim.quantized``).
    ``amsgrad=True`` keeps the running max of the second moment as a third state (``max_exp_avg_sq``,
    4 more bytes per parameter in fp32); ``maximize=True`` ascends. Keyword options (``extra_bits``
    required): :class:`PackedOptions`.
    """

    @takes_options
    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, amsgrad: bool = False, *,
                 maximize: bool = False, decoupled: bool = True, **options: Any) -> None:
        defaults = dict(lr=lr, betas=check_betas(betas), eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                        maximize=maximize, decoupled=decoupled)
        super().__init__(params, defaults, **options)

    def _check_group(self, group):
        betas = check_betas(group["betas"])
        for i, b in enumerate(betas):
            try:
                check_real(f"betas[{i}]", b, high=1.0, high_open=True)
            except ValueError as e:
                raise ValueError(f"betas={betas} must lie in [0, 1): {e}") from None
        check_real("eps", group["eps"])

    def _state_keys(self, group):
        return ("exp_avg", "exp_avg_sq", "max_exp_avg_sq") if group.get("amsgrad") else ("exp_avg", "exp_avg_sq")

    def _coef_values(self, group, step):
        b1, b2 = group["betas"]
        lr, wd = group["lr"], group["weight_decay"]
        return [1.0 - lr * wd, wd, 1.0 - b1, b2, 1.0 - b2, math.sqrt(1.0 - b2**step),
                group["eps"], lr / (1.0 - b1**step), b1]

    def _options(self, group, step):
        return dict(decoupled=group["decoupled"], amsgrad=bool(group.get("amsgrad", False)),
                    maximize=bool(group.get("maximize", False)))

    def _math(self):
        return adam_math


class PackedAdam(PackedAdamW):
    """Adam (torch.optim.Adam semantics, L2 weight decay) with packed extra bits.

    Keyword options (``extra_bits`` required): :class:`PackedOptions`.
    """

    @takes_options
    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, amsgrad: bool = False, *,
                 maximize: bool = False, **options: Any) -> None:
        # NOTE: past PackedAdamW's constructor, which takes ``decoupled``: Adam refuses it as an
        # unknown keyword, as before.
        defaults = dict(lr=lr, betas=check_betas(betas), eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                        maximize=maximize, decoupled=False)
        PackedOptimizer.__init__(self, params, defaults, **options)


def master_weight(optimizer: PackedOptimizer, p: torch.Tensor) -> torch.Tensor:
    """Function form of :meth:`PackedOptimizer.master_weight`."""
    return optimizer.master_weight(p)
