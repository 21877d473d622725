"""Many models in one memory budget: planned parallelism and model switching.

Implements Sections 3.3, 4.4 and 4.5 of "CalcGraph: taming the high costs of deep learning
using models (2022)". The number of same-architecture models that fit in a budget is computed
from the compiled plan, never found by trial: in `loop` mode k models are resident in k heaps
(k x parameters, gradients and optimizer state) and train one at a time, so
need(k) = required(batch) + (k - 1) x persistent bytes; in `vmap` mode k models are stacked
(`torch.func.stack_module_state`) and trained in one vectorised step whose program is compiled
with k as the size variable. `train_many` trains N models in waves of k, switching each wave's
models in and out of the pre-allocated memory.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import pandas as pd
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, stack_module_state, vmap

from .heap import Heap, HeapSnapshot
from .plan import CompiledGraph, OptimizerSpec, _Tracker, make_optimizer, plan_training, search_max

__all__ = [
    "ManyResult", "ParallelPlan", "StackedGroup", "max_parallel_models", "plan_parallel_training", "train_many",
]

_MODES = ("loop", "vmap")


class StackedGroup:
    """k same-architecture models as stacked leaf tensors [k, ...] trained in one vmapped step.

    # NOTE: one optimizer over the stacked tensors equals k independent optimizers for
    # element-wise rules (Adam, AdamW, SGD); the loss is the sum of the k models' losses, so
    # each model's gradient is its own. Models with buffers (BatchNorm) are refused.
    """

    def __init__(self, template: nn.Module, k: int, *, optimizer: OptimizerSpec = "adam", lr: float = 1e-3,
                 loss: Callable | None = None, device: torch.device | str = "cpu") -> None:
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        if any(True for _ in template.buffers()):
            raise ValueError("vmap mode needs a model without buffers (e.g. no BatchNorm); use mode='loop'")
        device = torch.device(device)
        copies = [_on(copy.deepcopy(template), device) for _ in range(k)]
        params, _ = stack_module_state(copies)
        del copies
        self.params = {n: p.detach().requires_grad_(True) for n, p in params.items()}
        # NOTE: functional_call only borrows the module's structure; the template's own tensors
        # are swapped out for the stacked ones during the call, so no copy is needed.
        self.base = template
        self.loss = loss or F.cross_entropy
        self.k = k
        self.optimizer = make_optimizer(optimizer, list(self.params.values()), lr=lr, device=device)

        def one(p, x, y):
            return self.loss(functional_call(self.base, p, (x,)), y)

        self._losses = vmap(one, in_dims=(0, None, None))

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        losses = self._losses(self.params, x, y)
        losses.sum().backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=False)
        return losses.detach()

    def load(self, j: int, module: nn.Module) -> None:
        """Copy one model's parameters into slot j; its optimizer state and gradients zeroed."""
        with torch.no_grad():
            for name, p in module.named_parameters():
                self.params[name][j].copy_(p)
                state = self.optimizer.state.get(self.params[name], {})
                for v in state.values():
                    if isinstance(v, torch.Tensor) and v.dim() > 0:
                        v[j].zero_()
                if self.params[name].grad is not None:
                    self.params[name].grad[j].zero_()

    def reset_steps(self) -> None:
        for state in self.optimizer.state.values():
            if "step" in state:
                state["step"].zero_()

    def state_dict(self, j: int) -> dict[str, torch.Tensor]:
        return {n: p[j].detach().to("cpu", copy=True) for n, p in self.params.items()}


def plan_parallel_training(
    template: nn.Module, input_shape: Sequence[int], batch_size: int, *, loss: Callable | None = None,
    optimizer: OptimizerSpec = "adam", lr: float = 1e-3, device: torch.device | str | None = None,
) -> CompiledGraph:
    """The memory plan of a k-model vmapped training program (two steps), affine in k."""
    dev = torch.device(device or "cpu")
    shape = tuple(input_shape)

    def program(k: int, tracker: _Tracker) -> None:
        group = StackedGroup(template, k, optimizer=optimizer, lr=lr, loss=loss, device=dev)
        for name, p in group.params.items():
            tracker.tag(p, "forward", "parameter", name)
        tracker.spec = {"parameters": [], "buffers": [], "state": []}
        for step in range(2):
            tracker.mark(f"step{step + 1}")
            x = torch.randn(batch_size, *shape, device=dev)
            y = torch.zeros(batch_size, dtype=torch.long, device=dev)
            tracker.tag(x, "forward", "input", "input")
            with torch.autograd.graph.saved_tensors_hooks(tracker.pack, lambda t: t):
                losses = group._losses(group.params, x, y)
            losses.sum().backward()
            del losses
            for name, p in group.params.items():
                tracker.tag(p.grad, "gradient", "gradient", name + ".grad")
            group.optimizer.step()
            tracker.tag_state(group.optimizer)
            group.optimizer.zero_grad(set_to_none=False)
            del x, y
        tracker.mark("end")

    graph = CompiledGraph(program, device=dev, description=f"{shape}, batch {batch_size}, k vmapped models")
    return graph


@dataclass
class ParallelPlan:
    """How many models fit in a budget at once, and what the plan evaluated to say so."""

    models: int
    mode: str
    evaluations: int
    bytes_needed: int
    graph: CompiledGraph


def max_parallel_models(
    template: nn.Module, input_shape: Sequence[int], memory_budget: float, *, batch_size: int,
    mode: str = "loop", loss: Callable | None = None, optimizer: OptimizerSpec = "adam", lr: float = 1e-3,
    device: torch.device | str | None = None, graph: CompiledGraph | None = None,
) -> ParallelPlan:
    """Models that fit in `memory_budget` bytes at once, from the plan alone (zero trials)."""
    if mode not in _MODES:
        raise ValueError(f"mode must be one of {_MODES}, got {mode!r}")
    if not memory_budget > 0:
        raise ValueError(f"memory_budget must be > 0 bytes, got {memory_budget}")
    if mode == "loop":
        graph = graph or plan_training(template, input_shape, loss=loss, optimizer=optimizer, lr=lr,
                                       device=device, persistent_grads=True, calibrate=False)
        single, static = graph.required_bytes(batch_size), graph.persistent_bytes()

        def need(k: int) -> int:
            return single + (k - 1) * static

        k, calls = search_max(lambda k: need(k) <= memory_budget, int(memory_budget // single))
    else:
        graph = graph or plan_parallel_training(template, input_shape, batch_size, loss=loss,
                                                optimizer=optimizer, lr=lr, device=device)
        need = graph.required_bytes
        k, calls = search_max(lambda k: need(k) <= memory_budget, int(memory_budget // need(1)))
    if k == 0:
        raise ValueError(f"one model needs {need(1)} bytes, more than the budget {memory_budget:.0f} bytes")
    return ParallelPlan(k, mode, calls, need(k), graph)


@dataclass
class ManyResult:
    """Trained models (host copies), per-round losses and the plan that scheduled them."""

    states: list[dict[str, torch.Tensor]]
    history: pd.DataFrame
    plan: ParallelPlan
    seconds: float
    snapshots: list[HeapSnapshot] = field(default_factory=list)


def _batches(data: tuple[torch.Tensor, torch.Tensor], batch_size: int):
    x, y = data
    for start in range(0, len(x), batch_size):
        yield x[start:start + batch_size], y[start:start + batch_size]


def train_many(
    models_or_factory: Sequence[nn.Module] | Callable[[], nn.Module], data: tuple[torch.Tensor, torch.Tensor], *,
    memory_budget: float, rounds: int, n_models: int | None = None, batch_size: int | None = None,
    loss: Callable | None = None, optimizer: OptimizerSpec = "adam", lr: float = 1e-3, mode: str = "loop",
    seed: int = 0, max_parallel: int | None = None, device: torch.device | str | None = None,
    progress: bool = False,
) -> ManyResult:
    """Train N same-architecture models for `rounds` rounds each within `memory_budget` bytes.

    `models_or_factory` is a list of initialised models, or a zero-argument factory plus
    `n_models` (model i is initialised as `torch.manual_seed(seed + i); factory()` would, by
    re-running `reset_parameters` in place). A round is one pass over `data` = (inputs, labels)
    in batches of `batch_size` (default: the whole set, one step per round as in the paper).
    The plan says how many models are resident at once (k); models run in waves of k.
    """
    from tqdm.auto import tqdm

    if mode not in _MODES:
        raise ValueError(f"mode must be one of {_MODES}, got {mode!r}")
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    dev = torch.device(device or data[0].device)
    if callable(models_or_factory) and not isinstance(models_or_factory, nn.Module):
        if n_models is None or n_models < 1:
            raise ValueError(f"a factory needs n_models >= 1, got {n_models}")
        factory, given = models_or_factory, None
        torch.manual_seed(seed)
        template = factory()
    else:
        given = list(models_or_factory)
        if not given:
            raise ValueError("models_or_factory is an empty list")
        n_models, template = len(given), given[0]
    batch_size = batch_size or len(data[0])
    if not 1 <= batch_size:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    input_shape = tuple(data[0].shape[1:])
    plan = max_parallel_models(template, input_shape, memory_budget, batch_size=min(batch_size, len(data[0])),
                               mode=mode, loss=loss, optimizer=optimizer, lr=lr, device=dev)
    k = min(plan.models, n_models, max_parallel or n_models)
    loss_fn = loss or F.cross_entropy
    start = time.perf_counter()
    history, states, snapshots = [], [None] * n_models, [None] * n_models

    def init(slot_model: nn.Module, i: int, heap: Heap | None) -> None:
        if given is not None:
            with torch.no_grad():
                for dst, src in zip(slot_model.state_dict().values(), given[i].state_dict().values(), strict=True):
                    dst.copy_(src)
        else:
            heap.reinit(seed + i)

    waves = range(0, n_models, k)
    if mode == "loop":
        slots = []
        for _ in range(k):
            m = _on(copy.deepcopy(template), dev)
            opt = make_optimizer(optimizer, m.parameters(), lr=lr, device=dev)
            slots.append((m, opt, Heap(plan.graph, device=dev).bind(m, opt)))
        for first in tqdm(waves, desc="waves", disable=not progress, leave=False):
            ids = list(range(first, min(first + k, n_models)))
            for (m, _, heap), i in zip(slots, ids, strict=False):
                heap.load(HeapSnapshot({}, [g.copy() for g in _hyper(heap)]))
                init(m, i, heap)
            for r in range(rounds):
                for (m, opt, heap), i in zip(slots, ids, strict=False):
                    for xb, yb in _batches(data, batch_size):
                        heap.zero_grad()
                        value = loss_fn(m(xb), yb)
                        value.backward()
                        opt.step()
                    history.append({"model": i, "round": r + 1, "loss": float(value.detach())})
            for (m, _, heap), i in zip(slots, ids, strict=False):
                snapshots[i] = heap.save()
                states[i] = {n: t.detach().to("cpu", copy=True) for n, t in m.state_dict().items()}
    else:
        group = StackedGroup(template, k, optimizer=optimizer, lr=lr, loss=loss, device=dev)
        scratch = _on(copy.deepcopy(template), dev)
        scratch_opt = make_optimizer(optimizer, scratch.parameters(), lr=lr, device=dev)
        scratch_heap = None
        if given is None:
            scratch_plan = plan_training(template, input_shape, loss=loss, optimizer=optimizer, lr=lr, device=dev,
                                         calibrate=False)
            scratch_heap = Heap(scratch_plan, device=dev).bind(scratch, scratch_opt)
        for first in tqdm(waves, desc="waves", disable=not progress, leave=False):
            ids = list(range(first, min(first + k, n_models)))
            group.reset_steps()
            for j, i in enumerate(ids):
                init(scratch, i, scratch_heap)
                group.load(j, scratch)
            for r in range(rounds):
                for xb, yb in _batches(data, batch_size):
                    losses = group.step(xb, yb)
                history += [{"model": i, "round": r + 1, "loss": float(losses[j])} for j, i in enumerate(ids)]
            for j, i in enumerate(ids):
                states[i] = group.state_dict(j)
    return ManyResult(states, pd.DataFrame(history), plan, time.perf_counter() - start,
                      [s for s in snapshots if s is not None])


def _on(module: nn.Module, device: torch.device) -> nn.Module:
    if any(t.device != device for t in [*module.parameters(), *module.buffers()]):
        module = module.to(device)
    return module


def _hyper(heap: Heap) -> list[dict]:
    return [{k: v for k, v in g.items() if k != "params"} for g in heap.optimizer.param_groups]
