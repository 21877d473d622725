"""Validate a state dict before a packed optimizer loads it, naming what differs.

Paper: Lewandowski & Kosson, "Memory Efficient Mixed Precision Optimizers", section 3.1: a packed
optimizer's state is the k extra bits of every parameter (``extra``: uint8 byte planes or dense
int32 words) beside the algorithm's moments, so a state dict of another optimizer cannot stand in
for it. ``torch.optim.Optimizer.load_state_dict`` checks only the number of parameters per group;
a ``torch.optim.AdamW`` state dict then failed at ``step()`` with ``KeyError: 'extra_bits'``, a
``PackedSGD`` one with ``KeyError: 'betas'``, and a moment of the wrong shape with a raw size
mismatch. :func:`check_state_dict` raises a ValueError first, naming the param group or the
parameter index (its id in the state dict, which torch numbers across groups), the key, and what
was expected and found. :func:`load_checked` then loads it (the packed optimizers' ``load_state_dict``).
"""

from __future__ import annotations

import numbers
from copy import deepcopy
from itertools import chain
from typing import Any

import torch

from workbench.optim.distributed import load_layout
from workbench.optim.options import PackedOptions

# NOTE: the optimizer arguments are typed as torch.optim.Optimizer, where the packed optimizers are meant
# (workbench.optim.packed.PackedOptimizer): packed imports this module to load its state, and a module it
# imports does not import it back, not even for a type hint (tests/test_layout.py, the no-circle rule).
__all__ = ["LATER_KEYS", "check_state_dict", "load_checked", "saved_seed"]

# NOTE: keys added after state dicts were first saved, with the value an older state dict means
# (torch.optim fills its own new keys the same way, with setdefault in __setstate__).
LATER_KEYS = {"amsgrad": False, "maximize": False}
_FOREIGN_HINT = ("; a packed optimizer loads only state dicts saved by the same packed optimizer class "
                 "(torch.optim's state has no packed extra bits, and PackedSGD's no Adam moments)")


def _describe(value: Any) -> str:
    if torch.is_tensor(value):
        return f"a tensor of shape {tuple(value.shape)} and dtype {value.dtype}"
    return f"{value!r} ({type(value).__name__})"


def _check_param_state(name: str, pid: Any, p: torch.Tensor, saved: Any, expected: dict[str, Any]) -> None:
    where = f"{name}.load_state_dict: state of parameter {pid!r} (shape {tuple(p.shape)}, {p.dtype})"
    if not isinstance(saved, dict):
        raise ValueError(f"{where}: expected a dict of states, got {_describe(saved)}")
    missing = [k for k in expected if k not in saved]
    extra = [k for k in saved if k not in expected]
    if missing or extra:
        key, what = (missing[0], "is missing") if missing else (extra[0], "is not a state of this optimizer")
        raise ValueError(f"{where}: key {key!r} {what}; expected keys {sorted(expected)}, got {sorted(saved)}"
                         + _FOREIGN_HINT)
    for key, want in expected.items():
        value = saved[key]
        if want is int:
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{where}: key 'step' expected a non-negative Python int, got {_describe(value)}"
                                 + _FOREIGN_HINT)
            continue
        shape, dtype = want
        shapes = shape if isinstance(shape, set) else {shape}  # byte planes: (planes, numel) or (planes, *shape)
        if not torch.is_tensor(value) or tuple(value.shape) not in shapes or value.dtype != dtype:
            told = " or ".join(map(str, sorted(shapes, key=len)))
            raise ValueError(f"{where}: key {key!r} expected a tensor of shape {told} and dtype {dtype}, "
                             f"got {_describe(value)}")


def check_state_dict(optimizer: torch.optim.Optimizer, state_dict: Any) -> None:
    """Raise ValueError where ``state_dict`` cannot be loaded into ``optimizer`` as it is.

    Checks, in order: the two top-level entries; the number of param groups; each saved group has
    every hyperparameter and option key of this optimizer's groups, the same number of parameters,
    and values the optimizer accepts (``validate_group``); each saved per-parameter state has
    exactly the keys a step creates (``step``, ``extra``, the algorithm's moments), an int step and
    tensors of the expected shape and dtype for that parameter and group; no parameter id listed twice;
    no state entry belongs to no saved parameter; the stochastic-rounding seed (:func:`saved_seed`).
    """
    name = type(optimizer).__name__
    if not isinstance(state_dict, dict) or not isinstance(state_dict.get("state"), dict) \
            or not isinstance(state_dict.get("param_groups"), list):
        found = sorted(state_dict) if isinstance(state_dict, dict) else type(state_dict).__name__
        raise ValueError(f"{name}.load_state_dict: expected a dict with 'state' (a dict) and 'param_groups' "
                         f"(a list), got {found}")
    groups, state = state_dict["param_groups"], state_dict["state"]
    if len(groups) != len(optimizer.param_groups):
        raise ValueError(f"{name}.load_state_dict: the state dict has {len(groups)} param groups, the optimizer "
                         f"{len(optimizer.param_groups)}")
    ids = [pid for g in groups if isinstance(g, dict) for pid in g.get("params", ())]
    twice = sorted({pid for pid in ids if ids.count(pid) > 1}, key=repr)
    if twice:
        raise ValueError(f"{name}.load_state_dict: parameter ids {twice[:5]} are listed more than once in the "
                         "param groups: each parameter belongs to one group, once")
    for gi, (saved, ours) in enumerate(zip(groups, optimizer.param_groups, strict=True)):
        where = f"{name}.load_state_dict: param group {gi}"
        packed = [k for k in PackedOptions.GROUP if k in ours]
        keys = packed + sorted(k for k in ours if k != "params" and k not in packed)
        missing = [k for k in keys if k not in saved and k not in LATER_KEYS]
        if missing:
            raise ValueError(f"{where}: missing key{'s' if len(missing) > 1 else ''} "
                             f"{', '.join(map(repr, missing))}; expected the keys {keys}, got "
                             f"{sorted(k for k in saved if k != 'params')}" + _FOREIGN_HINT)
        if len(saved.get("params", ())) != len(ours["params"]):
            raise ValueError(f"{where}: key 'params' lists {len(saved.get('params', ()))} parameters, expected "
                             f"{len(ours['params'])} (the optimizer's group)")
        group = dict(LATER_KEYS, **saved)  # the group as it will be once loaded
        group["params"] = ours["params"]
        try:
            optimizer.validate_group(group, gi)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{where}: {e}") from None
        dtypes = saved.get("param_dtypes")
        if dtypes is not None and (not isinstance(dtypes, (list, tuple)) or len(dtypes) != len(ours["params"])):
            raise ValueError(f"{where}: key 'param_dtypes' must list one dtype name per parameter "
                             f"({len(ours['params'])}), got {dtypes!r:.200}")
        for i, (pid, p) in enumerate(zip(saved["params"], ours["params"], strict=True)):
            if pid in state:
                if dtypes is not None and dtypes[i] != str(p.dtype).removeprefix("torch."):
                    raise ValueError(
                        f"{name}.load_state_dict: state of parameter {pid!r} (shape {tuple(p.shape)}) was saved for "
                        f"{dtypes[i]} parameters and this one is {p.dtype}: its extra bits are the bits below a "
                        f"{dtypes[i]} value, noise below a {str(p.dtype).removeprefix('torch.')} one; load it into "
                        f"a model of the dtype it was saved with, or start a new optimizer")
                _check_param_state(name, pid, p, state[pid], optimizer.expected_state(p, group))
    ids = [pid for g in groups if isinstance(g, dict) for pid in g.get("params", ())]
    stray = [k for k in state if k not in ids]
    if stray:
        # NOTE: torch.distributed.checkpoint gives back the non-tensor entries (``step``) of a state dict
        # keyed by integers under string keys ('0'), which would leave the steps silently unloaded.
        raise ValueError(f"{name}.load_state_dict: state entries {stray[:5]} belong to no parameter of the saved "
                         f"param groups (ids {ids[:5]}...); with torch.distributed.checkpoint save and load "
                         "get_optimizer_state_dict(model, optimizer) and set_optimizer_state_dict (keys are names)")


def saved_seed(optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> int | None:
    """The stochastic-rounding seed a state dict carries (None for one saved before seeds were): its top-level
    ``sr_seed``, or every param group's (``torch.distributed.checkpoint``'s ``get_optimizer_state_dict`` keeps
    only "state" and "param_groups", so ``state_dict()`` writes the seed into each group as well).

    Raises ValueError for a seed that is not an int (1.5 is not truncated, True is not 1) or for groups that
    disagree, naming the value.
    """
    name = type(optimizer).__name__
    found = {"sr_seed": state_dict["sr_seed"]} if "sr_seed" in state_dict else {}
    found.update({f"param group {gi}'s sr_seed": g["sr_seed"] for gi, g in enumerate(state_dict["param_groups"])
                  if isinstance(g, dict) and "sr_seed" in g})
    for where, value in found.items():
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise ValueError(f"{name}.load_state_dict: {where}={value!r} ({type(value).__name__}): the "
                             "stochastic-rounding seed must be an int (the seed= the optimizer was built with)")
    values = {int(v) for v in found.values()}
    if len(values) > 1:
        raise ValueError(f"{name}.load_state_dict: the stochastic-rounding seeds disagree: {found}; a state dict "
                         "saved by one packed optimizer carries one seed")
    return values.pop() if values else None


def load_checked(optimizer: torch.optim.Optimizer, state_dict: Any) -> None:
    """Check ``state_dict`` (:func:`check_state_dict`), then load it into ``optimizer``.

    # NOTE: torch's loader casts every state tensor to the parameter's dtype (fp16 here), which would
    # destroy fp32 states and integer extra bits, so state entries are mapped here as they are (to the
    # parameter's device and layout: ``distributed.load_layout``).
    """
    check_state_dict(optimizer, state_dict)
    seed = saved_seed(optimizer, state_dict)  # validated before anything changes
    sd = dict(state_dict)
    saved_state = sd.pop("state")
    sd.pop("sr_seed", None)
    sd["param_groups"] = [{k: v for k, v in g.items() if k not in ("sr_seed", "param_dtypes")}
                          for g in sd["param_groups"]]
    saved_ids = list(chain.from_iterable(g["params"] for g in sd["param_groups"]))
    torch.optim.Optimizer.load_state_dict(optimizer, dict(sd, state={}))
    for g in optimizer.param_groups:
        for k, v in LATER_KEYS.items():
            if k in optimizer.defaults:
                g.setdefault(k, v)
    params = list(chain.from_iterable(g["params"] for g in optimizer.param_groups))
    for pid, p in zip(saved_ids, params, strict=True):
        if pid in saved_state:
            optimizer.state[p] = {k: load_layout(p, k, v) if torch.is_tensor(v) else deepcopy(v)
                                  for k, v in saved_state[pid].items()}
    if seed is not None:
        optimizer.seed = seed
