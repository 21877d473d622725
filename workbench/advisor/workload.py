"""The user's training problem as the advisor plans, times and builds it: the model factory, the user's own
sample batch (its rows reused at every batch size: real token ids, real images), the loss and the optimizer.

CalcGraph ("CalcGraph: taming the high costs of deep learning using models", 2022, Section 3.2) traces the
training program under fake tensors, where values never matter; every real step (calibration, timing,
`Advice.build()`, `verify()`) takes rows of the user's batch. A batch given only as shapes (the command line's
tensors on the meta device) is drawn at random in the ranges the model shows: token ids below the smallest
embedding table, class indices below the output's class dimension.

Before any trace, one dry run of the forward and the loss on the meta device (no memory) checks what the
user passed besides the model: a loss that refuses the model's output or the targets is named with both
shapes, so a wrong target shape is not blamed on the model.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
from torch.utils._pytree import tree_leaves

from workbench.calcgraph import training_program
from workbench.calcgraph.program import parameter_steps
from workbench.calcgraph.sharded import fake_group, shard_model, sharded_program

from .configs import Config, training_setup

__all__ = ["Workload", "check_factory", "check_loss"]


def _faking() -> bool:
    return torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is not None


def _describe(t: torch.Tensor, per_example: bool = False) -> str:
    shape = t.shape[1:] if per_example else t.shape
    return f"{'per example ' if per_example else ''}[{', '.join(map(str, shape))}] " \
           f"{str(t.dtype).removeprefix('torch.')}"


def _name(fn: object) -> str:
    return getattr(fn, "__qualname__", None) or type(fn).__name__


def check_factory(model_fn: object) -> None:
    """`model_fn` builds an nn.Module (tried on the meta device: no memory); errors name the factory."""
    if isinstance(model_fn, nn.Module):
        raise TypeError(f"model_fn must be a function that builds the model, got a {type(model_fn).__name__} "
                        f"instance: pass a function that builds the model (the class itself, or "
                        f"`lambda: {type(model_fn).__name__}(...)`), so that each candidate gets a fresh one")
    if not callable(model_fn):
        raise TypeError(f"model_fn must be a function that builds your nn.Module, got {model_fn!r:.80}")
    try:
        with torch.device("meta"):
            model = model_fn()
    except (Exception, SystemExit) as error:  # the user's code: any error (sys.exit too), named
        raise ValueError(f"model_fn {_name(model_fn)} failed to build the model: {type(error).__name__}: "
                         f"{str(error)[:300]}") from error
    if not isinstance(model, nn.Module):
        raise TypeError(f"model_fn {_name(model_fn)} must return an nn.Module, got {type(model).__name__} "
                        f"{model!r:.80}")


def check_loss(model_fn: Callable[[], nn.Module], inputs: torch.Tensor, targets: torch.Tensor,
               loss_fn: Callable | None) -> object:
    """The forward and the loss run once on the meta device at batch 2; returns the model's (meta) output, or
    None where the forward cannot run on meta (then the trace reports it, naming the layer). Raises
    ValueError naming `loss_fn` and the targets when the loss refuses them or returns no scalar."""
    x = torch.empty((2, *inputs.shape[1:]), dtype=inputs.dtype, device="meta")
    y = torch.empty((2, *targets.shape[1:]), dtype=targets.dtype, device="meta")
    try:
        with torch.device("meta"):
            out = model_fn().train()(x)
    except Exception:  # noqa: BLE001 - a meta kernel missing or a wrong shape: the fake-tensor trace names the layer
        return None
    what = f"loss_fn {_name(loss_fn)}" if loss_fn is not None else "the default loss (cross-entropy)"
    shapes = ", ".join(_describe(t, True) for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.dim())
    hint = ("pass targets as your loss_fn takes them, or a loss_fn" if loss_fn is None or loss_fn is F.cross_entropy
            else "check the targets' shape and dtype against what loss_fn expects")
    try:
        value = (loss_fn or F.cross_entropy)(out, y)
    except Exception as error:  # the user's loss (or ours on the user's targets): any error, named
        raise ValueError(f"{what} refused the model's output ({shapes}) and the targets "
                         f"({_describe(targets, True)}): {type(error).__name__}: {str(error).strip()[:300]}; "
                         f"{hint}") from None
    if not isinstance(value, torch.Tensor) or value.numel() != 1 or not value.is_floating_point():
        got = _describe(value) if isinstance(value, torch.Tensor) else type(value).__name__
        raise ValueError(f"{what} must return a floating scalar loss, got {got} for the model's output ({shapes}) "
                         f"and the targets ({_describe(targets, True)})")
    return out


def _ranges(model_fn: Callable[[], nn.Module], out: object, custom_loss: bool) -> tuple[int, int]:
    """(exclusive bound of token ids, of integer targets) for a batch given as shapes only: the smallest
    embedding table; the output's class dimension (cross-entropy's dim 1, a custom loss's last dim)."""
    with torch.device("meta"):
        tables = [m.num_embeddings for m in model_fn().modules() if isinstance(m, (nn.Embedding, nn.EmbeddingBag))]
    leaves = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    classes = 1
    if leaves and leaves[0].dim() >= 2:
        classes = int(leaves[0].shape[-1] if custom_loss else leaves[0].shape[1])
    return (min(tables) if tables else 1), max(1, classes)


@dataclass
class Workload:
    build: Callable[[], nn.Module]
    inputs: torch.Tensor
    targets: torch.Tensor
    loss_fn: Callable
    optimizer: str
    lr: float
    device: torch.device
    # exclusive bounds of random token ids and integer targets, for a batch given as shapes (meta tensors)
    id_range: int = 1
    target_range: int = 1
    world_size: int = 1  # > 1: every program is one rank's of the model sharded by FSDP2 over that many ranks
    mesh: Any = field(default=None, repr=False)  # the device mesh real sharded steps run on (`sharding`)
    _given: bool = field(init=False)

    def __post_init__(self) -> None:
        self._given = self.inputs.device.type != "meta" and self.targets.device.type != "meta"

    @classmethod
    def of(cls, model_fn: Callable[[], nn.Module], inputs: torch.Tensor, targets: torch.Tensor,
           loss_fn: Callable | None, optimizer: str, lr: float, device: torch.device, world_size: int = 1
           ) -> Workload:
        """The checked workload: the factory and the loss tried on the meta device first."""
        check_factory(model_fn)
        out = check_loss(model_fn, inputs, targets, loss_fn)
        ids, classes = _ranges(model_fn, out, loss_fn is not None) if out is not None else (1, 1)
        return cls(model_fn, inputs, targets, loss_fn or F.cross_entropy, optimizer, lr, device, ids, classes,
                   world_size)

    @contextlib.contextmanager
    def sharding(self) -> Iterator[None]:
        """Real steps of a sharded workload run as rank 0 of a fake process group (no other rank, collectives
        return at once: memory and compute of one rank, no communication); nothing for an unsharded one."""
        if self.world_size == 1 or self.mesh is not None:
            yield
            return
        with fake_group(self.world_size) as mesh:
            self.mesh = mesh
            try:
                yield
            finally:
                self.mesh = None

    def shard(self, model: nn.Module) -> nn.Module:
        """`model` sharded by FSDP2 over `world_size` ranks (each child with parameters, then the root): in
        `sharding()`, or in the user's own initialized process group of that many ranks."""
        if self.world_size == 1:
            return model
        mesh = self.mesh
        if mesh is None:
            if not dist.is_initialized() or dist.get_world_size() != self.world_size:
                raise RuntimeError(f"a candidate sharded over {self.world_size} ranks is built in each rank of an "
                                   f"initialized process group of {self.world_size} ranks (torch.distributed)")
            mesh = init_device_mesh(self.device.type, (self.world_size,))
        return shard_model(model, mesh)

    @property
    def batch_size(self) -> int:
        return int(self.inputs.shape[0])

    def _fresh(self, t: torch.Tensor, size: int, device: torch.device, dtype: torch.dtype, bound: int
               ) -> torch.Tensor:
        shape = (size, *t.shape[1:])
        if self._given:
            # NOTE: a new tensor every call (index_select copies), as the plan's fresh batch per step, so that
            # the allocator measures what the plan counts; rows repeat where the size exceeds the user's batch.
            # Traced, the same ops, so that calibration aligns the real run's calls with the plan's by name (their
            # `arange` had matched a model's own), and integers zeroed in place as the plan's values
            rows = torch.arange(size, device=t.device) % t.shape[0]
            picked = t.index_select(0, rows)
            if _faking() and not picked.is_floating_point():
                picked.zero_()
            return picked.to(device=device, dtype=dtype)
        if t.is_floating_point():
            return torch.randn(shape, device=device, dtype=dtype)
        if bound > 1 and not _faking():
            return torch.randint(0, bound, shape, device=device, dtype=dtype)
        return torch.zeros(shape, device=device, dtype=dtype)

    def make_batch(self, config: Config) -> Callable[[int, torch.device], tuple[torch.Tensor, torch.Tensor]]:
        """`(size, device) -> (inputs, targets)`: rows of the user's batch (float inputs in bf16 for bf16
        weights), fresh tensors each call."""
        bf16 = config.precision == "bf16" and self.inputs.is_floating_point()
        x_dtype = torch.bfloat16 if bf16 else self.inputs.dtype
        return lambda size, device: (self._fresh(self.inputs, size, device, x_dtype, self.id_range),
                                     self._fresh(self.targets, size, device, self.targets.dtype, self.target_range))

    def program(self, config: Config, *, steps: int = 2, segments=None, setup: dict | None = None) -> Callable:
        """CalcGraph's training program of `config` (build, `steps` steps): `program(size, tracker)`. Traced, each
        allocation a checkpoint's recomputation makes is tagged `recomputed` in the trace's `info`."""
        setup = setup or training_setup(config, self.build, optimizer=self.optimizer, lr=self.lr, segments=segments)
        batch = self.make_batch(config)
        if self.world_size > 1:  # rank 0's program in a fake group of world_size ranks
            return functools.partial(sharded_program, setup["build"], tuple(self.inputs.shape[1:]), self.world_size,
                                     0, dict(loss=self.loss_fn, optimizer=setup["optimizer"], device=self.device,
                                             steps=steps, autocast=setup["autocast"],
                                             in_backward=setup["in_backward"], make_batch=batch,
                                             input_dtype=self._input_dtype(config)))

        def program(size: int, tracker) -> None:
            with _recomputation(tracker) if tracker is not None else contextlib.nullcontext():
                training_program(
                    setup["build"], tuple(self.inputs.shape[1:]), size, loss=self.loss_fn,
                    optimizer=setup["optimizer"], device=self.device, steps=steps, annotate=tracker,
                    autocast=setup["autocast"], in_backward=setup["in_backward"], make_batch=batch,
                    input_dtype=self._input_dtype(config))
        return program

    def parameter_steps(self, config: Config, parameters: Sequence[tuple], order: Sequence[str]) -> Callable:
        """`config`'s optimizer updating each parameter of `order` as step in backward does
        (`calcgraph.program.parameter_steps`), as a program to trace: `program(size, tracker)`, `size` unused."""
        # the updates are the same with any checkpoints (an optimal plan's segments are not needed to make them)
        setup = training_setup(replace(config, checkpoint="none"), self.build, optimizer=self.optimizer, lr=self.lr)
        return lambda size, tracker: parameter_steps(parameters, order, tracker, optimizer=setup["optimizer"],
                                                     device=self.device)

    def state_bytes(self, config: Config) -> int:
        """Bytes of the optimizer state `config`'s optimizer creates for the model, built on the meta device."""
        setup = training_setup(replace(config, step_in_backward=False, checkpoint="none"), self.build,
                               optimizer=self.optimizer, lr=self.lr)
        with torch.device("meta"):
            model = setup["build"]()
        opt = setup["optimizer"](model.parameters())
        if hasattr(opt, "_init_state"):  # a packed optimizer: its state (moments, extra bits) as its first step has it
            for group in opt.param_groups:
                for p in group["params"]:
                    opt._init_state(p, group)
        return sum(t.untyped_storage().nbytes() for st in opt.state.values() for t in st.values()
                   if isinstance(t, torch.Tensor))

    def _input_dtype(self, config: Config) -> torch.dtype:
        return torch.bfloat16 if config.precision == "bf16" and self.inputs.is_floating_point() else self.inputs.dtype


@contextlib.contextmanager
def _recomputation(tracker) -> Iterator[None]:
    """Tags `recomputed` (in the tracker's `info`) the allocations made by modules that run forward inside a
    backward pass with grad mode on: a checkpoint's recomputation (the backward's own ops run with grad mode off).

    # NOTE: CalcGraph tags what autograd saves in the forward as activations; a non-reentrant checkpoint's
    # recomputation saves its tensors through checkpoint's own hooks, in backward, so the plan calls them
    # temporaries. A tag in the trace, not a set of ids beside it, goes wherever the trace's allocations go (a step
    # made again, `calcgraph.derive.repeat_step`).
    """
    starts: list[int] = []

    def recomputing() -> bool:
        return torch._C._current_graph_task_id() != -1 and torch.is_grad_enabled()

    def before(module, args) -> None:
        if recomputing():
            starts.append(len(tracker.sizes))

    def after(module, args, out) -> None:
        if starts and recomputing():
            for info in tracker.info[starts.pop():]:
                info["recomputed"] = True

    handles = [register_module_forward_pre_hook(before), register_module_forward_hook(after)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
