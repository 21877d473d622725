"""Packed optimizers beyond one process: FSDP2's sharded (DTensor) parameters, and DDP.

Paper: Lewandowski & Kosson, "Memory Efficient Mixed Precision Optimizers", sections 3.1 (the extra
bits are per-parameter state, updated elementwise) and 3.2 (the step inside backward).

FSDP2 (``torch.distributed.fsdp.fully_shard``) keeps each parameter as a DTensor sharded over a
device mesh: a rank owns a shard (its local tensor) and, after backward's reduce-scatter, the
same shard of the gradient. The update is elementwise, so a packed optimizer steps the local shard
alone, without communication, and keeps the extra bits and moments of that shard only. They are
stored as DTensors with the parameter's mesh and placements (the byte planes of the extra bits have
one more leading dimension, so a ``Shard(d)`` of the parameter is a ``Shard(d + 1)`` of its extra
bits): each rank holds 1/world of the state, and ``state_dict()`` is a sharded state dict that
``torch.distributed.checkpoint`` saves and loads at another world size. In every state dict the byte
planes are shaped ``(planes, *parameter.shape)`` for that reason; the ``(planes, numel)`` layout a
single process keeps internally, and older state dicts, still load.

Dense int32 words (stored widths other than 8 and 16 bits) pack values across element boundaries,
so they cannot follow a shard boundary: they are refused for DTensor parameters.

DDP (``DistributedDataParallel``) all-reduces gradients in buckets after autograd has accumulated
them: a post-accumulate-grad hook fires before the all-reduce, so :func:`step_in_backward` would
apply each rank's own, unsynchronised gradient and the replicas would drift apart. It is refused
with that reason (:func:`refuse_ddp`); under FSDP2 the hooks run after the reduce-scatter (torch PR
#129450), so there it is correct.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from workbench.optim.layout import logical_planes, planes_in_order
from workbench.optim.packing import extra_storage, is_byte_aligned

if torch.distributed.is_available():
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
else:  # NOTE: a torch built without distributed support has no DTensor: no parameter is sharded
    class DTensor:  # noqa: D101 - never instantiated; isinstance checks are False
        pass

    Replicate = Shard = compute_local_shape_and_global_offset = None

__all__ = ["DDP_REASON", "check_shardable", "is_sharded", "like_param", "load_layout", "local", "new_extra",
           "new_moment", "refuse_ddp", "refuse_under_ddp", "shard_offset", "state_dict_layout"]

DDP_REASON = (
    "under DistributedDataParallel a parameter's post-accumulate-grad hook fires before DDP all-reduces its "
    "gradient bucket, so the update inside backward would use this rank's own, unsynchronised gradient and the "
    "replicas would drift apart. Under DDP call optimizer.step() after backward (DDP has synchronised the "
    "gradients by then); or shard the model with FSDP2 (torch.distributed.fsdp.fully_shard), whose hooks run "
    "after the reduce-scatter, and use step_in_backward there")


def is_sharded(t: Any) -> bool:
    """True for a DTensor (a parameter of a model wrapped by FSDP2's ``fully_shard``)."""
    return isinstance(t, DTensor)


def local(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (the tensor itself otherwise), aliasing its storage."""
    if not isinstance(t, DTensor):
        return t
    with torch.no_grad():  # without grad mode, to_local returns the local tensor itself (no autograd view)
        return t.to_local()


def _state_placements(p: DTensor, lead: int) -> list:
    return [Shard(pl.dim % p.dim() + lead) if isinstance(pl, Shard) else pl for pl in p.placements]


def check_shardable(p: torch.Tensor, bits: int, where: str) -> None:
    """Raise ValueError where the state of DTensor parameter ``p`` cannot be sharded like it."""
    if not isinstance(p, DTensor):
        return
    odd = [pl for pl in p.placements if type(pl) not in (Shard, Replicate)]
    if odd:
        raise ValueError(f"{where} is a DTensor with placements {tuple(p.placements)}: packed optimizers take "
                         "Shard and Replicate placements (FSDP2, HSDP), not partial or strided ones")
    if not is_byte_aligned(bits):
        raise ValueError(
            f"{where} is a DTensor (FSDP2) but the format stores {bits} bits per value in dense int32 words, "
            "which cross element boundaries and cannot be sharded with the parameter; allowed with DTensor "
            "parameters: 8 or 16 stored bits (extra_bits=8 or 16, or 7 or 15 with stochastic_rounding=True)")


def _sharded_zeros(p: DTensor, lead: tuple[int, ...], dtype: torch.dtype) -> DTensor:
    part = local(p)
    shape = torch.Size((*lead, *p.shape))
    stride = torch.empty(shape, device="meta").stride()
    zeros = part.new_zeros((*lead, *part.shape), dtype=dtype)
    return DTensor.from_local(zeros, p.device_mesh, _state_placements(p, len(lead)), run_check=False,
                              shape=shape, stride=stride)


def new_extra(p: torch.Tensor, bits: int) -> torch.Tensor:
    """Zero extra bits for ``p``: byte planes ``(planes, numel)`` or int32 words; a DTensor of
    ``(planes, *p.shape)`` over the local shard for a DTensor parameter."""
    if isinstance(p, DTensor):
        return _sharded_zeros(p, (bits // 8,), torch.uint8)
    shape, dtype = extra_storage(p.numel(), bits, aligned=True)
    return p.new_zeros(shape, dtype=dtype)


def new_moment(p: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A zero state shaped like ``p`` (a DTensor over the local shard for a DTensor parameter)."""
    if isinstance(p, DTensor):
        return _sharded_zeros(p, (), dtype)
    return torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)  # p's layout (``layout``)


def _local_box(p: DTensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    return compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)


def shard_offset(p: torch.Tensor) -> int:
    """Index, in ``p`` flattened, of its local shard's first element (0 for a plain tensor).

    # NOTE: stochastic rounding draws the bits of element i of a parameter from its stream at i, so
    # a shard shifts its key by this offset; for Shard(0) (FSDP2) a shard is a contiguous range of the
    # flattened parameter and draws exactly the bits one process would (other shardings draw others).
    """
    if not isinstance(p, DTensor) or p.dim() == 0:
        return 0
    _, offset = _local_box(p)
    strides = [math.prod(p.shape[i + 1:]) for i in range(p.dim())]
    return sum(o * s for o, s in zip(offset, strides, strict=True))


def like_param(p: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """``value`` (computed on ``p``'s local shard, shaped like it) as a tensor laid out like ``p``."""
    if not isinstance(p, DTensor):
        return value
    return DTensor.from_local(value, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                              stride=p.stride())


def _plane_layout(p: torch.Tensor, key: str, value: torch.Tensor) -> bool:
    return key == "extra" and value.dtype == torch.uint8 and value.dim() >= 1


def state_dict_layout(p: torch.Tensor, key: str, value: Any) -> Any:
    """A state as a state dict shows it: byte planes ``(planes, *p.shape)`` (a view, logical indexing), the rest
    as kept."""
    if torch.is_tensor(value) and not isinstance(value, DTensor) and _plane_layout(p, key, value):
        return logical_planes(value, p)
    return value


def load_layout(p: torch.Tensor, key: str, value: Any) -> Any:
    """A saved state (checked by ``state_check``) as the optimizer keeps it for ``p``: a copy on
    ``p``'s device; byte planes back to the kept layout and moments laid out like ``p`` (``layout``); a full
    tensor cut to ``p``'s local shard."""
    if not torch.is_tensor(value):
        return value
    planes = _plane_layout(p, key, value)
    if isinstance(p, DTensor):
        lead = 1 if planes else 0
        if isinstance(value, DTensor):
            want = _state_placements(p, lead)
            if list(value.placements) != want:
                value = value.redistribute(p.device_mesh, want)
            return value.to(local(p).device).clone()
        full = value.reshape(value.shape[0], *p.shape) if planes else value
        shape, offset = _local_box(p)
        part = full[(slice(None),) * lead + tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))]
        zeros = _sharded_zeros(p, tuple(full.shape[:lead]), value.dtype)
        local(zeros).copy_(part)
        return zeros
    if isinstance(value, DTensor):
        value = value.full_tensor()
    value = value.to(p.device)
    if planes:
        return planes_in_order(value, p)
    if key != "extra" and tuple(value.shape) == tuple(p.shape):
        return torch.empty_like(p, dtype=value.dtype).copy_(value)
    return value.clone()


def refuse_ddp(model: nn.Module) -> None:
    """Raise RuntimeError (:data:`DDP_REASON`) where ``model`` is, or contains, a DDP wrapper."""
    if any(isinstance(m, nn.parallel.DistributedDataParallel) for m in model.modules()):
        raise RuntimeError(f"step_in_backward on a DistributedDataParallel model: {DDP_REASON}")


def refuse_under_ddp(params: list[torch.Tensor]) -> None:
    """Raise RuntimeError (:data:`DDP_REASON`) inside a DDP forward over any of ``params``.

    # NOTE: DDP marks the module whose forward it is running (torch's hook for TorchDynamo); a model
    # registered before it was wrapped is caught at its first forward under DDP, before any backward.
    """
    active = nn.parallel.DistributedDataParallel._get_active_ddp_module()
    if active is not None:
        managed = {id(p) for p in active.module.parameters()}
        if any(id(p) in managed for p in params):
            raise RuntimeError(f"step_in_backward on a model whose parameters DistributedDataParallel manages "
                               f"(it was wrapped after step_in_backward): {DDP_REASON}")
