"""The device's used memory beside the tensor peak: the unit of the paper's memory tables.

Paper: Lewandowski & Kosson, "Memory Efficient Mixed Precision Optimizers", section 4: Table 3 reports
"Global GPU Memory usage" (ResNet-18 on CIFAR-10: fp32 4,720 MB, AMP 4,520, fp16 3,840, fp16+8 3,776) and
Table 2 "Peak memory usage" of flan-T5 fine-tuning, the memory a GPU shows as used: the CUDA context and
library handles plus everything PyTorch's caching allocator has reserved, fragmentation included. The
tensor peak (``MemoryMeter``: ``max_memory_allocated`` on CUDA) is a different unit: a saving in one need
not show in the other (the AMP - fp16+8 gap of 744 MB in Table 3 is larger than AMP's whole 156 MB of
per-parameter state at 11M parameters).

`used_memory` reads it around one run: ``torch.cuda.mem_get_info`` before (after emptying the cache)
gives the memory used outside the allocator (context, handles); the allocator's peak reserve during
the run (``max_memory_reserved``) is added to it. On a CPU there is no such figure: the columns are NaN.
"""

from __future__ import annotations

import contextlib
import gc
import math
from collections.abc import Callable, Iterable, Iterator

import pandas as pd
import torch
from torch import nn

from workbench.dtype_probe import Fp16Probe

from .peak_memory import Format, memory_by_format
from .peers import PeerUnavailable, peer_label, peer_peak

__all__ = ["DEVICE_COLUMNS", "device_memory_by_format", "used_memory"]

#: The columns `used_memory` fills: bytes used outside the allocator before the run, the allocator's peak
#: reserve during it, their sum (the device's used memory at its peak) and the device's used memory after.
DEVICE_COLUMNS = ("context_bytes", "reserved_peak_bytes", "device_peak_bytes", "device_used_after_bytes")


@contextlib.contextmanager
def used_memory(device: torch.device | str) -> Iterator[dict]:
    """Yields a dict that holds `DEVICE_COLUMNS` once the block ends (NaN on a CPU).

    # NOTE: the allocator's peak statistics are reset at entry; a MemoryMeter opened inside the block
    # resets them again, which leaves ``max_memory_reserved`` right: the reserve never shrinks inside
    # the block (no ``empty_cache``), so its peak after the meter's reset is the peak of the whole run.
    """
    device = torch.device(device)
    reading = dict.fromkeys(DEVICE_COLUMNS, math.nan)
    if device.type != "cuda":
        yield reading
        return
    gc.collect()  # the previous run's model and optimizer, if a reference cycle still holds them
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    outside = (total - free) - torch.cuda.memory_reserved(device)
    torch.cuda.reset_peak_memory_stats(device)
    yield reading
    torch.cuda.synchronize(device)
    reserved = torch.cuda.max_memory_reserved(device)
    reading.update(context_bytes=float(outside), reserved_peak_bytes=float(reserved),
                   device_peak_bytes=float(outside + reserved),
                   device_used_after_bytes=float(total - torch.cuda.mem_get_info(device)[0]))


def device_memory_by_format(
    model_fn: Callable[[], nn.Module], batches: list[tuple[torch.Tensor, torch.Tensor]], *,
    formats: Iterable[str | Format], optimizer: str = "sgd", in_backward: Iterable[bool] = (False, True),
    lr: float = 0.01, device: torch.device | str = "cpu", progress: bool = True, fp16_on_slow_cpu: str = "fp16",
    fp16_probe: Fp16Probe | None = None, peers: Iterable[str] = (),
) -> pd.DataFrame:
    """`memory_by_format` (the tensor peak, with its phase and categories) with `DEVICE_COLUMNS` beside each
    row: every (format, step in backward) run in its own `used_memory` block, the cache emptied between.
    ``fp16_on_slow_cpu`` and ``fp16_probe`` as `memory_by_format` (the bf16 twin where fp16 is slow on a CPU;
    ``ran_as``, ``dtype_note``). ``peers`` (`peers.PEER_METHODS`): each method's rows after the formats', in its
    own format with the step in backward its own way (`peers.peer_peak`); one that cannot run here has ``available``
    False and the reason in ``note``."""
    from tqdm.auto import tqdm

    runs = [(f, sib, False) for f in formats for sib in in_backward]
    runs += [(name, sib, True) for name in peers for sib in in_backward]
    frames = []
    for fmt, sib, peer in tqdm(runs, desc="memory", disable=not progress):
        with used_memory(device) as reading:
            if peer:
                df = pd.DataFrame([_peer_row(fmt, model_fn, batches, sib, optimizer, lr, device)])
            else:
                df = memory_by_format(model_fn, batches, formats=[fmt], optimizer=optimizer, in_backward=[sib],
                                      lr=lr, device=device, progress=False, fp16_on_slow_cpu=fp16_on_slow_cpu,
                                      fp16_probe=fp16_probe).assign(available=True, note="")
        frames.append(df.assign(**reading))
    df = pd.concat(frames, ignore_index=True)
    amp = df[(df["format"] == "amp") & ~df["step_in_backward"]]["peak_bytes"]
    df["ratio_vs_amp"] = df["peak_bytes"] / amp.iloc[0] if len(amp) else math.nan
    return df


def _peer_row(name: str, model_fn, batches, in_backward: bool, optimizer: str, lr: float, device) -> dict:
    label = peer_label(name, optimizer)
    try:
        row = peer_peak(name, model_fn, batches, in_backward=in_backward, optimizer=optimizer, lr=lr, device=device)
        return {**row, "ran_as": label, "dtype_note": "", "available": True, "note": ""}
    except PeerUnavailable as exc:
        return {"format": label, "step_in_backward": in_backward, "ran_as": label, "dtype_note": "",
                "available": False, "note": str(exc)}
