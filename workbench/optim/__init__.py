"""Packed-bit mixed precision optimizers: Lewandowski & Kosson, "Memory Efficient Mixed Precision Optimizers".

``formats``: the 16-bit formats and the extra bits that complete them to fp32 (Table 1).
``packing``: k-bit values densely in int32 words (Fig 1), or byte planes for 8/16 bits.
``rng``: random bits for stochastic rounding (counter-based hash, torch-drawn noise).
``split_merge``: fp32 <-> 16-bit value + extra bits, with stochastic rounding (3.1).
``update``: the elementwise merge / fp32 step / split, eager in chunks or ``torch.compile``d.
``options``: ``PackedOptions``, the keyword options of every packed optimizer, declared once.
``quantized``: 8-bit moments (``state_dtype=torch.int8``): codes in groups of 32 with a bf16 scale each.
``fused``: the flat buffers of the fused step ("Fused" in 3.1) and ``select_step``, the one place
where the update's backend (compiled, eager) is chosen.
``triton_kernel`` (source: ``triton_source``): the hand-written Triton step, CUDA, every width; ``cpu_kernel``:
the hand-written C++ step, CPU, byte planes; ``kernel_args``: their argument checks and ``GradSegments``.
``packed``: PackedOptimizer, what the packed optimizers share (per-parameter or fused flat step; fp32 or bf16
states; truncated or stochastic master rounding; torch.amp.GradScaler; state dicts).
``algorithms``: PackedSGD, PackedAdamW, PackedAdam (amsgrad, maximize as torch.optim).
``layout``: the memory order parameters are stepped in (channels_last and other dense layouts).
``state_check``: state dicts validated before loading.
``backward``: step_in_backward (the update runs inside backward, gradients freed at once; 3.2), with
clipping, loss scaling and gradient accumulation in the hook and misuse refused (4.1).
``applied``: AppliedGradient, what ``p.grad`` holds once its update ran inside backward.
``distributed``: FSDP2's DTensor parameters (state kept over the local shard as DTensors, state dicts
that torch.distributed.checkpoint reshards) and why step_in_backward is refused under DDP (issue 20).
"""

from workbench.optim.algorithms import PackedAdam, PackedAdamW, PackedSGD, master_weight
from workbench.optim.applied import AppliedGradient
from workbench.optim.backward import StepInBackwardHandle, step_in_backward
from workbench.optim.fused import select_step
from workbench.optim.options import PackedOptions
from workbench.optim.packed import PackedOptimizer
from workbench.optim.packing import pack, packed_words, unpack
from workbench.optim.split_merge import merge, split, stochastic_round

__all__ = [
    "AppliedGradient",
    "PackedAdam",
    "PackedAdamW",
    "PackedOptimizer",
    "PackedOptions",
    "PackedSGD",
    "StepInBackwardHandle",
    "master_weight",
    "merge",
    "pack",
    "packed_words",
    "select_step",
    "split",
    "step_in_backward",
    "stochastic_round",
    "unpack",
]
