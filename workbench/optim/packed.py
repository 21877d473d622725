"""PackedOptimizer: what PackedSGD / PackedAdamW / PackedAdam (``workbench.optim.algorithms``) share, optimizers
for fp16/bf16 models without an fp32 master copy.

Paper: Lewandowski & Kosson, "Memory Efficient Mixed Precision Optimizers", section 3.1.
Each parameter is the 16-bit tensor the model uses; the optimizer keeps only the next k bits of
its fp32 value (``workbench.optim.packing``: dense int32 words, or uint8 byte planes when the stored
width is 8 or 16 bits). A step merges half + extra bits into the fp32 master value, applies the
ordinary torch.optim update in fp32 and splits the result back, optionally rounding the 16-bit
value stochastically (one more stored bit un-rounds it).

The keyword options they share (extra_bits, stochastic_rounding, master_rounding, state_dtype,
fused, compile, seed) are declared, checked and documented once, in ``PackedOptions``
(``workbench.optim.options``). Options beyond the paper: ``state_dtype=torch.bfloat16`` keeps the moments in
bf16, ``torch.int8`` in 8 bits (``quantized``), ``master_rounding="stochastic"`` rounds the master stochastically,
``master_rounding="nearest"`` to nearest (and the 16-bit value the model sees too).

``fused=True`` ("Fused" in 3.1): a group's halves, extra bits and states live in flat buffers
(``workbench.optim.fused``), and one flat update runs over the whole group, by the fastest step
available on the device (``fused.select_step``: the hand-written kernels, ``triton_kernel`` on CUDA for
every format and ``cpu_kernel`` on CPU for byte-plane formats; else ``torch.compile``d, or the eager update
where compile is unavailable; ``compile=True``/``False`` forces the compiled or the eager one). All give
the same result (bit for bit; NaN payloads are the device's). The per-parameter step (unfused groups and
``step_in_backward``) runs the same hand-written kernel on one parameter, else the eager update in bounded
chunks; with ``compile=True`` it is compiled, with dynamic shapes (one kernel per format).

Drop-in for torch.optim: ``amsgrad`` and ``maximize`` as in torch.optim.AdamW/SGD (the running max
of the second moment is one more state, ``max_exp_avg_sq``); ``foreach``/``capturable``/
``differentiable`` only at torch's defaults (``options.TORCH_ONLY``); torch.amp.GradScaler works
through torch's protocol for fused optimizers (``_step_supports_amp_scaling``): it checks the 16-bit
gradients for inf/NaN without unscaling them, and the step unscales in fp32 or is skipped.
``load_state_dict`` validates the state dict first (``workbench.optim.state_check``).

FSDP2 (``torch.distributed.fsdp.fully_shard``): DTensor parameters are stepped on their local shard,
with extra bits and moments kept over that shard as DTensors (``workbench.optim.distributed``).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor

from workbench.optim.distributed import (
    check_shardable, is_sharded, like_param, local, new_extra, new_moment, shard_offset, state_dict_layout,
)
from workbench.optim.formats import SUPPORTED_DTYPES, check_format, storage_bits
from workbench.optim.fused import FlatGroup, StepSpec, select_step
from workbench.optim.layout import grad_in_order, in_layout, is_dense, memory_order
from workbench.optim.options import PackedOptions, check_real, takes_options
from workbench.optim.packing import extra_storage
from workbench.optim.quantized import expected_states, kind_of, new_quantized, refuse_sharded, stored_keys
from workbench.optim.rng import mix_key, shift_key
from workbench.optim.split_merge import merge
from workbench.optim.state_check import load_checked

__all__ = ["PackedOptimizer"]


def _extra_arg(extra: torch.Tensor) -> torch.Tensor | list[torch.Tensor]:
    """Byte planes go to the update as separate 1-D views (one vectorised loop); words as they are."""
    if extra.dtype != torch.uint8:
        return extra
    return list((extra if extra.dim() == 2 else extra.reshape(extra.shape[0], -1)).unbind(0))


class PackedOptimizer(torch.optim.Optimizer):
    """Shared machinery: packed extra bits, per-parameter steps, flat fused steps, state dicts.

    ``defaults`` holds the algorithm's hyperparameters (with ``lr`` and ``weight_decay``);
    ``options`` are :class:`PackedOptions`' keywords.
    """

    # torch.amp.GradScaler sets ``grad_scale`` and ``found_inf`` on the optimizer and calls step()
    _step_supports_amp_scaling = True

    @takes_options
    def __init__(self, params: Iterable, defaults: dict[str, Any], **options: Any) -> None:
        opts = PackedOptions.from_keywords(f"{type(self).__name__}.__init__", options)
        defaults = dict(defaults, **opts.group_defaults())
        self.compile = None if opts.compile is None else bool(opts.compile)
        self._flat: dict[int, FlatGroup] = {}
        self._index: dict[int, tuple[int, int]] = {}  # id(param) -> (group index, flat offset)
        self._coef_cache: dict[int, tuple[Any, torch.Tensor]] = {}
        self._steps: dict[tuple, Callable] = {}  # the selected update per format and options (``_select``)
        # id(param) -> the dtype and (local) shape its state was made for: fp16's and bf16's extra bits are other
        # bits, and a state is sized for one shape (``_check_made_for``)
        self._made_for: dict[int, tuple[torch.dtype, torch.Size]] = {}
        self._checked: dict[int, tuple] = {}  # id(group) -> the options it was last validated with
        seed = opts.seed
        # NOTE: the random bits of stochastic rounding are a hash of (seed, group, step, position),
        # so the seed (drawn from torch's global generator when not given) is the whole RNG state.
        self.seed = int(torch.randint(0, 2**31 - 1, ()).item()) if seed is None else seed
        super().__init__(params, defaults)

    # ------------------------------------------------------------------ validation and state
    def _check_group(self, group: dict[str, Any]) -> None:
        """Per-group option checks (subclasses add theirs)."""

    def validate_group(self, group: dict[str, Any], gi: int) -> None:
        """Raise TypeError/ValueError for a param group's bad hyperparameter, option or parameter."""
        for key in ("lr", "weight_decay"):
            check_real(key, group[key])
        PackedOptions.check_group(group)
        k = group["extra_bits"]
        seen: dict[int, int] = {}
        for i, p in enumerate(group["params"]):
            if id(p) in seen:  # torch.optim warns and steps it twice; the result then differs from one step
                raise ValueError(f"parameter {i} of group {gi} (shape {tuple(p.shape)}) is parameter {seen[id(p)]} "
                                 f"again: list each parameter once")
            seen[id(p)] = i
            if p.dtype not in SUPPORTED_DTYPES:
                raise TypeError(
                    f"parameter {i} of group {gi} (shape {tuple(p.shape)}) has dtype {p.dtype}; "
                    f"{type(self).__name__} needs torch.float16 or torch.bfloat16 parameters"
                )
            check_format(p.dtype, k)
            check_shardable(p, self._bits(group), f"parameter {i} of group {gi} (shape {tuple(p.shape)})")
            if is_sharded(p) and group["state_dtype"] == torch.int8:
                refuse_sharded(f"parameter {i} of group {gi} (shape {tuple(p.shape)})")
            if not is_dense(local(p)):
                raise ValueError(f"parameter {i} of group {gi} (shape {tuple(p.shape)}, strides {p.stride()}) has "
                                 "gaps or overlaps in memory: packed optimizers update parameters in their memory "
                                 "order (contiguous, channels_last or any dense layout); make it .contiguous()")
        if group["fused"] and len({(p.dtype, p.device) for p in group["params"]}) > 1:
            raise ValueError(f"fused=True needs one dtype and device per group; group {gi} mixes them")
        self._check_group(group)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        with warnings.catch_warnings():  # refused below, naming the parameter (validate_group)
            warnings.filterwarnings("ignore", "optimizer contains a parameter group with duplicate parameters")
            super().add_param_group(param_group)
        gi = len(self.param_groups) - 1
        try:
            self.validate_group(self.param_groups[gi], gi)
        except (TypeError, ValueError):
            self.param_groups.pop()
            raise
        self._index_group(gi)

    def _still_valid(self, gi: int, group: dict) -> None:
        """`validate_group` again where a group's options or parameters were edited by hand since it was last
        checked (``group["extra_bits"] = 20`` stepped with a format that does not exist)."""
        key = (*(group[k] for k in PackedOptions.GROUP), len(group["params"]))  # cheap: checked per parameter
        if self._checked.get(id(group)) != key:
            self.validate_group(group, gi)
            self._checked[id(group)] = key

    @staticmethod
    def _refuse_sparse(owner: str, p: torch.Tensor) -> None:
        if p.grad is not None and p.grad.is_sparse:
            raise RuntimeError(f"{owner} does not support sparse gradients (a parameter of shape {tuple(p.shape)}: "
                               f"nn.Embedding(sparse=True)?), as torch.optim.AdamW does not; use dense gradients")

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
        """Names of the per-parameter states (shaped like the parameter, ``state_dtype``)."""
        raise NotImplementedError

    def expected_state(self, p: torch.Tensor, group: dict) -> dict[str, Any]:
        """What a state dict holds for ``p`` after a step: key -> (shape, dtype), or ``int`` for ``step``;
        byte planes may be shaped ``(planes, numel)`` or ``(planes, *p.shape)`` (a set of shapes)."""
        shape, dtype = extra_storage(p.numel(), self._bits(group), aligned=True)
        extra = {tuple(shape), (shape[0], *p.shape)} if dtype == torch.uint8 else tuple(shape)
        out: dict[str, Any] = {"step": int, "extra": ({(shape[0], *p.shape)} if is_sharded(p) else extra, dtype)}
        if group["state_dtype"] == torch.int8:  # 1-D codes in memory order and a bf16 scale per 32 values
            return dict(out, **expected_states(p.numel(), self._state_keys(group)))
        out.update({k: (tuple(p.shape), group["state_dtype"]) for k in self._state_keys(group)})
        return out

    def _bits(self, group: dict) -> int:
        return storage_bits(group["extra_bits"], group["stochastic_rounding"])

    def _init_state(self, p: torch.Tensor, group: dict) -> dict:
        st = self.state[p]
        if "extra" not in st:
            # a 16-bit value is exact: its extra bits are zero and it needs no rounding flag
            st["step"] = 0
            st["extra"] = new_extra(p, self._bits(group))
            self._made_for[id(p)] = p.dtype, local(p).shape
        else:
            self._check_made_for(p)
        int8 = group["state_dtype"] == torch.int8
        for k in self._state_keys(group):
            if k not in st:
                st.update(new_quantized(p.numel(), k, local(p)) if int8 else {k: new_moment(p, group["state_dtype"])})
        return st

    def _check_made_for(self, p: torch.Tensor) -> None:
        """Raise where ``p`` changed under its state: resized through ``.data``, or converted (``model.half()``,
        ``.float()``) after steps. The state would be read for another tensor: torch.optim's AdamW raises on a
        size mismatch, and extra bits made for bf16 are noise below an fp16 value."""
        made = self._made_for.get(id(p))
        if made is None:
            return
        dtype, shape = made
        if p.dtype != dtype:
            raise RuntimeError(
                f"{type(self).__name__}: a parameter of shape {tuple(p.shape)} is {p.dtype} now, and its packed state "
                f"(extra bits) was made for {dtype}: convert it back (the model was converted after steps, e.g. "
                f".half() or .float()), or build a new optimizer for the converted model")
        if local(p).shape != shape:
            raise RuntimeError(
                f"{type(self).__name__}: a parameter is shape {tuple(local(p).shape)} now, and its optimizer state "
                f"was made for shape {tuple(shape)} (the parameter was replaced through .data or resized after "
                f"steps): build a new optimizer, or load a state dict made for this shape")

    def master_weight(self, p: torch.Tensor) -> torch.Tensor:
        """The fp32 value of parameter ``p`` reconstructed from its 16 bits and extra bits."""
        st = self.state.get(p, {})
        if "extra" not in st:
            return p.detach().float()
        group = self._group_of(p)
        half = local(p.detach())
        out = torch.empty_like(half, dtype=torch.float32)
        memory_order(out).copy_(merge(memory_order(half), local(st["extra"]), extra_bits=group["extra_bits"],
                                      stochastic_rounding=group["stochastic_rounding"],
                                      master_rounding=group["master_rounding"]))
        return like_param(p, out)

    def state_dict(self) -> dict[str, Any]:
        sd = super().state_dict()
        params = [p for g in self.param_groups for p in g["params"]]
        for i, st in sd["state"].items():  # torch numbers the parameters across groups, in order
            sd["state"][i] = {k: state_dict_layout(params[i], k, v) for k, v in st.items()}
        # NOTE: the seed is the whole RNG state of stochastic rounding. torch.distributed.checkpoint's
        # get_optimizer_state_dict keeps only "state" and "param_groups" (a top-level entry is dropped and a
        # resumed run rounds with another seed), so every group carries it too; load_state_dict reads either.
        sd["sr_seed"] = self.seed
        for g, ours in zip(sd["param_groups"], self.param_groups, strict=True):
            g["sr_seed"] = self.seed
            # the dtype each parameter's extra bits are for: fp16's loaded under bf16 would be noise
            g["param_dtypes"] = [str(self._made_for.get(id(p), (p.dtype,))[0]).removeprefix("torch.")
                                 for p in ours["params"]]
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict saved by the same packed optimizer class (validated first: a ValueError
        names the param group or parameter index, the key and what was expected and found)."""
        load_checked(self, state_dict)
        self._made_for.clear()
        for p in (p for g in self.param_groups for p in g["params"] if "extra" in self.state.get(p, {})):
            self._made_for[id(p)] = p.dtype, local(p).shape
        self._flat.clear()
        self._coef_cache.clear()
        self._steps.clear()
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

    def _coef(self, group: dict, step: int, device: torch.device, tail: tuple[float, float] | None = None
              ) -> torch.Tensor:
        """The group's update coefficients as an fp32 tensor, rebuilt only when they change.

        ``tail``: (1 / loss scale, clip value), appended for a ``scaled`` update."""
        vals = self._coef_values(group, step) + (list(tail) if tail is not None else [])
        hit = self._coef_cache.get(id(group))
        if hit is not None and hit[0] == (vals, device):
            return hit[1]
        coef = torch.tensor(vals, dtype=torch.float32)
        if device.type == "cuda" and not isinstance(coef, FakeTensor):
            # NOTE: pinned and non-blocking: a pageable copy would wait for the GPU to finish all queued work
            # at every step (the bias corrections change every step)
            coef = coef.pin_memory().to(device, non_blocking=True)
        else:
            coef = coef.to(device)
        self._coef_cache[id(group)] = ((vals, device), coef)
        return coef

    def _random(self, group: dict) -> bool:
        return group["stochastic_rounding"] or group["master_rounding"] == "stochastic"

    def _select(self, group: dict, step: int, dtype: torch.dtype, device: torch.device, *, dynamic: bool,
                scaled: bool = False) -> tuple[str, Callable]:
        # math_fn and options tell SGD, Adam and AdamW apart; the dtypes do the rest
        static = dict(math_fn=self._math(), extra_bits=group["extra_bits"],
                      stochastic_rounding=group["stochastic_rounding"], master_rounding=group["master_rounding"],
                      options=self._options(group, step), scaled=scaled)
        if group["state_dtype"] == torch.int8:  # the (codes, scales) pairs' kinds (``update.packed_update``)
            static["quantized"] = tuple(map(kind_of, self._state_keys(group)))
        spec = StepSpec(static, self._bits(group), dtype, group["state_dtype"], dynamic)
        return select_step(device, spec, fused=group["fused"], compile=self.compile)

    def _update(self, group: dict, step: int, dtype: torch.dtype, device: torch.device, *, dynamic: bool,
                scaled: bool = False) -> Callable:
        """The update a step runs (``_select``'s), chosen once per format and options (not at every step)."""
        options = self._options(group, step)
        k = (group["extra_bits"], group["stochastic_rounding"], group["master_rounding"], group["state_dtype"],
             group["fused"], tuple(sorted(options.items())), dtype, device, dynamic, scaled)
        update = self._steps.get(k)
        if update is None:
            update = self._steps[k] = self._select(group, step, dtype, device, dynamic=dynamic, scaled=scaled)[1]
        return update

    def flat_update(self, group_index: int = 0) -> Callable[[], None]:
        """The fused group's update alone, as :meth:`step` runs it: the kernel over the flat buffers with the
        gradients the parameters hold now, without the step's checks and bookkeeping (the step count stays).
        For timing the kernel beside ``step()``; the group must have taken one fused step."""
        group, flat = self.param_groups[group_index], self._flat.get(group_index)
        if flat is None or not flat.valid(self.state):
            raise RuntimeError(f"param group {group_index} has no flat buffers: flat_update needs a group with "
                               "fused=True after one step()")
        step = self.state[group["params"][0]]["step"]
        grad = flat.grad_segments()
        coef = self._coef(group, step + 1, flat.half.device, None)
        key = mix_key(self.seed, group_index, step) if self._random(group) else None
        states = [flat.states[k] for k in flat.keys]
        update = self._update(group, step, flat.half.dtype, flat.half.device, dynamic=flat.extra.dtype == torch.uint8)
        return lambda: update(flat.half, grad, flat.extra_arg, states, coef, key)

    def step_backend(self, group_index: int = 0, *, per_parameter: bool = False) -> str:
        """Name of the update backend a step of this param group runs (``fused.select_step``)."""
        group = self.param_groups[group_index]
        p = group["params"][0]
        flat = group["fused"] and not per_parameter
        dynamic = not flat or extra_storage(32, self._bits(group), aligned=True)[1] == torch.uint8
        return self._select(group, 0, p.dtype, p.device, dynamic=dynamic)[0]

    def _mark_stepped(self) -> None:
        # NOTE: LR schedulers check this flag (set by their wrapper of ``step``) to warn about a
        # scheduler step before any optimizer step; updates inside backward never call ``step``.
        self._opt_called = True

    @staticmethod
    def _tail(grad_scale: float | None, clip_value: float | None) -> tuple[float, float] | None:
        if grad_scale is None and clip_value is None:
            return None
        inv = 1.0 if grad_scale is None else 1.0 / float(grad_scale)  # as GradScaler: reciprocal in double
        return inv, math.inf if clip_value is None else float(clip_value)

    @torch.no_grad()
    def step_param(self, p: torch.Tensor, group: dict | None = None, *, grad_scale: float | None = None,
                   clip_value: float | None = None) -> None:
        """Update one parameter from its ``.grad`` (used by :func:`step_in_backward`).

        ``grad_scale``: the loss scale the gradient carries (divided out in fp32); ``clip_value``:
        clamp the unscaled gradient to [-clip_value, clip_value] in fp32 first (paper 4.1)."""
        located, gi, offset = self._locate(p)
        group = located if group is None else group
        self._still_valid(gi, group)
        self._refuse_sparse(type(self).__name__, p)
        st = self._init_state(p, group)
        step = st["step"]
        half = local(p)  # a DTensor parameter (FSDP2) is stepped on its local shard
        if half.numel():  # an uneven sharding can leave a rank an empty shard: nothing to update
            tail = self._tail(grad_scale, clip_value)
            coef = self._coef(group, step + 1, half.device, tail)
            key = shift_key(mix_key(self.seed, gi, step), offset + shard_offset(p)) if self._random(group) else None
            int8, keys = group["state_dtype"] == torch.int8, self._state_keys(group)
            states = [st[k] for k in stored_keys(keys)] if int8 else []  # int8: 1-D, in memory order already
            for k in () if int8 else keys:
                if local(st[k]).stride() != half.stride():  # a state laid out otherwise (``layout``): once
                    st[k] = in_layout(st[k], p)
                states.append(memory_order(local(st[k])))
            update = self._update(group, step, p.dtype, half.device, dynamic=True, scaled=tail is not None)
            update(memory_order(half), grad_in_order(local(p.grad), half), _extra_arg(local(st["extra"])), states,
                   coef, key)
        st["step"] = step + 1
        self._mark_stepped()

    @torch.no_grad()
    def step(self, closure: Callable | None = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # torch.amp.GradScaler's protocol for optimizers that unscale inside their step
        found_inf, grad_scale = getattr(self, "found_inf", None), getattr(self, "grad_scale", None)
        if found_inf is not None and float(found_inf) != 0:
            return loss  # an inf/NaN gradient: the step is skipped, as GradScaler.step does
        scale = None if grad_scale is None else float(grad_scale)
        tail = self._tail(scale, None)
        for gi, group in enumerate(self.param_groups):
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            # NOTE: DTensor parameters (FSDP2) take the per-parameter path: the flat buffers would replace
            # the storage FSDP2 all-gathers from.
            if group["fused"] and not any(map(is_sharded, group["params"])):
                self._still_valid(gi, group)  # the per-parameter path checks in step_param
                for p in params:
                    self._refuse_sparse(type(self).__name__, p)
                flat = self._flat.get(gi)
                if flat is None or not flat.valid(self.state):
                    flat = None
                    dicts = [self._init_state(p, group) for p in group["params"]]
                else:  # the very state dicts the buffers were made for, each with every entry
                    dicts = flat.state_dicts
                steps = {st["step"] for st in dicts}
                if len(params) == len(group["params"]) and len(steps) == 1:
                    self._fused_step(gi, group, steps.pop(), tail, flat)
                    continue
                # NOTE: a fused group where some parameters have no gradient (or different step
                # counts after a state load) takes the per-parameter path, which computes the same.
            for p in params:
                self.step_param(p, group, grad_scale=scale)
        return loss

    def _fused_step(self, gi: int, group: dict, step: int, tail: tuple[float, float] | None,
                    flat: FlatGroup | None) -> None:
        """The group's step over its flat buffers (``flat``: the group's, valid; None: made anew)."""
        if flat is None:
            flat = self._flat[gi] = FlatGroup(group["params"], self.state, list(self._state_keys(group)),
                                               self._bits(group), group["state_dtype"])
        grad = flat.grad_segments()  # read in place by the kernels, gathered into one tensor by the other steps
        coef = self._coef(group, step + 1, flat.half.device, tail)
        key = mix_key(self.seed, gi, step) if self._random(group) else None
        states = [flat.states[k] for k in flat.keys]
        # byte planes: dynamic shapes (one kernel per format); dense words: static (see update.py)
        update = self._update(group, step, flat.half.dtype, flat.half.device,
                              dynamic=flat.extra.dtype == torch.uint8, scaled=tail is not None)
        update(flat.half, grad, flat.extra_arg, states, coef, key)
        for st in flat.state_dicts:
            st["step"] += 1
