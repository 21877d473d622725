"""The packed-bit notebook's measurements at the paper's scale on a CUDA GPU, one CSV per part.

Paper: Lewandowski & Kosson, "Memory Efficient Mixed Precision Optimizers": Fig 2 (peak memory of
a dummy MLP, here 8192 x 8 layers (0.47e9 parameters)), Table 3's memory rows (ResNet-18 at width 64,
batch 256, tensor peak and the device's used memory), Fig 3 (AdamW step throughput at 1e8 parameters,
the compiled Triton step against ``torch.optim.AdamW(fused=True)``), Table 2 (transformers' T5 with
flan-T5 large's shape, batch 16 x 128 tokens, with the step inside backward); Tables 2 and 3 with FlashOptim's
rows beside them (FlashAdamW, FlashSGD for Table 3, in its own format and gradient release). ``meter`` checks
:class:`~workbench.measure.MemoryMeter` on CUDA: the allocator's peak of a ResNet-18 training step
against the tensor bytes the same step allocates (tracked on CUDA, and on the CPU).

Each part runs on its own; a part that fails writes ``<part>.error.txt`` and the others still run::

    python -m workbench.experiments.packed_bit_optimizers.cuda_tables --out results/ --parts meter throughput
"""

from __future__ import annotations

import argparse
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import pandas as pd
import torch

from workbench.data import make_loader, synthetic_images
from workbench.measure import MemoryMeter
from workbench.models import MLP, build

from .device_memory import device_memory_by_format
from .peak_memory import memory_by_format
from .peers import FLASH
from .throughput import DEFAULT_CONFIGS, backward_step_ratio, throughput_table
from .table2 import fused_backward

__all__ = ["meter_check", "main"]


def _resnet_step(device: torch.device, batch: int, width: int) -> Callable[[], None]:
    torch.manual_seed(0)
    model = build("resnet18", width=width / 64).to(device)  # width: the stage-1 channels
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x = torch.randn(batch, 3, 32, 32, device=device)
    y = torch.randint(0, 10, (batch,), device=device)

    def step() -> None:
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def _tracked_peak(meter: MemoryMeter) -> int:
    """Peak of the live tensor bytes in a ``trace=True`` meter's events (each row: live bytes after it)."""
    trace = meter.trace
    return int(trace["bytes"].max()) if trace is not None and len(trace) else 0


def meter_check(*, batch: int = 64, width: int = 64, steps: int = 2) -> pd.DataFrame:
    """ResNet-18 training steps (SGD momentum, state created inside): allocator peak vs tensor bytes.

    Rows: CUDA ``max_memory_allocated`` (``MemoryMeter('cuda')``), CUDA tensor bytes
    (``trace=True``: every storage an aten op creates, before allocator rounding), and CPU tensor
    bytes (``MemoryMeter('cpu')``) of the same steps. The gap is allocator rounding plus cuDNN
    workspaces (allocated through the caching allocator, not as tensors).
    """
    rows = []
    for device, trace in ((torch.device("cuda"), False), (torch.device("cuda"), True), (torch.device("cpu"), False)):
        step = _resnet_step(device, batch, width)
        with MemoryMeter(device, trace=trace) as meter:
            for _ in range(steps):
                step()
        what = ("CUDA allocator (max_memory_allocated)" if device.type == "cuda" and not trace
                else "CUDA tensor bytes (trace)" if trace else "CPU tensor bytes")
        rows.append({"measure": what, "device": str(device),
                     "peak_bytes": _tracked_peak(meter) if trace else meter.peak_bytes,
                     "batch": batch, "width": width, "steps": steps})
        del step
        if device.type == "cuda":
            torch.cuda.empty_cache()
    df = pd.DataFrame(rows)
    df["vs_cpu_tensor_bytes"] = df["peak_bytes"] / df["peak_bytes"].iloc[-1]
    return df


def _fig2(width: int, depth: int, batch: int, steps: int, formats: list[str]) -> pd.DataFrame:
    gen = torch.Generator().manual_seed(0)
    batches = [(torch.randn(batch, width, generator=gen), torch.randint(10, (batch,), generator=gen))
               for _ in range(steps)]
    return memory_by_format(lambda: MLP(sizes=(width,) * depth + (10,), activation="relu"), batches,
                            formats=formats, optimizer="sgd", device="cuda", progress=False)


def _table3(width: int, batch: int, formats: list[str]) -> pd.DataFrame:
    data = synthetic_images(batch * 2, shape=(3, 32, 32), num_classes=10, seed=0)
    batches = list(make_loader(data, batch, shuffle=False))
    return device_memory_by_format(lambda: build("resnet18", width=width / 64), batches, formats=formats,
                                   optimizer="sgd", device="cuda", progress=False, peers=(FLASH,))


PARTS: dict[str, Callable[[argparse.Namespace], pd.DataFrame]] = {
    "meter": lambda a: meter_check(),
    "throughput": lambda a: throughput_table(
        sizes=a.numel, configs=(*DEFAULT_CONFIGS, ("fp16", 8), ("bf16", 16, {"state_dtype": torch.bfloat16})),
        n_tensors=a.tensors, repeats=a.repeats, peers=True, device="cuda", progress=False, compiled_too=True),
    "backward": lambda a: backward_step_ratio(width=4096, depth=4, batch=64, repeats=a.repeats, device="cuda",
                                              progress=False),
    "fig2": lambda a: _fig2(8192, 8, 16, 3, ["fp32", "amp", "fp16", "fp16+8", "bf16+16"]),
    "table3": lambda a: _table3(64, 256, ["fp32", "amp", "fp16", "fp16+8", "fp16+13 SR"]),
    "table2": lambda a: fused_backward(d_model=1024, layers=24, batch=16, seq=128, repeats=5, device="cuda",
                                       progress=False),
}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="folder for <part>.csv (and <part>.error.txt)")
    ap.add_argument("--parts", nargs="+", default=list(PARTS), choices=list(PARTS))
    ap.add_argument("--numel", type=int, nargs="+", default=[100_000_000], help="Fig 3 parameter counts")
    ap.add_argument("--tensors", type=int, default=64, help="Fig 3: parameters split into this many tensors")
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU: torch.cuda.is_available() is False here")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    with pd.option_context("display.width", 250, "display.max_columns", 30, "display.max_colwidth", 40):
        for part in args.parts:
            t0 = time.perf_counter()
            try:
                df = PARTS[part](args)
            except Exception:  # noqa: BLE001 - one failing part must not lose the others
                (out / f"{part}.error.txt").write_text(traceback.format_exc())
                print(f"== {part}: FAILED\n{traceback.format_exc()}", flush=True)
                continue
            df.to_csv(out / f"{part}.csv", index=False)
            print(f"== {part} ({time.perf_counter() - t0:.0f} s)\n{df.to_string(index=False)}", flush=True)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
