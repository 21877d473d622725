"""Claims of Lewandowski & Kosson, "Memory Efficient Mixed Precision Optimizers" (section 1, section 4:
Fig 2, Fig 3, Fig 4, Fig 6, Table 2, Table 3), our targets, and the function that judges them.

Every measured value is read from the records the notebook saves (``memory``, ``memory_resnet18``,
``throughput``, ``accuracy``, ``step_time``, ``step_time_rounds``, ``addition_error``,
``fused_backward``) and its parameters, so ``results.json`` alone can re-judge the ledger. The paper's
speed claims were made on GPUs (a V100 for Table 3, an A100 for Fig 3): they are judged only on a GPU
and read "other device" elsewhere; memory, accuracy and rounding-error claims hold on any device. On a CPU
where fp16 is slow, the memory records may come from bf16 twins with fp16's bytes (`dtypes`): the memory rows
are judged from them and their scale names each twin; accuracy is always measured in fp16.

Memory tables in both units: the tensor peak, and the device's used memory the paper's tables report
(CUDA only: ``device_memory``). Three comparisons are gated beyond their rule: a Table 2 saving whose
ceiling (gradient bytes at the ordinary peak / the peak) lies below the claim's band reads
`NOT_COMPARABLE` (the run cannot show it, whatever the technique does); a saving against fp32 that
plain fp16 (no extra bits) matches or beats in the same run reads `NOT_COMPARABLE` (it is half-precision
activations, not the technique; the like-with-like rows beside it judge the technique); and a GPU timing
whose kernels fill under half its wall time reads `HOST_BOUND` (`workbench.timing.host_bound`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import pandas as pd

from workbench.report import Claim, Ledger, Measured, Records, at_least, at_most, between, judge, record_frame, within
from workbench.timing import HOST_BOUND_RULE

from .accuracy_claims import control_loses, control_rule, gap, loss_tracking, paper_scale_accuracy, parity
from .peak_memory import find_row, saving_ceiling
from .throughput import throughput_share_ratio
from .table_claims import (
    CEILING_RULE, LIKE_RULE, LIKE_STATES, NOT_COMPARABLE, STATES_RULE, TABLE2_REL, TABLE2_SAVING,
    apply_gates, below_ceiling, fp32_momentum, fused_name, half_precision_alone, round_ratio, step_shares, table2,
    table2_planned, table2_shares, table3_memory, twins_said, vs_amp,
)

__all__ = ["CLAIMS", "NOT_COMPARABLE", "ledger"]

_TORCH = "torch AdamW fused (fp32)"
_UNIT_LABELS = (("tensor", "tensor peak"), ("device", "device's used memory"))


# ------------------------------------------------------------------------------ memory (Fig 2, Table 3)


def _mem_scale(df: pd.DataFrame, params: Mapping) -> str:
    amp = find_row(df, format="amp", step_in_backward=False)
    ceiling = saving_ceiling(df, optimizer=params.get("optimizer", "sgd"))
    return (f"MLP {params.get('mem_width')}x{params.get('mem_depth')} ({df['params'].iloc[0] / 1e6:.2f}M params), "
            f"batch {params.get('mem_batch')}, {int(df['steps'].iloc[0])} steps, {params.get('optimizer', 'sgd')}; "
            f"saving ceiling at the measured AMP peak ({amp['peak_bytes_per_param']:.2f} B/param, not 14): "
            f"{ceiling:.0%}")


def _fig2(per_param: bool) -> Callable[[Records, Mapping], Measured | None]:
    def measure(records: Records, params: Mapping) -> Measured | None:
        df = record_frame(records, "memory")
        amp = find_row(df, format="amp", step_in_backward=False)
        ours = find_row(df, format="fp16+8", step_in_backward=True)
        if amp is None or ours is None:
            return None
        value = (amp["peak_bytes_per_param"] - ours["peak_bytes_per_param"] if per_param
                 else 1 - ours["peak_bytes"] / amp["peak_bytes"])
        return Measured(float(value), scale=_mem_scale(df, params) + twins_said(amp, ours))
    return measure


# ------------------------------------------------------------------------------ Fig 3: update throughput


def _tp_scale(df: pd.DataFrame, params: Mapping, method: str) -> str:
    return (f"{int(df['numel'].iloc[0]) / 1e6:.1f}M params in {int(df['n_tensors'].iloc[0])} tensors, "
            f"{int(df['threads'].iloc[0])} threads; {method}")


def _steps(df: pd.DataFrame, *, aligned: bool | None = True, state_dtype: str | None = None) -> pd.DataFrame:
    """The packed rows timed as ``optimizer.step()`` (not the kernel alone): k = 8/16 (``aligned``), k not a
    multiple of 8 (``aligned=False``) or any k (None); of one moment dtype if given."""
    if "median_s" not in df:
        return df.iloc[:0]
    bits = pd.to_numeric(df["extra_bits"], errors="coerce")
    pick = bits.notna() & df["median_s"].notna()
    if aligned is not None:
        pick &= bits.isin([8, 16]) if aligned else bits % 8 != 0
    if "timed" in df:
        pick &= df["timed"] == "step"
    if state_dtype is not None:
        pick &= df["state_dtype"] == state_dtype
    return df[pick]


def _share_vs_torch(records: Records, params: Mapping) -> Measured | None:
    """Fig 3: the best byte-aligned packed step's bandwidth share over torch's fused AdamW's."""
    df = record_frame(records, "throughput")
    packed = None if df is None else _steps(df)
    if packed is None or packed.empty:
        return None
    ratios = {m: r for m in packed["method"] if (r := throughput_share_ratio(df, m)) is not None}
    if not ratios:
        return None
    best = max(ratios, key=lambda m: ratios[m][0])
    value, lo, hi = ratios[best]
    return Measured(value, spread=(lo, hi), scale=_tp_scale(df, params, best))


def _unaligned_vs_aligned(records: Records, params: Mapping) -> Measured | None:
    """Fig 3: the best non-byte-aligned k's bandwidth share over the best of k = 8/16 (None unless both run),
    with the spread of their paired per-round ratios; the scale names the two methods (their backends)."""
    df = record_frame(records, "throughput")
    if df is None:
        return None
    best = []
    for aligned in (False, True):
        rows = _steps(df, aligned=aligned)
        if rows.empty:
            return None
        best.append(rows.loc[rows["bandwidth_fraction"].idxmax()])
    (u, a), per = best, lambda row, c: float(row[c]) * float(row["bytes_per_param"])
    return Measured(float(u["bandwidth_fraction"] / a["bandwidth_fraction"]),
                    spread=(per(u, "ratio_lo") / per(a, "ratio_hi"), per(u, "ratio_hi") / per(a, "ratio_lo")),
                    scale=_tp_scale(df, params, f"{u['method']} vs {a['method']}"))


def _steps_vs_torch(state_dtype: str | None, *, widest: bool = False) -> Callable[[Records, Mapping], Measured | None]:
    """Our targets: ``step()`` steps/s over torch's fused AdamW, paired per round (median, min..max), best k = 8/16
    with ``state_dtype`` moments or (``widest``) the slowest packed width; the scale adds the steps-in-a-row one."""
    def measure(records: Records, params: Mapping) -> Measured | None:
        df = record_frame(records, "throughput")
        rows = None if df is None else _steps(df, aligned=None if widest else True, state_dtype=state_dtype)
        if rows is None or rows.empty or "ratio_paired" not in rows:
            return None
        row = rows.loc[rows["ratio_paired"].idxmin() if widest else rows["ratio_paired"].idxmax()]
        in_a_row = ("" if pd.isna(row.get("ratio_inarow")) else
                    f"; steps in a row {row['ratio_inarow']:.2f}x ({row['ratio_inarow_lo']:.2f}-"
                    f"{row['ratio_inarow_hi']:.2f})")
        return Measured(float(row["ratio_paired"]), spread=(float(row["ratio_lo"]), float(row["ratio_hi"])),
                        scale=_tp_scale(df, params, row["method"]) + in_a_row)
    return measure


# ------------------------------------------------------------------------------ Fig 6: forward error


def _errors(records: Records, panel: str) -> tuple[pd.Series, str] | None:
    df = record_frame(records, "addition_error")
    sub = None if df is None else df[df["panel"] == panel]
    if sub is None or sub.empty:
        return None
    key = "ops" if panel == "many ops" else "n"
    last = sub[sub[key] == sub[key].max()]
    scale = (f"standard-normal fp16 values; {int(last['ops'].iloc[0])} additions of {int(last['n'].iloc[0])} values"
             if panel == "many ops" else f"one addition of {int(last['n'].iloc[0])} values")
    return last.set_index("format")["rel_error"], scale


def _error_ratio(panel: str, num: tuple[str, ...], den: str) -> Callable[[Records, Mapping], Measured | None]:
    """min(error of ``num`` formats) / error of ``den`` at the largest size (one op) or op count (many ops)."""
    def measure(records: Records, params: Mapping) -> Measured | None:
        got = _errors(records, panel)
        if got is None or not set(num) | {den} <= set(got[0].index):
            return None
        err, scale = got
        return Measured(float(min(err[f] for f in num) / err[den]), scale=scale)
    return measure


def _fixed(name: str) -> Callable[[Mapping], str]:
    return lambda params: name


_SAME = "'same accuracy' read as a gap within 1 point either way (our tolerance); mean over seeds, paired by seed"
_TABLE3_SPEED = ("Table 3 (ResNet-18 / CIFAR-10 on a V100): execution time fp32 42 min, AMP 24, fp16+13 rstoc 38, "
                 "fp16+8 20, fp16 23")

CLAIMS: tuple[Claim, ...] = (
    # Fig 2 and section 1: bytes per parameter
    Claim("54% lower peak memory than AMP on a synthetic model (fp16+8, step in backward; Fig 2)",
          unit="fraction of AMP peak saved", paper=0.54, measure=_fig2(per_param=False),
          rule=within(0.54, rel=0.1, better="higher", partly_rel=0.5, refuted=0.0),
          definition="Fig 2: 'peak memory usage is down by 54%' = 1 - peak(fp16 params + 8 extra bits, step in "
                     "backward) / peak(torch AMP), three SGD-momentum steps of a dummy 2e9-parameter model"),
    Claim("at least 6 bytes less per parameter than AMP (fp16+8, step in backward; section 1)",
          unit="peak bytes per parameter saved", paper=6.0, measure=_fig2(per_param=True),
          rule=at_least(6.0, partly=4.0, refuted=0.0),
          definition="section 1: dropping the fp32 copy (keeping only the extra bits) and the gradient leaves 'at "
                     "least 6 bytes less' stored per parameter; measured as AMP's peak minus ours, per parameter"),
    # Table 3 memory, in both units: the tensor peak and the device's used memory (the paper's "Global GPU Memory")
    *(c for unit, label in _UNIT_LABELS for c in (
        Claim(f"20 to 25% lower peak memory in real training than fp32 (fp16+8 with the step in backward; section 4, "
              f"Table 3: 3776 vs 4720 MB): {label}", unit="fraction of fp32 peak saved", paper="20-25%",
              measure=table3_memory("fp32", unit),
              rule=between(0.20, 0.25, better="higher", partly_rel=0.5, refuted=0.0),
              definition="section 4: 'a reduction of 20 to 25% in real training conditions, as it is the case with "
                         "our ResNet18 experiment' (abstract: 'up to 25%'). The text names no baseline; Table 3's "
                         "own memory column gives 1 - 3776/4720 = 20.0% against fp32 (16.5% against AMP, 1.7% "
                         "against plain fp16: rows below). Like with like: plain fp16 saves 1 - 3840/4720 = 18.6% "
                         "there; where it saves at least as much as fp16+8 in the same run, the saving is "
                         "half-precision activations and the row reads 'not comparable'"),
        Claim(f"fp16+8 uses 16.5% less memory than AMP training ResNet-18 (Table 3: 3776 vs 4520 MB): {label}",
              unit="fraction of AMP peak saved", paper=1 - 3776 / 4520, measure=table3_memory("amp", unit),
              rule=within(1 - 3776 / 4520, rel=0.2, better="higher", partly_rel=0.5, refuted=0.0),
              definition="Table 3 'Global GPU Memory usage', ResNet-18 / CIFAR-10: 1 - fp16+8 / AMP = 1 - 3776/4520 "
                         "(Table 3 does not say whether the step ran in backward; measured with it, without it in "
                         "the scale)"),
        Claim(f"fp16+8 needs no more memory than plain fp16 (Table 3: 3776 vs 3840 MB): {label}",
              unit="fraction of plain fp16's peak saved", paper="1.7% lower (3776 vs 3840 MB)",
              measure=table3_memory("fp16", unit, ours_format=LIKE_STATES), rule=at_least(0.0, partly=-0.02),
              definition="Table 3: fp16 weights and activations in both, fp16+8 adding its extra bits and (here) "
                         "the step in backward: 1 - fp16+8 / fp16. Like with like (issue 44): the paper's fp16+8 "
                         "keeps fp32 momentum where plain fp16 keeps fp16 momentum, so fp16+8 is measured with its "
                         "momentum in 16 bits (bf16: the same bytes as fp16's); the fp32-momentum figure is in the "
                         "scale. Its 64 MB is within what allocators and libraries move between GPUs, so the "
                         "direction is tested: reproduced at or below plain fp16, partly within 2% above"),
    )),
    # Table 3 / Fig 4: accuracy
    *(Claim(f"same accuracy as mixed precision (fp16+8 vs AMP, {task}; Table 3: 94.06% vs 94.04%)",
            unit="accuracy fp16+8 - AMP (points, mean over seeds)", paper=94.06 - 94.04,
            measure=parity(which, "fp16+8", "amp", "fp16"), rule=between(-1.0, 1.0, better="higher", partly_rel=1.0),
            definition=f"Table 3 top-1 accuracy, fp16+8 minus AMP; {_SAME}. Control (issue 44): plain fp16 (no extra "
                       f"bits) in the same runs must lose more than 1 point against AMP, else the row is "
                       f"inconclusive: {why}")
      for which, task, why in (
          ("main", "main task", "at the main learning rate every 16-bit format may land within the tolerance"),
          ("low", "low learning rate, where plain fp16 loses", "here updates fall below half an fp16 ulp, so plain "
           "fp16 stalls while AMP's fp32 master weights do not"),
          ("hard", "harder synthetic task", "as on the main task"))),
    Claim("fp8+8 keeps fp16's accuracy (Table 3: 93.96% vs 93.79%)",
          unit="accuracy fp8+8 - fp16 (points, mean over seeds)", paper=93.96 - 93.79,
          measure=parity("main", "fp8+8", "fp16", "fp8"), rule=between(-1.0, 1.0, better="higher", partly_rel=1.0),
          definition=f"Table 3, fp8 emulated as truncated fp16 (e5m2); fp8+8 minus fp16; {_SAME}. Control: plain "
                     f"fp8 must lose more than 1 point against fp16 in the same runs"),
    Claim("fp8+4 loses accuracy against fp8+8 (Table 3: 65.53% vs 93.96%)",
          unit="accuracy fp8+8 - fp8+4 (points, mean over seeds)", paper="loses (28.4 points on CIFAR-10)",
          measure=gap("main", "fp8+8", "fp8+4"), rule=at_least(1.0, partly=0.5),
          definition="Table 3, fp8 emulated as truncated fp16. The size of the loss belongs to ResNet-18 / "
                     "CIFAR-10 after 200 epochs; on another task the claim tested is its direction: a loss of at "
                     "least 1 point"),
    Claim("plain fp8 loses more than fp8+4 (Table 3: 8.78% vs 65.53%)",
          unit="accuracy fp8+4 - fp8 (points, mean over seeds)", paper="loses (56.8 points on CIFAR-10)",
          measure=gap("main", "fp8+4", "fp8"), rule=at_least(1.0, partly=0.5),
          definition="Table 3, as the row above: the direction (at least 1 point), not CIFAR-10's size"),
    Claim("Fig 4, first half: plain fp16 loses accuracy against fp32 when updates are small",
          unit="accuracy fp32 - fp16 (points, mean over seeds)", paper="loses", measure=gap("low", "fp32", "fp16"),
          rule=at_least(1.0, partly=0.5),
          definition="Fig 4 (DLRM): 'a vanilla fp16 model leads to losing part of the model's accuracy'; here the "
                     "same mechanism: a learning rate whose updates fall below half an fp16 ulp; loss >= 1 point"),
    Claim("Fig 4, second half: fp16+8 matches fp32 in the same runs",
          unit="accuracy fp16+8 - fp32 (points, mean over seeds)", paper=0.0,
          measure=parity("low", "fp16+8", "fp32", "fp16"),
          rule=between(-1.0, 1.0, better="higher", partly_rel=1.0),
          definition=f"Fig 4: '8 extra-bits of storage are sufficient to achieve the same accuracy as a standard "
                     f"single-precision setup'; {_SAME}. Control: plain fp16 must lose more than 1 point against "
                     f"fp32 in the same runs (the row above)"),
    Claim("ResNet-18 / CIFAR-10 accuracy of fp16+8 (Table 3: 94.06%; fp32 94.64%, AMP 94.04%)",
          unit="top-1 accuracy (%), mean over seeds", paper=94.06, measure=paper_scale_accuracy("fp16+8"),
          rule=within(94.06, rel=0.01, better="higher", partly_rel=0.02),
          definition="Table 3: top-1 test accuracy after 200 epochs (batch 256, SGD momentum, lr 0.3, cosine); "
                     "measured only by the paper profile (CIFAR-10 in data/, ResNet-18)"),
    Claim("on DLRM (Criteo), 8 extra bits reach fp32's ROC-AUC where plain fp16 loses (Fig 4)", unit="ROC-AUC",
          paper="matches fp32", not_run="DLRM and the Criteo data are not in this workbench; the two Fig 4 rows "
          "above test the same mechanism (updates below half an fp16 ulp)"),
    # training-step time: Table 3 and section 4, on a V100
    Claim("up to 16% faster training than AMP (fp16+8; Table 3: 20 vs 24 min)",
          unit="training-step time saved vs AMP (fraction, medians)", paper=0.16,
          measure=vs_amp(lambda p: fused_name("fp16+8", p), time_saved=True),
          rule=within(0.16, rel=0.25, better="higher", partly_rel=1.0), made_on="gpu",
          definition=f"{_TABLE3_SPEED}: time saved 1 - 20/24 = 16.7%; here 1 - t(fp16+8 fused) / t(AMP)"),
    Claim("AMP trains faster than fp32 (Table 3: 24 vs 42 min, 1.75x)", unit="AMP speed / fp32 speed (medians)",
          paper=1.75, measure=vs_amp(_fixed("fp32"), time_saved=False),
          rule=within(1.75, rel=0.15, better="higher", partly_rel=0.3, refuted=1.0), made_on="gpu",
          definition=f"{_TABLE3_SPEED}: 42/24 = 1.75; here t(fp32) / t(AMP). fp16 autocast has no fast path on "
                     "a CPU. Partly down to 1.04x; AMP slower than fp32 (below 1) is refuted"),
    Claim("the fused optimizer trains 2-10% faster than the per-parameter one (section 4, Fig 5)",
          unit="training-step time saved by fusing (fraction, medians)", paper="2-10%",
          measure=round_ratio(lambda p: fused_name("fp16+8", p), _fixed("fp16+8"), time_saved=True),
          rule=between(0.02, 0.10, better="higher", partly_rel=0.5), made_on="gpu",
          definition="section 4 (DCGAN, Fig 5): '2% to 10% faster training' with the fused optimizer; as for "
                     "Table 3's times, faster = time saved: 1 - t(fused) / t(per-parameter), paired by round"),
    Claim("stochastic rounding is slower (fp16+13 SR vs fp16+8; Table 3: 38 vs 20 min)",
          unit="time ratio fp16+13 SR / fp16+8 (medians, fused steps)", paper=38 / 20,
          measure=round_ratio(lambda p: fused_name("fp16+13 SR", p), lambda p: fused_name("fp16+8", p),
                              time_saved=False),
          rule=within(38 / 20, rel=0.25, better="lower", partly_rel=0.5), made_on="gpu",
          definition=f"{_TABLE3_SPEED}: 38/20 = 1.9; a smaller cost reads better than claimed"),
    # Table 2
    Claim("step fused into backward lowers peak memory by 11% (Table 2): tensor peak", unit="fraction of peak saved",
          paper=TABLE2_SAVING, measure=table2("memory"),
          rule=within(TABLE2_SAVING, rel=TABLE2_REL, better="higher", partly_rel=0.5, refuted=0.0),
          definition="Table 2 (flan-T5 on GLUE): 1 - peak(in backward) / peak(ordinary): MNLI 29,930 -> 26,818 MB "
                     "(10.4%), QNLI 30,239 -> 26,826 (11.3%), MRPC 29,964 -> 26,649 (11.1%); the ordinary loop frees "
                     "its gradients at zero_grad (torch's default). Judged at the paper's size: measured there (gpu "
                     "profile), else planned there (CalcGraph). The step in backward frees gradients, so a smaller "
                     "run whose gradients at the ordinary peak are under the band's low end (ceiling) cannot show "
                     "it: 'not comparable'"),
    Claim("step fused into backward lowers peak memory by 11% (Table 2) against a loop that keeps its gradients "
          "between steps (section 3.2): tensor peak, planned", unit="fraction of peak saved", paper=TABLE2_SAVING,
          measure=table2_planned(keep_grads=True),
          rule=within(TABLE2_SAVING, rel=TABLE2_REL, better="higher", partly_rel=0.5, refuted=0.0),
          definition="Table 2 as above, the ordinary run's gradients kept from one step to the next (zeroed in "
                     "place, not freed): section 3.2's 'every gradient of every parameter has to be stored in the "
                     "memory at all time'; planned at flan-T5 large's size (the real runs free theirs)"),
    Claim("step fused into backward lowers peak memory by 11% (Table 2): device's used memory",
          unit="fraction of peak saved", paper=TABLE2_SAVING, measure=table2("device"),
          rule=within(TABLE2_SAVING, rel=TABLE2_REL, better="higher", partly_rel=0.5, refuted=0.0),
          definition="Table 2 as above, in the unit a GPU reports (CUDA context + the caching allocator's peak "
                     "reserve, torch.cuda.mem_get_info): where the paper's MB may come from; CUDA only"),
    Claim("fused backward barely slows training (Table 2: +3 to +4%)",
          unit="time ratio in backward / ordinary (medians)", paper=1.04, measure=table2("time"),
          rule=within(1.04, rel=0.05, better="lower", partly_rel=0.1), made_on="gpu",
          definition="Table 2 time to complete, in backward / ordinary: MNLI 1.041, QNLI 1.030, MRPC 1.044"),
    # Fig 3
    Claim("the packed operators are as efficient as torch's own (Fig 3)",
          unit="bandwidth share vs torch AdamW(fused=True) (bytes/s ratio, median steps), best of k=8/16",
          paper=1.0, measure=_share_vs_torch, rule=within(1.0, rel=0.2, better="higher", partly_rel=0.5),
          made_on="gpu",
          definition="Fig 3 (A100): throughput as a percentage of the GPU's bandwidth; 'as efficient' = the same "
                     "share: bytes/s of the packed step / bytes/s of torch's fused AdamW, bytes counted "
                     "analytically (a packed step moves fewer bytes, so this is not the steps/s ratio)"),
    Claim("somewhat weaker for extra-bit sizes that rely on shared memory (Fig 3)",
          unit="bandwidth share, best k not a multiple of 8 / best of k=8/16 (optimizer.step)", paper="somewhat weaker",
          measure=_unaligned_vs_aligned, rule=between(0.6, 0.95, better="higher", partly_rel=0.5), made_on="gpu",
          definition="Fig 3: k that straddle int32 words need shared memory in the paper's CUDA kernel; 'somewhat "
                     "weaker' read as 0.6-0.95 of the best k=8/16 share (our reading, no number in the paper), far "
                     "weaker (under 0.3) not reproduced; the scale names the methods timed (their backends)"),
    Claim("packed fused step at least 1.0x torch fused AdamW on a CPU (fp32 moments)",
          unit="optimizer.step() steps/s ratio (median of paired rounds), best of k=8/16", paper="1.0 (ours)",
          measure=_steps_vs_torch("fp32"), rule=at_least(1.0, partly=0.8), source="target", made_on="cpu",
          definition="our goal: steps/s of PackedAdamW(fused=True).step() / torch.optim.AdamW(fused=True).step() on "
                     "a training-loop step (new gradient tensors each step), fp32 moments"),
    Claim("8-bit moments: packed fused step at least 1.0x torch fused AdamW on a CPU (issue 46)",
          unit="optimizer.step() steps/s ratio (median of paired rounds), best of k=8/16", paper="1.0 (ours)",
          measure=_steps_vs_torch("int8"), rule=at_least(1.0, partly=0.8), source="target", made_on="cpu",
          definition="our goal: as the fp32-moment row with state_dtype=torch.int8 (8-bit moments in groups of 32, "
                     "a bf16 scale each; 12.25 vs 28 bytes moved per parameter), against FlashOptim's bytes"),
    Claim("packed fused step at least 1.1x torch fused AdamW on a GPU (fp32 moments)",
          unit="optimizer.step() steps/s ratio (median of paired rounds), best of k=8/16", paper="1.1 (ours)",
          measure=_steps_vs_torch("fp32"), rule=at_least(1.1, partly=0.9), source="target", made_on="gpu",
          definition="our goal: steps/s of PackedAdamW(fused=True).step() / torch.optim.AdamW(fused=True).step(), "
                     "fp32 moments (bytes moved 24 vs 28 per parameter: the ceiling is 1.17x)"),
    Claim("packed fused step at least 1.4x torch fused AdamW on a GPU (bf16 moments)",
          unit="optimizer.step() steps/s ratio (median of paired rounds), best of k=8/16", paper="1.4 (ours)",
          measure=_steps_vs_torch("bfloat16"), rule=at_least(1.4, partly=1.1), source="target", made_on="gpu",
          definition="our goal: as above with bf16 moments (16 vs 28 bytes per parameter: the ceiling is 1.75x)"),
    Claim("every packed width's fused step at least 0.5x torch fused AdamW on a GPU",
          unit="optimizer.step() steps/s ratio (median of paired rounds), slowest packed width timed",
          paper="0.5 (ours)", measure=_steps_vs_torch(None, widest=True), rule=at_least(0.5, partly=0.25),
          source="target", made_on="gpu",
          definition="our goal: fused=True on CUDA never takes a path slower than half of torch's fused fp32 "
                     "AdamW, whatever k (dense int32 words included)"),
    # Fig 6
    Claim("extra bits give much lower error than fp16 after many additions (Fig 6 right)",
          unit="error ratio fp16 / fp16+8", paper="much lower", measure=_error_ratio("many ops", ("fp16",), "fp16+8"),
          rule=at_least(2.0, partly=1.0),
          definition="Fig 6: ||x16 - exact|| / ||exact|| after repeated in-place additions of standard-normal "
                     "values; 'significantly better results on cumulative operations' read as at least 2x"),
    Claim("after one addition fp16+8 is somewhat poorer than fp16 (Fig 6 left)", unit="error ratio fp16+8 / fp16",
          paper="somewhat poorer", measure=_error_ratio("one op", ("fp16+8",), "fp16"), rule=at_least(1.0),
          definition="Fig 6 left: relative error after one in-place addition (truncation vs round to nearest)"),
    Claim("stochastic rounding gives lower error than fp16 and fp16+8 after many additions (Fig 6)",
          unit="error ratio best of fp16, fp16+8 / fp16+8 SR", paper="lower",
          measure=_error_ratio("many ops", ("fp16", "fp16+8"), "fp16+8 SR"), rule=at_least(1.0),
          definition="section 4: 'stochastic rounding provides a better accuracy as compared to classic 16bits "
                     "formats or basic extra-bit format (see Figure 6)'"),
    Claim("fp16+8 rounded to nearest keeps fp16's error after one addition (Fig 6 left, ours)",
          unit="error ratio fp16+8 nearest / fp16", paper="1.0 (ours)",
          measure=_error_ratio("one op", ("fp16+8 nearest",), "fp16"), rule=between(0.99, 1.01, partly_rel=0.05),
          source="target",
          definition="our goal for master_rounding='nearest' (issue 46): the value the model sees is the fp16 sum "
                     "rounded to nearest, as plain fp16's, where the paper's truncation is 'somewhat poorer'"),
    Claim("fp16+8 rounded to nearest at most halves truncation's error after many additions (Fig 6 right, ours)",
          unit="error ratio fp16+8 / fp16+8 nearest", paper="2.0 (ours)",
          measure=_error_ratio("many ops", ("fp16+8",), "fp16+8 nearest"), rule=at_least(2.0, partly=1.5),
          source="target",
          definition="our goal for master_rounding='nearest' (issue 46): the same bytes as the paper's fp16+8, the "
                     "extra bits holding the signed remainder of a visible value rounded to nearest"),
    Claim("at the low learning rate fp16+8 rounded to nearest tracks fp32's loss at least as closely as truncation "
          "(ours)", unit="mean |final loss - fp32's| over seeds, fp16+8 nearest / fp16+8", paper="<= 1.0 (ours)",
          measure=loss_tracking("low", "fp16+8 nearest", "fp16+8"), rule=at_most(1.0, partly=1.25),
          source="target",
          definition="our goal for master_rounding='nearest' (issue 46), where updates fall below the 16-bit "
                     "step: the same bytes as the paper's fp16+8 and a training loss at least as close to fp32's, "
                     "paired by seed (the evidence for the default; see the notebook's accuracy section)"),
    Claim("on DCGAN (LSUN), the packed optimizer beats plain bf16 training (section 4, Fig 5)",
          unit="inception score / FID", paper="significantly better",
          not_run="needs the LSUN data set and inception-score / FID tooling"),
)


def _text(prefix: str) -> str:
    return next(c.text for c in CLAIMS if c.text.startswith(prefix))


_GATES: dict[str, tuple[str, Callable[[Records, Mapping], str | None]]] = {
    _text("step fused into backward lowers peak memory by 11% (Table 2): tensor"): (CEILING_RULE, below_ceiling),
    **{_text(f"20 to 25% lower peak memory in real training than fp32 (fp16+8 with the step in backward; section 4, "
             f"Table 3: 3776 vs 4720 MB): {label}"): (LIKE_RULE, half_precision_alone(unit))
       for unit, label in _UNIT_LABELS},
    **{_text(f"fp16+8 needs no more memory than plain fp16 (Table 3: 3776 vs 3840 MB): {label}"):
       (STATES_RULE, fp32_momentum(unit)) for unit, label in _UNIT_LABELS},
    **{_text(f"same accuracy as mixed precision (fp16+8 vs AMP, {task}"): (control_rule("fp16", "amp"),
                                                                            control_loses(which, "fp16", "amp"))
       for which, task in (("main", "main task"), ("low", "low learning rate"), ("hard", "harder synthetic"))},
    _text("fp8+8 keeps fp16's accuracy"): (control_rule("fp8", "fp16"), control_loses("main", "fp8", "fp16")),
    _text("Fig 4, second half"): (control_rule("fp16", "fp32"), control_loses("low", "fp16", "fp32")),
    _text("fused backward barely slows"): (HOST_BOUND_RULE, table2_shares),
    _text("up to 16% faster"): (HOST_BOUND_RULE, step_shares(lambda p: fused_name("fp16+8", p), _fixed("amp"))),
    _text("AMP trains faster"): (HOST_BOUND_RULE, step_shares(_fixed("fp32"), _fixed("amp"))),
    _text("the fused optimizer"): (HOST_BOUND_RULE, step_shares(lambda p: fused_name("fp16+8", p), _fixed("fp16+8"))),
    _text("stochastic rounding is slower"): (HOST_BOUND_RULE, step_shares(lambda p: fused_name("fp16+13 SR", p),
                                                                            lambda p: fused_name("fp16+8", p))),
}
def ledger(records: Records, params: Mapping, *, device: str, device_class: str, verdicts: bool) -> Ledger:
    """The packed-bit notebook's ledger from its records and parameters; the gated rows (`_GATES`) read their
    gate's verdict instead of their rule's where the gate says so, and name the gate in their rule."""
    book = judge(CLAIMS, records, params, device=device, device_class=device_class, verdicts=verdicts)
    return apply_gates(book, _GATES, records, params)
