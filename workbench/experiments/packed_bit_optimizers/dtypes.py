"""Which dtype a memory run trains in: the paper's fp16 formats, or their bf16 twins where fp16 is slow.

Paper: Lewandowski & Kosson, "Memory Efficient Mixed Precision Optimizers", section 4: Fig 2 and Table 3's
memory column measure fp16 formats (fp16, fp16+8, fp16+13 with stochastic rounding, AMP's fp16 autocast).

Issue 48 (part 3): on a CPU without fast fp16 kernels (`workbench.dtype_probe`) fp16 training is tens to
hundreds of times slower than bf16 training: the Table 3 memory cell took 527 of the notebook's 809 s on an
Intel Sapphire Rapids. A memory run measures bytes, and bf16 has fp16's: the bf16 twin of a format keeps every
byte (fp16 -> bf16, fp16+k -> bf16+k with the same extra-bit storage, AMP's fp16 autocast -> bf16 autocast).
So the memory sections may run the twin (``fp16_on_slow_cpu="bf16"``) and each row says what ran and why
(``ran_as``, ``dtype_note``). Measured (MLP and ResNet-18 at x0.125 and x0.5, SGD and AdamW, k = 4, 8, 13,
with and without stochastic rounding): a twin's tensor peak is fp16's byte for byte, except where the eager
packed step holds the peak with k < 13 and no stochastic rounding: fp16's bit split keeps up to 12 bytes more
per chunk value than bf16's (`TWIN_STEP_BYTES`; AdamW 5), which the twin's peak does not show.

Accuracy and speed are not bytes: fp16's 10-bit significand is the claim there (Fig 4's updates below half an
fp16 ulp; the fp8 rows are fp16 values cut to e5m2), so those sections keep fp16 and the probe's record says
what it costs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

import torch

from workbench.dtype_probe import Fp16Probe, probe_fp16
from workbench.optim.update import CHUNK

__all__ = ["FP16_ON_SLOW_CPU", "TWIN_STEP_BYTES", "bf16_twin", "check_fp16_choice", "plan_formats", "sections_note",
           "uses_fp16"]

#: Allowed values of ``fp16_on_slow_cpu``: run the bf16 twin where the probe finds fp16 slow, or fp16 anyway.
FP16_ON_SLOW_CPU = ("bf16", "fp16")
# NOTE: measured, not derived: fp16+8 in backward on ResNet-18 x0.5 (batch 16, SGD) peaked at 41,087,662 B,
# bf16+8 at 40,694,446 B: 393,216 B = 12 x CHUNK, the same on an MLP; 0 at k = 13 and with stochastic rounding.
#: The most a packed twin's tensor peak can lie below its fp16 format's (the eager step's chunk temporaries).
TWIN_STEP_BYTES = 12 * CHUNK


def check_fp16_choice(value: str) -> str:
    if value not in FP16_ON_SLOW_CPU:
        raise ValueError(f"fp16_on_slow_cpu={value!r}: allowed {list(FP16_ON_SLOW_CPU)} ('bf16': the bf16 twin "
                         "with the same bytes where fp16 is slow on this CPU; 'fp16': fp16 anyway)")
    return value


def uses_fp16(fmt: Any) -> bool:
    """True if a training format (`peak_memory.Format`) computes in fp16: fp16 weights, or AMP's fp16 autocast."""
    return torch.float16 in (fmt.param_dtype, fmt.autocast)


def bf16_twin(fmt: Any) -> Any:
    """The format with fp16 replaced by bf16 and every byte kept ('fp16+8' -> 'bf16+8', 'amp' -> 'amp bf16':
    AMP with bf16 autocast); ``fmt`` itself where it has no fp16."""
    if not uses_fp16(fmt):
        return fmt
    name = "amp bf16" if fmt.name == "amp" else fmt.name.replace("fp16", "bf16", 1)
    swap = {"param_dtype": torch.bfloat16} if fmt.param_dtype == torch.float16 else {"autocast": torch.bfloat16}
    return dataclasses.replace(fmt, name=name, **swap)


def plan_formats(formats: Iterable[Any], *, device: torch.device | str, fp16_on_slow_cpu: str = "fp16",
                 fp16_probe: Fp16Probe | None = None) -> list[tuple[Any, Any, str]]:
    """(asked, to run, note) per format: the bf16 twin where fp16 is slow on ``device`` (a CPU) and
    ``fp16_on_slow_cpu`` is 'bf16'; the note says why that dtype ran ('' where no fp16 was asked for, on CUDA,
    and where no probe was asked for or given).

    ``fp16_probe``: the probe's record (tests inject one); None probes ``device`` where the choice matters
    (a fp16 format asked for on a non-CUDA device with 'bf16'), else nothing is said. CUDA runs fp16 always.
    """
    check_fp16_choice(fp16_on_slow_cpu)
    device = torch.device(device)
    formats = list(formats)
    fp16 = [f for f in formats if uses_fp16(f)]
    probe = fp16_probe
    if device.type == "cuda" or not fp16:
        probe = None
    elif probe is None and fp16_on_slow_cpu == "bf16":
        probe = probe_fp16(device)
    plan = []
    for fmt in formats:
        if probe is None or not uses_fp16(fmt):
            plan.append((fmt, fmt, ""))
        elif probe.fp16_fast:
            plan.append((fmt, fmt, f"fp16: fast here ({probe.summary})"))
        elif fp16_on_slow_cpu == "fp16":
            plan.append((fmt, fmt, f"fp16 though slow here ({probe.summary}; fp16_on_slow_cpu='fp16')"))
        else:
            twin = bf16_twin(fmt)
            plan.append((fmt, twin, f"bf16 twin, same bytes: fp16 slow here ({probe.summary})"))
    return plan


def sections_note(probe: Fp16Probe, fp16_on_slow_cpu: str) -> str:
    """Which of the notebook's sections run fp16 on this device, and why, in a sentence (printed beside the
    probe, so a run that spends minutes on slow fp16 says so)."""
    check_fp16_choice(fp16_on_slow_cpu)
    if probe.fp16_fast:
        return "fp16 is fast here: every section runs the paper's fp16 formats."
    cost = f"fp16 takes {probe.summary.replace('fp16 / bf16 time: ', '')} bf16's time per kernel here"
    if fp16_on_slow_cpu == "fp16":
        return f"fp16 is slow here and fp16_on_slow_cpu='fp16': every section runs fp16 ({cost})."
    return ("fp16 is slow here: Fig 2 and Table 3 memory run each fp16 format's bf16 twin (same bytes; their rows "
            "say so in ran_as and dtype_note); Table 3 / Fig 4 accuracy, the training-step times and the side-by-side "
            f"table keep fp16, whose numerics are their claims, and take longer for it ({cost}).")
