"""PackedSGD / PackedAdamW / PackedAdam: optimizers for fp16/bf16 models without an fp32 master copy.

Paper: Lewandowski & Kosson, "Memory Efficient Mixed Precision Optimizers", section 3.1.
Each parameter is the 16-bit tensor the model uses; the optimizer keeps only the next k bits of
its fp32 value (``workbench.optim.bits``: dense int32 words, or uint8 byte planes when the stored
width is 8 or 16 bits). A step merges half + extra bits into the fp32 master value, applies the
ordinary torch.optim update in fp32 and splits the result back, optionally rounding the 16-bit
value stochastically (one more stored bit un-rounds it).

Options beyond the paper: ``state_dtype=torch.bfloat16`` keeps the moments in bf16 (torch.optim's
own behaviour for bf16 parameters), ``master_rounding="stochastic"`` rounds the kept master value
stochastically at its lowest kept bit instead of truncating it (small k then stays unbiased).

``fused=True`` ("Fused" in 3.1): a group's halves, extra bits and states live in flat buffers
(each parameter a 32-value-aligned segment, so per-parameter state entries stay views of them and
``state_dict`` looks the same), and one flat update runs over the whole group. It is
``torch.compile``d (C++ on CPU, Triton on GPU) with ``compile=True``; the eager fallback runs the
same function uncompiled and gives the same result (bit for bit; compiled code reads 16-bit
patterns through exact float conversions, so only NaN payloads could differ). With
``compile=True`` the per-parameter step (used by ``step_in_backward``) is compiled too, with
dynamic shapes, so one kernel per format serves every parameter size.
"""

from __future__ import annotations

import math
import numbers
import weakref
from collections.abc import Callable, Iterable
from copy import deepcopy
from itertools import chain
from typing import Any

import torch

from workbench.optim.bits import (
    SUPPORTED_DTYPES,
    check_format,
    extra_storage,
    merge,
    mix_key,
    storage_bits,
)
from workbench.optim.update import adam_math, chunked_update, compiled_update, sgd_math

__all__ = ["PackedOptimizer", "PackedSGD", "PackedAdamW", "PackedAdam", "master_weight"]

STATE_DTYPES = (torch.float32, torch.bfloat16)
MASTER_ROUNDING = ("truncate", "stochastic")
_GOLDEN = 0x9E3779B1


def _check_real(name: str, value: Any, *, low: float = 0.0, high: float = math.inf,
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


def _shift_key(key: int, offset: int) -> int:
    """The key whose stream at index i equals ``key``'s stream at index offset + i."""
    k = (key + offset * _GOLDEN) & 0xFFFFFFFF
    return k - (1 << 32) if k >= 1 << 31 else k


def _extra_arg(extra: torch.Tensor) -> torch.Tensor | list[torch.Tensor]:
    """Byte planes go to the update as separate 1-D views (one vectorised loop); words as they are."""
    return list(extra.unbind(0)) if extra.dtype == torch.uint8 else extra


# NOTE: the fused path rebinds each ``p.data`` to a view of the group's flat buffer (as apex's
# flat-buffer optimizers do). Gradients are copied into a flat gradient buffer unless they already
# are its views (``zero_grad(set_to_none=False)`` keeps them so); the optimizer holds that buffer
# only weakly, so ``zero_grad(set_to_none=True)`` frees it with the gradients. A group where some
# parameter has no gradient takes the per-parameter path, which computes the same update.
class _FlatGroup:
    """Flat buffers of one fused param group; params, grads and states become views into them."""

    def __init__(self, params: list[torch.Tensor], state: dict, keys: list[str], bits: int,
                 state_dtype: torch.dtype):
        self.params, self.keys, self.bits = params, keys, bits
        self.offsets, off = [], 0
        for p in params:
            self.offsets.append(off)
            off += (p.numel() + 31) // 32 * 32
        self.total = off
        dev, dtype = params[0].device, params[0].dtype
        self.half = torch.zeros(off, dtype=dtype, device=dev)
        shape, edtype = extra_storage(off, bits, aligned=True)
        self.extra = torch.zeros(shape, dtype=edtype, device=dev)
        self.states = {k: torch.zeros(off, dtype=state_dtype, device=dev) for k in keys}
        self._grad: weakref.ref | None = None
        for p, o in zip(params, self.offsets, strict=True):
            n, st = p.numel(), state[p]
            view = self.half[o : o + n]
            view.copy_(p.detach().reshape(-1))
            p.data = view.view_as(p)
            for k in keys:
                self.states[k][o : o + n].copy_(st[k].reshape(-1))
                st[k] = self.states[k][o : o + n].view_as(p)
            seg = self._extra_view(o, n)
            seg.copy_(st["extra"])
            st["extra"] = seg
        # data pointers every view must keep; checked each step in plain integers (cheap)
        self._expect = [
            (p, self.half[o:].data_ptr(), state[p]["extra"].data_ptr(),
             tuple(self.states[k][o:].data_ptr() for k in keys))
            for p, o in zip(params, self.offsets, strict=True)
        ]
        self._item = self.half.element_size()

    def _extra_view(self, o: int, n: int) -> torch.Tensor:
        if self.extra.dtype == torch.uint8:
            return self.extra[:, o : o + n]
        ws = o * self.bits // 32
        return self.extra[ws : ws + (n * self.bits + 31) // 32]

    def valid(self, state: dict) -> bool:
        for p, hp, ep, sps in self._expect:
            st = state.get(p)
            if st is None or p.data_ptr() != hp or "extra" not in st or st["extra"].data_ptr() != ep:
                return False
            if any(st[k].data_ptr() != sp for k, sp in zip(self.keys, sps, strict=True)):
                return False
        return True

    def gather_grads(self) -> torch.Tensor:
        """The flat gradient: reused when every ``.grad`` is still its view, else copied into a new one."""
        buf = self._grad() if self._grad is not None else None
        if buf is not None:
            base = buf.data_ptr()
            if all(p.grad.data_ptr() == base + o * self._item
                   for p, o in zip(self.params, self.offsets, strict=True)):
                return buf
        buf = torch.empty(self.total, dtype=self.half.dtype, device=self.half.device)
        end = 0
        for p, o in zip(self.params, self.offsets, strict=True):
            buf[end:o].zero_()  # padding between segments: a defined value, never read back
            view = buf[o : o + p.numel()]
            view.copy_(p.grad.reshape(-1))
            p.grad = view.view_as(p)
            end = o + p.numel()
        buf[end:].zero_()
        self._grad = weakref.ref(buf)
        return buf


class PackedOptimizer(torch.optim.Optimizer):
    """Shared machinery: packed extra bits, per-parameter steps, flat fused steps, state dicts."""

    def __init__(
        self,
        params: Iterable,
        defaults: dict[str, Any],
        *,
        extra_bits: int,
        stochastic_rounding: bool = False,
        master_rounding: str = "truncate",
        state_dtype: torch.dtype = torch.float32,
        fused: bool = False,
        compile: bool = False,
        seed: int | None = None,
    ) -> None:
        defaults = dict(defaults, extra_bits=extra_bits, stochastic_rounding=bool(stochastic_rounding),
                        master_rounding=master_rounding, state_dtype=state_dtype, fused=bool(fused))
        self.compile = bool(compile)
        self._flat: dict[int, _FlatGroup] = {}
        self._index: dict[int, tuple[int, int]] = {}  # id(param) -> (group index, flat offset)
        self._coef_cache: dict[int, tuple[Any, torch.Tensor]] = {}
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise TypeError(f"seed={seed!r} must be an int or None")
        # NOTE: the random bits of stochastic rounding are a hash of (seed, group, step, position),
        # so the seed (drawn from torch's global generator when not given) is the whole RNG state.
        self.seed = int(torch.randint(0, 2**31 - 1, ()).item()) if seed is None else seed
        super().__init__(params, defaults)

    # ------------------------------------------------------------------ validation and state
    def _check_group(self, group: dict[str, Any]) -> None:
        """Per-group option checks (subclasses add theirs)."""

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        gi = len(self.param_groups) - 1
        group = self.param_groups[gi]
        try:
            for key in ("lr", "weight_decay"):
                _check_real(key, group[key])
            k = group["extra_bits"]
            if isinstance(k, bool) or not isinstance(k, int):
                raise TypeError(f"extra_bits={k!r} must be an int in 0..16 (bf16) / 0..13 (fp16)")
            if group["master_rounding"] not in MASTER_ROUNDING:
                raise ValueError(f"master_rounding={group['master_rounding']!r}: allowed {MASTER_ROUNDING}")
            if group["state_dtype"] not in STATE_DTYPES:
                raise TypeError(f"state_dtype={group['state_dtype']!r}: allowed torch.float32, torch.bfloat16")
            for i, p in enumerate(group["params"]):
                if p.dtype not in SUPPORTED_DTYPES:
                    raise TypeError(
                        f"parameter {i} of group {gi} (shape {tuple(p.shape)}) has dtype {p.dtype}; "
                        f"{type(self).__name__} needs torch.float16 or torch.bfloat16 parameters"
                    )
                check_format(p.dtype, k)
            if group["fused"] and len({(p.dtype, p.device) for p in group["params"]}) > 1:
                raise ValueError(f"fused=True needs one dtype and device per group; group {gi} mixes them")
            self._check_group(group)
        except (TypeError, ValueError):
            self.param_groups.pop()
            raise
        self._index_group(gi)

    def _index_group(self, gi: int) -> None:
        off = 0
        for p in self.param_groups[gi]["params"]:
            self._index[id(p)] = (gi, off)
            off += (p.numel() + 31) // 32 * 32

    def _locate(self, p: torch.Tensor) -> tuple[dict, int, int]:
        """(group, group index, offset in the group's flat stream) of ``p``: a dict lookup."""
        hit = self._index.get(id(p))
        if hit is None or hit[0] >= len(self.param_groups):
            self._index.clear()  # param_groups were edited by hand: rebuild once
            for gi in range(len(self.param_groups)):
                self._index_group(gi)
            hit = self._index.get(id(p))
            if hit is None:
                raise KeyError("parameter is not managed by this optimizer")
        return self.param_groups[hit[0]], hit[0], hit[1]

    def _group_of(self, p: torch.Tensor) -> dict:
        return self._locate(p)[0]

    def _state_keys(self, group: dict) -> tuple[str, ...]:
        raise NotImplementedError

    def _bits(self, group: dict) -> int:
        return storage_bits(group["extra_bits"], group["stochastic_rounding"])

    def _init_state(self, p: torch.Tensor, group: dict) -> dict:
        st = self.state[p]
        if "extra" not in st:
            # a 16-bit value is exact: its extra bits are zero and it needs no rounding flag
            shape, dtype = extra_storage(p.numel(), self._bits(group), aligned=True)
            st["step"] = 0
            st["extra"] = torch.zeros(shape, dtype=dtype, device=p.device)
        for k in self._state_keys(group):
            if k not in st:
                st[k] = torch.zeros(p.shape, dtype=group["state_dtype"], device=p.device)
        return st

    def master_weight(self, p: torch.Tensor) -> torch.Tensor:
        """The fp32 value of parameter ``p`` reconstructed from its 16 bits and extra bits."""
        st = self.state.get(p, {})
        if "extra" not in st:
            return p.detach().float()
        group = self._group_of(p)
        return merge(p.detach(), st["extra"], extra_bits=group["extra_bits"],
                     stochastic_rounding=group["stochastic_rounding"])

    def state_dict(self) -> dict[str, Any]:
        sd = super().state_dict()
        sd["sr_seed"] = self.seed
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # NOTE: torch's loader casts every state tensor to the parameter's dtype (fp16 here), which
        # would destroy fp32 states and integer extra bits, so state entries are mapped here as-is.
        sd = dict(state_dict)
        saved_state = sd.pop("state")
        seed = sd.pop("sr_seed", None)
        saved_ids = list(chain.from_iterable(g["params"] for g in sd["param_groups"]))
        super().load_state_dict(dict(sd, state={}))
        params = list(chain.from_iterable(g["params"] for g in self.param_groups))
        for pid, p in zip(saved_ids, params, strict=True):
            if pid in saved_state:
                self.state[p] = {
                    k: v.to(p.device).clone() if torch.is_tensor(v) else deepcopy(v)
                    for k, v in saved_state[pid].items()
                }
        if seed is not None:
            self.seed = int(seed)
        self._flat.clear()
        self._coef_cache.clear()
        self._index.clear()
        for gi in range(len(self.param_groups)):
            self._index_group(gi)

    # ------------------------------------------------------------------------------ stepping
    def _coef_values(self, group: dict, step: int) -> list[float]:
        raise NotImplementedError

    def _options(self, group: dict, step: int) -> dict[str, Any]:
        raise NotImplementedError

    def _math(self) -> Callable:
        raise NotImplementedError

    def _coef(self, group: dict, step: int, device: torch.device) -> torch.Tensor:
        """The group's update coefficients as an fp32 tensor, rebuilt only when they change."""
        vals = self._coef_values(group, step)
        hit = self._coef_cache.get(id(group))
        if hit is not None and hit[0] == (vals, device):
            return hit[1]
        coef = torch.tensor(vals, dtype=torch.float32, device=device)
        self._coef_cache[id(group)] = ((vals, device), coef)
        return coef

    def _random(self, group: dict) -> bool:
        return group["stochastic_rounding"] or group["master_rounding"] == "stochastic"

    def _kwargs(self, group: dict, step: int) -> dict[str, Any]:
        return dict(math_fn=self._math(), extra_bits=group["extra_bits"],
                    stochastic_rounding=group["stochastic_rounding"],
                    master_rounding=group["master_rounding"], options=self._options(group, step))

    def _compiled(self, group: dict, step: int, dtype: torch.dtype, device: torch.device, *,
                  dynamic: bool) -> Callable:
        # math_fn and options in the kwargs tell SGD, Adam and AdamW apart; the dtypes do the rest
        return compiled_update(dynamic=dynamic, device_type=device.type, key=(dtype, group["state_dtype"]),
                               **self._kwargs(group, step))

    def _mark_stepped(self) -> None:
        # NOTE: LR schedulers check this flag (set by their wrapper of ``step``) to warn about a
        # scheduler step before any optimizer step; updates inside backward never call ``step``.
        self._opt_called = True

    @torch.no_grad()
    def step_param(self, p: torch.Tensor, group: dict | None = None) -> None:
        """Update one parameter from its ``.grad`` (used by :func:`step_in_backward`)."""
        located, gi, offset = self._locate(p)
        group = located if group is None else group
        st = self._init_state(p, group)
        step = st["step"]
        coef = self._coef(group, step + 1, p.device)
        key = _shift_key(mix_key(self.seed, gi, step), offset) if self._random(group) else None
        states = [st[k].view(-1) for k in self._state_keys(group)]
        extra = _extra_arg(st["extra"])
        if self.compile:
            if key is not None:
                key = torch.tensor(key, dtype=torch.int32, device=p.device)
            update = self._compiled(group, step, p.dtype, p.device, dynamic=True)
            update(p.view(-1), p.grad.reshape(-1), extra, states, coef, key)
        else:
            chunked_update(p.view(-1), p.grad.reshape(-1), extra, states, coef, key,
                           bits=self._bits(group), **self._kwargs(group, step))
        st["step"] = step + 1
        self._mark_stepped()

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
        bits = self._bits(group)
        flat = self._flat.get(gi)
        if flat is None or not flat.valid(self.state):
            flat = self._flat[gi] = _FlatGroup(group["params"], self.state, list(self._state_keys(group)),
                                               bits, group["state_dtype"])
        grad = flat.gather_grads()
        coef = self._coef(group, step + 1, flat.half.device)
        key = mix_key(self.seed, gi, step) if self._random(group) else None
        states = [flat.states[k] for k in flat.keys]
        extra = _extra_arg(flat.extra)
        if self.compile:
            if key is not None:
                key = torch.tensor(key, dtype=torch.int32, device=flat.half.device)
            # byte planes: dynamic shapes (one kernel per format); dense words: static (see update.py)
            dynamic = flat.extra.dtype == torch.uint8
            update = self._compiled(group, step, flat.half.dtype, flat.half.device, dynamic=dynamic)
            update(flat.half, grad, extra, states, coef, key)
        else:
            chunked_update(flat.half, grad, extra, states, coef, key, bits=bits, **self._kwargs(group, step))
        for p in group["params"]:
            self.state[p]["step"] += 1


class PackedSGD(PackedOptimizer):
    """SGD (torch.optim.SGD semantics) on fp16/bf16 parameters plus k packed extra bits.

    The momentum buffer (in groups with momentum) is kept in ``state_dtype``.
    """

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
        master_rounding: str = "truncate",
        state_dtype: torch.dtype = torch.float32,
        fused: bool = False,
        compile: bool = False,
        seed: int | None = None,
    ) -> None:
        defaults = dict(lr=lr, momentum=momentum, dampening=dampening,
                        weight_decay=weight_decay, nesterov=nesterov)
        super().__init__(params, defaults, extra_bits=extra_bits, fused=fused, compile=compile,
                         stochastic_rounding=stochastic_rounding, master_rounding=master_rounding,
                         state_dtype=state_dtype, seed=seed)

    def _check_group(self, group):
        _check_real("momentum", group["momentum"])
        _check_real("dampening", group["dampening"])
        if group["nesterov"] and (group["momentum"] <= 0 or group["dampening"] != 0):
            raise ValueError("nesterov needs momentum > 0 and dampening = 0")

    def _state_keys(self, group):
        # NOTE: per group, as torch.optim.SGD: a group may set momentum when the default has none.
        return ("momentum_buffer",) if group["momentum"] != 0 else ()

    def _coef_values(self, group, step):
        return [group["lr"], group["weight_decay"], group["momentum"], 1.0 - group["dampening"]]

    def _options(self, group, step):
        return dict(momentum=group["momentum"] != 0, nesterov=group["nesterov"], first=step == 0)

    def _math(self):
        return sgd_math


class PackedAdamW(PackedOptimizer):
    """AdamW (torch.optim.AdamW semantics) on fp16/bf16 parameters plus k packed extra bits.

    ``decoupled=False`` gives Adam (L2 weight decay added to the gradient); see :class:`PackedAdam`.
    ``state_dtype=torch.bfloat16`` keeps both moments in bf16 (4 instead of 8 bytes per parameter).
    """

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
        master_rounding: str = "truncate",
        state_dtype: torch.dtype = torch.float32,
        decoupled: bool = True,
        fused: bool = False,
        compile: bool = False,
        seed: int | None = None,
    ) -> None:
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        decoupled=decoupled)
        super().__init__(params, defaults, extra_bits=extra_bits, fused=fused, compile=compile,
                         stochastic_rounding=stochastic_rounding, master_rounding=master_rounding,
                         state_dtype=state_dtype, seed=seed)

    def _check_group(self, group):
        betas = group["betas"]
        if len(betas) != 2:
            raise ValueError(f"betas={betas} must be a pair")
        for i, b in enumerate(betas):
            try:
                _check_real(f"betas[{i}]", b, high=1.0, high_open=True)
            except ValueError as e:
                raise ValueError(f"betas={betas} must lie in [0, 1): {e}") from None
        _check_real("eps", group["eps"])

    def _state_keys(self, group):
        return ("exp_avg", "exp_avg_sq")

    def _coef_values(self, group, step):
        b1, b2 = group["betas"]
        lr, wd = group["lr"], group["weight_decay"]
        return [1.0 - lr * wd, wd, 1.0 - b1, b2, 1.0 - b2, math.sqrt(1.0 - b2**step),
                group["eps"], lr / (1.0 - b1**step), b1]

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
        master_rounding: str = "truncate",
        state_dtype: torch.dtype = torch.float32,
        fused: bool = False,
        compile: bool = False,
        seed: int | None = None,
    ) -> None:
        super().__init__(params, lr, betas, eps, weight_decay, extra_bits=extra_bits,
                         stochastic_rounding=stochastic_rounding, master_rounding=master_rounding,
                         state_dtype=state_dtype, decoupled=False, fused=fused, compile=compile,
                         seed=seed)


def master_weight(optimizer: PackedOptimizer, p: torch.Tensor) -> torch.Tensor:
    """Function form of :meth:`PackedOptimizer.master_weight`."""
    return optimizer.master_weight(p)
