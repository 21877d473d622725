"""The accuracy rows of the packed-bit ledger (Table 3, Fig 4): gaps between formats paired by seed, and the
controls that let a parity row fail.

Paper: Lewandowski & Kosson, "Memory Efficient Mixed Precision Optimizers", section 4, Table 3 (top-1 accuracy by
format) and Fig 4 (plain fp16 loses where fp16+8 matches fp32).

A gap is the mean over seeds of accuracy(first) - accuracy(second) in points, its spread the lowest..highest seed
(seed noise, the repeat noise of this measurement). Issue 44: a parity claim ("same accuracy") must be able to
fail, so each parity row names a control that should lose in the same runs (plain fp16 without the extra bits,
plain fp8) and reads "inconclusive" (`control_loses`) unless the control lost more than the tolerance on every
seed.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import pandas as pd

from workbench.report import Measured, Records, record_frame

from .accuracy import paired_gap
from .table_claims import HARD_REGIME

__all__ = ["TOLERANCE", "control_loses", "control_rule", "gap", "loss_tracking", "paper_scale_accuracy", "parity"]


def _regime(which: str, params: Mapping) -> str:
    main = params.get("acc_dataset", "digits")
    return {"main": main, "low": f"{main}, low lr", "hard": HARD_REGIME}[which]


def _acc_scale(df: pd.DataFrame, params: Mapping) -> str:
    task = df["task"].iloc[0] if "task" in df and df["task"].iloc[0] else df["regime"].iloc[0]
    return (f"{task}, {int(df['epochs'].iloc[0])} epochs, lr {df['lr'].iloc[0]:g}, "
            f"seeds {sorted(set(df['seed']))}")


def gap(which: str, first: str, second: str) -> Callable[[Records, Mapping], Measured | None]:
    """accuracy(first) - accuracy(second) in points: mean over seeds, spread lowest..highest seed."""
    def measure(records: Records, params: Mapping) -> Measured | None:
        df = record_frame(records, "accuracy")
        if df is None:
            return None
        regime = _regime(which, params)
        sub = df[df["regime"] == regime]
        if sub.empty or not {first, second} <= set(sub["format"]):
            return None
        mean, lo, hi = paired_gap(df, regime, first, second)
        return Measured(mean, spread=(lo, hi), scale=_acc_scale(sub, params))
    return measure


TOLERANCE = 1.0  # points: 'same accuracy' read as a gap within 1 point either way


def parity(which: str, first: str, second: str, control: str) -> Callable[[Records, Mapping], Measured | None]:
    """`gap` of ``first`` over ``second``, its scale adding the control's gap (``control`` - ``second``) in the same
    runs: what a format that should lose did."""
    base = gap(which, first, second)

    def measure(records: Records, params: Mapping) -> Measured | None:
        got = base(records, params)
        if got is None:
            return None
        lost = _control_gap(records, params, which, control, second)
        said = ("no control run" if lost is None else
                f"{lost[0]:+.1f} points ({lost[1]:+.1f}..{lost[2]:+.1f} over seeds)")
        return Measured(got.value, spread=got.spread, scale=f"{got.scale}; control {control} - {second}: {said}")
    return measure


def _control_gap(records: Records, params: Mapping, which: str, control: str,
                 second: str) -> tuple[float, float, float] | None:
    df = record_frame(records, "accuracy")
    regime = _regime(which, params)
    if df is None or not {control, second} <= set(df[df["regime"] == regime]["format"]):
        return None
    return paired_gap(df, regime, control, second)


def control_loses(which: str, control: str, second: str) -> Callable[[Records, Mapping], str | None]:
    """"inconclusive" unless ``control`` lost more than the tolerance against ``second`` on every seed in the same
    regime: a parity the run could not have failed is no evidence."""
    def gate(records: Records, params: Mapping) -> str | None:
        lost = _control_gap(records, params, which, control, second)
        return None if lost is not None and round(lost[2], 9) < -TOLERANCE else "inconclusive"  # seeds in %
    return gate


def control_rule(control: str, second: str) -> str:
    return (f"'inconclusive' unless the control ({control}) loses more than {TOLERANCE:g} point against {second} on "
            f"every seed in the same runs (otherwise the run could not have failed this parity)")


def paper_scale_accuracy(fmt: str) -> Callable[[Records, Mapping], Measured | None]:
    """Top-1 accuracy (%) of ``fmt`` only when the run is Table 3's (ResNet-18 on CIFAR-10)."""
    def measure(records: Records, params: Mapping) -> Measured | None:
        df = record_frame(records, "accuracy")
        if df is None or params.get("acc_dataset") != "cifar10" or params.get("acc_model") != "resnet18":
            return None
        sub = df[(df["regime"] == "cifar10") & (df["format"] == fmt)]
        if sub.empty:
            return None
        acc = 100 * sub["test_acc"]
        return Measured(float(acc.mean()), spread=(float(acc.min()), float(acc.max())),
                        scale=_acc_scale(sub, params))
    return measure


def loss_tracking(which: str, first: str, second: str, base: str = "fp32") -> Callable[[Records, Mapping],
                                                                                  Measured | None]:
    """How closely ``first`` tracks ``base``'s final training loss against ``second``: the mean over seeds of
    |loss(first) - loss(base)| over the same for ``second``, each paired by seed (same initial weights, data order
    and schedule); spread the lowest..highest seed's own ratio. Below 1: ``first`` is the closer."""
    def measure(records: Records, params: Mapping) -> Measured | None:
        df = record_frame(records, "accuracy")
        regime = _regime(which, params)
        sub = None if df is None else df[df["regime"] == regime]
        if sub is None or not {first, second, base} <= set(sub["format"]):
            return None
        loss = sub.pivot_table(index="seed", columns="format", values="train_loss")
        one, two = (loss[first] - loss[base]).abs(), (loss[second] - loss[base]).abs()
        if not two.mean() > 0:
            return None
        per_seed = (one / two)[two > 0]  # not empty: the mean of `two` is positive
        return Measured(float(one.mean() / two.mean()), spread=(float(per_seed.min()), float(per_seed.max())),
                        scale=f"{_acc_scale(sub, params)}; mean |loss - {base}'s|: {first} {one.mean():.2e}, "
                              f"{second} {two.mean():.2e}")
    return measure
