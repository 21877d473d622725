"""The technique switches the memory advisor combines, each a switch on an ordinary training step.

- precision: fp32; AMP (`torch.autocast`, bf16, or fp16 on CUDA); or bf16 weights with k packed
  extra mantissa bits kept by `workbench.optim`'s packed optimizers (k = 0, 8, 16; Lewandowski &
  Kosson, "Memory Efficient Mixed Precision Optimizers", Section 3.1);
- the optimizer: AdamW (or SGD with momentum 0.9), torch's fused implementation for fp32 and AMP weights;
- optimizer state dtype: fp32, or bf16 (packed optimizers only; torch's AdamW keeps its moments in the
  parameters' dtype);
- step in backward (the same paper, Section 3.2): the update applied as each gradient is ready;
- activation checkpointing: OpTorch's sequential checkpoints (`workbench.checkpoint.sc`) for models whose
  layers `workbench.checkpoint.layers_of` can open: `uniform` (round(sqrt(n)) equal segments) or `optimal`
  (`plan_checkpoints(strategy="optimal")`: the least recomputation whose activations fit the budget, planned
  by `advise` from one per-layer profile at a small batch and passed here as `segments`). Units are whole
  residual blocks (`split_blocks=False`, `SPLIT_BLOCKS`). Any other model with repeated blocks (transformer
  blocks, dense layers) is checkpointed block by block (`blocks.checkpoint_blocks`): `uniform` every block,
  `optimal` the blocks its plan names.

`training_setup` turns a `Config` into the arguments of CalcGraph's `training_program`, so the plan
(fake tensors), the measurement and `Advice.build()` all run the same program.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from workbench.checkpoint import CheckpointPlan, layers_of, sc
from workbench.optim import PackedAdamW, PackedSGD

from .blocks import checkpoint_blocks, find_blocks

__all__ = ["CHECKPOINTS", "EXTRA_BITS", "PRECISIONS", "SPLIT_BLOCKS", "Config", "block_labels", "checkpoint_kind",
           "default_grid", "training_setup"]

# NOTE: the advisor checkpoints whole residual blocks. Opened blocks give a ResNet-50 166 units, where
# one optimal plan under a budget took 15 s on 2 CPU cores and the advisor plans one per candidate;
# whole blocks give it 22 units and a plan in a fraction of a second.
SPLIT_BLOCKS = False

PRECISIONS = ("fp32", "amp_bf16", "amp_fp16", "bf16")
EXTRA_BITS = (0, 8, 16)
CHECKPOINTS = ("none", "uniform", "optimal")
_AUTOCAST = {"amp_bf16": torch.bfloat16, "amp_fp16": torch.float16}
_STATE = {"fp32": torch.float32, "bf16": torch.bfloat16}
OPTIMIZERS = ("adamw", "sgd")


@dataclass(frozen=True)
class Config:
    """One combination of techniques. `extra_bits` is k for bf16 weights (None otherwise)."""

    precision: str = "fp32"
    extra_bits: int | None = None
    state_dtype: str = "fp32"
    step_in_backward: bool = False
    checkpoint: str = "none"

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {self.precision!r}")
        if (self.precision == "bf16") != (self.extra_bits is not None):
            raise ValueError(f"extra_bits is k for precision 'bf16' (one of {EXTRA_BITS}) and None otherwise; "
                             f"got precision {self.precision!r} with extra_bits {self.extra_bits!r}")
        if self.extra_bits is not None and (isinstance(self.extra_bits, bool) or not isinstance(self.extra_bits, int)
                                            or self.extra_bits not in EXTRA_BITS):
            raise ValueError(f"extra_bits must be one of {EXTRA_BITS}, got {self.extra_bits!r}")
        if self.state_dtype not in _STATE:
            raise ValueError(f"state_dtype must be one of {tuple(_STATE)}, got {self.state_dtype!r}")
        if self.state_dtype == "bf16" and self.precision != "bf16":
            raise ValueError("state_dtype 'bf16' needs bf16 weights (a packed optimizer); torch's optimizers "
                             "keep fp32 state for fp32 parameters")
        if not isinstance(self.step_in_backward, bool):
            raise TypeError(f"step_in_backward must be True or False, got {self.step_in_backward!r}")
        if self.checkpoint not in CHECKPOINTS:
            raise ValueError(f"checkpoint must be one of {CHECKPOINTS}, got {self.checkpoint!r}")

    @property
    def name(self) -> str:
        parts = [f"bf16+{self.extra_bits}" if self.precision == "bf16" else self.precision.replace("_", " ")]
        if self.state_dtype == "bf16":
            parts.append("bf16 state")
        if self.step_in_backward:
            parts.append("step in backward")
        if self.checkpoint != "none":
            parts.append(f"checkpoint {self.checkpoint}")
        return ", ".join(parts)


def default_grid(device: torch.device, *, checkpointable: bool) -> list[Config]:
    """Every combination: AMP fp16 only on CUDA (CPU autocast is bf16), checkpointing only where the
    model's layers open (`checkpointable`)."""
    precisions = [("fp32", None), ("amp_bf16", None)] + ([("amp_fp16", None)] if device.type == "cuda" else [])
    precisions += [("bf16", k) for k in EXTRA_BITS]
    checkpoints = CHECKPOINTS if checkpointable else ("none",)
    grid = []
    for (precision, k), in_backward, checkpoint in itertools.product(precisions, (False, True), checkpoints):
        for state in ("fp32", "bf16") if precision == "bf16" else ("fp32",):
            grid.append(Config(precision, k, state, in_backward, checkpoint))
    return grid


def _opens(model: nn.Module) -> bool:
    try:
        return len(layers_of(model)) >= 2
    except (TypeError, ValueError):
        return False


def checkpoint_kind(build: Callable[[], nn.Module]) -> str | None:
    """How the model is checkpointed (built on the meta device: no memory): "layers" where `sc` can open its
    layers, "blocks" where it has repeated blocks (`blocks.find_blocks`), None where neither."""
    with torch.device("meta"):
        model = build()
    if _opens(model):
        return "layers"
    return "blocks" if find_blocks(model) else None


def block_labels(build: Callable[[], nn.Module]) -> list[str]:
    """The module labels of the model's blocks where it is checkpointed block by block (`checkpoint_kind` "blocks"),
    in forward order; else []."""
    with torch.device("meta"):
        model = build()
    if _opens(model):
        return []
    names = {id(module): name for name, module in model.named_modules()}
    return [names[id(block)] for block in find_blocks(model)]


def training_setup(config: Config, build: Callable[[], nn.Module], *, optimizer: str = "adamw",
                   lr: float = 1e-3, seed: int = 0, segments: Sequence[tuple[int, int, bool]] | None = None) -> dict:
    """The keyword arguments of `training_program` for `config`: the model factory (cast, checkpointed),
    the optimizer factory, autocast and step in backward. `seed` keys stochastic rounding; `segments` are the
    checkpoint plan's (start, end, checkpointed) over the model's units, required for `checkpoint='optimal'`."""
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {optimizer!r}")
    if (config.checkpoint == "optimal") != (segments is not None):
        raise ValueError(f"segments (the checkpoint plan) go with checkpoint 'optimal' and only with it; got "
                         f"checkpoint {config.checkpoint!r} and segments {segments!r}")
    plan = CheckpointPlan("optimal", list(segments), None, None) if segments is not None else None

    def model() -> nn.Module:
        net = build()
        if config.precision == "bf16":
            net = net.to(torch.bfloat16)
        if config.checkpoint == "none":
            return net
        if not _opens(net):
            return checkpoint_blocks(net, segments)
        wrapped = sc(net, split_blocks=SPLIT_BLOCKS)
        if plan is not None:
            wrapped.plan = plan
        return wrapped

    if config.precision == "bf16":
        packed = PackedAdamW if optimizer == "adamw" else PackedSGD
        extra = {} if optimizer == "adamw" else {"momentum": 0.9}
        # NOTE: a fixed seed: drawing one from torch's generator calls .item(), which fake tensors refuse
        opt = lambda params: packed(params, lr=lr, extra_bits=config.extra_bits,  # noqa: E731
                                    state_dtype=_STATE[config.state_dtype], seed=seed, **extra)
    # NOTE: torch's fused kernels (CPU and CUDA): one update call per parameter group, no temporaries, faster
    # than the per-tensor loop torch picks by default on CPU, and half the dispatches to trace (a ResNet-50
    # program traced in 0.65 s instead of 1.28 s, the same plan error against the allocator)
    elif optimizer == "adamw":
        opt = lambda params: torch.optim.AdamW(params, lr=lr, fused=True)  # noqa: E731
    else:
        opt = lambda params: torch.optim.SGD(params, lr=lr, momentum=0.9, fused=True)  # noqa: E731
    return {"build": model, "optimizer": opt, "autocast": _AUTOCAST.get(config.precision),
            "in_backward": config.step_in_backward}
