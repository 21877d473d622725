"""Table 2 and Table 3's claims measured in the paper's units and judged like with like (the packed-bit ledger's
gated rows; the claims themselves are data in ``claims``).

Paper: Lewandowski & Kosson, "Memory Efficient Mixed Precision Optimizers", section 4, Table 2 (the step fused
into backward, flan-T5 fine-tuning: 11% lower peak memory, +3-4% time) and Table 3 (ResNet-18 on CIFAR-10:
"Global GPU Memory usage" and execution time by format).

Each ``measure`` reads a value from the notebook's records; each gate returns the verdict a row reads instead of
its rule's, or None: `NOT_COMPARABLE` where the run cannot show the claim (a Table 2 saving above its ceiling, a
saving against fp32 that plain fp16 alone reaches) and `HOST_BOUND` where a GPU timing measured the host.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from workbench.report import Measured, Records, finite, record_frame
from workbench.timing import HOST_BOUND, host_bound

from .bench import find_row

__all__ = ["NOT_COMPARABLE", "TABLE2_REL", "TABLE2_SAVING", "below_ceiling", "half_precision_alone", "step_shares",
           "table2", "table2_shares", "table3_memory"]

#: The verdict of a row whose run cannot show the claim (its ceiling, or a like-with-like baseline, rules it out)
NOT_COMPARABLE = "not comparable"


# ------------------------------------------------------------------------------ Table 3 memory, both units


_UNITS = {"tensor": ("peak_bytes", "tensor peak"), "device": ("device_peak_bytes", "device's used memory")}


def table3_memory(baseline: str, unit: str = "tensor") -> Callable[[Records, Mapping], Measured | None]:
    """1 - fp16+8 (step in backward) / ``baseline`` (ordinary) in ``unit``: the tensor peak or the device's
    used memory (CUDA only). Against fp32 the same run's plain fp16 must be there (like with like)."""
    column, what = _UNITS[unit]

    def measure(records: Records, params: Mapping) -> Measured | None:
        df = record_frame(records, "memory_resnet18")
        base = find_row(df, format=baseline, step_in_backward=False)
        ours = find_row(df, format="fp16+8", step_in_backward=True)
        fp16 = find_row(df, format="fp16", step_in_backward=False)
        if base is None or ours is None or (baseline == "fp32" and fp16 is None):
            return None
        size = params.get("t3_size")
        scale = (f"ResNet-18 width x{params.get('t3_width')} ({base['params'] / 1e6:.2f}M params), batch "
                 f"{params.get('t3_batch')} x 3 x {size}^2, {params.get('optimizer', 'sgd')}, state included; {what}")
        if column not in df or finite(ours[column]) is None or finite(base[column]) is None:
            return Measured(None, scale=scale + ": read on CUDA only (torch.cuda.mem_get_info), none on this device")
        ordinary = find_row(df, format="fp16+8", step_in_backward=False)
        scale += f"; peak in {ours['peak_phase']} ({baseline}: {base['peak_phase']})"
        if ordinary is not None:
            scale += f"; without the step in backward: {1 - ordinary[column] / base[column]:.1%}"
        if baseline == "fp32":
            amp = find_row(df, format="amp", step_in_backward=False)
            scale += f"; same run vs fp32: plain fp16 {1 - fp16[column] / base[column]:.1%}" + (
                "" if amp is None else f", AMP {1 - amp[column] / base[column]:.1%}")
        if unit == "device":
            scale += f" (CUDA context and handles {ours['context_bytes'] / 2**20:,.0f} MiB in each)"
        return Measured(float(1 - ours[column] / base[column]), scale=scale)
    return measure


def half_precision_alone(unit: str) -> Callable[[Records, Mapping], str | None]:
    """`NOT_COMPARABLE` when plain fp16 saves at least as much against fp32 as fp16+8 (in backward) does."""
    column = _UNITS[unit][0]

    def gate(records: Records, params: Mapping) -> str | None:
        df = record_frame(records, "memory_resnet18")
        rows = [find_row(df, format=f, step_in_backward=s) for f, s in (("fp16", False), ("fp16+8", True))]
        if any(r is None or finite(r.get(column)) is None for r in rows):
            return None
        return NOT_COMPARABLE if rows[0][column] <= rows[1][column] else None
    return gate


# ------------------------------------------------------------------------------ Table 3 speed: host-bound steps


def step_shares(*names: Callable[[Mapping], str]) -> Callable[[Records, Mapping], str | None]:
    """`HOST_BOUND` when any of the named steps' kernels fill under half its wall time (CUDA only)."""
    def gate(records: Records, params: Mapping) -> str | None:
        df = record_frame(records, "step_time")
        rows = [find_row(df, format=name(params)) for name in names]
        rows = [r for r in rows if r is not None and "kernel_s" in r]
        return HOST_BOUND if any(host_bound(r["kernel_s"], r["median_s"], r["device"]) for r in rows) else None
    return gate


# ------------------------------------------------------------------------------ Table 2: step fused into backward


TABLE2_SAVING, TABLE2_REL = 0.11, 0.15  # Table 2: 11% lower peak; reproduced within 15% of it


def table2(what: str) -> Callable[[Records, Mapping], Measured | None]:
    """Table 2 from the fused_backward records: the saving in the tensor peak (``"memory"``) or the device's
    used memory (``"device"``, CUDA only), or the time ratio (``"time"``)."""
    def measure(records: Records, params: Mapping) -> Measured | None:
        df = record_frame(records, "fused_backward")
        base = find_row(df, format="fp32", step_in_backward=False)
        sib = find_row(df, format="fp32", step_in_backward=True)
        if base is None or sib is None:
            return None
        model = base["model"] if "model" in base else (
            f"transformer d={params.get('tf_d_model')}, {params.get('tf_layers')} layers")
        scale = (f"{model} ({base['params'] / 1e6:.2f}M params), batch {params.get('tf_batch')}x"
                 f"{params.get('tf_seq')} tokens, AdamW fp32; peak in {base['peak_phase']} (ordinary) / "
                 f"{sib['peak_phase']} (in backward)")
        if "ceiling" in base:
            scale += f"; ceiling (gradients at the ordinary peak / the peak): {base['ceiling']:.1%}"
        if what == "memory":
            return Measured(float(1 - sib["peak_bytes"] / base["peak_bytes"]), scale=scale)
        if what == "device":
            if "device_peak_bytes" not in df or finite(base["device_peak_bytes"]) is None:
                return Measured(None, scale=scale + "; the device's used memory is read on CUDA only")
            return Measured(float(1 - sib["device_peak_bytes"] / base["device_peak_bytes"]), scale=scale + (
                f"; device's used memory {base['device_peak_bytes'] / 2**20:,.0f} -> "
                f"{sib['device_peak_bytes'] / 2**20:,.0f} MiB"))
        return Measured(float(sib["time_ratio"]), spread=(float(sib["time_ratio_lo"]), float(sib["time_ratio_hi"])),
                        scale=scale + f", {params.get('tf_repeats')} interleaved rounds")
    return measure


def below_ceiling(records: Records, params: Mapping) -> str | None:
    """`NOT_COMPARABLE` when the ordinary run's ceiling lies below the claim's band: freeing every gradient
    live at its peak could not reach it."""
    base = find_row(record_frame(records, "fused_backward"), format="fp32", step_in_backward=False)
    if base is None or "ceiling" not in base:
        return None
    return NOT_COMPARABLE if base["ceiling"] < TABLE2_SAVING * (1 - TABLE2_REL) else None


def table2_shares(records: Records, params: Mapping) -> str | None:
    df = record_frame(records, "fused_backward")
    if df is None or "kernel_s" not in df:
        return None
    return HOST_BOUND if any(host_bound(k, w, d) for k, w, d in zip(df["kernel_s"], df["step_s"], df["device"],
                                                                     strict=True)) else None
