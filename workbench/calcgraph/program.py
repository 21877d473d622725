"""The training program CalcGraph plans and runs (Sections 3.1-3.2 of "CalcGraph: taming the high costs
of deep learning using models (2022)"): build the model and optimizer, then forward, loss, backward and
optimizer step, twice. The same function runs under fake tensors (the plan), for real under a meter (the
truth) and for real under the profiler (calibration), so that all count the same tensors.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.utils._python_dispatch import _disable_current_modes

from ..measure import MemoryMeter, op_tensors
from ..optim import step_in_backward
from .tracker import _Tracker

__all__ = ["OptimizerSpec", "make_optimizer", "measure_required_bytes", "training_program"]

_OPTIMIZERS = ("adam", "adamw", "sgd")

OptimizerSpec = str | Callable[..., torch.optim.Optimizer]


class _DtypeMismatch(ValueError):
    """The model's floating parameters and the input disagree on dtype (raised before any step)."""


def per_example_shape(sample_input) -> tuple[int, ...]:
    """A per-example shape given as a sequence of whole numbers; ValueError naming `sample_input` otherwise."""
    if isinstance(sample_input, (str, bytes)) or not isinstance(sample_input, Sequence):
        raise TypeError(f"sample_input must be a tensor [batch, ...] or a per-example shape (a sequence of "
                        f"whole numbers), got {sample_input!r}")
    if not all(isinstance(s, (int, np.integer)) and not isinstance(s, bool) for s in sample_input):
        raise ValueError(f"sample_input: a per-example shape holds whole numbers, got {list(sample_input)!r}")
    return tuple(int(s) for s in sample_input)


def _module(build, model) -> nn.Module:
    if not isinstance(model, nn.Module):
        name = getattr(build, "__qualname__", None) or repr(build)
        raise TypeError(f"the model factory {name} returned {type(model).__name__}, not an nn.Module")
    return model


def _build_model(build: Callable[[], nn.Module], device: torch.device) -> nn.Module:
    """Run the factory: for real, or, under fake tensors, on the meta device and then materialised.

    # NOTE: under FakeTensorMode, `Module._apply` swaps each parameter for its converted copy
    # (`.to(torch.bfloat16)` in a factory) and torch refuses, at random (measured: 4 of 6 tries in
    # torch 2.13), to swap a fake tensor that has a weak reference. A plan must trace the same program
    # at every batch size, so under fake tensors a factory always runs on the meta device outside the
    # fake mode (no memory, no swap) and its tensors are then materialised as fake ones of the same
    # dtypes and shapes; parameters the factory ties together stay tied. A deep copy of a module
    # (`plan_training(module, ...)`) converts nothing and runs as is.
    """
    fake = torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is not None
    if not fake or getattr(build, "_calcgraph_copy", False):
        with device:
            return _module(build, build()).train()
    # NOTE: outside every dispatch mode, the tracker's too: a meta tensor is no memory, and the initialisers' meta ops
    # were 1,100 of a ResNet-50 one-step trace's 2,800 op calls, each through the tracker's Python (0.02 ms). A factory
    # whose modules keep a real tensor (made on a device it names) is built again with the tracker following it
    with _disable_current_modes(), torch.device("meta"):
        model = _module(build, build()).train()
    if any(t.device.type != "meta" for module in model.modules() for t in op_tensors(vars(module))):
        with unset_fake_temporarily(), torch.device("meta"):
            model = _module(build, build()).train()
    if any(_holds_indices(b) for b in model.buffers()):
        # NOTE: a buffer of integers holds data, not just a shape (BERT's `position_ids` index its position
        # embeddings), and the meta build loses it: an op whose fake kernel falls back to a real run then reads
        # garbage ("index 4294967297 is out of bounds"). Such a model is built for real and copied under the fake
        # mode, as `plan_training` plans a module instance (its weights become fake, its buffers keep their values).
        with _disable_current_modes(), device:  # neither fake nor tracked: not the program's allocations
            real = _module(build, build()).train()
        return copy.deepcopy(real)
    tied: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        tied.setdefault(id(param), []).append(name)
    # NOTE: `to_empty` would convert each meta tensor into a fake one before `empty_like` (FakeTensor's meta converter,
    # a sixth of a ResNet-50 trace); a tensor of its size, strides and dtype made directly is the same allocation
    model = model._apply(lambda t: torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device=device))
    for first, *others in (names for names in tied.values() if len(names) > 1):
        shared = model.get_parameter(first)
        for name in others:
            owner, _, attr = name.rpartition(".")
            setattr(model.get_submodule(owner), attr, shared)
    return model


def _holds_indices(buffer: torch.Tensor) -> bool:
    """An integer buffer of more than one value (a scalar counter such as BatchNorm's `num_batches_tracked` is not
    data an op indexes with)."""
    return not buffer.is_floating_point() and not buffer.is_complex() and buffer.dtype != torch.bool \
        and buffer.numel() > 1


def _check_dtypes(model: nn.Module, input_dtype: torch.dtype) -> None:
    floats = {p.dtype for p in model.parameters() if p.is_floating_point()}
    if input_dtype.is_floating_point and floats and input_dtype not in floats:
        names = ", ".join(sorted(str(d) for d in floats))
        raise _DtypeMismatch(
            f"the model's parameters are {names} but the input is {input_dtype}: the real step would fail on "
            f"a dtype mismatch; pass a sample_input of the model's dtype (or input_dtype=...) or convert the model"
        )


def make_optimizer(
    spec: OptimizerSpec, params, *, lr: float = 1e-3, device: torch.device | str | None = None,
) -> torch.optim.Optimizer:
    """"adam", "adamw", "sgd" (momentum 0.9) or a callable `spec(params)`.

    # NOTE: `foreach` is fixed from the device, not left to torch's default: torch picks the
    # foreach kernels only for plain CUDA tensors, so a fake tensor would silently take the
    # single-tensor path and plan a different program from the one that runs.
    """
    if callable(spec):
        return spec(params)
    if spec not in _OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {_OPTIMIZERS} or a callable, got {spec!r}")
    if not lr > 0:
        raise ValueError(f"lr must be > 0, got {lr}")
    foreach = torch.device(device or "cpu").type == "cuda"
    if spec == "adam":
        return torch.optim.Adam(params, lr=lr, foreach=foreach)
    if spec == "adamw":
        return torch.optim.AdamW(params, lr=lr, foreach=foreach)
    return torch.optim.SGD(params, lr=lr, momentum=0.9, foreach=foreach)


def training_program(
    build: Callable[[], nn.Module], input_shape: Sequence[int], batch_size: int, *,
    loss: Callable | None = None, optimizer: OptimizerSpec = "adam", lr: float = 1e-3,
    device: torch.device | str = "cpu", steps: int = 2, persistent_grads: bool = False,
    annotate: _Tracker | None = None, input_dtype: torch.dtype = torch.float32,
    autocast: torch.dtype | None = None, in_backward: bool = False,
    make_batch: Callable[[int, torch.device], tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> None:
    """Build model and optimizer, then `steps` training steps on a batch created each step.

    The program that `plan_training` traces under fake tensors and `measure_required_bytes` runs for
    real, so that both count exactly the same tensors. `persistent_grads` keeps gradient
    buffers for the whole run (zeroed in place, as a `Heap` does) instead of freeing them.
    Inputs are `randn` of `input_dtype`, or zeros for an integer dtype (token ids, real tensors even
    under a plan's fake tensors, see `values.py`); a floating input dtype that no floating parameter has
    is refused before any step. `make_batch(size, device)`
    replaces that batch (and the class-index targets) by the caller's. Technique switches (the memory
    advisor's): `autocast` runs forward and loss under `torch.autocast` in that dtype; `in_backward`
    applies the optimizer inside backward (`workbench.optim.step_in_backward`).
    """
    device = torch.device(device)
    loss = loss or F.cross_entropy
    if in_backward and persistent_grads:
        raise ValueError("in_backward frees each gradient as it is applied; persistent_grads keeps them: pick one")
    # NOTE: built under the device so that parameters are born there: moving them afterwards swaps
    # tensors, which torch refuses for fake tensors that the tracker holds weak references to.
    model = _build_model(build, device)
    # "cuda" names the current CUDA device: a parameter on cuda:0 is already in place
    elsewhere = [t for t in [*model.parameters(), *model.buffers()] if t.device.type != device.type
                 or (device.index is not None and t.device.index != device.index)]
    if elsewhere:
        model = model.to(device)
    _check_dtypes(model, input_dtype)
    if annotate is not None:
        annotate.watch_model(model)
    if persistent_grads:
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
            if annotate is not None:
                annotate.tag(p.grad, "gradient", "gradient", annotate.names.get(id(p), "?") + ".grad")
    opt = make_optimizer(optimizer, model.parameters(), lr=lr, device=device)
    hooks = step_in_backward(model, opt) if in_backward else None
    # traced: where each gradient becomes ready, where step in backward would apply its update (`derive.in_backward`)
    ready = [p.register_post_accumulate_grad_hook(annotate.grad_ready) for p in model.parameters()
             if p.requires_grad] if annotate is not None and not in_backward else []
    cast = torch.autocast(device.type, dtype=autocast) if autocast is not None else contextlib.nullcontext()
    for step in range(steps):
        if annotate is not None:
            annotate.mark(f"step{step + 1}")
        if make_batch is not None:
            x, y = make_batch(batch_size, device)
        elif input_dtype.is_floating_point:
            x = torch.randn(batch_size, *input_shape, device=device, dtype=input_dtype)
        else:
            with unset_fake_temporarily():  # real under a plan's fake tensors: its values can shape memory
                x = torch.zeros(batch_size, *input_shape, device=device, dtype=input_dtype)
        if make_batch is None:
            y = torch.zeros(batch_size, dtype=torch.long, device=device)
        if annotate is not None:
            annotate.tag(x, "forward", "input", "input")
            annotate.tag(y, "forward", "input", "target")
            with torch.autograd.graph.saved_tensors_hooks(annotate.pack, lambda t: t), cast:
                value = loss(model(x), y)
        else:
            with cast:
                value = loss(model(x), y)
        value.backward()
        del value
        if annotate is not None:
            annotate.tag_grads(model)
        if hooks is None:
            if annotate is not None:
                annotate.point("step")
            opt.step()
        if annotate is not None:
            annotate.tag_state(opt)
        if hooks is None:
            opt.zero_grad(set_to_none=not persistent_grads)
        del x, y
    if hooks is not None:
        hooks.remove()
    for handle in ready:
        handle.remove()
    if annotate is not None:
        annotate.mark("end")
        annotate.spec = {
            "parameters": [(n, tuple(p.shape), p.dtype) for n, p in model.named_parameters()],
            "buffers": [(n, tuple(b.shape), b.dtype) for n, b in model.named_buffers()],
            "state": [[(k, tuple(v.shape), v.dtype, v.device.type) for k, v in opt.state[p].items()
                       if isinstance(v, torch.Tensor)] for p in model.parameters()],
        }
        annotate.unwatch()


def parameter_steps(parameters: Sequence[tuple], order: Sequence[str], annotate: _Tracker, *,
                    optimizer: OptimizerSpec = "adam", device: torch.device | str = "cpu") -> None:
    """Step in backward's updates alone: each parameter named in `order` given a fresh gradient and updated by
    `workbench.optim.step_in_backward`'s hook, one after another and outside any backward (`annotate` notes where each
    begins and ends). `parameters`: the model's (name, shape, dtype) in its order (`_Trace.spec`). What
    `derive.in_backward` splices into the backward of a program traced without step in backward."""
    device = torch.device(device)
    annotate.spec = {"parameters": list(parameters)}
    params = nn.ParameterList(nn.Parameter(torch.empty(shape, dtype=dtype, device=device))
                              for _, shape, dtype in parameters)
    named = {}
    for (name, _, _), p in zip(parameters, params, strict=True):
        annotate.names[id(p)] = name
        annotate.tag(p, "forward", "parameter", name)
        named[name] = p
    # NOTE: the optimizer as `training_program` makes it (its default lr: no step's memory depends on it)
    opt = make_optimizer(optimizer, list(params), device=device)
    handle = step_in_backward(params, opt)
    annotate.mark("step1")
    with torch.no_grad():  # as inside backward
        for name in order:
            named[name].grad = torch.empty_like(named[name])
            annotate.point("ready", name)
            handle._hook(named[name])
            annotate.point("applied", name)
    annotate.tag_state(opt)
    handle.remove()
    annotate.mark("end")


def measure_required_bytes(
    build: Callable[[], nn.Module], input_shape: Sequence[int], batch_size: int, **kwargs,
) -> int:
    """Measured truth: `MemoryMeter`'s peak over a real run of `training_program`."""
    device = torch.device(kwargs.get("device") or "cpu")
    kwargs["device"] = device
    if device.type == "cuda":
        # NOTE: cuBLAS and cuBLASLt keep per-process workspaces that the first matmul allocates
        # through torch's allocator and that live as long as the process (measured on an H100,
        # torch 2.11: 68 MB). They are no tensor of the program, so a plan cannot count them; one
        # unmetered step at batch 1 creates them before the meter opens, as in any process that
        # has already trained.
        training_program(build, input_shape, 1, **{**kwargs, "steps": 1})
        torch.cuda.empty_cache()
    with MemoryMeter(device) as meter:
        training_program(build, input_shape, batch_size, **kwargs)
    return meter.peak_bytes


