"""CalcGraph's entry point: the memory plan of a user's training step (`plan_training`).

Implements Sections 3.1-3.2 of "CalcGraph: taming the high costs of deep learning using models
(2022)": the user's model, sample batch, loss and optimizer become one training program (`program.py`)
that the model compiler (`graph.py`) traces under fake tensors and, on CPU and CUDA, calibrates against the
device's allocator in real steps at small batches (`calibrate.py`).
"""

from __future__ import annotations

import copy
import math
import warnings
from collections.abc import Callable, Sequence
from numbers import Real

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily

from ..measure import check_device
from .calibrate import NoAllocatorEvents
from .graph import CALIBRATED_ZONE, MAX_BATCH, ZONES, CompiledGraph, search_max
from .program import (
    _OPTIMIZERS, OptimizerSpec, make_optimizer, measure_required_bytes, per_example_shape, training_program,
)
from .tracker import _Tracker

__all__ = [
    "CALIBRATED_ZONE", "MAX_BATCH", "ZONES", "CompiledGraph", "make_optimizer", "measure_required_bytes",
    "plan_training", "search_max", "training_program",
]


def plan_training(
    model: nn.Module | Callable[[], nn.Module], sample_input: torch.Tensor | Sequence[int], *,
    loss: Callable | None = None, optimizer: OptimizerSpec = "adam", lr: float = 1e-3,
    device: torch.device | str | None = None, persistent_grads: bool = False,
    trace_sizes: Sequence[int] = (2, 3, 4), input_dtype: torch.dtype | None = None,
    calibrate: bool | None = None,
) -> CompiledGraph:
    """Compile one training step's memory plan without allocating real memory.

    `model` is a module (deep-copied into fake tensors) or a zero-argument factory;
    `sample_input` a tensor whose first dimension is the batch (or the per-example shape).
    Labels are class indices (cross-entropy) unless `loss` says otherwise. The input's dtype is
    `input_dtype`, else the sample tensor's, else float32. An integer or boolean sample tensor is the
    batch itself (its rows, repeated in turn to any batch size): token ids and the lengths computed from
    them steer memory, e.g. `pack_padded_sequence`, whose plan is then exact at each batch size it is
    asked for and traced there (not affine in the batch size, calibrated at batch 1 alone). Other inputs are random
    (floats) or zeros. # NOTE: traced at batches 2, 3 and 4 by default (BatchNorm refuses a batch of one
    in training); batch 1 is traced on its own where its program differs (`CompiledGraph._batch_one`).
    `calibrate` (True, False or None: on CPU and CUDA where the plan is affine in the batch size) adds what real
    kernels allocate beyond their fake tensors, measured in real steps at small batches
    (`CompiledGraph.calibrate`), so that `required_bytes` and `max_batch_size` cover kernel scratch.
    `calibrate=False` is the paper's plan with zero real steps: it counts tensors only (an LSTM's oneDNN
    workspace, convolution and BatchNorm scratch are missed; on CUDA, cuDNN's convolution workspaces and the
    memory-efficient attention backward's: the 2026-11-27 H100 run's uncalibrated plans were -31% on a grouped
    convolution and -80% on nn.MultiheadAttention at batch 256).
    """
    if calibrate is not None and not isinstance(calibrate, bool):
        raise TypeError(f"calibrate must be True, False or None (calibrate on CPU), got {calibrate!r}")
    if input_dtype is None:
        input_dtype = sample_input.dtype if isinstance(sample_input, torch.Tensor) else torch.float32
    if not isinstance(input_dtype, torch.dtype):
        raise TypeError(f"input_dtype must be a torch.dtype, got {input_dtype!r}")
    if isinstance(sample_input, torch.Tensor):
        if sample_input.dim() < 2:
            raise ValueError(f"sample_input must be [batch, ...], got shape {tuple(sample_input.shape)}")
        input_shape = tuple(sample_input.shape[1:])
    else:
        input_shape = per_example_shape(sample_input)
    if not input_shape or min(input_shape) < 1:
        raise ValueError(f"per-example input shape must be non-empty and positive, got {input_shape}")
    if isinstance(model, nn.Module):
        template = model
        build = lambda: copy.deepcopy(template)  # noqa: E731
        build._calcgraph_copy = True  # see program._build_model
    elif callable(model):
        build = model
    else:
        raise TypeError(f"model must be an nn.Module or a factory, got {type(model).__name__}")
    if isinstance(optimizer, str) and optimizer not in _OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {_OPTIMIZERS} or a callable, got {optimizer!r}")
    if isinstance(lr, bool) or not isinstance(lr, Real) or not (math.isfinite(lr) and lr >= 0):
        raise ValueError(f"lr must be a finite number >= 0, got {lr!r}")
    if loss is not None and not callable(loss):
        raise TypeError(f"loss must be a callable (output, target) -> scalar, got {loss!r}")
    dev = check_device(device, "plan_training")
    if not isinstance(persistent_grads, bool):
        raise TypeError(f"persistent_grads must be True or False, got {persistent_grads!r}")
    if not isinstance(model, nn.Module):
        _refuse_meta_factory(build)

    batches = None
    if isinstance(sample_input, torch.Tensor) and sample_input.dtype == input_dtype and not (
            input_dtype.is_floating_point or input_dtype.is_complex):
        batches = _user_rows(sample_input.detach().to(dev))

    def program(size: int, tracker: _Tracker) -> None:
        training_program(build, input_shape, size, loss=loss, optimizer=optimizer, lr=lr, device=dev,
                         persistent_grads=persistent_grads, annotate=tracker, input_dtype=input_dtype,
                         make_batch=batches)

    name = optimizer if isinstance(optimizer, str) else "custom"
    graph = CompiledGraph(program, device=dev, trace_sizes=trace_sizes, input_shape=input_shape,
                          input_dtype=input_dtype, description=f"input {input_shape} {input_dtype}, optimizer {name}")
    graph.input_shape, graph.input_dtype = input_shape, input_dtype
    graph.build, graph.loss, graph.optimizer, graph.lr = build, loss, optimizer, lr
    graph.persistent_grads = persistent_grads
    asked = calibrate is not None
    if calibrate is None:
        calibrate = True  # on either device check_device allows
        if not graph.affine:
            warnings.warn(f"{graph.description}: the program's allocations are not affine in the batch size "
                          f"(see `nonaffine`): each batch size is traced on its own and the plan is calibrated "
                          f"at batch 1 alone (kernel scratch elsewhere is not covered)", stacklevel=2)
    if not calibrate:
        return graph
    try:
        return graph.calibrate()
    except NoAllocatorEvents as error:
        if asked:
            raise
        # NOTE: CUDA calibration has not yet run on a GPU here: a profiler that reports no CUDA allocator events
        # leaves the default plan uncalibrated, said, rather than failing every CUDA plan
        warnings.warn(f"{error}: this plan is not calibrated", stacklevel=2)
        graph.calibration = None
        return graph


def _refuse_meta_factory(build: Callable[[], nn.Module]) -> None:
    """ValueError where the factory puts tensors on the meta device itself: the plan materialises a meta-built
    model (see `program._build_model`), but the program it plans cannot run (meta tensors hold no values and
    cannot be copied to a device). Built under fake tensors: no memory."""
    try:
        # NOTE: a factory that deep-copies a layer (nn.TransformerEncoder's clones) makes torch's Tensor.__deepcopy__
        # read a fake tensor's data pointer, which torch warns of in red; this build is only looked at, never run
        with FakeTensorMode(allow_non_fake_inputs=True), torch.device("cpu"), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor", category=UserWarning)
            model = build()
    except Exception:  # noqa: BLE001 - the trace builds it again and names what fails
        return
    if not isinstance(model, nn.Module):
        return  # the trace names it
    meta = [name for name, t in [*model.named_parameters(), *model.named_buffers()] if t.device.type == "meta"]
    if meta:
        raise ValueError(f"the model factory puts {len(meta)} tensors on the meta device itself ({', '.join(meta[:3])}"
                         f"{', ...' if len(meta) > 3 else ''}): a model on meta cannot train, so no plan of it is the "
                         f"program that runs; build it without device='meta' (plan_training builds it without "
                         f"memory), or materialise it (module.to_empty(device=...)) in the factory")


def _user_rows(sample: torch.Tensor) -> Callable[[int, torch.device], tuple[torch.Tensor, torch.Tensor]]:
    """`make_batch` for `training_program`: the user's rows, repeated in turn to the batch size (one tensor,
    real even under fake tensors, see `values.py`), and class-index targets."""
    def rows(size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        whole, part = divmod(size, len(sample))
        with unset_fake_temporarily():
            x = torch.cat([sample] * whole + [sample[:part]])
        return x, torch.zeros(size, dtype=torch.long, device=device)
    return rows
