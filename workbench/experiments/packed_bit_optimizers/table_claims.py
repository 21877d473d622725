"""Table 2 and Table 3's claims measured in the paper's units and regime and judged like with like (the
packed-bit ledger's measures for those rows and its gates; the claims themselves are data in ``claims``).

Paper: Lewandowski & Kosson, "Memory Efficient Mixed Precision Optimizers", section 4, Table 2 (the step fused
into backward, flan-T5 fine-tuning: 11% lower peak memory, +3-4% time) and Table 3 (ResNet-18 on CIFAR-10:
"Global GPU Memory usage" and execution time by format).

Each ``measure`` reads a value from the notebook's records; each gate returns the verdict a row reads instead of
its rule's, or None: `NOT_COMPARABLE` where the run cannot show the claim (a Table 2 saving above its ceiling, a
saving against fp32 that plain fp16 alone reaches) and `HOST_BOUND` where a GPU timing measured the host.
`apply_gates` applies them to a judged ledger.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from workbench.report import Ledger, Measured, Records, finite, record_frame
from workbench.timing import HOST_BOUND, host_bound

from .peak_memory import find_row
from .dtypes import TWIN_STEP_BYTES
from .paper_scale import PAPER_T3
from .table2_plan import PAPER_T2
from .step_times import rounds_ratio

__all__ = ["CEILING_RULE", "HARD_REGIME", "LIKE_RULE", "LIKE_STATES", "NOT_COMPARABLE", "PLAN_RECORD", "STATES_RULE",
           "TABLE2_REL", "TABLE2_SAVING", "apply_gates", "below_ceiling", "fp32_momentum", "fused_name",
           "half_precision_alone", "paper_size", "round_ratio", "step_shares", "table2",
           "table2_shares", "table3_memory", "twins_said", "vs_amp"]

#: The verdict of a row whose run cannot show the claim (its ceiling, or a like-with-like baseline, rules it out)
NOT_COMPARABLE = "not comparable"
HARD_REGIME = "synthetic (harder)"  # the accuracy regime whose model the training-step times ran on before


# ------------------------------------------------------------------------------ Table 3 memory, both units


def twins_said(*rows) -> str:
    """'; ran bf16 twins ...' naming each row whose ``ran_as`` differs from its ``format`` (`dtypes.plan_formats`:
    fp16 slow on this CPU), else ''. A twin has fp16's bytes, so a memory claim is still judged from it; where a
    packed twin ran, the text gives how much less its step's temporaries can hold (`TWIN_STEP_BYTES`)."""
    twins = [r for r in rows if r is not None and isinstance(r.get("ran_as"), str) and r["ran_as"] != r["format"]]
    if not twins:
        return ""
    swaps = ", ".join(dict.fromkeys(f"{r['format']} as {r['ran_as']}" for r in twins))
    packed = any("+" in r["format"] for r in twins)
    return (f"; ran bf16 twins with fp16's bytes ({swaps}): fp16 is slow on this CPU (dtype_note)"
            + (f"; a packed twin's step holds up to {TWIN_STEP_BYTES / 2**20:.2f} MiB less than fp16's" if packed
               else ""))


_UNITS = {"tensor": ("peak_bytes", "tensor peak"), "device": ("device_peak_bytes", "device's used memory")}
PLAN_RECORD = "memory_resnet18_plan"  # `paper_scale.planned_memory`: Table 3's sizes planned under fake tensors
LIKE_STATES = "fp16+8 bf16 states"  # fp16+8 with its momentum in 16 bits, as plain fp16's (like with like)


def paper_size(params: Mapping) -> bool:
    """True when the Table 3 memory run (``memory_resnet18``) ran at the paper's ResNet-18, batch and images."""
    return (params.get("t3_width") == PAPER_T3["width"] and params.get("t3_batch") == PAPER_T3["batch"]
            and params.get("t3_size") == PAPER_T3["size"])


def _t3_source(records: Records, params: Mapping, unit: str) -> tuple[object, str, str]:
    """(rows, their column, 'measured' | 'planned' | 'toy') for Table 3's memory in ``unit``: the run itself at the
    paper's size, else (tensor peak) the plan at the paper's size, else the toy run (never judged)."""
    df, column = record_frame(records, "memory_resnet18"), _UNITS[unit][0]
    if df is not None and paper_size(params):
        return df, column, "measured"
    plan = record_frame(records, PLAN_RECORD)
    if unit == "tensor" and plan is not None:
        return plan, "planned_bytes", "planned"
    return df, column, "toy"


def _planned_scale(base, ours, baseline: str) -> tuple[str, float]:
    """The scale of a planned saving (the plan's check beside it) and its spread: +- the difference between the
    saving planned and the saving the allocator gave at the check batch."""
    cb = int(ours["check_batch"])
    at = {r: 1 - ours[c] / base[c] for r, c in (("plan", "planned_check_bytes"), ("alloc", "allocator_check_bytes"))}
    text = (f"planned (CalcGraph, fake tensors) at the paper's size: {ours['model']} ({base['params'] / 1e6:.2f}M "
            f"params), batch {int(ours['batch'])}, state included; planner checked in this run on the same model at "
            f"batch {cb} against AllocatorMeter: plan / allocator {ours['plan_error']:+.1%} ({ours['format']}), "
            f"{base['plan_error']:+.1%} ({baseline}); saving at batch {cb}: planned {at['plan']:.1%}, allocator "
            f"{at['alloc']:.1%} (spread: +- their difference)")
    return text, abs(at["plan"] - at["alloc"])


def table3_memory(baseline: str, unit: str = "tensor", ours_format: str = "fp16+8"
                  ) -> Callable[[Records, Mapping], Measured | None]:
    """1 - ``ours_format`` (step in backward) / ``baseline`` (ordinary) in ``unit``: the tensor peak or the device's
    used memory (CUDA only), at the paper's size: measured there (the gpu profile), else planned (`_t3_source`);
    a toy run's value is said in the scale, never judged. Against fp32 the same run's plain fp16 must be there
    (like with like); an ``ours_format`` the records lack falls back to fp16+8 (its gate then says why)."""
    what = _UNITS[unit][1]

    def measure(records: Records, params: Mapping) -> Measured | None:
        df, column, kind = _t3_source(records, params, unit)
        base = find_row(df, format=baseline, step_in_backward=False)
        ours = find_row(df, format=ours_format, step_in_backward=True)
        ours = find_row(df, format="fp16+8", step_in_backward=True) if ours is None else ours
        fp16 = find_row(df, format="fp16", step_in_backward=False)
        if base is None or ours is None or (baseline == "fp32" and fp16 is None):
            return None
        amp, ordinary = (find_row(df, format=f, step_in_backward=False) for f in ("amp", "fp16+8"))
        named = (base, ours, ordinary) + ((fp16, amp) if baseline == "fp32" else ())
        spread = None
        if kind == "planned":
            scale, spread = _planned_scale(base, ours, baseline)
        else:
            scale = (f"ResNet-18 width x{params.get('t3_width')} ({base['params'] / 1e6:.2f}M params), batch "
                     f"{params.get('t3_batch')} x 3 x {params.get('t3_size')}^2, {params.get('optimizer', 'sgd')}, "
                     f"state included")
        twins = twins_said(*named)
        if kind == "planned":  # the plan's packed step is the in-place C++ kernel: a twin's bytes are fp16's exactly
            twins = twins.split("; a packed twin's step")[0]
        scale += f"{twins}; {what}; {ours['format']} in backward"
        if column not in df or finite(ours[column]) is None or finite(base[column]) is None:
            return Measured(None, scale=scale + ": read on CUDA only (torch.cuda.mem_get_info), none on this device")
        value = float(1 - ours[column] / base[column])
        if kind == "toy":
            return Measured(None, scale=scale + f": {value:.1%} at this toy size, not judged (Table 3 is ResNet-18 "
                            f"x1, batch 256, 32x32: the planned rows judge it where this run planned them)")
        if "peak_phase" in df:
            scale += f"; peak in {ours['peak_phase']} ({baseline}: {base['peak_phase']})"
        if ordinary is not None:
            scale += f"; without the step in backward: {1 - ordinary[column] / base[column]:.1%}"
        if ours["format"] != "fp16+8" and (fp32_states := find_row(df, format="fp16+8", step_in_backward=True)) \
                is not None:
            scale += f"; with fp32 momentum (the paper's fp16+8): {1 - fp32_states[column] / base[column]:.1%}"
        if baseline == "fp32":
            scale += f"; same run vs fp32: plain fp16 {1 - fp16[column] / base[column]:.1%}" + (
                "" if amp is None else f", AMP {1 - amp[column] / base[column]:.1%}")
        if unit == "device":
            scale += f" (CUDA context and handles {ours['context_bytes'] / 2**20:,.0f} MiB in each)"
        return Measured(value, spread=None if spread is None else (value - spread, value + spread),
                        scale=scale)
    return measure


def half_precision_alone(unit: str) -> Callable[[Records, Mapping], str | None]:
    """`NOT_COMPARABLE` when plain fp16 saves at least as much against fp32 as fp16+8 (in backward) does."""
    def gate(records: Records, params: Mapping) -> str | None:
        df, column, _ = _t3_source(records, params, unit)
        rows = [find_row(df, format=f, step_in_backward=s) for f, s in (("fp16", False), ("fp16+8", True))]
        if any(r is None or finite(r.get(column)) is None for r in rows):
            return None
        return NOT_COMPARABLE if rows[0][column] <= rows[1][column] else None
    return gate


def fp32_momentum(unit: str) -> Callable[[Records, Mapping], str | None]:
    """`NOT_COMPARABLE` when the records hold no fp16+8 with 16-bit momentum (`LIKE_STATES`): fp16+8's fp32
    momentum against plain fp16's fp16 momentum compares two state sizes, not the extra bits."""
    def gate(records: Records, params: Mapping) -> str | None:
        df, _, _ = _t3_source(records, params, unit)
        return NOT_COMPARABLE if find_row(df, format=LIKE_STATES, step_in_backward=True) is None else None
    return gate


# ------------------------------------------------------------------------------ Table 3 speed: training-step time


def fused_name(name: str, params: Mapping) -> str:
    return f"{name} fused" + (" compiled" if params.get("speed_compile") else "")


def _speed_scale(records: Records, params: Mapping) -> str:
    acc, df = record_frame(records, "accuracy"), record_frame(records, "step_time")
    if df is not None and "workload" in df and df["workload"].iloc[0]:
        task, batch = df["workload"].iloc[0], int(df["batch"].iloc[0])
    else:  # records from before the workload was recorded: the harder task's model at acc_batch
        hard = None if acc is None else acc[acc["regime"] == HARD_REGIME]
        task = hard["task"].iloc[0] if hard is not None and len(hard) and "task" in hard else "the harder task's model"
        batch = params.get("acc_batch")
    fp32 = find_row(df, format="fp32")
    vs = ("" if fp32 is None or "speedup_vs_amp" not in fp32
          else f"; on this device fp32 runs {fp32['speedup_vs_amp']:.2f}x AMP's speed")
    rounds = "" if df is None else f", {int(df['rounds'].iloc[0])} interleaved rounds"
    return f"{task}, batch {batch}, {params.get('optimizer', 'sgd')}{rounds}{vs}"


def vs_amp(fmt: Callable[[Mapping], str], time_saved: bool) -> Callable[[Records, Mapping], Measured | None]:
    """From ``speedup_vs_amp`` (AMP time / the format's time): time saved (1 - 1/s) or AMP's speed
    over the format's (1/s)."""
    def measure(records: Records, params: Mapping) -> Measured | None:
        df = record_frame(records, "step_time")
        row = find_row(df, format=fmt(params))
        if row is None or "speedup_vs_amp" not in row:
            return None
        s, lo, hi = (float(row[c]) for c in ("speedup_vs_amp", "speedup_vs_amp_lo", "speedup_vs_amp_hi"))
        value, spread = ((1 - 1 / s, (1 - 1 / lo, 1 - 1 / hi)) if time_saved else (1 / s, (1 / hi, 1 / lo)))
        return Measured(value, spread=spread, scale=_speed_scale(records, params) + f"; {fmt(params)}")
    return measure


def round_ratio(name: Callable[[Mapping], str], base: Callable[[Mapping], str], *,
                 time_saved: bool) -> Callable[[Records, Mapping], Measured | None]:
    """Paired per-round ratio base time / name time: as time saved (1 - 1/r) or as a time ratio
    name / base (1/r)."""
    def measure(records: Records, params: Mapping) -> Measured | None:
        rounds = record_frame(records, "step_time_rounds")
        got = None if rounds is None else rounds_ratio(rounds, name(params), base(params))
        if got is None:
            return None
        r, lo, hi = got
        value, spread = ((1 - 1 / r, (1 - 1 / lo, 1 - 1 / hi)) if time_saved else (1 / r, (1 / hi, 1 / lo)))
        return Measured(value, spread=spread,
                        scale=_speed_scale(records, params) + f"; {name(params)} vs {base(params)}")
    return measure


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


T2_PLAN_RECORD = "fused_backward_plan"  # `table2_plan.planned_fused_backward`: Table 2's size under fake tensors


def t2_paper_size(params: Mapping) -> bool:
    """True when Table 2's run (``fused_backward``) ran at the paper's flan-T5 large, batch and tokens."""
    return all(params.get(f"tf_{key}") == value for key, value in PAPER_T2.items())


def _t2_plan(records: Records) -> object | None:
    plan = record_frame(records, T2_PLAN_RECORD)
    return None if plan is None or "size" not in plan else plan


def table2_planned(keep_grads: bool) -> Callable[[Records, Mapping], Measured | None]:
    """1 - peak(in backward) / peak(ordinary) of Table 2's program planned at the paper's size, the ordinary loop
    freeing its gradients at ``zero_grad`` (torch's default) or (``keep_grads``) keeping them zeroed between steps.
    Spread: +- the difference between the saving planned and the one the allocator gave in the same run at the check
    size (`table2_plan`'s real runs under AllocatorMeter), where there is one."""
    def measure(records: Records, params: Mapping) -> Measured | None:
        plan = _t2_plan(records)
        if plan is None:
            return None
        paper = plan[plan["size"] == "paper"]
        base = find_row(paper, program="ordinary, gradients kept" if keep_grads else "ordinary")
        sib = find_row(paper, program="in backward")
        if base is None or sib is None:
            return None
        saving = float(1 - sib["planned_bytes"] / base["planned_bytes"])
        loop = "keeps its gradients zeroed between steps" if keep_grads else "frees its gradients at zero_grad"
        scale = (f"planned (CalcGraph, fake tensors) at the paper's size: {base['model']} ({base['params'] / 1e6:.1f}M "
                 f"params), two steps, fresh optimizer; the ordinary loop {loop}: "
                 f"peak {base['planned_bytes'] / 2**20:,.0f} -> {sib['planned_bytes'] / 2**20:,.0f} MiB, gradients "
                 f"live at the ordinary peak {base['gradients_at_peak'] / 2**20:,.0f} MiB "
                 f"({base['gradients_at_peak'] / base['planned_bytes']:.1%}, the ceiling)")
        check = plan[plan["size"] == "check"]
        pb, ps = (find_row(check, program=name) for name in ("ordinary", "in backward"))
        if pb is None or ps is None or "allocator_bytes" not in check or not check["allocator_bytes"].notna().all():
            return Measured(saving, scale=scale + "; the planner not checked in this run")
        planned = 1 - ps["planned_bytes"] / pb["planned_bytes"]
        allocated = 1 - ps["allocator_bytes"] / pb["allocator_bytes"]
        scale += (f"; planner checked in this run on the same program at {pb['model']} against AllocatorMeter: "
                  f"plan / allocator {pb['plan_error']:+.3%} (ordinary), {ps['plan_error']:+.3%} (in backward); "
                  f"saving there: planned {planned:.2%}, allocator {allocated:.2%} (spread: +- their difference)")
        gap = abs(float(planned - allocated))
        return Measured(saving, spread=(saving - gap, saving + gap), scale=scale)
    return measure


def table2(what: str) -> Callable[[Records, Mapping], Measured | None]:
    """Table 2 from the fused_backward records: the saving in the tensor peak (``"memory"``; below the paper's size
    the plan at it where there is one, `table2_planned`) or the device's used memory (``"device"``, CUDA only), or
    the time ratio (``"time"``)."""
    def measure(records: Records, params: Mapping) -> Measured | None:
        if what == "memory" and not t2_paper_size(params) and _t2_plan(records) is not None:
            return table2_planned(keep_grads=False)(records, params)
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
    """`NOT_COMPARABLE` when a run below the paper's size (and no plan at it) has its ordinary ceiling below the
    claim's band: freeing every gradient live at its peak could not reach it. At the paper's size (run or planned)
    a low ceiling is the finding itself, judged by the rule."""
    if t2_paper_size(params) or _t2_plan(records) is not None:
        return None
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


# ------------------------------------------------------------------------------ gates


CEILING_RULE = (f"'{NOT_COMPARABLE}' where the ordinary peak's gradients are under "
                 f"{TABLE2_SAVING * (1 - TABLE2_REL):.1%} of it (the ceiling)")
LIKE_RULE = f"'{NOT_COMPARABLE}' where plain fp16 saves at least as much against fp32 in the same run"
STATES_RULE = (f"'{NOT_COMPARABLE}' without an fp16+8 run whose momentum is 16-bit as plain fp16's "
               f"('{LIKE_STATES}'): fp32 against fp16 momentum compares state sizes, not the extra bits")
# claim text -> (the rule text it adds, the verdict it gives instead of the rule's, or None)
_JUDGED = {"better than claimed", "reproduced", "partly", "not reproduced", "refuted", "inconclusive"}


def apply_gates(book: Ledger, gates: Mapping[str, tuple[str, Callable[[Records, Mapping], str | None]]],
                records: Records, params: Mapping) -> Ledger:
    """`book` with each gated row's rule naming its gate (claim text -> (rule text, gate)) and, where the row
    was judged and its gate gives a verdict, that verdict instead of the rule's."""
    for row in book.rows:
        if row["claim"] not in gates:
            continue
        text, gate = gates[row["claim"]]
        row["rule"] += "; " + text
        if row["verdict"] in _JUDGED and (instead := gate(records, params)) is not None:
            row["verdict"] = instead
    return book
