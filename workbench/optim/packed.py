"""PackedSGD / PackedAdamW / PackedAdam: optimizers for fp16/bf16 models without an fp32 master copy.

Paper: Lewandowski & Kosson, "Memory Efficient Mixed Precision Optimizers" (004), section 3.1.
Each parameter is the 16-bit tensor the model uses; the optimizer keeps only the next k bits of
its fp32 value, densely packed (``workbench.optim.bits``). A step merges half + extra bits into the
fp32 master value, applies the ordinary torch.optim update in fp32 and splits the result back,
optionally rounding the 16-bit value stochastically (one more stored bit un-rounds it).

``fused=True`` ("Fused" in 3.1): a group's halves, gradients, extra bits and states live in flat
buffers (each parameter a 32-value-aligned segment, so per-parameter state entries stay views of
them and ``state_dict`` looks the same), and one flat update runs over the whole group. It is
``torch.compile``d (C++ on CPU, Triton on GPU) with ``compile=True``; the eager fallback runs the
same function uncompiled and gives the same result (bit for bit; compiled code reads 16-bit
patterns through exact float conversions, so only NaN payloads could differ).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from copy import deepcopy
from itertools import chain
from typing import Any

import torch

from workbench.optim.bits import (
    SUPPORTED_DTYPES,
    check_format,
    max_extra_bits,
    merge,
    packed_words,
    storage_bits,
)
from workbench.optim.update import adam_math, chunked_update, compiled_update, sgd_math

__all__ = ["PackedOptimizer", "PackedSGD", "PackedAdamW", "PackedAdam", "master_weight"]


# NOTE: the fused path rebinds each ``p.data`` to a view of the group's flat buffer (as apex's
# flat-buffer optimizers do) and gradients are copied into a flat gradient buffer unless they
# already are its views (``zero_grad(set_to_none=False)`` keeps them so). A group where some
# parameter has no gradient takes the per-parameter path, which computes the same update.
class _FlatGroup:
    """Flat buffers of one fused param group; params, grads and states become views into them."""

    def __init__(self, params: list[torch.Tensor], state: dict, keys: list[str], bits: int):
        self.params, self.keys, self.bits = params, keys, bits
        self.offsets, off = [], 0
        for p in params:
            self.offsets.append(off)
            off += (p.numel() + 31) // 32 * 32
        self.total = off
        dev, dtype = params[0].device, params[0].dtype
        self.half = torch.zeros(off, dtype=dtype, device=dev)
        self.grad = torch.zeros(off, dtype=dtype, device=dev)
        self.words = torch.zeros(off * bits // 32, dtype=torch.int32, device=dev)
        self.states = {k: torch.zeros(off, dtype=torch.float32, device=dev) for k in keys}
        for p, o in zip(params, self.offsets, strict=True):
            n, st = p.numel(), state[p]
            view = self.half[o : o + n]
            view.copy_(p.detach().reshape(-1))
            p.data = view.view_as(p)
            for k in keys:
                self.states[k][o : o + n].copy_(st[k].reshape(-1))
                st[k] = self.states[k][o : o + n].view_as(p)
            w = self.words[o * bits // 32 : o * bits // 32 + packed_words(n, bits)]
            w.copy_(st["extra"])
            st["extra"] = w

    def valid(self, state: dict) -> bool:
        for p, o in zip(self.params, self.offsets, strict=True):
            st = state.get(p, {})
            if p.data_ptr() != self.half[o:].data_ptr() or "extra" not in st:
                return False
            if st["extra"].data_ptr() != self.words[o * self.bits // 32 :].data_ptr():
                return False
        return True

    def gather_grads(self) -> None:
        for p, o in zip(self.params, self.offsets, strict=True):
            view = self.grad[o : o + p.numel()]
            if p.grad.data_ptr() != view.data_ptr():
                view.copy_(p.grad.reshape(-1))
                p.grad = view.view_as(p)


class PackedOptimizer(torch.optim.Optimizer):
    """Shared machinery: packed extra bits, per-parameter steps, flat fused steps, state dicts."""

    _state_keys: tuple[str, ...] = ()

    def __init__(
        self,
        params: Iterable,
        defaults: dict[str, Any],
        *,
        extra_bits: int,
        stochastic_rounding: bool = False,
        fused: bool = False,
        compile: bool = False,
        seed: int | None = None,
    ) -> None:
        if isinstance(extra_bits, bool) or not isinstance(extra_bits, int) or extra_bits < 0:
            raise ValueError(f"extra_bits={extra_bits!r} must be an int in 0..16 (bf16) / 0..13 (fp16)")
        for key in ("lr", "weight_decay"):
            if not defaults[key] >= 0.0:
                raise ValueError(f"{key}={defaults[key]} must be >= 0")
        defaults = dict(defaults, extra_bits=extra_bits,
                        stochastic_rounding=bool(stochastic_rounding), fused=bool(fused))
        self.compile = bool(compile)
        self._flat: dict[int, _FlatGroup] = {}
        super().__init__(params, defaults)
        device = self.param_groups[0]["params"][0].device
        self._generator = torch.Generator(device=device)
        if seed is None:
            self._generator.seed()
        else:
            self._generator.manual_seed(seed)

    # ------------------------------------------------------------------ validation and state
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        gi = len(self.param_groups) - 1
        group = self.param_groups[gi]
        for i, p in enumerate(group["params"]):
            if p.dtype not in SUPPORTED_DTYPES:
                raise TypeError(
                    f"parameter {i} of group {gi} (shape {tuple(p.shape)}) has dtype {p.dtype}; "
                    f"{type(self).__name__} needs torch.float16 or torch.bfloat16 parameters"
                )
            check_format(p.dtype, group["extra_bits"])
        if group["fused"] and len({(p.dtype, p.device) for p in group["params"]}) > 1:
            raise ValueError(f"fused=True needs one dtype and device per group; group {gi} mixes them")

    def _init_state(self, p: torch.Tensor, group: dict) -> dict:
        st = self.state[p]
        if "extra" not in st:
            bits = storage_bits(group["extra_bits"], group["stochastic_rounding"])
            # a 16-bit value is exact: its extra bits are zero and it needs no rounding flag
            st["step"] = 0
            st["extra"] = torch.zeros(packed_words(p.numel(), bits), dtype=torch.int32, device=p.device)
            for k in self._state_keys:
                st[k] = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
        return st

    def master_weight(self, p: torch.Tensor) -> torch.Tensor:
        """The fp32 value of parameter ``p`` reconstructed from its 16 bits and extra bits."""
        st = self.state.get(p, {})
        if "extra" not in st:
            return p.detach().float()
        group = self._group_of(p)
        return merge(p.detach(), st["extra"], extra_bits=group["extra_bits"],
                     stochastic_rounding=group["stochastic_rounding"])

    def _group_of(self, p: torch.Tensor) -> dict:
        for g in self.param_groups:
            if any(q is p for q in g["params"]):
                return g
        raise KeyError("parameter is not managed by this optimizer")

    def state_dict(self) -> dict[str, Any]:
        sd = super().state_dict()
        sd["sr_generator_state"] = self._generator.get_state()
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # NOTE: torch's loader casts every state tensor to the parameter's dtype (fp16 here), which
        # would destroy fp32 states and int32 extra bits, so state entries are mapped here as-is.
        sd = dict(state_dict)
        saved_state = sd.pop("state")
        gen = sd.pop("sr_generator_state", None)
        saved_ids = list(chain.from_iterable(g["params"] for g in sd["param_groups"]))
        super().load_state_dict(dict(sd, state={}))
        params = list(chain.from_iterable(g["params"] for g in self.param_groups))
        for pid, p in zip(saved_ids, params, strict=True):
            if pid in saved_state:
                self.state[p] = {
                    k: v.to(p.device).clone() if torch.is_tensor(v) else deepcopy(v)
                    for k, v in saved_state[pid].items()
                }
        if gen is not None:
            self._generator.set_state(gen)
        self._flat.clear()

    # ------------------------------------------------------------------------------ stepping
    def _coef(self, group: dict, step: int, device: torch.device) -> torch.Tensor:
        raise NotImplementedError

    def _options(self, group: dict, step: int) -> dict[str, Any]:
        raise NotImplementedError

    def _math(self) -> Callable:
        raise NotImplementedError

    def _noise(self, n: int, group: dict, dtype: torch.dtype, device) -> torch.Tensor | None:
        if not group["stochastic_rounding"]:
            return None
        return torch.randint(0, 2 ** max_extra_bits(dtype), (n,), dtype=torch.int32,
                             device=device, generator=self._generator)

    @torch.no_grad()
    def step_param(self, p: torch.Tensor, group: dict | None = None) -> None:
        """Update one parameter from its ``.grad`` (used by :func:`step_in_backward`)."""
        group = self._group_of(p) if group is None else group
        st = self._init_state(p, group)
        coef = self._coef(group, st["step"] + 1, p.device)
        bits = storage_bits(group["extra_bits"], group["stochastic_rounding"])
        chunked_update(
            p.view(-1), p.grad.reshape(-1), st["extra"],
            [st[k].view(-1) for k in self._state_keys], coef,
            self._noise(p.numel(), group, p.dtype, p.device),
            bits=bits, math_fn=self._math(), extra_bits=group["extra_bits"],
            stochastic_rounding=group["stochastic_rounding"], options=self._options(group, st["step"]),
        )
        st["step"] += 1

    @torch.no_grad()
    def step(self, closure: Callable | None = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for gi, group in enumerate(self.param_groups):
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            if group["fused"]:
                for p in group["params"]:
                    self._init_state(p, group)
                steps = {self.state[p]["step"] for p in group["params"]}
                if len(params) == len(group["params"]) and len(steps) == 1:
                    self._fused_step(gi, group, steps.pop())
                    continue
                # NOTE: a fused group where some parameters have no gradient (or different step
                # counts after a state load) takes the per-parameter path, which computes the same.
            for p in params:
                self.step_param(p, group)
        return loss

    def _fused_step(self, gi: int, group: dict, step: int) -> None:
        bits = storage_bits(group["extra_bits"], group["stochastic_rounding"])
        flat = self._flat.get(gi)
        if flat is None or not flat.valid(self.state):
            flat = self._flat[gi] = _FlatGroup(group["params"], self.state, list(self._state_keys), bits)
        flat.gather_grads()
        kw = dict(math_fn=self._math(), extra_bits=group["extra_bits"],
                  stochastic_rounding=group["stochastic_rounding"], options=self._options(group, step))
        coef = self._coef(group, step + 1, flat.half.device)
        noise = self._noise(flat.total, group, flat.half.dtype, flat.half.device)
        states = [flat.states[k] for k in self._state_keys]
        if self.compile:
            compiled_update()(flat.half, flat.grad, flat.words, states, coef, noise, **kw)
        else:
            chunked_update(flat.half, flat.grad, flat.words, states, coef, noise, bits=bits, **kw)
        for p in group["params"]:
            self.state[p]["step"] += 1


class PackedSGD(PackedOptimizer):
    """SGD (torch.optim.SGD semantics) on fp16/bf16 parameters plus k packed extra bits."""

    def __init__(
        self,
        params: Iterable,
        lr: float,
        momentum: float = 0.0,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
        *,
        extra_bits: int,
        stochastic_rounding: bool = False,
        fused: bool = False,
        compile: bool = False,
        seed: int | None = None,
    ) -> None:
        if not momentum >= 0.0:
            raise ValueError(f"momentum={momentum} must be >= 0")
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("nesterov needs momentum > 0 and dampening = 0")
        self._state_keys = ("momentum_buffer",) if momentum != 0 else ()
        defaults = dict(lr=lr, momentum=momentum, dampening=dampening,
                        weight_decay=weight_decay, nesterov=nesterov)
        super().__init__(params, defaults, extra_bits=extra_bits, fused=fused, compile=compile,
                         stochastic_rounding=stochastic_rounding, seed=seed)

    def _coef(self, group, step, device):
        vals = [group["lr"], group["weight_decay"], group["momentum"], 1.0 - group["dampening"]]
        return torch.tensor(vals, dtype=torch.float32, device=device)

    def _options(self, group, step):
        return dict(momentum=group["momentum"] != 0, nesterov=group["nesterov"], first=step == 0)

    def _math(self):
        return sgd_math


class PackedAdamW(PackedOptimizer):
    """AdamW (torch.optim.AdamW semantics) on fp16/bf16 parameters plus k packed extra bits.

    ``decoupled=False`` gives Adam (L2 weight decay added to the gradient); see :class:`PackedAdam`.
    """

    _state_keys = ("exp_avg", "exp_avg_sq")

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        extra_bits: int,
        stochastic_rounding: bool = False,
        decoupled: bool = True,
        fused: bool = False,
        compile: bool = False,
        seed: int | None = None,
    ) -> None:
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"betas={betas} must lie in [0, 1)")
        if not eps >= 0.0:
            raise ValueError(f"eps={eps} must be >= 0")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        decoupled=decoupled)
        super().__init__(params, defaults, extra_bits=extra_bits, fused=fused, compile=compile,
                         stochastic_rounding=stochastic_rounding, seed=seed)

    def _coef(self, group, step, device):
        b1, b2 = group["betas"]
        lr, wd = group["lr"], group["weight_decay"]
        vals = [1.0 - lr * wd, wd, 1.0 - b1, b2, 1.0 - b2, math.sqrt(1.0 - b2**step),
                group["eps"], lr / (1.0 - b1**step), b1]
        return torch.tensor(vals, dtype=torch.float32, device=device)

    def _options(self, group, step):
        return dict(decoupled=group["decoupled"])

    def _math(self):
        return adam_math


class PackedAdam(PackedAdamW):
    """Adam (torch.optim.Adam semantics, L2 weight decay) with packed extra bits."""

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        *,
        extra_bits: int,
        stochastic_rounding: bool = False,
        fused: bool = False,
        compile: bool = False,
        seed: int | None = None,
    ) -> None:
        super().__init__(params, lr, betas, eps, weight_decay, extra_bits=extra_bits,
                         stochastic_rounding=stochastic_rounding, decoupled=False, fused=fused,
                         compile=compile, seed=seed)


def master_weight(optimizer: PackedOptimizer, p: torch.Tensor) -> torch.Tensor:
    """Function form of :meth:`PackedOptimizer.master_weight`."""
    return optimizer.master_weight(p)
